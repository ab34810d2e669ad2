"""Grain data pipeline: the packing transform, global batches equal to the old path on every
mesh and layout, what each of 1, 2, 4 or 8 processes feeds, iterator state, errors."""

import json

import grain
import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from test_data import random_docs

from eqx_longctx import ShardingSpec, to_layout
from eqx_longctx.data import (
    Batch,
    EpochShuffle,
    GrainBatches,
    GrainEvalBatches,
    PackDocuments,
    PackedDataset,
    pack_documents,
    place_batch,
    process_slice,
)

SEQ = 32
BATCH = 4


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return random_docs(7, num=50, max_len=3 * SEQ)


@pytest.fixture(scope="module")
def dataset(docs) -> PackedDataset:
    return PackedDataset.from_documents(docs, SEQ, seed=5)


def make_spec(name: str) -> ShardingSpec | None:
    """The meshes and layouts of the tests: batch, fsdp, expert and sequence splits."""
    if name == "none":
        return None
    mesh_shape, kwargs = {
        "data2_context4_zigzag": ({"data": 2, "context": 4}, {}),
        "fsdp2_context4_striped": (
            {"fsdp": 2, "context": 4},
            {"fsdp_axis": "fsdp", "load_balance": "striped"},
        ),
        "context8_none": ({"context": 8}, {"load_balance": "none"}),
        "ulysses8": ({"context": 8}, {"strategy": "ulysses"}),
        "usp_data2": (
            {"data": 2, "ulysses": 2, "context": 2},
            {"strategy": "usp", "ulysses_axis": "ulysses"},
        ),
        "usp4x2_striped": (
            {"ulysses": 2, "context": 4},
            {"strategy": "usp", "ulysses_axis": "ulysses", "load_balance": "striped"},
        ),
        "tensor_replicated": (
            {"data": 2, "tensor": 2, "context": 2},
            {"tensor_axis": "tensor", "load_balance": "striped"},
        ),
        "fsdp_context_expert": (
            {"fsdp": 2, "expert": 2, "context": 2},
            {"fsdp_axis": ("fsdp", "context"), "expert_axis": "expert"},
        ),
    }[name]
    names, sizes = tuple(mesh_shape), tuple(mesh_shape.values())
    if name == "context8_none":  # an Auto-axis Mesh as well as jax.make_mesh's Explicit ones
        return ShardingSpec(Mesh(np.array(jax.devices()).reshape(sizes), names), **kwargs)
    return ShardingSpec(jax.make_mesh(sizes, names), **kwargs)


SPECS = [
    "none",
    "data2_context4_zigzag",
    "fsdp2_context4_striped",
    "context8_none",
    "ulysses8",
    "usp_data2",
    "usp4x2_striped",
    "tensor_replicated",
    "fsdp_context_expert",
]


def assert_same(got: Batch, want: Batch) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        if isinstance(w, jax.Array):
            assert isinstance(g, jax.Array) and g.sharding.is_equivalent_to(w.sharding, g.ndim)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("seq_len", [2, 3, 8, 37])
def test_pack_documents_transform_gives_the_packed_rows(seq_len):
    docs = random_docs(seq_len, num=12, max_len=3 * seq_len) + [""]  # long and empty docs
    packed = pack_documents(docs, seq_len)
    for source in (docs, grain.MapDataset.source(docs)):
        rows = PackDocuments(source, seq_len)
        assert len(rows) == packed.tokens.shape[0] and rows.num_documents == len(docs)
        order = np.random.default_rng(0).permutation(len(rows))  # random access, any order
        for r in order:
            for got, want in zip(rows[int(r)], packed, strict=True):
                np.testing.assert_array_equal(got, want[r])
    sliced = list(PackDocuments(docs, seq_len)[1:3])
    np.testing.assert_array_equal(sliced[1].tokens, packed.tokens[2])


def test_grain_pipeline_from_documents_equals_packed_dataset(docs, dataset):
    spec = make_spec("data2_context4_zigzag")
    rows = PackDocuments(grain.MapDataset.source(docs), SEQ)
    from_docs = GrainBatches(rows, batch_size=BATCH, seed=5, spec=spec)
    from_packed = GrainBatches(dataset, batch_size=BATCH, seed=5, spec=spec)
    for step in (0, 3, 12, 13):  # 13 straddles the first and second epoch
        assert_same(from_docs.get(step), from_packed.get(step))
    evals = GrainEvalBatches(rows, batch_size=BATCH, spec=spec)
    theirs = GrainEvalBatches(dataset, batch_size=BATCH, spec=spec)
    assert len(evals) == len(theirs)
    for got, want in zip(evals, theirs, strict=True):
        assert_same(got, want)


