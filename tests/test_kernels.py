"""Pallas flash-attention kernels against a naive float32 oracle written here.

The oracle materialises every score and a dense mask built from positions, segment ids and
the window; it shares no code with the kernels. Every case runs the path the library runs:
`block_attention` (the block contract's custom VJP) with a `PallasBlockImpl`, or the
impl's `tile_queries` / `attend` / `attend_backward` hop by hop as the ring calls them.
Kernels run in Pallas' interpreter (`interpret=True`, what `impl="pallas"` picks off TPU);
`test_kernels_tpu.py` runs them in TPU interpret mode (VMEM/SMEM, scalar prefetch and DMAs
simulated, race detector on), lowers them for Mosaic and calls them inside `shard_map`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RTOL, rel_err

from eqx_longctx import flash_attention
from eqx_longctx.attention._block import BlockOptions, block_attention
from eqx_longctx.kernels import (
    DEFAULT_BLOCK_SIZES,
    PallasBlockImpl,
    default_block_sizes,
    pallas_flash_backward,
    pallas_flash_backward_heads_major,
    pallas_flash_forward,
    pallas_flash_forward_heads_major,
)
from eqx_longctx.kernels._blocks import EMPTY, FULL, PARTIAL, Config, Ids, classify, schedule

# ---------------------------------------------------------------------------- the oracle


def oracle_mask(qp, kp, qs, ks, causal, window):
    """`[b, 1, s, t]` visibility, spelled out from the contract."""
    dq, dk = qp[:, None, :, None], kp[:, None, None, :]
    mask = jnp.ones(jnp.broadcast_shapes(dq.shape, dk.shape), bool)
    if causal:
        mask = mask & (dq >= dk)
    if window is not None:
        mask = mask & (dq - dk < window)
    if qs is not None:
        mask = mask & (qs[:, None, :, None] == ks[:, None, None, :])
    return mask


def oracle(q, k, v, qp, kp, qs, ks, *, causal, window, scale):
    """Naive float32 attention: `(out [b, s, h, dv], lse [b, s, h])`; no-key rows 0 / -inf."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    mask = oracle_mask(qp, kp, qs, ks, causal, window)
    s = jnp.einsum("bshd,bthd->bhst", q, k, precision="highest") * scale
    s = jnp.where(mask, s, -jnp.inf)
    m = jax.lax.stop_gradient(s.max(-1, keepdims=True))
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    e = jnp.where(mask, jnp.exp(s - m), 0.0)
    denom = e.sum(-1)
    safe = jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("bhst,bthd->bhsd", e, v, precision="highest") / safe[..., None]
    lse = jnp.where(denom == 0, -jnp.inf, m[..., 0] + jnp.log(safe))
    return out.transpose(0, 2, 1, 3), lse.transpose(0, 2, 1)


# ---------------------------------------------------------------------------- the path


def pallas_block(q, k, v, qp, kp, qs=None, ks=None, *, causal, window=None, scale=None,
                 block_q=128, block_k=128, interpret=True, max_live_blocks=None):  # fmt: skip
    """`(out, lse)` through `block_attention` with a `PallasBlockImpl`: what `attention`,
    `flash_attention` and the all-gather and Ulysses strategies run with `impl="pallas"`."""
    impl = PallasBlockImpl(block_q, block_k, interpret, max_live_blocks)
    options = BlockOptions.make(causal, window, scale, q.shape[-1])
    return block_attention(impl, q, k, v, qp, kp, qs, ks, options)


# ---------------------------------------------------------------------------- inputs


def zigzag(total: int, chunks: int, rank: int):
    """Positions a rank holds in a zig-zag layout of `2 * chunks` pieces."""
    c = total // (2 * chunks)
    lo, hi = rank * c, (2 * chunks - 1 - rank) * c
    return np.concatenate([np.arange(lo, lo + c), np.arange(hi, hi + c)])


def packed(lengths):
    return np.repeat(np.arange(len(lengths)), lengths)


