"""Flash attention for GPUs in Pallas' Triton lowering: the block contract's forward and
backward (FlashAttention-2, arXiv:2307.08691) on `[batch, seq, heads, dim]` arrays read in
place, with the mask computed in the kernel from positions, segment ids, a window and a
chunk. The XLA twin is `XlaBlockImpl` (`eqx_longctx/attention/_local.py`); the TPU kernels
are `_flash_pallas.py`.

Three kernels, each a grid of programs over (block, batch, head):

- **forward** `(q block, batch, q head)`: walks the key blocks of its K/V head (`q head //
  group`: GQA and MQA read K/V once per group, never repeated in memory), online softmax in
  float32; writes `out` and the natural-log `lse` (float32, `-inf` for rows that see no key).
- **dK/dV** `(key block, batch, kv head)`: walks every query block of each query head of the
  group, from the row's global `lse` and `delta = rowsum(dout * out) - dlse`; float32 out.
- **dQ** `(q block, batch, q head)`: walks the key blocks; adds into the caller's float32
  accumulator in place (`input_output_aliases`), as a ring's hops need.

Each program walks only the range of partner blocks that hold a visible pair: before the
kernels, XLA classifies every (query block, key block) pair from the blocks' position and
segment ranges (the rule of `pairs_are_empty`) and gives each block the first and last
partner that is not empty (`block_ranges`). The kernels' loops run over that range with no
branch inside, so Triton can pipeline their loads. For the causal upper triangle, windows,
chunks, sorted documents, zig-zag shards and ring hops the range holds no empty pair; for
an unusual layout (positions shuffled) the empty pairs inside it are computed and masked.
Sequences are padded to whole blocks and head dims to powers of two (Triton's tiles), the
padding masked by static lengths.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_NEG_INF = float("-inf")


class GpuConfig(NamedTuple):
    """What one kernel call is compiled for (static)."""

    causal: bool
    window: int | None
    chunk: int | None
    softcap: float | None
    scale: float
    block_q: int
    block_k: int
    seq_q: int  # valid (unpadded) query rows
    seq_k: int  # valid (unpadded) key rows
    group: int  # query heads per K/V head
    heads_major: bool  # K/V `[batch, kv_heads, seq, dim]` (the KV cache's layout)
    interpret: bool
    num_warps: int
    num_stages: int
    exact: bool  # float32 inputs: IEEE products (no TF32)


def next_power_of_two(n: int, least: int = 16) -> int:
    """The smallest power of two `>= max(n, least)` (Triton's tile sizes; 16 is the least
    a tensor-core product takes)."""
    return max(least, 1 << max(0, int(n) - 1).bit_length())


# ---------------------------------------------------------------------------- the rules


def _visible(cfg: GpuConfig, rows, cols, qp, kp, qs, ks):
    """`[block_q, block_k]` visibility: valid rows and columns, then the contract's rules."""
    mask = (rows < cfg.seq_q)[:, None] & (cols < cfg.seq_k)[None, :]
    dq, dk = qp[:, None], kp[None, :]
    if cfg.causal:
        mask = mask & (dq >= dk)
    if cfg.window is not None:
        mask = mask & (dq - dk < cfg.window)
    if cfg.chunk is not None:
        mask = mask & (jnp.floor_divide(dq, cfg.chunk) == jnp.floor_divide(dk, cfg.chunk))
    if qs is not None:
        mask = mask & (qs[:, None] == ks[None, :])
    return mask


def block_ranges(cfg: GpuConfig, qp, kp, qs, ks):
    """`(q_lo, q_hi, k_lo, k_hi)`: for each query block `[b, nq]` the first and one past
    the last key block holding a visible pair, and for each key block `[b, nk]` the same
    range of query blocks (`lo == hi == 0`: none). Judged from each block's position and
    segment ranges (the rule of `pairs_are_empty`); ids are padded to whole blocks."""
    b = qp.shape[0]

    def extent(ids, block):
        blocks = ids.reshape(b, -1, block)
        return blocks.min(-1), blocks.max(-1)

    (q0, q1), (k0, k1) = extent(qp, cfg.block_q), extent(kp, cfg.block_k)
    q0, q1, k0, k1 = q0[:, :, None], q1[:, :, None], k0[:, None, :], k1[:, None, :]
    empty = jnp.zeros((b, q0.shape[1], k0.shape[2]), jnp.bool_)
    if cfg.causal:
        empty = empty | (q1 < k0)
    if cfg.window is not None:
        empty = empty | (q0 - k1 >= cfg.window)
    if cfg.chunk is not None:
        c = cfg.chunk
        empty = empty | (jnp.floor_divide(q0, c) > jnp.floor_divide(k1, c))
        empty = empty | (jnp.floor_divide(q1, c) < jnp.floor_divide(k0, c))
    if qs is not None:
        (s0, s1), (t0, t1) = extent(qs, cfg.block_q), extent(ks, cfg.block_k)
        empty = empty | (s1[:, :, None] < t0[:, None, :]) | (s0[:, :, None] > t1[:, None, :])
    live = ~empty

    def span(live, axis):
        n = live.shape[axis]
        any_ = live.any(axis)
        lo = jnp.argmax(live, axis=axis)
        hi = n - jnp.argmax(jnp.flip(live, axis), axis=axis)
        return (jnp.where(any_, lo, 0).astype(jnp.int32),
                jnp.where(any_, hi, 0).astype(jnp.int32))  # fmt: skip

    return (*span(live, 2), *span(live, 1))


