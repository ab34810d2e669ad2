"""Context-parallel edge cases beside the oracle grid of `test_context_parallel.py`: every
`ShardingSpec` and shape rule raises a clear `ValueError`; long zig-zag rows switch the flash
tiles to the chunk length and still match the oracle; K, V, positions and segment ids travel
in one collective per dtype, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, make_mesh, segment_ids_from_lengths
from jax.sharding import Mesh
from test_context_parallel import HEAD_DIM, make_spec

from eqx_longctx import ShardingSpec, attention, from_layout, reference_attention, to_layout

# ---- errors ------------------------------------------------------------------------------


def _spec(shape=(2, 4), names=("data", "context"), **kw):
    return ShardingSpec(make_mesh(shape, names), **kw)


def _attend(spec, batch=4, seq=64, q_heads=8, kv_heads=2):
    q = jnp.zeros((batch, seq, q_heads, HEAD_DIM))
    kv = jnp.zeros((batch, seq, kv_heads, HEAD_DIM))
    return attention(q, kv, kv, spec=spec)


def _layout(spec, seq):
    return to_layout(np.zeros((2, seq)), spec, axis=1)


SPEC_ERRORS = [
    ("unknown strategy", dict(strategy="megatron"), "unknown strategy 'megatron'"),
    ("unknown load_balance", dict(load_balance="random"), "unknown load_balance 'random'"),
    ("context axis not in mesh", dict(context_axis="seq"), r"context_axis='seq' is not an axis"),
    ("batch axis not in mesh", dict(batch_axis="batch"), r"batch_axis='batch' is not an axis"),
    ("tensor axis not in mesh", dict(tensor_axis="model"), r"tensor_axis='model' is not an axis"),
    ("axis used twice", dict(batch_axis="context"), "'context' is used twice"),
    ("axis used twice (tensor)", dict(tensor_axis="data"), "'data' is used twice"),
    (
        "ulysses axis without usp",
        dict(strategy="ring", ulysses_axis="data", batch_axis=None),
        "ulysses_axis='data' is used only by strategy='usp' \\(or 'auto'",
    ),
    ("usp without ulysses axis", dict(strategy="usp"), "strategy='usp' needs ulysses_axis"),
]


@pytest.mark.parametrize("kw,match", [e[1:] for e in SPEC_ERRORS], ids=[e[0] for e in SPEC_ERRORS])
def test_bad_spec_raises(kw, match):
    with pytest.raises(ValueError, match=match):
        _spec(**kw)


def test_usp_with_ulysses_axis_of_size_one_raises():
    with pytest.raises(ValueError, match="ulysses_axis 'ulysses' of size > 1, got size 1"):
        _spec(
            (1, 8), ("ulysses", "context"), strategy="usp", ulysses_axis="ulysses", batch_axis=None
        )


@pytest.mark.parametrize("mesh", ["not a mesh", ((2, 4), ("data", "context")), None])
def test_non_mesh_raises(mesh):
    with pytest.raises(ValueError, match="needs a jax.sharding.Mesh"):
        ShardingSpec(mesh)


SEQ_ERRORS = [
    # (mesh name, layout, seq, divisor named in the message)
    ("ring-2x4", "none", 30, 4),
    ("ring-2x4", "striped", 30, 4),
    ("ring-2x4", "zigzag", 36, 8),  # divisible by N=4, not by 2N
    ("ulysses-1x8", "zigzag", 40, 16),
    ("usp-2x4", "zigzag", 40, 16),  # N = ulysses x context = 8
    ("usp-4x2", "none", 36, 8),
]


@pytest.mark.parametrize("mesh,layout,seq,need", SEQ_ERRORS, ids=[str(e) for e in SEQ_ERRORS])
def test_sequence_not_divisible_raises(mesh, layout, seq, need):
    spec = make_spec(mesh, layout)
    match = f"seq must be divisible by {need}; got seq={seq}"
    with pytest.raises(ValueError, match=match):
        _attend(spec, seq=seq)
    with pytest.raises(ValueError, match=match):
        _layout(spec, seq)
    with pytest.raises(ValueError, match=match):
        from_layout(jnp.zeros((2, seq)), spec, axis=1)


@pytest.mark.parametrize(
    "mesh,q_heads,kv_heads,match",
    [
        ("ulysses-1x8", 4, 2, r"'ulysses' over axis 'context' \(size 8\) needs num_heads"),
        ("ulysses-2x4", 6, 2, r"'ulysses' over axis 'context' \(size 4\) needs num_heads"),
        ("usp-4x2", 6, 1, r"'usp' over axis 'ulysses' \(size 4\) needs num_heads"),
        ("usp-2x4", 3, 3, r"'usp' over axis 'ulysses' \(size 2\) needs num_heads"),
    ],
)
def test_heads_not_divisible_by_ulysses_degree_raises(mesh, q_heads, kv_heads, match):
    with pytest.raises(ValueError, match=match):
        _attend(make_spec(mesh, "zigzag"), q_heads=q_heads, kv_heads=kv_heads)


def test_batch_not_divisible_by_batch_axis_raises():
    with pytest.raises(ValueError, match="batch must be divisible by 2; got batch=3"):
        _attend(make_spec("ring-2x4", "zigzag"), batch=3)


def test_heads_not_divisible_by_tensor_axis_raises():
    spec = ShardingSpec(make_mesh((2, 2, 2), ("data", "context", "tensor")), tensor_axis="tensor")
    with pytest.raises(ValueError, match="divisible by 2; got q_heads=3, kv_heads=3"):
        _attend(spec, q_heads=3, kv_heads=3)
    with pytest.raises(ValueError, match="divisible by 2; got q_heads=4, kv_heads=1"):
        _attend(spec, q_heads=4, kv_heads=1)


# Not the full product (~27 s of one core less): every strategy with the policy's own
# tiles, and one-head tiles on the ring, whose hops run the same block kernel as
# all-gather's whole K/V; Ulysses over 8 leaves each device one query head anyway.
@pytest.mark.parametrize(
    "strategy,one_head_tiles",
    [("all_gather", False), ("ulysses", False), ("ring", False), ("ring", True)],
    ids=["all_gather", "ulysses", "ring", "ring-one-head-tiles"],
)
def test_zigzag_chunk_aligned_tiles(strategy, one_head_tiles, monkeypatch):
    """Long enough rows switch the flash tiles to zig-zag's chunk length (here 128); the 8
    fake devices share the CPU's caches, so each gets 1/8 of the score-tile bytes (and, with
    `one_head_tiles`, so few that every score tile holds one head)."""
    from eqx_longctx.attention import _tiling_policy as policy

    if one_head_tiles:  # 8 devices x one 128 x 128 float32 head
        monkeypatch.setattr(policy, "TILE_BYTES", 8 * 128 * 128 * 4)
    mesh = jax.make_mesh((1, 8), ("data", "context"))
    spec = ShardingSpec(mesh, strategy=strategy, load_balance="zigzag")
    seq = 2048
    tiling = policy.tiling(spec, seq)
    assert tiling.block == 128 and tiling.tile_bytes == policy.TILE_BYTES // 8
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    q = jax.random.normal(ks[0], (1, seq, 8, 8))
    k = jax.random.normal(ks[1], (1, seq, 2, 8))
    v = jax.random.normal(ks[2], (1, seq, 2, 8))
    seg = jnp.asarray(segment_ids_from_lengths([[300, 1000, 748]]))
    lay = lambda x: to_layout(x, spec, axis=1)  # noqa: E731
    f = lambda q, k, v: from_layout(  # noqa: E731
        attention(lay(q), lay(k), lay(v), spec=spec, segment_ids=lay(seg)), spec, axis=1
    )
    out, grads = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2)))(
        q, k, v
    )
    ref, ref_grads = jax.value_and_grad(
        lambda *a: jnp.sum(reference_attention(*a, segment_ids=seg) ** 2), argnums=(0, 1, 2)
    )(q, k, v)
    assert_close(out, ref, what="forward loss")
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        assert_close(a, b, what=f"d{name}")


@pytest.mark.parametrize("collective", ["all-gather", "collective-permute"])
@pytest.mark.parametrize(
    ("dtype", "collectives"), [(jnp.float32, 1), (jnp.bfloat16, 2), (jnp.float16, 2)]
)
def test_arrays_travel_together_one_collective_per_dtype(dtype, collectives, collective):
    """K, V, positions and segment ids take one collective per dtype (the ids bitcast into
    float32 lanes; the ring's hops), and what arrives is bit for bit what one collective per
    array delivers, ids whose bits read as NaN or denormal floats included, gradients too."""
    from jax.sharding import PartitionSpec as P

    from eqx_longctx.attention._pack import together

    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "context"))
    ks = jax.random.split(jax.random.PRNGKey(0), 2)
    k = jax.random.normal(ks[0], (4, 32, 2, 8)).astype(dtype)
    v = jax.random.normal(ks[1], (4, 32, 2, 4)).astype(dtype)
    # -5 is a NaN's bits as float32; 7919 x n up to ~1e6 are denormals.
    pos = jnp.arange(128, dtype=jnp.int32).reshape(4, 32) * 7919 - 5
    seg = jnp.arange(128, dtype=jnp.int32).reshape(4, 32) // 5
    if collective == "all-gather":
        move = lambda x: jax.lax.all_gather(x, "context", axis=1, tiled=True)  # noqa: E731
        out_spec = P("data")
    else:
        ring = [(i, (i + 1) % 4) for i in range(4)]
        move = lambda x: jax.lax.ppermute(x, "context", ring)  # noqa: E731
        out_spec = P("data", "context")

    def run(fn):
        return jax.shard_map(
            lambda k, v, pos, seg: fn((k, v, pos, None, seg)), mesh=mesh,
            in_specs=(P("data", "context"),) * 4, out_specs=out_spec, check_vma=False,
        )  # fmt: skip

    one, each = run(lambda t: together(t, move)), run(lambda t: jax.tree.map(move, t))
    got, want = jax.jit(one)(k, v, pos, seg), jax.jit(each)(k, v, pos, seg)
    assert got[3] is None
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    text = jax.jit(one).lower(k, v, pos, seg).compile().as_text()
    assert text.count(f" {collective}(") + text.count(f" {collective}-start(") == collectives

    def loss(fn):
        def f(k, v):
            out = fn(k, v, pos, seg)
            return jnp.sum(jnp.sin(out[0].astype(jnp.float32))) + 2 * jnp.sum(
                jnp.cos(out[1].astype(jnp.float32))
            )

        return f

    g_one = jax.jit(jax.grad(loss(one), (0, 1)))(k, v)
    g_each = jax.jit(jax.grad(loss(each), (0, 1)))(k, v)
    for a, b in zip(g_one, g_each, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