def make_case(case, seed=0):
    b, sq, sk = case.get("b", 1), case["sq"], case["sk"]
    hq, hk, d, dv = case.get("hq", 2), case.get("hk", 2), case.get("d", 64), case.get("dv", 64)
    dtype = case.get("dtype", jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(keys[0], (b, sq, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, sk, hk, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, sk, hk, dv), jnp.float32).astype(dtype)
    layout = case.get("layout", "arange")
    if layout == "arange":
        qp, kp = np.arange(sq), np.arange(sk)
    elif layout == "shuffled":  # self-attention over a random token order, one per row
        rng = np.random.default_rng(seed)
        qp = kp = np.stack([rng.permutation(sq) for _ in range(b)])
    elif layout == "zigzag":  # one rank of a zig-zag layout attending its own tokens
        qp = kp = zigzag(2 * sq, 2, 0)
    elif layout == "ring_hop":  # rank 0's queries, rank 1's keys (one ring hop)
        qp, kp = zigzag(4 * sq, 4, 0), zigzag(4 * sk, 4, 1) + case.get("offset", 0)
    else:
        raise AssertionError(layout)
    qp = jnp.asarray(np.broadcast_to(qp, (b, sq)), jnp.int32)
    kp = jnp.asarray(np.broadcast_to(kp, (b, sk)), jnp.int32)
    qs = ks = None
    if "segments" in case:
        q_lengths, kv_lengths = case["segments"]
        qs = jnp.asarray(np.broadcast_to(packed(q_lengths), (b, sq)), jnp.int32)
        ks = jnp.asarray(np.broadcast_to(packed(kv_lengths), (b, sk)), jnp.int32)
    return q, k, v, qp, kp, qs, ks


def kwargs(case):
    return dict(
        causal=case.get("causal", True),
        window=case.get("window"),
        scale=case.get("scale", case.get("d", 64) ** -0.5),
        block_q=case.get("bq", 128),
        block_k=case.get("bk", 128),
        max_live_blocks=case.get("max_live"),
    )


def oracle_kwargs(case):
    kw = kwargs(case)
    return dict(causal=kw["causal"], window=kw["window"], scale=kw["scale"])


# One row per configuration; every row runs forward and backward against the oracle.
CASES = {
    "causal": dict(sq=256, sk=256),
    "noncausal_ragged": dict(sq=200, sk=328, causal=False),
    "window_gqa": dict(sq=384, sk=384, hq=4, hk=2, window=100, max_live=2),
    "segments_mqa_ragged": dict(sq=320, sk=320, hq=4, hk=1, bq=256, segments=([100, 60, 160],) * 2),
    "zigzag_mla": dict(sq=256, sk=256, d=64, dv=128, bk=256, layout="zigzag"),
    "shuffled_segments": dict(sq=256, sk=256, b=2, layout="shuffled", segments=([128, 128],) * 2),
    "ring_hop_gqa": dict(sq=256, sk=256, hq=4, hk=2, layout="ring_hop", offset=-64),
    "no_key_rows": dict(sq=256, sk=128, causal=False, segments=([64, 64, 128], [96, 32])),
    "bf16_segments_gqa": dict(
        sq=256, sk=256, hq=4, hk=2, dtype=jnp.bfloat16, segments=[[70, 186]] * 2
    ),
    "bf16_window_ragged": dict(
        sq=200, sk=200, window=64, dtype=jnp.bfloat16, d=128, dv=128, max_live=2
    ),
}


def check_close(actual, expected, dtype, what):
    err = rel_err(actual, expected)
    assert err <= RTOL[jnp.dtype(dtype)], f"{what}: relative error {err:.2e}"
    return err


def check_lse(lse, ref, dtype):
    lse, ref = np.asarray(lse), np.asarray(ref)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref))
    fin = np.isfinite(ref)
    err = np.max(np.abs(lse[fin] - ref[fin])) / np.max(np.abs(ref[fin])) if fin.any() else 0.0
    assert err <= RTOL[jnp.dtype(dtype)], f"lse: relative error {err:.2e}"


