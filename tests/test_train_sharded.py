"""The trainer on sharded weights, for every model family: a train step under FSDP matches
the replicated one, each device holds about 1/N of the parameters and optimizer state, a
checkpoint restores under another mesh, the DeepSeek main job runs, weight decay follows the
rank of each weight, metrics name their units, and every new flag rule is a clear error."""

import ast
import dataclasses
import math
import pathlib
import shutil

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from helpers import make_mesh
from jax.sharding import PartitionSpec
from test_train import SEQ, SMALL_MODEL, params_of, small_config

import eqx_longctx
from eqx_longctx import model_family
from eqx_longctx.data import ByteTokenizer, load_datasets, place_batch
from eqx_longctx.nn import REMAT_POLICIES
from eqx_longctx.run import Placement, bytes_on_device, placement_from_flags
from eqx_longctx.train import (
    Trainer,
    decay_mask,
    evaluate,
    make_optimizer,
    make_train_step,
)
from eqx_longctx.train._cli import build_parser, main
from eqx_longctx.train._step import matrix_rank

TRAIN_DIR = pathlib.Path(eqx_longctx.__file__).parent / "train"
LLAMA = model_family("llama").config.from_preset("tiny", vocab_size=259, **SMALL_MODEL)
DEEPSEEK = model_family("deepseek").config.from_preset("tiny", vocab_size=259)
FOUR_EXPERTS = dataclasses.replace(DEEPSEEK, n_routed_experts=4, n_group=1)
BATCH = 8


@pytest.fixture(scope="module")
def datasets():
    return load_datasets(None, seq_len=SEQ, max_bytes=300_000, val_fraction=0.1)


def family_of(config) -> eqx_longctx.ModelFamily:
    """The installed family whose config class `config` is."""
    (fam,) = [f for f in eqx_longctx.model_families().values() if type(config) is f.config]
    return fam


def build(placement: Placement, config, optimizer):
    fam = family_of(config)
    make = lambda spec: fam.model(config, key=jax.random.key(0), spec=spec)  # noqa: E731
    model = placement.build_model(make)
    return model, placement.init_opt_state(optimizer, model)


def run_steps(
    placement: Placement, datasets, steps: int = 2, config=LLAMA, grad_accum: int = 1,
    prepare=lambda batch: batch,
):  # fmt: skip
    """`steps` train steps of the small Llama under `placement`: (losses, model, opt_state),
    each batch passed through `prepare` before it is placed.

    Adam's epsilon is raised from 1e-8 so that a weight whose gradient is nearly zero does
    not turn summation-order noise into a full-size update."""
    optimizer = make_optimizer(1e-2, 1, 8, weight_decay=0.1, eps=1e-4)
    model, opt_state = build(placement, config, optimizer)
    shardings = None
    if placement.spec is not None:
        shardings = (
            placement.param_shardings(model),
            placement.opt_state_shardings(optimizer, model),
        )
    step = make_train_step(optimizer, shardings=shardings, donate=True, grad_accum=grad_accum)
    losses = []
    for i in range(steps):
        batch = place_batch(prepare(datasets[0].batch(i, BATCH)), placement.spec)
        model, opt_state, metrics = step(model, opt_state, batch)
        losses.append(float(metrics["loss"]))
    return losses, model, opt_state


@pytest.fixture(scope="module")
def replicated(datasets):
    return run_steps(placement_from_flags(1), datasets)


