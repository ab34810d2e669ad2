"""Context-parallel attention on 8 fake devices, forward and gradients, against the oracle.

Every strategy runs on global arrays in its spec's token layout: `to_layout` on q, k, v and
segment ids, `from_layout` on the output. The oracle (`reference_attention`, float32, every
score materialized) sees the natural order. The spec's errors, zig-zag's chunk-aligned tiles
and the one-collective packing of K/V are in `test_context_parallel_edges.py`.
"""

import functools
import itertools
from typing import NamedTuple

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_close,
    make_mesh,
    pairwise_cover,
    random_segment_ids,
    segment_ids_from_lengths,
)
from jax.sharding import Mesh

from eqx_longctx import ShardingSpec, attention, from_layout, reference_attention, to_layout

# ---- the central table -------------------------------------------------------------------
#
# Factors: strategy on a mesh (data x context; ulysses x context for usp) x layout x head
# type x causal x packed x mesh axis type (`jax.make_mesh`, Explicit; `Mesh(...)`, Auto).
# The full product is ~800 cases of one compile each (~2 s on this CPU), too slow for CI.
# The table is instead:
#   - on one "home" mesh per strategy, Explicit axes: the longest ring (1x8), Ulysses over 8
#     (1x8: GQA and MQA need K/V head replication), all-gather on 2x4 (batch sharded too),
#     usp 2x4; the full product of layout x causal x packed (12 cases) on each, each of the
#     12 with one head type, turning so that each head type meets every layout, mask and
#     packing on every home mesh (`home_head`). Pairwise in heads, not the full product:
#     Ulysses and usp repeat K/V heads and split them over devices before the masks and
#     layouts are applied, so heads x (layout, mask, packing) pairs reach every path; their
#     full product (36 cases per strategy) took 48 more cases, ~140 s of one core, as the
#     ring's and all-gather's did before (those move K/V whole: heads reach only the block
#     kernel, test_attention_local.py's grid);
#   - plus rows chosen so that every pair of values of any two factors appears at least once
#     (`pairwise_cover`), which brings in every other mesh and the Auto axis type.

MESHES = {  # name: (strategy, mesh shape, mesh axis names)
    "all_gather-1x8": ("all_gather", (1, 8), ("data", "context")),
    "all_gather-2x4": ("all_gather", (2, 4), ("data", "context")),
    "all_gather-4x2": ("all_gather", (4, 2), ("data", "context")),
    "ulysses-1x8": ("ulysses", (1, 8), ("data", "context")),
    "ulysses-2x4": ("ulysses", (2, 4), ("data", "context")),
    "ulysses-4x2": ("ulysses", (4, 2), ("data", "context")),
    "ring-1x8": ("ring", (1, 8), ("data", "context")),
    "ring-2x4": ("ring", (2, 4), ("data", "context")),
    "ring-4x2": ("ring", (4, 2), ("data", "context")),
    "usp-2x4": ("usp", (2, 4), ("ulysses", "context")),
    "usp-4x2": ("usp", (4, 2), ("ulysses", "context")),
}
HOME = ("all_gather-2x4", "ulysses-1x8", "ring-1x8", "usp-2x4")
LAYOUTS = ("none", "zigzag", "striped")
HEADS = {"mha": (8, 8), "gqa": (8, 2), "mqa": (8, 1)}  # (q_heads, kv_heads)
FACTORS = dict(
    mesh=tuple(MESHES),
    layout=LAYOUTS,
    heads=tuple(HEADS),
    causal=(True, False),
    packed=(False, True),
    axes=("explicit", "auto"),
)
BATCH, SEQ, HEAD_DIM = 4, 64, 8


class Case(NamedTuple):
    mesh: str
    layout: str
    heads: str
    causal: bool
    packed: bool
    axes: str  # "explicit" (jax.make_mesh) or "auto" (jax.sharding.Mesh)

    @property
    def id(self) -> str:
        mask = "causal" if self.causal else "full"
        packing = "packed" if self.packed else "unpacked"
        return f"{self.mesh}-{self.layout}-{self.heads}-{mask}-{packing}-{self.axes}"


def home_head(layout: str, causal: bool, packed: bool) -> str:
    """The head type a home mesh runs with this layout, mask and packing, turning so that
    each meets every value of the three (zig-zag, causal, packed gets GQA on every home
    mesh: .ci/run's Python 3.12 subset runs those rows, one per strategy)."""
    return tuple(HEADS)[(LAYOUTS.index(layout) + causal + 2 * packed) % len(HEADS)]