def loss_weights(case, seed=1):
    b, sq, hq, dv = case.get("b", 1), case["sq"], case.get("hq", 2), case.get("dv", 64)
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(k1, (b, sq, hq, dv)), jax.random.normal(k2, (b, sq, hq))


def outputs_and_grads(attn, w_out, w_lse, q, k, v):
    """`((out, lse), (dq, dk, dv))` of a loss that depends on `out` and on `lse` (so its
    cotangent reaches the backward), in one compiled function."""

    def loss(q, k, v):
        out, lse = attn(q, k, v)
        finite_lse = jnp.where(jnp.isneginf(lse), 0.0, lse)
        value = jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(finite_lse * w_lse)
        return value, (out, lse)

    (_, outs), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return outs, grads


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_grad_match_oracle(name):
    case = CASES[name]
    dtype = case.get("dtype", jnp.float32)
    q, k, v, qp, kp, qs, ks = make_case(case)
    w = loss_weights(case)
    (out, lse), grads = outputs_and_grads(
        lambda q, k, v: pallas_block(q, k, v, qp, kp, qs, ks, **kwargs(case)), *w,
        q, k, v,
    )  # fmt: skip
    (ref_out, ref_lse), ref_grads = outputs_and_grads(
        lambda q, k, v: oracle(q, k, v, qp, kp, qs, ks, **oracle_kwargs(case)), *w, q, k, v
    )
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    check_close(out, ref_out, dtype, "out")
    check_lse(lse, ref_lse, dtype)
    for name_, g, r, x in zip("qkv", grads, ref_grads, (q, k, v), strict=True):
        assert g.dtype == x.dtype and g.shape == x.shape
        check_close(g, r, dtype, f"d{name_}")


@pytest.mark.parametrize("name", ["ring_hop_gqa", "segments_mqa_ragged"])
def test_explicit_backward_over_kv_halves_with_global_statistics(name):
    case = CASES[name]
    kw = kwargs(case)
    impl = PallasBlockImpl(kw["block_q"], kw["block_k"], True, kw["max_live_blocks"])
    half = case["sk"] // 2
    check_ring_of_two(impl, case, (slice(0, half), slice(half, None)))


def check_ring_of_two(impl, case, hops, check=check_close):
    """A ring in miniature, through the impl's methods as the ring calls them: the queries
    tiled once, the keys split in two `hops`, each given the global lse and delta; the
    query-gradient accumulator passes from hop to hop, dk/dv concatenate, and the partial
    forwards merge. Checked against the oracle's forward and VJP."""
    q, k, v, qp, kp, qs, ks = make_case(case)
    okw = oracle_kwargs(case)
    ref_out, ref_lse = oracle(q, k, v, qp, kp, qs, ks, **okw)
    w_out, w_lse = loss_weights(case)
    _, vjp = jax.vjp(lambda q, k, v: oracle(q, k, v, qp, kp, qs, ks, **okw), q, k, v)
    ref_dq, ref_dk, ref_dv = vjp((w_out, w_lse))
    delta = jnp.sum(w_out * ref_out, -1) - w_lse
    options = BlockOptions.make(okw["causal"], okw["window"], okw["scale"], q.shape[-1])

    @jax.jit
    def ring_of_two(q, k, v):
        qt = impl.tile_queries(q, qp, qs, k[:, hops[0]], options)
        dout, lse, delta_ = qt.split_q(w_out), qt.split_rows(ref_lse), qt.split_rows(delta)
        outs, lses, dq, dks, dvs = [], [], qt.zeros_dq(), [], []
        for p in hops:
            block = (k[:, p], v[:, p], kp[:, p], None if ks is None else ks[:, p])
            o, lse_p = impl.attend(qt, *block)
            dq, dk, dv = impl.attend_backward(qt, *block, dout, lse, delta_, dq)
            outs.append(qt.merge_q(o))
            lses.append(qt.merge_rows(lse_p))
            dks.append(dk)
            dvs.append(dv)
        return outs, lses, qt.dq(dq), dks, dvs

    outs, lses, dq, dks, dvs = ring_of_two(q, k, v)
    lse = jnp.logaddexp(*lses)
    weights = [jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(x - lse))[..., None] for x in lses]
    out = weights[0] * outs[0] + weights[1] * outs[1]
    check(out, ref_out, jnp.float32, "merged out")
    check_lse(lse, ref_lse, jnp.float32)
    check(dq, ref_dq, jnp.float32, "dq")
    check(jnp.concatenate(dks, 1), ref_dk, jnp.float32, "dk")
    check(jnp.concatenate(dvs, 1), ref_dv, jnp.float32, "dv")


