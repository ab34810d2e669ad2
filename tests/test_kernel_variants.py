"""Soft-capping and chunked attention inside the Pallas kernels (forward, dQ, dK/dV), against
a naive float32 oracle written here that shares no code with the library.

The oracle materialises every score, caps it (`c * tanh(x / c)`), masks it with the causal,
window, chunk and segment rules spelled out on token positions, and adds the sinks' logits
to each row's denominator. Kernels run in Pallas' interpreter (`interpret=True`, what
`impl="pallas"` picks off TPU), through the block contract's custom VJP as every strategy
runs them; one case runs a ring over a zig-zag layout on a 2 x 4 mesh. The last tests
check that chunks shrink the kernels' schedule and that a TPU export carries the kernels.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import need_devices, rel_err

import eqx_longctx as el
from eqx_longctx import ShardingSpec, attention
from eqx_longctx.attention._block import BlockOptions, block_attention
from eqx_longctx.kernels import PallasBlockImpl, pallas_flash_forward
from eqx_longctx.kernels._blocks import EMPTY, FULL, PARTIAL, Ids, classify, schedule

TOL = 1e-5  # float32, relative to the largest reference magnitude

# ---------------------------------------------------------------------------- the oracle


def oracle(q, k, v, qp, kp, qs=None, ks=None, *, scale, softcap=None, chunk=None,
           window=None, sinks=None):  # fmt: skip
    """`(out [b, s, h, dv], lse [b, s, h])` of causal attention with every variant written
    out; rows that see nothing (and have no sink) get 0 / -inf."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    x = jnp.einsum("bshd,bthd->bhst", q, k, precision="highest") * scale
    if softcap is not None:
        x = softcap * jnp.tanh(x / softcap)
    i, j = qp[:, None, :, None], kp[:, None, None, :]
    seen = i >= j
    if window is not None:
        seen = seen & (i - j < window)
    if chunk is not None:
        seen = seen & (i // chunk == j // chunk)
    if qs is not None and ks is not None:
        seen = seen & (qs[:, None, :, None] == ks[:, None, None, :])
    x = jnp.where(seen, x, -jnp.inf)
    m = x.max(-1, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, sinks[None, :, None, None])
    m = jax.lax.stop_gradient(jnp.where(jnp.isneginf(m), 0.0, m))
    e = jnp.where(seen, jnp.exp(x - m), 0.0)
    denom = e.sum(-1)
    if sinks is not None:
        denom = denom + jnp.exp(sinks[None, :, None] - m[..., 0])
    safe = jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("bhst,bthd->bhsd", e, v, precision="highest") / safe[..., None]
    lse = jnp.where(denom == 0, -jnp.inf, m[..., 0] + jnp.log(safe))
    return out.transpose(0, 2, 1, 3), lse.transpose(0, 2, 1)


# ---------------------------------------------------------------------------- one device

CASES = {
    "softcap": dict(s=256, softcap=2.0),
    "chunk_200_ragged": dict(s=500, chunk=200),  # not a block multiple; padded
    "chunk_256": dict(s=512, chunk=256),  # whole blocks inside one chunk: FULL pairs
    # GQA (two query heads per K/V head) in the same program: one compile less in CI.
    "gqa_softcap_chunk_window_segments": dict(
        s=384, hq=4, hk=2, softcap=3.0, chunk=200, window=150, segments=(100, 284)
    ),
}


def inputs(s, hq=2, hk=2, d=64, segments=None, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    # Scores of a few units, so that a cap of 2-3 bends them.
    q = 2.0 * jax.random.normal(keys[0], (1, s, hq, d))
    k = jax.random.normal(keys[1], (1, s, hk, d))
    v = jax.random.normal(keys[2], (1, s, hk, d))
    pos = jnp.arange(s, dtype=jnp.int32)[None]
    seg = None
    if segments is not None:
        seg = jnp.asarray(np.repeat(np.arange(len(segments)), segments), jnp.int32)[None]
    w_out = jax.random.normal(keys[3], (1, s, hq, d))
    w_lse = jax.random.normal(keys[4], (1, s, hq))
    return q, k, v, pos, seg, w_out, w_lse


def value_and_grads(attn, w_out, w_lse, q, k, v):
    """`((out, lse), (dq, dk, dv))` of a loss on `out` and `lse` (both cotangents reach the
    backward)."""

    def loss(q, k, v):
        out, lse = attn(q, k, v)
        finite_lse = jnp.where(jnp.isneginf(lse), 0.0, lse)
        return jnp.sum(out * w_out) + jnp.sum(finite_lse * w_lse), (out, lse)

    (_, outs), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return outs, grads


def check(name, actual, expected):
    err = rel_err(actual, expected)
    assert err <= TOL, f"{name}: relative error {err:.2e} > {TOL:.0e}"
    return err


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_grads_match_oracle(name):
    case = dict(CASES[name])
    variants = {n: case.pop(n, None) for n in ("softcap", "chunk", "window")}
    q, k, v, pos, seg, w_out, w_lse = inputs(**case)
    scale = q.shape[-1] ** -0.5
    impl = PallasBlockImpl(128, 128, True)
    options = BlockOptions.make(True, variants["window"], scale, q.shape[-1],
                                variants["softcap"], variants["chunk"])  # fmt: skip
    ours = value_and_grads(
        lambda q, k, v: block_attention(impl, q, k, v, pos, pos, seg, seg, options),
        w_out, w_lse, q, k, v,
    )  # fmt: skip
    ref = value_and_grads(
        lambda q, k, v: oracle(q, k, v, pos, pos, seg, seg, scale=scale, **variants),
        w_out, w_lse, q, k, v,
    )  # fmt: skip
    (out, lse), grads = ours
    (ref_out, ref_lse), ref_grads = ref
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(np.asarray(ref_lse))
    errs = [check("out", out, ref_out), check("lse", np.asarray(lse)[fin], ref_lse[fin])]
    errs += [check(f"d{n}", g, r) for n, g, r in zip("qkv", grads, ref_grads, strict=True)]
    print(f"{name}: max relative error out/lse/dq/dk/dv " + " ".join(f"{e:.1e}" for e in errs))


def test_chunk_classifies_blocks_by_their_chunks():
    """Pairs in no common chunk are EMPTY, pairs inside one chunk below the diagonal FULL
    (no mask), the rest PARTIAL; chunk 256 and 200 over 512 positions, 128-blocks."""
    from eqx_longctx.kernels._blocks import Config

    pos = jnp.arange(512, dtype=jnp.int32)[None]
    ids = Ids(pos, pos, None, None)
    E, P, F = EMPTY, PARTIAL, FULL
    kind = classify(Config(True, None, 1.0, 128, 128, False, True, chunk=256), ids)[0]
    np.testing.assert_array_equal(kind, [[P, E, E, E], [F, P, E, E], [E, E, P, E], [E, E, F, P]])
    kind = classify(Config(True, None, 1.0, 128, 128, False, True, chunk=200), ids)[0]
    np.testing.assert_array_equal(kind, [[P, E, E, E], [P, P, E, E], [E, P, P, E], [E, P, P, P]])


# ---------------------------------------------------------------------------- a strategy


@pytest.mark.slow
def test_ring_zigzag_with_softcap_chunk_sinks_matches_oracle():
    """`attention(..., spec=ring over zig-zag on a 2 x 4 mesh, impl="pallas")` with a cap,
    chunks, sinks and packed rows: forward and gradients of q, k, v and the sinks."""
    need_devices(8)
    b, s, hq, hk, d = 2, 256, 4, 2, 32
    keys = jax.random.split(jax.random.PRNGKey(3), 5)
    q = 2.0 * jax.random.normal(keys[0], (b, s, hq, d))
    k = jax.random.normal(keys[1], (b, s, hk, d))
    v = jax.random.normal(keys[2], (b, s, hk, d))
    ct = jax.random.normal(keys[3], (b, s, hq, d))
    sinks = jax.random.normal(keys[4], (hq,))
    seg = jnp.asarray(np.stack([np.repeat([0, 1], n) for n in ([150, 106], [70, 186])]))
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    variants = dict(softcap=2.0, chunk=96)
    spec = ShardingSpec(jax.make_mesh((2, 4), ("data", "context")), strategy="ring",
                        load_balance="zigzag", impl="pallas")  # fmt: skip
    lay = lambda x: el.to_layout(x, spec, axis=1)  # noqa: E731

    def ours(q, k, v, sinks):
        out = attention(lay(q), lay(k), lay(v), spec=spec, segment_ids=lay(seg), sinks=sinks,
                        **variants)  # fmt: skip
        return el.from_layout(out, spec, axis=1)

    def ref(q, k, v, sinks):
        out, _ = oracle(q, k, v, pos, pos, seg, seg, scale=d**-0.5, sinks=sinks, **variants)
        return out

    def run(f):
        loss = lambda *a: jnp.sum(f(*a) * ct)  # noqa: E731
        return jax.jit(lambda *a: (f(*a), jax.grad(loss, (0, 1, 2, 3))(*a)))(q, k, v, sinks)

    with jax.set_mesh(spec.mesh):
        out, grads = run(ours)
    ref_out, ref_grads = run(ref)
    errs = [check("out", out, ref_out)]
    errs += [check(f"d{n}", g, r) for n, g, r in zip("qkv", grads[:3], ref_grads[:3], strict=True)]
    errs.append(check("dsinks", grads[3], ref_grads[3]))
    assert float(jnp.min(jnp.abs(ref_grads[3]))) > 0  # the sinks' gradient is not zero
    print("ring/zigzag: out/dq/dk/dv/dsinks " + " ".join(f"{e:.1e}" for e in errs))


# ---------------------------------------------------------------------------- skipping


def test_chunk_shrinks_the_kernels_schedule():
    """Chunks skip blocks in the schedule every kernel reads (non-empty pairs listed, the
    rest never fetched nor computed), and bound the grid's sequential axes as a window of
    the chunk's length does: at 1024 tokens, chunk 256, 128-blocks, 4 steps per block
    instead of 8, and 12 live block pairs instead of 36 (causal)."""
    s, blk = 1024, 128
    q = jnp.zeros((1, s, 2, 64))
    pos = jnp.arange(s, dtype=jnp.int32)[None]
    impl = PallasBlockImpl(blk, blk, True)
    steps, live = {}, {}
    for chunk in (None, 256):
        options = BlockOptions.make(True, None, None, 64, None, chunk)
        cfg = impl.tile_queries(q, pos, None, q, options).cfg
        steps[chunk] = cfg.steps(s // blk)
        sched = schedule(cfg, Ids(pos, pos, None, None))
        live[chunk] = int(jnp.sum(sched.row_kind != EMPTY))
        assert int(jnp.sum(sched.col_kind != EMPTY)) == live[chunk]
        assert not sched.overflow
    assert steps == {None: 8, 256: 4}
    assert live == {None: 8 * 9 // 2, 256: 4 * 3}


def _exported(f, *args):
    return jax.export.export(jax.jit(f), platforms=("tpu",))(*args).mlir_module()


def test_chunk_cuts_the_tpu_cost_estimate():
    """What a TPU compiler is told (the forward kernel's cost estimate in the exported
    program): with chunks, the bounded grid's FLOPs are 4/16 of the unchunked call's; the
    whole grid it falls back to, when a schedule overflows the bound, keeps the full count."""
    s, d = 2048, 64
    x = jax.ShapeDtypeStruct((1, s, 2, d), jnp.float32)
    ids = jax.ShapeDtypeStruct((1, s), jnp.int32)
    flops = {}
    for chunk in (None, 256):
        options = BlockOptions.make(True, None, None, d, None, chunk)
        impl = PallasBlockImpl(128, 128, False)

        def forward(q, k, v, pos, impl=impl, options=options):
            return block_attention(impl, q, k, v, pos, pos, None, None, options)

        text = _exported(forward, x, x, x, ids)
        flops[chunk] = sorted(int(f) for f in re.findall(r"flops\\22:(\d+)", text))
    (whole,) = flops[None]
    assert flops[256] == [whole * 4 // 16, whole]


def test_tpu_export_carries_the_kernels_with_softcap_and_chunk():
    """Forward and gradient with a cap and chunks lower to Mosaic from this host: each
    kernel twice (the chunk's bounded grid and the whole grid it falls back to)."""
    b, s, hq, hk, d = 1, 2048, 4, 2, 128
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    ids = jax.ShapeDtypeStruct((b, s), jnp.int32)
    impl = PallasBlockImpl(256, 256, False)
    options = BlockOptions.make(True, None, None, d, 30.0, 300)

    def forward(q, k, v, pos, seg):
        return block_attention(impl, q, k, v, pos, pos, seg, seg, options)

    def grads(q, k, v, pos, seg):
        def loss(q, k, v):
            return jnp.sum(forward(q, k, v, pos, seg)[0].astype(jnp.float32))

        return jax.grad(loss, (0, 1, 2))(q, k, v)

    args = (spec(b, s, hq, d), spec(b, s, hk, d), spec(b, s, hk, d), ids, ids)
    assert _exported(forward, *args).count("tpu_custom_call") == 2
    assert _exported(grads, *args).count("tpu_custom_call") == 6


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(softcap=0.0), r"softcap must be a finite number > 0.*softcap=0.0"),
        (dict(softcap=float("inf")), r"softcap must be a finite number > 0"),
        (dict(chunk=0), r"chunk must be a positive int.*chunk=0"),
        (dict(chunk=-5), r"chunk must be a positive int.*chunk=-5"),
        (dict(chunk=64, causal=False), r"chunk=64 needs causal=True"),
    ],
)
def test_bad_variants_raise(change, match):
    q = jnp.zeros((1, 128, 2, 64))
    pos = jnp.arange(128, dtype=jnp.int32)[None]
    with pytest.raises(ValueError, match=match):
        pallas_flash_forward(q, q, q, pos, pos, **(dict(causal=True) | change))