def _build_table() -> list[Case]:
    home = [
        dict(mesh=m, layout=lb, heads=home_head(lb, c, p), causal=c, packed=p, axes="explicit")
        for m, lb, c, p in itertools.product(HOME, LAYOUTS, (True, False), (False, True))
    ]
    return [Case(**row) for row in pairwise_cover(FACTORS, seed_rows=home)]


TABLE = _build_table()


# ---- building blocks -----------------------------------------------------------------------


def make_spec(mesh_name: str, layout: str, axes: str = "explicit") -> ShardingSpec:
    strategy, shape, names = MESHES[mesh_name]
    mesh = make_mesh(shape, names, axes)
    if strategy == "usp":
        return ShardingSpec(mesh, "usp", layout, batch_axis=None, ulysses_axis="ulysses")
    return ShardingSpec(mesh, strategy, layout)


@functools.cache
def make_inputs(heads: str, dtype=jnp.float32, seed: int = 0):
    """q, k, v (in `dtype`), packed segment ids and an f32 output cotangent, natural order."""
    hq, hk = HEADS[heads]
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (BATCH, SEQ, hq, HEAD_DIM), dtype)
    k = jax.random.normal(ks[1], (BATCH, SEQ, hk, HEAD_DIM), dtype)
    v = jax.random.normal(ks[2], (BATCH, SEQ, hk, HEAD_DIM), dtype)
    seg = random_segment_ids(ks[3], BATCH, SEQ)
    ct = jax.random.normal(ks[4], (BATCH, SEQ, hq, HEAD_DIM), jnp.float32)
    return q, k, v, seg, ct


def forward_and_grads(f, q, k, v, ct, *, jit: bool = True, mesh: Mesh | None = None):
    """`f(q, k, v)` and the gradients of `sum(f(q, k, v) * ct)` in q, k, v.

    Eager `grad` of a loss on an Explicit mesh needs that mesh set (JAX builds the seed
    cotangent with the loss's mesh-typed sharding), hence `mesh`.
    """

    def loss(q, k, v):
        out = f(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * ct), out

    value_and_grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    if jit:
        value_and_grad = jax.jit(value_and_grad)
    if mesh is None:
        (_, out), grads = value_and_grad(q, k, v)
    else:
        with jax.set_mesh(mesh):
            (_, out), grads = value_and_grad(q, k, v)
    return out, grads


def oracle_fn(causal: bool, segment_ids):
    def f(q, k, v):
        up = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
        return reference_attention(up(q), up(k), up(v), causal=causal, segment_ids=segment_ids)

    return f


@functools.cache
def cached_oracle(heads: str, causal: bool, packed: bool, dtype=jnp.float32):
    """Oracle output and gradients (float32, natural order) on `make_inputs(heads, dtype)`."""
    q, k, v, seg, ct = make_inputs(heads, dtype)
    out, grads = forward_and_grads(oracle_fn(causal, seg if packed else None), q, k, v, ct)
    return np.asarray(out), tuple(np.asarray(g) for g in grads)


def context_parallel_fn(spec: ShardingSpec, causal: bool, segment_ids):
    """Natural order in, natural order out: lay out, attend under `spec`, restore the order."""

    def f(q, k, v):
        lay = lambda x: to_layout(x, spec, axis=1)  # noqa: E731
        seg = None if segment_ids is None else lay(segment_ids)
        out = attention(lay(q), lay(k), lay(v), spec=spec, causal=causal, segment_ids=seg)
        return from_layout(out, spec, axis=1)

    return f


def _explicit_mesh(spec: ShardingSpec) -> Mesh | None:
    explicit = jax.sharding.AxisType.Explicit in spec.mesh.axis_types
    return spec.mesh if explicit else None


def check_against_oracle(out, grads, expected, dtype, what: str):
    ref_out, ref_grads = expected
    assert out.shape == ref_out.shape, what
    assert out.dtype == dtype, f"{what}: output dtype {out.dtype}, expected {dtype}"
    assert_close(out, ref_out, dtype, what=f"{what} forward")
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert g.shape == r.shape, f"{what} d{name}"
        assert_close(g, r, dtype, what=f"{what} d{name}")


# ---- the table, float32, under jit ------------------------------------------------------