def test_lse_cotangent_alone():
    case = dict(sq=256, sk=256, hq=2, hk=1, segments=([100, 156],) * 2)
    q, k, v, qp, kp, qs, ks = make_case(case)
    w = (jnp.zeros((1, 256, 2, 64)), loss_weights(case)[1])
    _, grads = outputs_and_grads(
        lambda q, k, v: pallas_block(q, k, v, qp, kp, qs, ks, **kwargs(case)), *w,
        q, k, v,
    )  # fmt: skip
    _, ref_grads = outputs_and_grads(
        lambda q, k, v: oracle(q, k, v, qp, kp, qs, ks, **oracle_kwargs(case)), *w, q, k, v
    )
    for g, r in zip(grads, ref_grads, strict=True):
        check_close(g, r, jnp.float32, "lse-only gradient")


def test_public_halves_equal_the_block_impl():
    """`pallas_flash_forward` / `pallas_flash_backward` and their heads-major twins give
    bit for bit what `PallasBlockImpl.attend` / `attend_backward` give the strategies."""
    case = CASES["window_gqa"]
    q, k, v, qp, kp, qs, ks = make_case(case)
    kw = kwargs(case)
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    impl = PallasBlockImpl(kw["block_q"], kw["block_k"], True, kw["max_live_blocks"])
    options = BlockOptions.make(kw["causal"], kw["window"], kw["scale"], q.shape[-1])

    @jax.jit
    def three(q, k, v):
        qt = impl.tile_queries(q, qp, qs, k, options)
        out_i, lse_i = impl.attend(qt, k, v, kp, ks)
        out_i, lse_i = qt.merge_q(out_i), qt.merge_rows(lse_i)
        dout = jnp.ones_like(out_i)
        delta = jnp.sum(out_i * dout, -1)
        rows = (qt.split_q(dout), qt.split_rows(lse_i), qt.split_rows(delta), qt.zeros_dq())
        dq_i, dk_i, dv_i = impl.attend_backward(qt, k, v, kp, ks, *rows)
        out, lse = pallas_flash_forward(q, k, v, qp, kp, qs, ks, **kw)
        out_h, lse_h = pallas_flash_forward_heads_major(t(q), t(k), t(v), qp, kp, qs, ks, **kw)
        grads = pallas_flash_backward(q, k, v, qp, kp, qs, ks, dout, lse, delta, **kw)
        grads_h = pallas_flash_backward_heads_major(
            t(q), t(k), t(v), qp, kp, qs, ks, t(dout), t(lse), t(delta), **kw
        )
        return (
            (out_i, lse_i, qt.dq(dq_i), dk_i, dv_i),
            (out, lse, *grads),
            tuple(map(t, (out_h, lse_h, *grads_h))),
        )

    library, seq_major, heads_major = three(q, k, v)
    for a, b, c in zip(library, seq_major, heads_major, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_nan_propagates_like_naive_softmax():
    """A NaN in a visible query or key makes exactly the rows that see it NaN; a NaN in a
    key block that every query block skips (empty pairs) changes nothing."""
    case = dict(sq=256, sk=256, hq=1, hk=1)
    q, k, v, qp, kp, _, _ = make_case(case)
    kw = kwargs(case)
    q = q.at[0, 5, 0, 3].set(jnp.nan)  # row 5
    k = k.at[0, 200, 0, 0].set(jnp.nan)  # seen causally by rows >= 200
    out, lse = pallas_block(q, k, v, qp, kp, **kw)
    ref_out, _ = oracle(q, k, v, qp, kp, None, None, **oracle_kwargs(case))
    nan_rows = np.isnan(np.asarray(out[0, :, 0])).any(-1)
    expected = np.zeros(256, bool)
    expected[5] = True
    expected[200:] = True
    np.testing.assert_array_equal(nan_rows, expected)
    np.testing.assert_array_equal(np.isnan(lse[0, :, 0]), expected)
    np.testing.assert_array_equal(np.isnan(ref_out[0, :, 0]).any(-1), expected)
    check_close(out[0, ~expected], ref_out[0, ~expected], jnp.float32, "finite rows")

    # Keys 128..255 are an EMPTY pair for queries 0..127 under the causal rule.
    q2 = q.at[0, 5, 0, 3].set(0.0)
    k2 = k.at[0, 200, 0, 0].set(0.0).at[0, 128:, 0, :].set(jnp.nan)
    v2 = v.at[0, 128:].set(jnp.nan)
    out2, _ = pallas_block(q2, k2, v2, qp, kp, **kw)
    assert np.isfinite(np.asarray(out2[0, :128])).all()
    assert np.isnan(np.asarray(out2[0, 128:])).all()


def _dense_visibility(cfg, ids):
    mask = oracle_mask(ids.q_pos, ids.kv_pos, ids.q_seg, ids.kv_seg, cfg.causal, cfg.window)
    b, sq, sk = mask.shape[0], mask.shape[2], mask.shape[3]
    blocks = mask[:, 0].reshape(b, sq // cfg.block_q, cfg.block_q, sk // cfg.block_k, cfg.block_k)
    return blocks.sum((2, 4)), cfg.block_q * cfg.block_k


@pytest.mark.parametrize("seed", range(4))
def test_classification_is_exact_where_it_claims(seed):
    """EMPTY pairs hold no visible pair, FULL pairs only visible ones; and a causal
    0..n-1 layout gets the textbook lower-triangular classes."""
    rng = np.random.default_rng(seed)
    b, s, blk = 2, 1024, 128
    pos = jnp.asarray(np.stack([np.sort(rng.permutation(4 * s)[:s]) for _ in range(b)]), jnp.int32)
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (b, s)), 1), jnp.int32)
    for window in (None, 300):
        for ids in (Ids(pos, pos, None, None), Ids(pos, pos - 50, seg, seg)):
            cfg = Config(True, window, 1.0, blk, blk, ids.q_seg is not None, True)
            kind = np.asarray(classify(cfg, ids))
            count, size = _dense_visibility(cfg, ids)
            assert (np.asarray(count)[kind == EMPTY] == 0).all()
            assert (np.asarray(count)[kind == FULL] == size).all()
    ar = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (1, s))
    cfg = Config(True, None, 1.0, blk, blk, False, True)
    n = s // blk
    expected = np.tril(np.full((n, n), FULL), -1) + np.eye(n, dtype=int)  # diagonal PARTIAL
    np.testing.assert_array_equal(classify(cfg, Ids(ar, ar, None, None))[0], expected)


