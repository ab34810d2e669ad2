"""The Pallas kernels follow the platform a program is lowered for, not the host: a TPU
program exported from this CPU host carries the Mosaic kernels (`tpu_custom_call`), for
`impl="pallas"` and `impl="auto"`, through `attention`, `flash_attention` and
`latent_attention`, forward and backward, on one device and under context-parallel specs;
a CPU export of the same function has none, and what runs here matches the oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import need_devices

from eqx_longctx import ShardingSpec, attention, flash_attention, latent_attention
from eqx_longctx import reference_attention as oracle

B, S, HQ, HK, D = 1, 512, 4, 2, 128


def _kernels(fn, *args, platform="tpu") -> int:
    exported = jax.export.export(jax.jit(fn), platforms=(platform,))(*args)
    return exported.mlir_module().count("tpu_custom_call")


def _grad(fn):
    """The gradient with respect to every (float) argument, so no kernel is dead code."""

    def loss(*args):
        return jnp.sum(fn(*args).astype(jnp.float32))

    def grads(*args):
        floats = [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating)]
        return jax.grad(loss, argnums=tuple(floats))(*args)

    return grads


def _shapes(dtype=jnp.bfloat16, kv_heads=HK):
    q = jax.ShapeDtypeStruct((B, S, HQ, D), dtype)
    kv = jax.ShapeDtypeStruct((B, S, kv_heads, D), dtype)
    return q, kv, kv


@pytest.mark.parametrize("impl", ["pallas", "auto"])
def test_attention_exported_for_tpu_carries_the_kernels(impl):
    """Forward: the flash forward kernel; backward: forward, dQ and dK/dV."""

    def fwd(q, k, v):
        return attention(q, k, v, causal=True, impl=impl)

    assert _kernels(fwd, *_shapes()) == 1
    assert _kernels(_grad(fwd), *_shapes()) == 3
    assert _kernels(fwd, *_shapes(), platform="cpu") == 0


@pytest.mark.parametrize("impl", ["pallas", "auto"])
def test_flash_attention_exported_for_tpu_carries_the_kernels(impl):
    ids = jax.ShapeDtypeStruct((B, S), jnp.int32)

    def fwd(q, k, v, seg):
        out, lse = flash_attention(
            q, k, v, q_segment_ids=seg, kv_segment_ids=seg, causal=True, window=200, impl=impl
        )
        return out.astype(jnp.float32).sum(-1) + lse

    assert _kernels(fwd, *_shapes(jnp.float32, kv_heads=1), ids) == 1
    assert _kernels(_grad(fwd), *_shapes(jnp.float32, kv_heads=1), ids) == 3
    assert _kernels(fwd, *_shapes(jnp.float32, kv_heads=1), ids, platform="cpu") == 0


class _UpProject:
    """MLA's up-projection: a latent `[b, s, r]` to K (192) and V (128) heads."""

    def __init__(self, key):
        kk, kv = jax.random.split(key)
        self.wk = jax.random.normal(kk, (64, HQ * 192), jnp.float32) * 0.1
        self.wv = jax.random.normal(kv, (64, HQ * 128), jnp.float32) * 0.1

    def __call__(self, latent):
        b, s, _ = latent.shape
        k = (latent @ self.wk).reshape(b, s, HQ, 192)
        v = (latent @ self.wv).reshape(b, s, HQ, 128)
        return k, v


def test_latent_attention_exported_for_tpu_carries_the_kernels():
    up = _UpProject(jax.random.PRNGKey(0))
    q = jax.ShapeDtypeStruct((B, S, HQ, 192), jnp.float32)
    latent = jax.ShapeDtypeStruct((B, S, 64), jnp.float32)

    def fwd(q, latent):
        return latent_attention(q, latent, up, causal=True, impl="auto")

    assert _kernels(fwd, q, latent) == 1
    assert _kernels(_grad(fwd), q, latent) == 3
    assert _kernels(fwd, q, latent, platform="cpu") == 0


@pytest.mark.parametrize("strategy", ["ring", "all_gather", "ulysses"])
def test_context_parallel_exported_for_tpu_carries_the_kernels(strategy):
    """Under a 4-way spec (zig-zag): the ring runs one forward kernel per hop it keeps in
    the program (the own shard and the scanned hops) and three per hop backward."""
    need_devices(4)
    mesh = jax.make_mesh((4,), ("context",), devices=jax.devices()[:4])
    spec = ShardingSpec(mesh=mesh, strategy=strategy, load_balance="zigzag")

    def fwd(q, k, v):
        return attention(q, k, v, spec=spec, causal=True, impl="auto")

    n_fwd, n_bwd = _kernels(fwd, *_shapes()), _kernels(_grad(fwd), *_shapes())
    if strategy == "ring":  # the own shard and one scanned hop; backward as many again
        assert (n_fwd, n_bwd) == (2, 8)
    else:
        assert (n_fwd, n_bwd) == (1, 3)
    assert _kernels(fwd, *_shapes(), platform="cpu") == 0


