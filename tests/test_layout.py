"""Token layouts (`none`, `zigzag`, `striped`), their inverse, and `ShardingSpec` as a value."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mesh
from jax.sharding import PartitionSpec

from eqx_longctx import ShardingSpec, from_layout, layout_order, to_layout

LAYOUTS = ("none", "zigzag", "striped")
MESHES = {  # name: (mesh shape, axis names, extra ShardingSpec arguments); N = sequence shards
    "1x8": ((1, 8), ("data", "context"), {}),
    "2x4": ((2, 4), ("data", "context"), {}),
    "4x2": ((4, 2), ("data", "context"), {}),
    "8x1": ((8, 1), ("data", "context"), {}),
    "usp-2x4": (
        (2, 4),
        ("ulysses", "context"),
        dict(strategy="usp", ulysses_axis="ulysses", batch_axis=None),
    ),
}
BATCH = 8


def make_spec(mesh: str, layout: str, axes: str = "explicit") -> ShardingSpec:
    shape, names, kw = MESHES[mesh]
    return ShardingSpec(make_mesh(shape, names, axes), load_balance=layout, **kw)


def sequence_index(spec: ShardingSpec, device) -> int:
    """Which of the N sequence shards `device` holds, from its coordinates in the mesh."""
    where = np.argwhere(spec.mesh.devices == device)[0]
    coords = dict(zip(spec.mesh.axis_names, where, strict=True))
    d = 0
    for axis in spec.sequence_axes:  # major to minor
        d = d * spec.axis_size(axis) + int(coords[axis])
    return d


def expected_tokens(layout: str, n: int, seq: int, d: int) -> np.ndarray:
    """The original token indices device `d` of `n` holds, from the layout's definition."""
    if layout == "none":
        return np.arange(d * seq // n, (d + 1) * seq // n)
    if layout == "striped":
        return np.arange(d, seq, n)
    chunks = np.arange(seq).reshape(2 * n, seq // (2 * n))
    return np.concatenate([chunks[d], chunks[2 * n - 1 - d]])


# ---- the permutation ---------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mesh", list(MESHES))
def test_layout_order_is_a_permutation_with_the_documented_shape(mesh, layout):
    spec = make_spec(mesh, layout)
    n = spec.context_parallel_size
    for seq in (2 * n, 6 * n, 64):
        order = layout_order(spec, seq)
        assert order.shape == (seq,) and order.dtype == np.int32
        np.testing.assert_array_equal(np.sort(order), np.arange(seq))
        per_device = order.reshape(n, seq // n)
        for d in range(n):
            np.testing.assert_array_equal(per_device[d], expected_tokens(layout, n, seq, d))


@pytest.mark.parametrize("mesh", list(MESHES))
def test_none_is_identity(mesh):
    spec = make_spec(mesh, "none")
    np.testing.assert_array_equal(layout_order(spec, 48), np.arange(48))
    x = np.random.default_rng(0).normal(size=(2, 48, 3))
    np.testing.assert_array_equal(to_layout(x, spec), x)


@pytest.mark.parametrize("mesh", ["1x8", "2x4", "4x2", "usp-2x4"])
def test_zigzag_pairs_chunk_i_with_chunk_2n_minus_1_minus_i(mesh):
    spec = make_spec(mesh, "zigzag")
    n, seq = spec.context_parallel_size, 64
    chunk = seq // (2 * n)
    slots = layout_order(spec, seq).reshape(n, 2, chunk)  # device, first/second half, token
    for i in range(n):
        assert set(slots[i, 0] // chunk) == {i}
        assert set(slots[i, 1] // chunk) == {2 * n - 1 - i}
        np.testing.assert_array_equal(np.diff(slots[i].reshape(-1))[: chunk - 1], 1)


@pytest.mark.parametrize("mesh", ["1x8", "2x4", "4x2", "usp-2x4"])
def test_striped_puts_token_t_on_device_t_mod_n(mesh):
    spec = make_spec(mesh, "striped")
    n, seq = spec.context_parallel_size, 64
    device_of_slot = np.repeat(np.arange(n), seq // n)
    order = layout_order(spec, seq)
    np.testing.assert_array_equal(order % n, device_of_slot)
    assert np.all(np.diff(order.reshape(n, -1), axis=1) == n)


@pytest.mark.parametrize("axes", ["explicit", "auto"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mesh", ["1x8", "2x4", "usp-2x4"])
def test_tokens_land_on_the_devices_the_layout_names(mesh, layout, axes):
    """Placed with the spec's token sharding, device `d` (by mesh coordinates) holds its tokens."""
    spec = make_spec(mesh, layout, axes)
    n, seq = spec.context_parallel_size, 64
    tokens = np.broadcast_to(np.arange(seq, dtype=np.int32), (BATCH, seq))
    placed = jax.device_put(to_layout(tokens, spec), spec.sharding(spec.token_pspec()))
    seen = set()
    for shard in placed.addressable_shards:
        d = sequence_index(spec, shard.device)
        rows = np.asarray(shard.data)
        for row in rows:
            np.testing.assert_array_equal(row, expected_tokens(layout, n, seq, d))
        seen.add(d)
    assert seen == set(range(n))


# ---- round trips ---------------------------------------------------------------------------


def _data(seq=64):
    return np.random.default_rng(0).normal(size=(BATCH, seq, 4, 3)).astype(np.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mesh", ["1x8", "2x4", "usp-2x4"])
def test_round_trip_numpy(mesh, layout):
    spec = make_spec(mesh, layout)
    x = _data()
    for axis in (1, 0, 3):
        y = x if axis == 1 else np.moveaxis(x, 1, axis)  # the sequence on another axis
        laid = to_layout(y, spec, axis=axis)
        assert isinstance(laid, np.ndarray) and laid.dtype == y.dtype
        expected = np.take(y, layout_order(spec, 64), axis=axis)
        np.testing.assert_array_equal(laid, expected)
        np.testing.assert_array_equal(from_layout(laid, spec, axis=axis), y)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mesh", ["1x8", "2x4", "usp-2x4"])
def test_round_trip_jax_unsharded(mesh, layout):
    spec = make_spec(mesh, layout)
    x = _data()
    laid = to_layout(jnp.asarray(x), spec)
    assert isinstance(laid, jax.Array) and laid.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(laid), to_layout(x, spec))
    np.testing.assert_array_equal(np.asarray(from_layout(laid, spec)), x)
    ints = to_layout(jnp.asarray(x[..., 0, 0] > 0).astype(jnp.int32), spec)
    assert ints.dtype == jnp.int32


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("axes", ["explicit", "auto"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mesh", ["2x4", "usp-2x4"])
def test_round_trip_jax_sharded(mesh, layout, axes, jit):
    spec = make_spec(mesh, layout, axes)
    x = _data()
    expected = to_layout(x, spec)
    pspecs = [
        spec.heads_pspec(),  # sequence sharded, as attention takes it
        PartitionSpec(spec.batch_axis),  # only the batch sharded
        PartitionSpec(),  # replicated over the mesh
    ]
    for pspec in pspecs:
        placed = jax.device_put(x, spec.sharding(pspec))
        if jit:
            laid = jax.jit(lambda x: to_layout(x, spec))(placed)
            back = jax.jit(lambda x: from_layout(x, spec))(laid)
            round_trip = jax.jit(lambda x: from_layout(to_layout(x, spec), spec))(placed)
            np.testing.assert_array_equal(np.asarray(round_trip), x)
        else:
            laid = to_layout(placed, spec)
            back = from_layout(laid, spec)
        np.testing.assert_array_equal(np.asarray(laid), expected, err_msg=str(pspec))
        np.testing.assert_array_equal(np.asarray(back), x, err_msg=str(pspec))


@pytest.mark.parametrize("axes", ["explicit", "auto"])
def test_round_trip_gradient_is_identity(axes):
    """The layout is a permutation: the gradient of a round trip is the cotangent itself."""
    spec = make_spec("2x4", "zigzag", axes)
    x = jax.device_put(_data(), spec.sharding(spec.heads_pspec()))
    ct = np.random.default_rng(1).normal(size=x.shape).astype(np.float32)
    # On the mesh and an argument, not a closure: jax 0.10.2 cannot jit this grad on an
    # Explicit mesh otherwise ("Length of device assignment 1 is not equal to ... 8").
    ct = jax.device_put(ct, spec.sharding(PartitionSpec()))
    loss = lambda x, ct: jnp.sum(from_layout(to_layout(x, spec), spec) * ct)  # noqa: E731
    grad = jax.jit(jax.grad(loss))(x, ct)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(ct))


# ---- ShardingSpec as a value ------------------------------------------------------------


def test_spec_is_hashable_and_compares_by_value():
    a = ShardingSpec(jax.make_mesh((2, 4), ("data", "context")), "ring", "zigzag")
    b = ShardingSpec(jax.make_mesh((2, 4), ("data", "context")), "ring", "zigzag")
    c = ShardingSpec(jax.make_mesh((2, 4), ("data", "context")), "ring", "striped")
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert len({a, b, c}) == 2
    assert jax.tree.leaves(a) == []  # all configuration, no arrays


def test_spec_is_immutable():
    spec = make_spec("2x4", "zigzag")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.strategy = "ulysses"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.mesh = None  # type: ignore[misc]


def test_spec_as_a_jit_static_argument():
    traces = []

    def f(x, spec):
        traces.append(spec)
        return to_layout(x, spec)

    jitted = jax.jit(f, static_argnums=1)
    x = jnp.asarray(_data())
    zigzag, same = make_spec("1x8", "zigzag"), make_spec("1x8", "zigzag")
    np.testing.assert_array_equal(np.asarray(jitted(x, zigzag)), to_layout(_data(), zigzag))
    jitted(x, same)
    assert len(traces) == 1  # an equal spec hits the cache
    striped = make_spec("1x8", "striped")
    np.testing.assert_array_equal(np.asarray(jitted(x, striped)), to_layout(_data(), striped))
    assert len(traces) == 2
    # A spec is also a leafless pytree, so it can be passed as an ordinary argument.
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda spec, x: to_layout(x, spec))(zigzag, x)),
        to_layout(_data(), zigzag),
    )


def test_spec_as_a_static_field():
    class Permute(eqx.Module):
        weight: jax.Array
        spec: ShardingSpec = eqx.field(static=True)

        def __call__(self, x):
            return to_layout(x * self.weight, self.spec)

    spec = make_spec("2x4", "striped")
    layer = Permute(jnp.asarray(2.0), spec)
    out = eqx.filter_jit(lambda m, x: m(x))(layer, jnp.asarray(_data()))
    np.testing.assert_array_equal(np.asarray(out), to_layout(2.0 * _data(), spec))
    assert jax.tree.leaves(layer) == [layer.weight]


def test_default_batch_axis():
    assert ShardingSpec(jax.make_mesh((8,), ("context",))).batch_axis is None
    no_data = ShardingSpec(jax.make_mesh((2, 4), ("model", "context")))
    assert no_data.batch_axis is None
    assert no_data.token_pspec() == PartitionSpec(None, ("context",))
    assert ShardingSpec(jax.make_mesh((2, 4), ("data", "context"))).batch_axis == "data"
    explicit_none = ShardingSpec(jax.make_mesh((2, 4), ("data", "context")), batch_axis=None)
    assert explicit_none.batch_axis is None
    assert make_spec("usp-2x4", "zigzag").batch_axis is None


# ---- causal work balance -------------------------------------------------------------------


def causal_blocks_per_device(spec: ShardingSpec, seq: int, block: int) -> np.ndarray:
    """Per device, the (query block, key block) pairs with at least one causally visible score.

    Each device's slots are cut into blocks of `block` tokens (as the block function cuts its
    query shard, and every key shard it sees); a block pair is non-empty when its smallest
    key position is at most its largest query position.
    """
    n = spec.context_parallel_size
    positions = layout_order(spec, seq).reshape(seq // block, block)
    q_max, k_min = positions.max(axis=1), positions.min(axis=1)
    non_empty = k_min[None, :] <= q_max[:, None]  # [query block, key block], device-major
    return non_empty.sum(axis=1).reshape(n, -1).sum(axis=1)


@pytest.mark.parametrize("blocks_per_device", [2, 32])
@pytest.mark.parametrize("mesh", ["1x8", "2x4", "usp-2x4"])
def test_causal_work_balance(mesh, blocks_per_device):
    n = make_spec(mesh, "none").context_parallel_size
    seq = n * blocks_per_device * 4
    block = seq // (n * blocks_per_device)  # blocks_per_device=2: one block per zigzag chunk
    ratio = {}
    for layout in LAYOUTS:
        work = causal_blocks_per_device(make_spec(mesh, layout), seq, block)
        assert work.sum() >= (seq // block) * (seq // block + 1) // 2  # the causal triangle
        ratio[layout] = work.max() / work.mean()
    assert ratio["zigzag"] <= 1.05, ratio
    assert ratio["striped"] <= 1.05, ratio
    # Contiguous chunks: device d does ~(2d + 1) / N of the mean, so the last one ~2 - 1/N.
    assert ratio["none"] >= 0.9 * (2 - 1 / n), ratio
    if blocks_per_device >= 32:
        assert abs(ratio["none"] - (2 - 1 / n)) < 0.02, ratio
    if n == 8:
        assert ratio["none"] > 1.8, ratio