def test_schedule_lists_live_pairs_first_and_flags_overflow():
    """Non-empty pairs first, in order; later steps are EMPTY and re-point at the block
    fetched last (no new DMA); a bound below the live count sets `overflow`."""
    s, blk, n = 1024, 128, 8
    ar = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (1, s))
    sched = schedule(Config(True, None, 1.0, blk, blk, False, True), Ids(ar, ar, None, None))
    rows = lambda x: np.asarray(x).reshape(n, -1)  # noqa: E731
    np.testing.assert_array_equal(rows(sched.kv_block)[2], [0, 1, 2, 2, 2, 2, 2, 2])
    np.testing.assert_array_equal(rows(sched.row_kind)[2], [FULL, FULL, PARTIAL] + [EMPTY] * 5)
    np.testing.assert_array_equal(rows(sched.q_block)[2], [2, 3, 4, 5, 6, 7, 7, 7])
    np.testing.assert_array_equal(rows(sched.col_kind)[2], [PARTIAL] + [FULL] * 5 + [EMPTY] * 2)
    assert not sched.overflow
    # A window of 200 tokens: at most 3 key blocks per query block and 3 query blocks per
    # key block, so 3 steps suffice and 2 do not.
    for steps, overflow in ((3, False), (2, True)):
        cfg = Config(True, 200, 1.0, blk, blk, False, True, max_live_blocks=steps)
        sched = schedule(cfg, Ids(ar, ar, None, None))
        assert rows(sched.kv_block).shape == (n, steps)
        assert bool(sched.overflow) == overflow
    np.testing.assert_array_equal(rows(sched.kv_block)[5], [3, 4])