def test_xla_impl_exported_for_tpu_has_no_kernels():
    def fwd(q, k, v):
        return attention(q, k, v, causal=True, impl="xla")

    assert _kernels(_grad(fwd), *_shapes()) == 0


@pytest.mark.parametrize("strategy", [None, "all_gather", "ring"])
def test_auto_runs_float16_under_jit_and_grad_off_tpu(strategy):
    """The kernels take float32 and bfloat16 only: for float16, `"auto"` off a TPU is the XLA
    path alone (tracing the kernels' side for a TPU export refused the dtype under `jit`,
    `grad` and every spec, on a host that never runs them)."""
    need_devices(8)
    ks = jax.random.split(jax.random.PRNGKey(2), 3)
    q, k, v = (jax.random.normal(kk, (2, 64, 2, 16), jnp.float16) for kk in ks)
    spec = None
    if strategy is not None:
        spec = ShardingSpec(jax.make_mesh((2, 4), ("data", "context")), strategy, "none")

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, causal=True, spec=spec).astype(jnp.float32) ** 2)

    out = jax.jit(lambda q, k, v: attention(q, k, v, causal=True, spec=spec))(q, k, v)
    ref = oracle(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True)
    assert out.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-3, rtol=2e-3)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(lambda q, k, v: jnp.sum(oracle(q, k, v, causal=True) ** 2), argnums=(0, 1, 2))(
        *(x.astype(jnp.float32) for x in (q, k, v))
    )
    for g, w in zip(grads, want, strict=True):
        assert g.dtype == jnp.float16
        np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("impl", ["pallas", "auto", "xla"])
def test_what_runs_on_this_host_matches_the_oracle(impl):
    """On the CPU, `"auto"` runs the XLA path and `"pallas"` the interpreted kernels; a
    CPU export of the same function gives the same numbers."""
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    q = jax.random.normal(ks[0], (B, 256, HQ, D), jnp.float32)
    k, v = (jax.random.normal(kk, (B, 256, HK, D), jnp.float32) for kk in ks[1:])

    def fwd(q, k, v):
        return attention(q, k, v, causal=True, impl=impl)

    ref = oracle(q, k, v, causal=True)
    out = jax.jit(fwd)(q, k, v)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    exported = jax.export.export(jax.jit(fwd), platforms=("cpu",))(q, k, v)
    np.testing.assert_array_equal(exported.call(q, k, v), out)

    def squares(f):
        return jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2))

    ref_grads = squares(lambda q, k, v: oracle(q, k, v, causal=True))(q, k, v)
    for g, r in zip(jax.jit(squares(fwd))(q, k, v), ref_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


# ---- the lowering matrix: every combination below lowers for a TPU from this host ------

_DIMS = [(64, 64), (128, 128), (256, 256), (192, 128)]  # (q/k head dim, v head dim); MLA last
_HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA


def _matrix():
    from eqx_longctx.kernels import DEFAULT_BLOCK_SIZES

    blocks = sorted(set(DEFAULT_BLOCK_SIZES.values()))
    cases = []
    for i, (dtype, segments, dims) in enumerate(
        (dtype, segments, dims)
        for dtype in ("bfloat16", "float32")
        for segments in (False, True)
        for dims in _DIMS
    ):
        heads, block, batch = _HEADS[i % 3], blocks[i % len(blocks)], 1 + i % 2
        cases.append((dtype, segments, dims, heads, block, batch))
    return cases


@pytest.mark.parametrize(
    "dtype, segments, dims, heads, blocks, batch",
    _matrix(),
    ids=lambda x: str(x).replace(" ", ""),
)
def test_lowering_matrix(dtype, segments, dims, heads, blocks, batch):
    """bf16 and f32, with and without segment ids, head dims 64/128/256 and 192/128 (MLA),
    MHA/GQA/MQA, each TPU generation's default blocks, batch 1 and 2: forward and backward
    of `flash_attention(impl="pallas")` lower through Mosaic for a TPU."""
    (d, dv), (hq, hk), (bq, bk) = dims, heads, blocks
    seq = 2 * max(bq, bk)
    dt = jnp.dtype(dtype)
    q = jax.ShapeDtypeStruct((batch, seq, hq, d), dt)
    k = jax.ShapeDtypeStruct((batch, seq, hk, d), dt)
    v = jax.ShapeDtypeStruct((batch, seq, hk, dv), dt)
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

    def fwd(q, k, v, seg):
        seg = seg if segments else None
        out, lse = flash_attention(
            q, k, v, q_segment_ids=seg, kv_segment_ids=seg, causal=True, impl="pallas",
            block_q=bq, block_k=bk,
        )  # fmt: skip
        return out.astype(jnp.float32).sum(-1) + lse

    assert _kernels(fwd, q, k, v, ids) == 1
    assert _kernels(_grad(fwd), q, k, v, ids) == 3