def test_epoch_shuffle_is_the_order_of_packed_dataset_batch(dataset):
    samples = EpochShuffle(grain.MapDataset.range(dataset.num_rows), seed=dataset.seed)
    n = 3 * dataset.num_rows + 5
    order = np.array([samples[i] for i in range(n)])
    tokens = np.concatenate([dataset.batch(s, 1).tokens for s in range(n)])
    np.testing.assert_array_equal(dataset.tokens[order], tokens)


@pytest.mark.parametrize("name", SPECS)
def test_batches_equal_the_old_path_on_every_mesh(dataset, name):
    spec = make_spec(name)
    batches = GrainBatches(dataset, batch_size=BATCH, seed=dataset.seed, spec=spec)
    epoch_end = dataset.num_rows // BATCH
    for step in (0, 1, epoch_end, epoch_end + 1, 40):
        assert_same(batches.get(step), place_batch(dataset.batch(step, BATCH), spec))
    evals = GrainEvalBatches(dataset, batch_size=BATCH, spec=spec)
    for got, want in zip(evals, dataset.eval_batches(BATCH), strict=True):
        assert_same(got, place_batch(want, spec))


def check_processes(batches_for, dataset, spec, monkeypatch, step: int) -> None:
    """For 1, 2, 4 and 8 simulated processes: each process reads only the rows its devices
    hold, its block holds exactly the cells of its devices, and the blocks together are the
    global batch in the layout."""
    want = dataset.batch(step, BATCH)
    if spec is not None:
        want = Batch(*(to_layout(np.asarray(x), spec, axis=1) for x in want))
    devices = sorted(jax.devices(), key=lambda d: d.id)
    sample_rows = np.array(
        [dataset.tokens.tolist().index(r.tolist()) for r in dataset.batch(step, BATCH).tokens]
    )
    read: list[int] = []
    original = PackedDataset.rows

    def recording_rows(self, index):
        read.extend(index.tolist())
        return original(self, index)

    monkeypatch.setattr(PackedDataset, "rows", recording_rows)
    for count in (1, 2, 4, 8) if spec is not None else (1,):
        covered = np.zeros((BATCH, SEQ), int)
        for p in range(count):
            batches = batches_for(p, count)
            part = batches.part
            read.clear()
            local = batches.local(step)
            # Only this process's rows were read, each once.
            assert sorted(read) == sorted(sample_rows[part.rows].tolist())
            assert all(np.all(np.diff(ix) > 0) for ix in (part.rows, part.slots))
            for got, full in zip(local, want, strict=True):
                np.testing.assert_array_equal(got, np.asarray(full)[np.ix_(part.rows, part.slots)])
            covered[np.ix_(part.rows, part.slots)] += 1
            if spec is None:
                continue
            # The block is the cells of this process's devices, no more (when they form a grid).
            group = devices[p * 8 // count : (p + 1) * 8 // count]
            index = spec.sharding(spec.token_pspec()).devices_indices_map((BATCH, SEQ))
            mine = np.zeros((BATCH, SEQ), bool)
            for d in group:
                mine[index[d]] = True
            assert mine[np.ix_(part.rows, part.slots)].all()
            assert mine.sum() == len(part.rows) * len(part.slots)
        # Together the processes cover every cell; replicated cells are fed by several.
        replicas = covered.min()
        assert replicas >= 1 and (covered == replicas).all()
        if spec is not None and spec.tensor_axis is None:
            assert replicas == 1  # every mesh axis splits the tokens: no cell fed twice


@pytest.mark.parametrize("name", SPECS)
def test_each_process_feeds_only_its_part(dataset, name, monkeypatch):
    spec = make_spec(name)

    def batches_for(p, count):
        return GrainBatches(
            dataset,
            batch_size=BATCH,
            seed=dataset.seed,
            spec=spec,
            process_index=p,
            process_count=count,
        )

    check_processes(batches_for, dataset, spec, monkeypatch, step=dataset.num_rows // BATCH)


def test_each_process_evaluates_only_its_part(dataset, monkeypatch):
    spec = make_spec("usp_data2")
    want = list(dataset.eval_batches(BATCH))
    last = len(want) - 1  # padded with empty rows
    for count in (2, 4):
        for p in range(count):
            evals = GrainEvalBatches(
                dataset, batch_size=BATCH, spec=spec, process_index=p, process_count=count
            )
            part = evals.part
            for got, full in zip(evals.local(last), want[last], strict=True):
                laid = to_layout(np.asarray(full), spec, axis=1)
                np.testing.assert_array_equal(got, laid[np.ix_(part.rows, part.slots)])


def test_state_round_trip_resumes_exactly(dataset):
    spec = make_spec("data2_context4_zigzag")
    batches = GrainBatches(dataset, batch_size=BATCH, seed=dataset.seed, spec=spec)
    resume_at = dataset.num_rows // BATCH - 1  # resume mid-epoch, just before a straddle
    for step in range(resume_at):
        assert_same(next(batches), batches.get(step))
    state = json.loads(json.dumps(batches.get_state()))
    assert state["grain"] == {"next_index": resume_at} and batches.step == resume_at
    rest = [next(batches) for _ in range(3)]
    for step, got in enumerate(rest, start=resume_at):
        assert_same(got, place_batch(dataset.batch(step, BATCH), spec))
    # Another mesh, or one device without a spec: the same global batches from that step.
    for other in ("usp4x2_striped", "none"):
        other_spec = make_spec(other)
        resumed = GrainBatches(dataset, batch_size=BATCH, seed=dataset.seed, spec=other_spec)
        resumed.set_state(state)
        for step in range(resume_at, resume_at + 3):
            assert_same(next(resumed), place_batch(dataset.batch(step, BATCH), other_spec))
    for count in (2, 4):  # a simulated process of another count picks up the same step
        part_batches = GrainBatches(
            dataset, batch_size=BATCH, seed=dataset.seed, spec=spec, process_index=1,
            process_count=count, prefetch=0,
        )  # fmt: skip
        part_batches.set_state(state)
        assert part_batches.step == resume_at


def test_prefetch_off_and_iteration_equal_random_access(dataset):
    spec = make_spec("fsdp2_context4_striped")
    batches = GrainBatches(dataset, batch_size=BATCH, seed=1, spec=spec, prefetch=0)
    for step in range(4):
        assert_same(next(batches), batches.get(step))
    assert batches.get_state()["grain"] == {"next_index": 4}
    batches.close()
    assert batches.step == 0


def test_errors(dataset, monkeypatch):
    spec = make_spec("data2_context4_zigzag")

    def make(**kw):
        args = {"batch_size": BATCH, "seed": 0, "spec": spec, **kw}
        return GrainBatches(dataset, **args)

    with pytest.raises(ValueError, match="batch_size must be at least 1; got batch_size=0"):
        make(batch_size=0)
    with pytest.raises(ValueError, match=r"divisible by 2; got batch=3"):
        make(batch_size=3)
    with pytest.raises(ValueError, match=r"seq must be divisible by 8; got seq=20"):
        GrainBatches(PackedDataset.from_documents(["abc"] * 9, 20), batch_size=2, seed=0, spec=spec)
    with pytest.raises(ValueError, match="PackedDataset .* or a PackDocuments .*; got list"):
        GrainBatches([1, 2], batch_size=2, seed=0, spec=spec)
    with pytest.raises(ValueError, match=r"together, or neither; got process_index=1, .*=None"):
        make(process_index=1)
    with pytest.raises(ValueError, match=r"\[0, process_count\); got process_index=2, .*=2"):
        make(process_index=2, process_count=2)
    with pytest.raises(ValueError, match=r"process_count must divide 8; got process_count=3"):
        make(process_index=0, process_count=3)
    with pytest.raises(ValueError, match=r"spec=None .* one process; got process_count=2"):
        make(spec=None, process_index=0, process_count=2)
    with pytest.raises(ValueError, match=r"at least 0; got prefetch=-1"):
        make(prefetch=-1)
    with pytest.raises(ValueError, match=r"step >= 0 needed; got step=-1"):
        make().get(-1)
    with pytest.raises(ValueError, match="simulates another process .* local\\(\\)"):
        make(process_index=1, process_count=2).get(0)
    batches = make()
    with pytest.raises(ValueError, match="dict from GrainBatches.get_state"):
        batches.set_state({"next_index": 3})
    state = batches.get_state()
    stream = r"recorded for \{'seed': 0, 'batch_size': 4.*have \{'seed': 0, 'batch_size': 8"
    with pytest.raises(ValueError, match=stream + ".*same seed"):
        make(batch_size=8).set_state(state)
    evals = GrainEvalBatches(dataset, batch_size=BATCH, spec=spec)
    with pytest.raises(ValueError, match=rf"0 <= batch < {len(evals)} needed; got batch="):
        evals.get(len(evals))
    with pytest.raises(ValueError, match="hold 4 rows; got batch_size=2"):
        evals.eval_batches(2)
    with pytest.raises(ValueError, match="at least one document; got an empty dataset"):
        PackDocuments([], 8)
    with pytest.raises(ValueError, match="seq_len must be at least 2"):
        PackDocuments(["abc"], 1)
    with pytest.raises(ValueError, match="document 1 is None .* filter"):
        PackDocuments(grain.MapDataset.source(["a", "b"]).filter(lambda d: d == "a"), 8)
    # As in a real run of 2 processes (this one being process 0):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"process_count=4 differs from the 2 processes"):
        process_slice(spec, (BATCH, SEQ), 0, 4)
    with pytest.raises(ValueError, match="process 1 of 2 holds none of the mesh's 8 devices"):
        process_slice(spec, (BATCH, SEQ), 1, 2)