@pytest.mark.parametrize("name", ["window_gqa", "segments_mqa_ragged"])
def test_max_live_blocks_too_small_falls_back_to_the_whole_grid(name):
    """A bound some block exceeds (1 step per block) is caught at run time: the whole grid
    runs instead, and output, lse and gradients are those of the oracle, not NaN."""
    case = dict(CASES[name], max_live=1)
    q, k, v, qp, kp, qs, ks = make_case(case)
    w = loss_weights(case)
    (out, lse), grads = outputs_and_grads(
        lambda q, k, v: pallas_block(q, k, v, qp, kp, qs, ks, **kwargs(case)), *w, q, k, v
    )
    (ref_out, ref_lse), ref_grads = outputs_and_grads(
        lambda q, k, v: oracle(q, k, v, qp, kp, qs, ks, **oracle_kwargs(case)), *w, q, k, v
    )
    check_close(out, ref_out, jnp.float32, "out")
    check_lse(lse, ref_lse, jnp.float32)
    for n, g, r in zip("qkv", grads, ref_grads, strict=True):
        check_close(g, r, jnp.float32, f"d{n}")


def test_default_block_sizes():
    assert default_block_sizes("TPU v5 lite") == DEFAULT_BLOCK_SIZES["TPU v5 lite"]
    assert default_block_sizes("TPU v6e") == DEFAULT_BLOCK_SIZES["TPU v6e"]
    bq, bk = default_block_sizes("cpu")
    assert bq % 128 == 0 and bk % 128 == 0


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(block_q=100), r"block_q must be a positive multiple of 128.*=100.*block_q=128"),
        (dict(block_k=0), r"block_k must be a positive multiple of 128.*block_k=0"),
        (dict(block_q=-128), r"block_q must be a positive multiple of 128"),
        (dict(block_k=64), r"block_k must be a positive multiple of 128.*block_k=64"),
        (dict(window=0), r"window must be a positive int.*window=0"),
        (dict(window=-3), r"window must be a positive int.*window=-3"),
        (dict(window=16, causal=False), r"window=16 needs causal=True"),
        (dict(max_live_blocks=0), r"max_live_blocks must be a positive int.*=0"),
    ],
)
def test_bad_static_arguments_raise(change, match):
    q, k, v, qp, kp, _, _ = make_case(dict(sq=128, sk=128))
    kw = dict(causal=True, block_q=128, block_k=128) | change
    for fn in (pallas_flash_forward, pallas_block):
        with pytest.raises(ValueError, match=match):
            fn(q, k, v, qp, kp, **kw)
    with pytest.raises(ValueError):  # flash_attention words the window rules its own way
        public_pallas(q, k, v, qp, kp, **kw)
    with pytest.raises(ValueError, match=match):
        lse = jnp.zeros((1, 128, 2))
        pallas_flash_backward(q, k, v, qp, kp, None, None, jnp.zeros_like(q), lse, lse, **kw)