def _dot(cfg: GpuConfig, a, b, *, trans_a=False, trans_b=False):
    precision = lax.Precision.HIGHEST if cfg.exact else None
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)


def _scores(cfg: GpuConfig, q, k):
    """Scaled float32 scores and, with a soft-cap, `tanh(s / softcap)` (for the backward)."""
    s = _dot(cfg, q, k, trans_b=True) * cfg.scale
    if cfg.softcap is None:
        return s, None
    t = jnp.tanh(s / cfg.softcap)
    return cfg.softcap * t, t


def _iota(n: int, start):
    return start + lax.broadcasted_iota(jnp.int32, (n,), 0)


# ---------------------------------------------------------------------------- forward


def _forward_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, qp_ref, kp_ref, *rest, cfg: GpuConfig,
                    segments: bool):  # fmt: skip
    qs_ref, ks_ref, o_ref, lse_ref = rest if segments else (None, None, *rest)
    bq, bk = cfg.block_q, cfg.block_k
    q = q_ref[...]
    qp = qp_ref[...]
    qs = None if qs_ref is None else qs_ref[...]
    rows = _iota(bq, pl.program_id(0) * bq)
    dv = v_ref.shape[-1]

    def visit(j, carry):
        acc, m, total = carry
        at = pl.ds(j * bk, bk)
        ks = None if ks_ref is None else ks_ref[at]
        s, _ = _scores(cfg, q, k_ref[at, :])
        mask = _visible(cfg, rows, _iota(bk, j * bk), qp, kp_ref[at], qs, ks)
        s = jnp.where(mask, s, _NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        base = jnp.where(m_new == _NEG_INF, 0.0, m_new)
        alpha = jnp.exp(m - base)
        p = jnp.exp(s - base[:, None])
        v = v_ref[at, :]
        acc = acc * alpha[:, None] + _dot(cfg, p.astype(v.dtype), v)
        return acc, m_new, total * alpha + jnp.sum(p, axis=1)

    init = (
        jnp.zeros((bq, dv), jnp.float32),
        jnp.full((bq,), _NEG_INF, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    acc, m, total = lax.fori_loop(lo_ref[...], hi_ref[...], visit, init)
    none = total == 0.0  # not `<= 0`: a NaN row stays NaN
    safe = jnp.where(none, 1.0, total)
    o_ref[...] = (acc / safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(none, _NEG_INF, m + jnp.log(safe))


def _kv_specs(cfg: GpuConfig, shape, index_of_head):
    """The BlockSpec of a whole K/V sequence of one head (`[seq, dim]` in the kernel)."""
    if cfg.heads_major:  # [b, kv_heads, seq, dim]
        block = (None, None, shape[2], shape[3])
        return pl.BlockSpec(block, lambda i, b, h: (b, index_of_head(h), 0, 0))
    block = (None, shape[1], None, shape[3])
    return pl.BlockSpec(block, lambda i, b, h: (b, 0, index_of_head(h), 0))


def _params(cfg: GpuConfig):
    return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def forward(cfg: GpuConfig, q, k, v, qp, kp, qs, ks):
    """`(out, lse)`: `out` `[b, sq_pad, h, dv_pad]` in `q`'s dtype, `lse` float32
    `[b, sq_pad, h]`, from padded inputs (see `GpuConfig`; K/V in either layout)."""
    b, sqp, h, dp = q.shape
    dvp = v.shape[-1]
    bq = cfg.block_q
    segments = qs is not None
    g = cfg.group
    q_block = pl.BlockSpec((None, bq, None, dp), lambda i, b, h: (b, i, h, 0))
    rows = pl.BlockSpec((None, bq), lambda i, b, h: (b, i))
    keys = pl.BlockSpec((None, kp.shape[1]), lambda i, b, h: (b, 0))
    bound = pl.BlockSpec((None, None), lambda i, b, h: (b, i))
    lo, hi, _, _ = block_ranges(cfg, qp, kp, qs, ks)
    in_specs = [bound, bound, q_block, _kv_specs(cfg, k.shape, lambda h: h // g),
                _kv_specs(cfg, v.shape, lambda h: h // g), rows, keys]  # fmt: skip
    args = [lo, hi, q, k, v, qp, kp]
    if segments:
        in_specs += [rows, keys]
        args += [qs, ks]
    kernel = functools.partial(_forward_kernel, cfg=cfg, segments=segments)
    return pl.pallas_call(
        kernel,
        grid=(sqp // bq, b, h),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, bq, None, dvp), lambda i, b, h: (b, i, h, 0)),
            pl.BlockSpec((None, bq, None), lambda i, b, h: (b, i, h)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, sqp, h, dvp), q.dtype),
            jax.ShapeDtypeStruct((b, sqp, h), jnp.float32),
        ],
        compiler_params=_params(cfg),
        interpret=cfg.interpret,
        name="flash_gpu_forward",
    )(*args)


# ---------------------------------------------------------------------------- backward


def _probabilities(cfg, q, k, lse, mask):
    """`p` from the global `lse`, and the soft-cap's `tanh` (or `None`)."""
    s, t = _scores(cfg, q, k)
    return jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0), t


def _score_grad(cfg, p, t, dp, delta):
    """d(loss)/d(scaled score) `p * (dp - delta)`, through the soft-cap when there is one."""
    ds = p * (dp - delta[:, None])
    return ds if t is None else ds * (1.0 - t * t)


def _dkv_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref,
                *rest, cfg: GpuConfig, segments: bool):  # fmt: skip
    qs_ref, ks_ref, dk_ref, dv_ref = rest if segments else (None, None, *rest)
    bq, bk = cfg.block_q, cfg.block_k
    k, v = k_ref[...], v_ref[...]
    kp = kp_ref[...]
    ks = None if ks_ref is None else ks_ref[...]
    cols = _iota(bk, pl.program_id(0) * bk)

    def visit(i, carry, head):
        dk, dv = carry
        at = pl.ds(i * bq, bq)
        qs = None if qs_ref is None else qs_ref[at]
        q, do = q_ref[at, head, :], do_ref[at, head, :]
        mask = _visible(cfg, _iota(bq, i * bq), cols, qp_ref[at], kp, qs, ks)
        p, t = _probabilities(cfg, q, k, lse_ref[at, head], mask)
        dv = dv + _dot(cfg, p.astype(do.dtype), do, trans_a=True)
        dp = _dot(cfg, do, v, trans_b=True)
        ds = _score_grad(cfg, p, t, dp, delta_ref[at, head])
        return dk + _dot(cfg, ds.astype(q.dtype), q, trans_a=True), dv

    carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    lo, hi = lo_ref[...], hi_ref[...]
    for head in range(cfg.group):  # the query heads that read this K/V head
        carry = lax.fori_loop(lo, hi, functools.partial(visit, head=head), carry)
    dk, dv = carry
    dk_ref[...] = dk * cfg.scale
    dv_ref[...] = dv


def _dq_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref,
               *rest, cfg: GpuConfig, segments: bool):  # fmt: skip
    qs_ref, ks_ref, acc_ref, dq_ref = rest if segments else (None, None, *rest)
    bq, bk = cfg.block_q, cfg.block_k
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    qp = qp_ref[...]
    qs = None if qs_ref is None else qs_ref[...]
    rows = _iota(bq, pl.program_id(0) * bq)

    def visit(j, dq):
        at = pl.ds(j * bk, bk)
        ks = None if ks_ref is None else ks_ref[at]
        k, v = k_ref[at, :], v_ref[at, :]
        mask = _visible(cfg, rows, _iota(bk, j * bk), qp, kp_ref[at], qs, ks)
        p, t = _probabilities(cfg, q, k, lse, mask)
        ds = _score_grad(cfg, p, t, _dot(cfg, do, v, trans_b=True), delta)
        return dq + _dot(cfg, ds.astype(k.dtype), k)

    dq = lax.fori_loop(lo_ref[...], hi_ref[...], visit, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = acc_ref[...] + dq * cfg.scale


def backward(cfg: GpuConfig, q, k, v, qp, kp, qs, ks, do, lse, delta, dq_acc):
    """`(dq, dk, dv)` float32 in the padded layouts: `dq_acc` plus this block's dQ, and
    this block's dK, dV (`[b, sk_pad, kv_heads, d_pad]`; K/V seq-major).
    `do` `[b, sq_pad, h, dv_pad]`; `lse`, `delta` `[b, sq_pad, h]` float32."""
    b, sqp, h, dp = q.shape
    dvp = v.shape[-1]
    bq, bk, g = cfg.block_q, cfg.block_k, cfg.group
    hk = h // g
    if cfg.heads_major:
        raise NotImplementedError("the GPU backward reads K/V seq-major (decoding has none)")
    skp = k.shape[1]
    segments = qs is not None
    q_lo, q_hi, k_lo, k_hi = block_ranges(cfg, qp, kp, qs, ks)

    # dK, dV: one program per (key block, batch, kv head), over the group's query heads.
    def kv_block(shape):
        return pl.BlockSpec((None, bk, None, shape[3]), lambda j, b, kh: (b, j, kh, 0))

    def group_rows(width):
        return pl.BlockSpec((None, sqp, g, width), lambda j, b, kh: (b, 0, kh, 0))

    stats = pl.BlockSpec((None, sqp, g), lambda j, b, kh: (b, 0, kh))
    q_ids = pl.BlockSpec((None, sqp), lambda j, b, kh: (b, 0))
    k_ids = pl.BlockSpec((None, bk), lambda j, b, kh: (b, j))
    bound = pl.BlockSpec((None, None), lambda j, b, kh: (b, j))
    in_specs = [bound, bound, group_rows(dp), kv_block(k.shape), kv_block(v.shape),
                group_rows(dvp), stats, stats, q_ids, k_ids]  # fmt: skip
    args = [k_lo, k_hi, q, k, v, do, lse, delta, qp, kp]
    if segments:
        in_specs += [q_ids, k_ids]
        args += [qs, ks]
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, segments=segments),
        grid=(skp // bk, b, hk),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, bk, None, dp), lambda j, b, kh: (b, j, kh, 0)),
            pl.BlockSpec((None, bk, None, dvp), lambda j, b, kh: (b, j, kh, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, skp, hk, dp), jnp.float32),
            jax.ShapeDtypeStruct((b, skp, hk, dvp), jnp.float32),
        ],
        compiler_params=_params(cfg),
        interpret=cfg.interpret,
        name="flash_gpu_dkv",
    )(*args)

    # dQ: one program per (query block, batch, query head), over the key blocks.
    q_block = lambda width: pl.BlockSpec((None, bq, None, width), lambda i, b, h: (b, i, h, 0))  # noqa: E731
    row_stats = pl.BlockSpec((None, bq, None), lambda i, b, h: (b, i, h))
    rows = pl.BlockSpec((None, bq), lambda i, b, h: (b, i))
    keys = pl.BlockSpec((None, kp.shape[1]), lambda i, b, h: (b, 0))
    bound = pl.BlockSpec((None, None), lambda i, b, h: (b, i))
    in_specs = [bound, bound, q_block(dp), _kv_specs(cfg, k.shape, lambda h: h // g),
                _kv_specs(cfg, v.shape, lambda h: h // g), q_block(dvp), row_stats, row_stats,
                rows, keys]  # fmt: skip
    args = [q_lo, q_hi, q, k, v, do, lse, delta, qp, kp]
    if segments:
        in_specs += [rows, keys]
        args += [qs, ks]
    in_specs.append(q_block(dp))
    args.append(dq_acc)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, segments=segments),
        grid=(sqp // bq, b, h),
        in_specs=in_specs,
        out_specs=q_block(dp),
        out_shape=jax.ShapeDtypeStruct(dq_acc.shape, jnp.float32),
        input_output_aliases={len(args) - 1: 0},
        compiler_params=_params(cfg),
        interpret=cfg.interpret,
        name="flash_gpu_dq",
    )(*args)
    return dq, dk, dv


def kernel_names() -> tuple[str, ...]:
    """The names the kernels carry in a lowered program (what the CUDA lowering test and
    the device benchmark look for)."""
    return ("flash_gpu_forward", "flash_gpu_dkv", "flash_gpu_dq")