def test_table_covers_every_pair_and_the_home_products():
    assert len(TABLE) == len(set(TABLE))
    for a, b in itertools.combinations(FACTORS, 2):
        pairs = {(getattr(c, a), getattr(c, b)) for c in TABLE}
        assert pairs == set(itertools.product(FACTORS[a], FACTORS[b])), (a, b)
    for mesh in HOME:
        rows = {(c.layout, c.heads, c.causal, c.packed) for c in TABLE if c.mesh == mesh}
        masks = set(itertools.product(LAYOUTS, FACTORS["causal"], FACTORS["packed"]))
        assert {(lb, c, p) for lb, _, c, p in rows} == masks, mesh
        # each head type with every layout, mask and packing
        for i, values in ((0, LAYOUTS), (2, FACTORS["causal"]), (3, FACTORS["packed"])):
            assert {(r[1], r[i]) for r in rows} == set(itertools.product(HEADS, values))
    assert {c.mesh for c in TABLE if c.axes == "auto"} == set(MESHES)


@pytest.mark.parametrize("case", TABLE, ids=[c.id for c in TABLE])
def test_against_oracle(case: Case):
    spec = make_spec(case.mesh, case.layout, case.axes)
    q, k, v, seg, ct = make_inputs(case.heads)
    seg = seg if case.packed else None
    out, grads = forward_and_grads(context_parallel_fn(spec, case.causal, seg), q, k, v, ct)
    expected = cached_oracle(case.heads, case.causal, case.packed)
    check_against_oracle(out, grads, expected, jnp.float32, case.id)


# ---- eagerly; inputs already sharded -----------------------------------------------------

EAGER = [  # eager runs are slow (no compilation cache across ops): two are enough
    Case("ulysses-1x8", "striped", "mqa", True, True, "auto"),
    Case("ring-2x4", "zigzag", "gqa", True, True, "explicit"),
]


@pytest.mark.parametrize("case", EAGER, ids=[c.id for c in EAGER])
def test_eager_against_oracle(case: Case):
    spec = make_spec(case.mesh, case.layout, case.axes)
    q, k, v, seg, ct = make_inputs(case.heads)
    f = context_parallel_fn(spec, case.causal, seg)
    out, grads = forward_and_grads(f, q, k, v, ct, jit=False, mesh=_explicit_mesh(spec))
    check_against_oracle(
        out, grads, cached_oracle(case.heads, case.causal, True), jnp.float32, f"eager {case.id}"
    )


PRESHARDED = [
    # (mesh, layout, axes, when the inputs are placed, jit)
    ("ring-2x4", "zigzag", "explicit", "after_layout", True),
    ("ring-2x4", "striped", "auto", "after_layout", False),
    ("ulysses-4x2", "zigzag", "explicit", "before_layout", False),
    ("all_gather-1x8", "striped", "auto", "before_layout", True),
    ("usp-2x4", "zigzag", "explicit", "after_layout", False),
    ("usp-4x2", "none", "auto", "before_layout", True),
]


@pytest.mark.parametrize(
    "mesh,layout,axes,placed,jit", PRESHARDED, ids=["-".join(map(str, p)) for p in PRESHARDED]
)
def test_presharded_inputs(mesh, layout, axes, placed, jit):
    """Inputs `device_put` with a `NamedSharding`, laid out on the host or on the devices."""
    spec = make_spec(mesh, layout, axes)
    q, k, v, seg, ct = make_inputs("gqa")
    heads, tokens = spec.sharding(spec.heads_pspec()), spec.sharding(spec.token_pspec())
    lay = lambda x: to_layout(x, spec, axis=1)  # noqa: E731
    if placed == "after_layout":  # the data pipeline's path: permute on the host, then place
        host = [lay(np.asarray(x)) for x in (q, k, v, seg, ct)]
        assert all(isinstance(x, np.ndarray) for x in host)
        (ql, kl, vl), sl, cl = [jax.device_put(x, heads) for x in host[:3]], host[3], host[4]
        sl, cl = jax.device_put(sl, tokens), jax.device_put(cl, heads)
    else:  # placed in natural order, permuted on the devices
        placed_arrays = [jax.device_put(x, heads) for x in (q, k, v, ct)]
        ql, kl, vl, cl = (lay(x) for x in placed_arrays)
        sl = lay(jax.device_put(seg, tokens))

    def f(q, k, v):
        return attention(q, k, v, spec=spec, segment_ids=sl)

    def loss(q, k, v):
        out = f(q, k, v)
        return jnp.sum(out * cl), out

    value_and_grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    if jit:
        value_and_grad = jax.jit(value_and_grad)
    mesh_context = jax.set_mesh(spec.mesh) if _explicit_mesh(spec) and not jit else None
    if mesh_context is None:
        (_, out), grads = value_and_grad(ql, kl, vl)
    else:  # see forward_and_grads
        with mesh_context:
            (_, out), grads = value_and_grad(ql, kl, vl)
    assert out.sharding.is_equivalent_to(heads, out.ndim), out.sharding
    back = lambda x: from_layout(x, spec, axis=1)  # noqa: E731
    check_against_oracle(
        back(out),
        [back(g) for g in grads],
        cached_oracle("gqa", True, True),
        jnp.float32,
        f"presharded {mesh} {layout} {axes} {placed} jit={jit}",
    )