def test_bad_arrays_raise():
    q, k, v, qp, kp, qs, ks = make_case(dict(sq=128, sk=128, hq=3, hk=3, segments=([128],) * 2))
    kw = dict(causal=True)
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    with pytest.raises(ValueError, match=r"q_heads must be a multiple of kv_heads.*q_heads=3"):
        pallas_flash_forward(q, k[:, :, :2], v[:, :, :2], qp, kp, **kw)
    with pytest.raises(ValueError, match=r"one dtype, float32 or bfloat16.*float16"):
        pallas_flash_forward(q.astype(jnp.float16), k, v, qp, kp, **kw)
    with pytest.raises(ValueError, match=r"one dtype.*bfloat16"):
        pallas_flash_forward(q, k.astype(jnp.bfloat16), v, qp, kp, **kw)
    with pytest.raises(ValueError, match=r"q_segment_ids and kv_segment_ids go together"):
        pallas_flash_forward(q, k, v, qp, kp, qs, None, **kw)
    # Shapes jaxtyping would catch on the sequence-major API go through the same checks here.
    with pytest.raises(ValueError, match=r"q_positions must be \[batch, seq\]=\(1, 128\)"):
        pallas_flash_forward_heads_major(t(q), t(k), t(v), qp[:, :64], kp, **kw)
    with pytest.raises(ValueError, match=r"k and v must share batch, kv_seq and kv_heads"):
        pallas_flash_forward_heads_major(t(q), t(k), t(v)[:, :, :64], qp, kp, **kw)
    with pytest.raises(ValueError, match=r"must be \[batch, seq, heads, dim\]"):
        pallas_flash_forward_heads_major(t(q)[0], t(k), t(v), qp, kp, **kw)
    with pytest.raises(ValueError, match=r"q_segment_ids must be \[batch, seq\]"):
        pallas_flash_forward_heads_major(t(q), t(k), t(v), qp, kp, qs[:, :10], ks, **kw)
    lse = jnp.zeros((1, 3, 128))
    with pytest.raises(ValueError, match=r"dout must be \[batch, seq, q_heads, v_head_dim\]"):
        pallas_flash_backward_heads_major(
            t(q), t(k), t(v), qp, kp, None, None, t(q)[..., :32], lse, lse, **kw
        )


def public_pallas(q, k, v, qp, kp, qs=None, ks=None, *, block_q=128, block_k=128,
                  interpret=True, max_live_blocks=None, **kw):  # fmt: skip
    """The public one-device call of the kernels: `flash_attention(impl=PallasBlockImpl)`."""
    impl = PallasBlockImpl(block_q, block_k, interpret, max_live_blocks)
    return flash_attention(
        q, k, v, q_positions=qp, kv_positions=kp, q_segment_ids=qs, kv_segment_ids=ks,
        impl=impl, **kw,
    )  # fmt: skip


def test_public_flash_attention_with_pallas_is_the_block_contract():
    """`flash_attention(impl=PallasBlockImpl(...))` has no gradient rule of its own: outputs
    and gradients are bit for bit those of `block_attention` with the same impl."""
    case = CASES["segments_mqa_ragged"]
    q, k, v, qp, kp, qs, ks = make_case(case)
    w = loss_weights(case)
    ours = outputs_and_grads(
        lambda q, k, v: pallas_block(q, k, v, qp, kp, qs, ks, **kwargs(case)), *w, q, k, v
    )
    public = outputs_and_grads(
        lambda q, k, v: public_pallas(q, k, v, qp, kp, qs, ks, **kwargs(case)), *w,
        q, k, v,
    )  # fmt: skip
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(public), strict=True):
        np.testing.assert_array_equal(a, b)