def assert_same_run(got, expected):
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(params_of(got[1]), params_of(expected[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(expected[2]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)


# ---- one trainer for every family -----------------------------------------------------


def test_train_imports_no_family_module():
    """`eqx_longctx.train` reaches the families through `eqx_longctx.model_family` only."""
    offenders = []
    for path in sorted(TRAIN_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            bad = [n for n in names if n.startswith(("models.llama", "models.deepseek"))]
            offenders += [f"{path.name}: {n}" for n in bad]
    assert offenders == []


def test_cli_choices_come_from_the_library():
    actions = {a.dest: a for a in build_parser()._actions}
    assert tuple(actions["remat"].choices or ()) == REMAT_POLICIES
    assert tuple(actions["model"].choices or ()) == eqx_longctx.family_names()
    assert eqx_longctx.family_names()[:2] == ("llama", "deepseek")


def test_deepseek_placement_checks_mla_heads():
    """MLA has as many key/value heads as query heads, of width nope + rope."""
    placement_from_flags(8, "fsdp=2,context=4").check_run(8, 64, DEEPSEEK)
    with pytest.raises(ValueError, match=r"'ulysses' on mesh .* 4 query / 4 key-value heads"):
        placement_from_flags(8, "context=8", "ulysses").check_run(8, 64, DEEPSEEK)


# ---- sharded train step ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("mesh", "fsdp_axes", "sharded"),
    [
        ("fsdp=2,context=4", None, ("fsdp",)),
        ("fsdp=2,context=4", "fsdp,context", ("fsdp", "context")),
    ],
)
def test_sharded_train_step_matches_replicated(datasets, replicated, mesh, fsdp_axes, sharded):
    placement = placement_from_flags(8, mesh, fsdp_axes=fsdp_axes)
    got = run_steps(placement, datasets)
    assert_same_run(got, replicated)
    # The embedding's `embed` axis is split over the fsdp axes, and stays so after updates.
    embed = got[1].embed
    assert embed.sharding.spec == PartitionSpec(None, sharded if len(sharded) > 1 else sharded[0])
    mu = optax.tree_utils.tree_get(got[2], "mu").embed
    assert mu.sharding.is_equivalent_to(embed.sharding, embed.ndim)


@pytest.mark.parametrize("axes", ["explicit", "auto"])
def test_unplaced_model_compiles_the_step_once(datasets, replicated, axes):
    """A model built with a spec but not placed (`Llama(config, spec=...)`, its arrays on
    one device, as in the quickstart notebook) and its fresh optimizer state: the step
    takes them onto the batch's mesh before its first call, so later steps (whose inputs
    are the step's own mesh-typed outputs) reuse the first compile; the run equals the
    replicated one."""
    mesh = make_mesh((2, 4), ("data", "context"), axes)
    spec = eqx_longctx.ShardingSpec(mesh, strategy="ring", load_balance="zigzag")
    optimizer = make_optimizer(1e-2, 1, 8, weight_decay=0.1, eps=1e-4)
    model = family_of(LLAMA).model(LLAMA, key=jax.random.key(0), spec=spec)
    assert isinstance(model.embed.sharding, jax.sharding.SingleDeviceSharding)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    step = make_train_step(optimizer)
    compiles = []

    def listen(event, duration_secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration" and kw.get("fun_name") == (
            "jit(step)"
        ):
            compiles.append(duration_secs)

    losses = []
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for i in range(2):
            batch = place_batch(datasets[0].batch(i, BATCH), spec)
            model, opt_state, metrics = step(model, opt_state, batch)
            losses.append(float(metrics["loss"]))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert len(compiles) == 1, f"the step compiled {len(compiles)} times in 2 steps, not once"
    assert_same_run((losses, model, opt_state), replicated)


@pytest.mark.parametrize("fsdp_axes", [None, "fsdp,context"])
def test_batches_split_over_the_batch_axes(datasets, fsdp_axes):
    """The batch is split over fsdp (not a sequence axis), the sequence over context."""
    placement = placement_from_flags(8, "fsdp=2,context=4", fsdp_axes=fsdp_axes)
    tokens = place_batch(datasets[0].batch(0, BATCH), placement.spec).tokens
    assert isinstance(tokens, jax.Array)
    assert {s.data.shape for s in tokens.addressable_shards} == {(BATCH // 2, SEQ // 4)}


def test_vocabulary_that_does_not_divide_stays_whole_over_tensor():
    """The byte tokenizer's 259 rows do not split over tensor=2: the embedding keeps them."""
    placement = placement_from_flags(8, "tensor=2,fsdp=2,context=2", vocab_size=259)
    assert placement.whole_vocab and "vocabulary kept whole" in placement.describe()
    model = placement.abstract_model(
        lambda spec: model_family("llama").model(LLAMA, key=jax.random.key(0), spec=spec)
    )
    assert model.embed.sharding.spec == PartitionSpec(None, "fsdp")
    assert not placement_from_flags(8, "tensor=2,fsdp=2,context=2", vocab_size=260).whole_vocab


def test_params_and_optimizer_state_split_over_every_device():
    placement = placement_from_flags(8, "fsdp=2,context=4", fsdp_axes="fsdp,context")
    model, opt_state = build(placement, LLAMA, make_optimizer(1e-2, 1, 8))
    state = (eqx.filter(model, eqx.is_array), opt_state)
    total = sum(x.nbytes for x in jax.tree.leaves(state))
    on_device0 = bytes_on_device(state, jax.devices()[0])
    # Norm scales and the per-layer widths that do not divide stay whole: a few percent.
    assert total / 8 <= on_device0 < 1.1 * total / 8, (on_device0, total)
    one = placement_from_flags(8, "data=2,context=4")
    model, opt_state = build(one, LLAMA, make_optimizer(1e-2, 1, 8))
    assert bytes_on_device((model, opt_state), jax.devices()[0]) == pytest.approx(total, rel=1e-3)


# ---- checkpoints under another mesh ------------------------------------------------------


def test_restore_under_another_mesh(tmp_path, datasets):
    """Saved under fsdp=2,context=4, resumed under fsdp=4,context=2: the same run."""
    changes = dict(devices=8, checkpoint_every=2, eval_every=8, steps=4, warmup_steps=1)
    changes.update(final_eval_batches=1)
    full = Trainer(small_config(tmp_path, mesh="fsdp=2,context=4", **changes), datasets=datasets)
    expected = full.run()
    full.close()
    shutil.rmtree(tmp_path / "checkpoints" / "4")  # killed before its last save
    moved = small_config(tmp_path, mesh="fsdp=4,context=2", resume=True, **changes)
    resumed = Trainer(moved, datasets=datasets)
    assert resumed.step == 2
    embed = resumed.model.embed
    assert embed.sharding.mesh.shape["fsdp"] == 4
    assert embed.sharding.spec == PartitionSpec(None, "fsdp")
    got = resumed.run()
    resumed.close()
    assert got.status == "completed" and got.step == 4
    for a, b in zip(params_of(got.model), params_of(expected.model), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


# ---- DeepSeek --------------------------------------------------------------------------


@pytest.mark.slow
def test_deepseek_main_job_runs(tmp_path, capsys):
    """The issue's command (trimmed to a few short steps): MLA + MoE on fsdp x context."""
    flags = ["--model", "deepseek", "--preset", "tiny", "--mesh", "fsdp=2,context=4"]
    flags += ["--devices", "8", "--steps", "2", "--seq-len", "64", "--batch-size", "8"]
    flags += ["--max-bytes", "200000", "--eval-batches", "1", "--final-eval-batches", "1"]
    flags += ["--override", "n_layers=2", "--run-dir", str(tmp_path), "--no-progress"]
    assert main(flags) == 0
    out = capsys.readouterr().out
    assert "training deepseek tiny" in out and "weights split over fsdp axes fsdp" in out
    assert "status:        completed" in out and "bits/byte" in out


# ---- weight decay by rank ------------------------------------------------------------------


def test_matrix_rank():
    assert matrix_rank(PartitionSpec("layers", "embed", "q_heads", "head_dim")) == 2
    assert matrix_rank(PartitionSpec("layers", "q_heads", "head_dim", "embed")) == 2
    assert matrix_rank(PartitionSpec("layers", "q_heads", "head_dim")) == 1
    assert matrix_rank(PartitionSpec("layers", "experts", "embed", "hidden")) == 3
    assert matrix_rank(PartitionSpec("vocab", "embed")) == 2
    assert matrix_rank(PartitionSpec("layers", "dim")) == 1


def abstract_params(config):
    """The parameters of a model as shapes (building the tiny DeepSeek eagerly is slow)."""
    model = eqx.filter_eval_shape(family_of(config).model, config, key=jax.random.key(0))
    return eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))


def test_weight_decay_by_rank_llama():
    mask = decay_mask(abstract_params(dataclasses.replace(LLAMA, attention_bias=True)))
    layer = mask.layers.layers
    assert mask.embed and layer.attn.wq and layer.attn.wo and layer.mlp.w_down
    assert not (mask.norm.weight or layer.attn_norm.weight or layer.mlp_norm.weight)
    assert not (layer.attn.bq or layer.attn.bk or layer.attn.bv)


def test_weight_decay_by_rank_deepseek():
    mask = decay_mask(abstract_params(DEEPSEEK))
    decayed = {
        jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(mask)
    }
    matrices = [k for k, v in decayed.items() if v]
    spared = [k for k, v in decayed.items() if not v]
    assert all("norm" in k or "bias" in k for k in spared), spared
    assert any("norm" in k for k in spared) and any("score_bias" in k for k in spared)
    for name in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "router", "w_gate", "w_down", ".embed"):
        assert any(name in k for k in matrices), (name, matrices)


# ---- metrics name their units ----------------------------------------------------------------


class _WordTokenizer:
    """A tokenizer whose tokens are not bytes (no `byte_ids`)."""

    vocab_size = 259


def test_bits_per_byte_only_for_byte_tokens(datasets):
    model = model_family("llama").model(LLAMA, key=jax.random.key(0))
    val = evaluate(model, datasets[1], BATCH, max_batches=2)
    assert val["bits_per_token"] == pytest.approx(val["loss"] / math.log(2))
    # Every loss-bearing target but the end-of-document ones is a byte.
    assert 0 < val["bytes"] < val["tokens"]
    assert val["bpb"] == pytest.approx(val["loss"] * val["tokens"] / math.log(2) / val["bytes"])
    other = evaluate(model, datasets[1], BATCH, max_batches=2, tokenizer=_WordTokenizer())
    assert "bpb" not in other and other["bits_per_token"] == pytest.approx(val["bits_per_token"])
    assert ByteTokenizer.byte_ids == 256


# ---- flag rules --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"model": "gpt"}, r"--model must be one of \('llama', 'deepseek'.*\); got --model 'gpt'"),
        (
            {"devices": 8, "mesh": "fsdp=2,context=4", "fsdp_axes": "fsdp,tensor"},
            r"--fsdp-axes names mesh axes .* --mesh 'fsdp=2,context=4''s axes \('fsdp', "
            r"'context'\); got --fsdp-axes 'fsdp,tensor'",
        ),
        (
            {"devices": 8, "mesh": "fsdp=2,context=4", "fsdp_axes": "fsdp,"},
            r"--fsdp-axes names mesh axes joined by commas",
        ),
        (
            {"devices": 8, "mesh": "fsdp=2,context=4", "fsdp_axes": "fsdp,fsdp"},
            r"at most once; got --fsdp-axes 'fsdp,fsdp'\. Pass --fsdp-axes fsdp\.",
        ),
        (
            {"devices": 8, "mesh": "fsdp=2,context=4", "fsdp_axes": "context"},
            r"has an fsdp axis of size 2, but --fsdp-axes 'context' leaves it out.*"
            r"--fsdp-axes fsdp,context",
        ),
        ({"devices": 1, "fsdp_axes": "context"}, r"--devices 1 without --mesh has no mesh"),
    ],
)
def test_config_rule(tmp_path, changes, match):
    with pytest.raises((ValueError, TypeError), match=match):
        small_config(tmp_path, **changes)


@pytest.mark.parametrize(
    ("mesh", "fsdp_axes", "config", "batch", "match"),
    [
        (
            "data=2,context=4",
            "data",
            LLAMA,
            8,
            r"--mesh 'data=2,context=4' with --strategy 'ring' and --fsdp-axes 'data': .*"
            r"'data' is used twice, as fsdp_axis and batch_axis",
        ),
        ("fsdp=4,context=2", None, LLAMA, 6, r"batch_size=6 must be divisible by 4"),
        ("expert=2,context=4", None, LLAMA, 8, r"expert=2 splits the routed experts .*none\."),
        ("expert=8,context=1", None, FOUR_EXPERTS, 8, r"model's 4 routed experts .* by 8"),
        ("tensor=8,context=1", None, DEEPSEEK, 8,
         r"4 query / 4 key-value heads: tensor_axis 'tensor' has 8 devices .* by 8"),
    ],
)  # fmt: skip
def test_placement_rule(mesh, fsdp_axes, config, batch, match):
    with pytest.raises(ValueError, match=match):
        placement_from_flags(8, mesh, fsdp_axes=fsdp_axes).check_run(batch, 64, config)


def test_preset_and_override_errors_name_the_family(tmp_path, datasets):
    deepseek = model_family("deepseek")
    with pytest.raises(ValueError, match=r"one of --model deepseek's presets \['deepseek-v2-lite'"):
        Trainer(small_config(tmp_path, model="deepseek", preset="llama3.1-8b"), datasets=datasets)
    with pytest.raises(
        ValueError, match=r"--override must name DeepSeekConfig fields; .*n_kv_heads"
    ):
        Trainer(small_config(tmp_path, model="deepseek"), datasets=datasets)
    assert "tiny" in deepseek.presets


def test_deepseek_experts_and_their_adam_state_split_over_the_expert_axis():
    placement = placement_from_flags(8, "expert=2,fsdp=2,context=2")
    placement.check_run(8, 64, DEEPSEEK)
    model, opt_state = build(placement, DEEPSEEK, make_optimizer(1e-2, 1, 8))
    experts = model.moe_layers.layers.mlp.w_gate  # [layers, experts, embed, hidden]
    assert experts.sharding.spec == PartitionSpec(None, "expert", "fsdp", None)
    mu = optax.tree_utils.tree_get(opt_state, "mu").moe_layers.layers.mlp.w_gate
    assert mu.sharding.is_equivalent_to(experts.sharding, experts.ndim)


@pytest.mark.parametrize("family_name", ["llama", "deepseek"])
@pytest.mark.parametrize("remat", REMAT_POLICIES)
def test_every_remat_policy_reaches_the_model(tmp_path, family_name, remat):
    from eqx_longctx.train import build_model_config

    config = small_config(tmp_path, model=family_name, model_overrides={}, remat=remat)
    assert build_model_config(config, 259).remat == remat
