"""`decode_attention` against softmax attention written out in NumPy: one new token per row
over a heads-major cache read a chunk at a time (several chunks, the last one moved back
over slots already read, empty slots, slots in any order), on one device and with the slots
split over 4 devices, through each way an implementation can read the cache (the XLA
direct product, the XLA block loop through the contract's default `attend_heads_major`,
the Pallas TPU kernel in TPU interpret mode, and the Pallas GPU kernel interpreted)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_longctx as el
from eqx_longctx.attention._decode import LayerCache, decode_attention
from eqx_longctx.attention._local import XlaBlockImpl
from eqx_longctx.attention._tiles import Tiling
from tests.helpers import assert_close, make_mesh

_decode = sys.modules["eqx_longctx.attention._decode"]
B, KVH, G, D, LAYERS = 2, 2, 2, 8, 3
SLOTS = 400  # per device: 3 chunks of 128 + one moved back over 112 slots already read


def _naive(q, k_new, v_new, cache_k, cache_v, cache_pos, q_pos, window, scale, value_dim=None):
    """`[b, heads, dv]`: each query head over the visible slots of its K/V head and itself."""
    b, hq, _ = q.shape
    kvh = cache_k.shape[1]
    out = np.zeros((b, hq, cache_v.shape[-1] if value_dim is None else value_dim))
    for r in range(b):
        seen = (cache_pos[r] >= 0) & (cache_pos[r] <= q_pos[r])
        if window is not None:
            seen &= q_pos[r] - cache_pos[r] < window
        for h in range(hq):
            kv = h // (hq // kvh)
            keys = np.concatenate([cache_k[r, kv, seen], k_new[r, kv][None]])
            vals = np.concatenate([cache_v[r, kv, seen], v_new[r, kv][None]])
            if value_dim is not None:
                vals = vals[:, :value_dim]
            s = keys.astype(np.float64) @ q[r, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[r, h] = p @ vals / p.sum()
    return out


def _problem(seed: int, slots: int, kvh: int = KVH, dk: int = D, dv: int = D):
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    q_pos = np.array([slots - 7, slots // 2], np.int32)  # row 1 sees fewer slots
    pos = np.stack([rng.permutation(slots) for _ in range(B)]).astype(np.int32)
    pos[:, rng.choice(slots, slots // 5, replace=False)] = -1  # empty slots
    pos[1, :150] = -1  # a whole chunk of row 1 empty
    k = f(LAYERS, B, kvh, slots, dk)
    v = f(LAYERS, B, kvh, slots, dv)
    return f(B, kvh * G, dk), f(B, kvh, dk), f(B, kvh, dv), k, v, pos, q_pos


def _impls():
    from jax.experimental.pallas import tpu as pltpu

    from eqx_longctx.kernels import PallasBlockImpl, PallasGpuBlockImpl

    return {
        "xla direct": XlaBlockImpl(),
        "xla blocks": XlaBlockImpl(Tiling(block=64, tile_bytes=1024)),
        "pallas interpret": PallasBlockImpl(128, 128, pltpu.InterpretParams()),
        "pallas_gpu interpret": PallasGpuBlockImpl(64, 64, True),
    }


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(_decode, "CHUNK_BYTES", 128 * B * KVH * D * 4)  # 128 slots


@pytest.mark.parametrize(
    "name", ["xla direct", "xla blocks", "pallas interpret", "pallas_gpu interpret"]
)
@pytest.mark.parametrize("window", [None, 90])
def test_one_device_equals_naive_attention(small_chunks, name, window):
    if name == "pallas interpret" and window is not None:
        pytest.skip("one Pallas case is enough (interpret mode is slow)")
    impl = _impls()[name]
    q, k_new, v_new, k, v, pos, q_pos = _problem(0, SLOTS)
    layer = 1

    @jax.jit
    def run(q, k_new, v_new, k, v, pos, q_pos, layer):
        return decode_attention(
            q[:, None], (k_new[:, None], v_new[:, None]), LayerCache((k, v), layer), pos,
            q_pos[:, None], spec=None, impl=impl, window=window,
        )  # fmt: skip

    out = run(q, k_new, v_new, k, v, pos, q_pos, jnp.int32(layer))[:, 0]
    want = _naive(q, k_new, v_new, k[layer], v[layer], pos, q_pos, window, D**-0.5)
    assert_close(out, want, what=f"{name}, window {window}")


@pytest.mark.parametrize("name", ["xla direct", "pallas interpret", "pallas_gpu interpret"])
def test_a_latent_cache_reads_its_values_from_the_keys(small_chunks, name):
    dk, dv = 12, 8  # MLA absorbed: one K/V "head" whose first dv features are the values
    q, k_new, _, k, _, pos, q_pos = _problem(1, SLOTS, kvh=1, dk=dk)
    out = decode_attention(
        jnp.asarray(q)[:, None], (jnp.asarray(k_new)[:, None],), LayerCache((k,), jnp.int32(2)),
        pos, q_pos[:, None], spec=None, impl=_impls()[name], scale=0.3, value_dim=dv,
    )[:, 0]  # fmt: skip
    want = _naive(q, k_new, k_new, k[2], k[2], pos, q_pos, None, 0.3, value_dim=dv)
    assert_close(out, want, what="latent")


@pytest.mark.parametrize("axes", ["auto", "explicit"])
def test_slots_split_over_four_devices_equal_naive_attention(small_chunks, axes):
    n = 4
    spec = el.ShardingSpec(make_mesh((n,), ("context",), axes), strategy="ring")
    q, k_new, v_new, k, v, pos, q_pos = _problem(2, SLOTS * n)
    rep = lambda x: jnp.broadcast_to(jnp.asarray(x)[:, None], (x.shape[0], n, *x.shape[1:]))  # noqa: E731
    out = jax.jit(lambda *a: decode_attention(*a, spec=spec, impl=XlaBlockImpl(), window=700))(
        rep(q), (rep(k_new), rep(v_new)), LayerCache((k, v), jnp.int32(0)), pos, rep(q_pos)
    )
    want = _naive(q, k_new, v_new, k[0], v[0], pos, q_pos, 700, D**-0.5)
    out = np.asarray(out)
    for i in range(n):  # every device's copy of the new token's output
        assert_close(out[:, i], want, what=f"{axes} mesh, copy {i}")


def _naive_variants(q, k_new, v_new, cache_k, cache_v, cache_pos, q_pos, chunk, softcap, sinks):
    """`_naive` with chunks, soft-capped scores and a sink logit per head, written out."""
    b, hq, _ = q.shape
    kvh = cache_k.shape[1]
    out = np.zeros((b, hq, cache_v.shape[-1]))
    for r in range(b):
        seen = (cache_pos[r] >= 0) & (cache_pos[r] <= q_pos[r])
        seen &= cache_pos[r] // chunk == q_pos[r] // chunk
        for h in range(hq):
            kv = h // (hq // kvh)
            keys = np.concatenate([cache_k[r, kv, seen], k_new[r, kv][None]]).astype(np.float64)
            vals = np.concatenate([cache_v[r, kv, seen], v_new[r, kv][None]])
            s = keys @ q[r, h].astype(np.float64) * D**-0.5
            s = softcap * np.tanh(s / softcap)
            m = max(s.max(), sinks[h])
            p = np.exp(s - m)
            out[r, h] = p @ vals / (p.sum() + np.exp(sinks[h] - m))
    return out


@pytest.mark.parametrize("mesh", [None, (2, 2)])
def test_sinks_softcap_and_chunks_in_decode(small_chunks, mesh):
    """Decode applies the variants: the chunk from positions, the cap on every score, the
    sinks after the merge (under a tensor axis each shard takes its own heads' sinks)."""
    n = 1 if mesh is None else mesh[0]
    spec = None
    if mesh is not None:
        grid = make_mesh(mesh, ("context", "tensor"))
        spec = el.ShardingSpec(grid, strategy="ring", tensor_axis="tensor", batch_axis=None)
    q, k_new, v_new, k, v, pos, q_pos = _problem(3, SLOTS * n)
    sinks = np.random.default_rng(4).standard_normal(KVH * G).astype(np.float32)
    rep = lambda x: jnp.broadcast_to(jnp.asarray(x)[:, None], (x.shape[0], n, *x.shape[1:]))  # noqa: E731
    kw = dict(spec=spec, impl=XlaBlockImpl(), chunk=96, softcap=1.5, sinks=jnp.asarray(sinks))
    out = jax.jit(lambda *a: decode_attention(*a, **kw))(
        rep(q), (rep(k_new), rep(v_new)), LayerCache((k, v), jnp.int32(0)), pos, rep(q_pos)
    )
    want = _naive_variants(q, k_new, v_new, k[0], v[0], pos, q_pos, 96, 1.5, sinks)
    for i in range(n):
        assert_close(np.asarray(out)[:, i], want, what=f"mesh {mesh}, copy {i}")