# ---- bfloat16 inputs against the float32 oracle ----------------------------------------

BF16 = [
    Case("ring-1x8", "zigzag", "gqa", True, True, "explicit"),
    Case("ring-2x4", "striped", "mqa", False, False, "auto"),
    Case("ulysses-1x8", "zigzag", "mqa", True, True, "explicit"),
    Case("ulysses-4x2", "striped", "gqa", True, False, "auto"),
]


@pytest.mark.parametrize("case", BF16, ids=[c.id for c in BF16])
def test_bfloat16_against_float32_oracle(case: Case):
    """bf16 in and out, f32 accumulation; the oracle sees the same bf16-rounded inputs."""
    spec = make_spec(case.mesh, case.layout, case.axes)
    q, k, v, seg, ct = make_inputs(case.heads, jnp.bfloat16)
    seg = seg if case.packed else None
    out, grads = forward_and_grads(context_parallel_fn(spec, case.causal, seg), q, k, v, ct)
    assert all(g.dtype == jnp.bfloat16 for g in grads)
    expected = cached_oracle(case.heads, case.causal, case.packed, jnp.bfloat16)
    check_against_oracle(out, grads, expected, jnp.bfloat16, f"bf16 {case.id}")


# ---- property-based: random documents whose boundaries ignore the chunking -------------


@st.composite
def doc_lengths(draw, seq: int, avoid: int):
    """Document lengths summing to `seq`, none divisible by `avoid` (so `avoid | seq` only)."""
    lengths, left = [], seq
    while left:
        choices = [n for n in range(1, left + 1) if n % avoid]
        # Long documents are the interesting ones; short ones keep the row from being one doc.
        n = draw(st.sampled_from(choices[::-1]))
        lengths.append(n)
        left -= n
    return lengths


@hypothesis.settings(max_examples=8, deadline=None, database=None)
@hypothesis.given(data=st.data())
def test_random_documents_against_oracle(data):
    mesh = data.draw(st.sampled_from(list(MESHES)), label="mesh")
    layout = data.draw(st.sampled_from(LAYOUTS), label="layout")
    axes = data.draw(st.sampled_from(["explicit", "auto"]), label="axes")
    heads = data.draw(st.sampled_from(list(HEADS)), label="heads")
    causal = data.draw(st.booleans(), label="causal")
    spec = make_spec(mesh, layout, axes)
    n = spec.context_parallel_size
    assert SEQ % (2 * n) == 0
    rows = [data.draw(doc_lengths(SEQ, 2 * n), label=f"row {i} lengths") for i in range(BATCH)]
    # Ids in a random order: a row's segment ids need not increase along it.
    ids = [
        data.draw(st.permutations(range(len(r))), label=f"row {i} ids") for i, r in enumerate(rows)
    ]
    seg = jnp.asarray(
        np.stack(
            [np.asarray(i)[s] for i, s in zip(ids, segment_ids_from_lengths(rows), strict=True)]
        )
    )
    q, k, v, _, ct = make_inputs(heads, seed=1)
    out, grads = forward_and_grads(context_parallel_fn(spec, causal, seg), q, k, v, ct)
    expected = forward_and_grads(oracle_fn(causal, seg), q, k, v, ct)
    what = f"{mesh} {layout} {axes} {heads} causal={causal} {rows} {ids}"
    check_against_oracle(out, grads, expected, jnp.float32, what)


# ---- a tensor axis beside the context axis ----------------------------------------------


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_tensor_axis(strategy):
    mesh = make_mesh((2, 2, 2), ("data", "context", "tensor"))
    spec = ShardingSpec(mesh, strategy, "zigzag", tensor_axis="tensor")
    q, k, v, seg, ct = make_inputs("gqa")
    out, grads = forward_and_grads(context_parallel_fn(spec, True, seg), q, k, v, ct)
    check_against_oracle(
        out, grads, cached_oracle("gqa", True, True), jnp.float32, f"{strategy} tensor axis"
    )
