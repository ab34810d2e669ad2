"""Flash-attention forward as a Pallas TPU kernel: online softmax over key blocks.

One grid step attends one query block of one query head to one key block:
grid `(batch, q_heads, nq, steps)`, the key axis innermost and sequential ("arbitrary"), the
running max `m`, denominator `l` and float32 accumulator in VMEM scratch. The wrapper's
block-pair classification (`_blocks.schedule`) arrives by scalar prefetch: empty pairs are
skipped (their K/V fetch re-points at the resident block, so no DMA is issued), full pairs
skip the mask, partial pairs build it from the per-token positions and segment ids.

Each grid step walks its key block in key sub-blocks (`block_k_compute`, chosen by `_vmem`
to keep the score temporaries within the VMEM budget), updating the online softmax per
sub-block; the kernels ask Mosaic for that budget (`vmem_limit_bytes`).

GQA/MQA: query head `h` reads K/V head `h // (q_heads // kv_heads)` through the index map,
so K/V are never repeated in memory. The value head dim may differ from the key's (MLA).

Layouts, for TPU tiles of 8 sublanes x 128 lanes (the ones splash attention uses): q, k, v
heads-major `[b, h, s, d]` in `(block, d)` blocks; the query side's positions and segment
ids as lane-broadcast columns `[b, s, 128]` (blocks `(block_q, 128)`) and the key side's as
sublane-broadcast rows `[b, 8, s]` (blocks `(8, block_k)`), so a mask is one broadcast
comparison with no relayout; the logsumexp lane-dense, `[b, h, 8, s]`.

Cost of skipping: an empty pair still costs its grid step's fixed overhead (no DMA, no
compute). Splash attention shrinks the grid to the longest row of non-empty pairs, which
needs the mask at trace time; here the classification is data (positions are arrays), so
the key axis has one step per key block unless the non-empty pairs per block are bounded
(`max_live_blocks`, by default the sliding window's); a query block's non-empty key blocks
come first either way, and a schedule that overflows its bound runs the whole grid.

Reference: Dao 2023, "FlashAttention-2" (arXiv:2307.08691), Algorithm 1.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._types import (
    AttnOut,
    Key,
    KvPositions,
    KvSegmentIds,
    LogSumExp,
    Positions,
    Query,
    SegmentIds,
    Value,
)
from ._blocks import (
    FULL,
    PARTIAL,
    Config,
    Ids,
    Schedule,
    by_batch_rows,
    call_kernel,
    kv_ids,
    make_config,
    query_chunk,
    query_ids,
    schedule,
    visible,
    with_fallback,
)
from ._checks import check_inputs
from ._operands import (
    NUM_LANES,
    NUM_SUBLANES,
    KvOperand,
    Side,
    kv_operand,
    lanes,
    out_struct,
    pad_axis,
    sublanes,
)
from ._vmem import kernel_vmem

_NT = (((1,), (1,)), ((), ()))  # contract the last dims: a @ b.T
_NN = (((1,), (0,)), ((), ()))


def _dot(a, b, dims):
    """Matmul with float32 accumulation; float32 operands ask for a float32 contraction
    explicitly instead of relying on the backend's default precision."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _tile_lanes(x, width: int):
    """`[rows, 128]` with equal lanes -> `[rows, width]`."""
    return jnp.tile(x, (1, pl.cdiv(width, NUM_LANES)))[:, :width]


def capped_scores(cfg: Config, s):
    """Float32 scores `s` scaled and, with `cfg.softcap`, capped (`c * tanh(x / c)`).

    **Returns:** `(scores, t)`: `t = tanh(x / c)` (for the backward's `1 - t^2`), or None.
    """
    x = s * cfg.scale
    if cfg.softcap is None:
        return x, None
    t = jnp.tanh(x / cfg.softcap)
    return cfg.softcap * t, t


def sub_blocks(n: int, size: int, body) -> None:
    """`body(start)` for the `n` key sub-blocks of `size` rows of a grid step's key block,
    unrolled, so every slice has a static, aligned offset (as splash attention unrolls its
    `block_kv_compute` loop): no dynamic lane offsets for Mosaic to lower."""
    for c in range(n):
        body(c * size)


def _fwd_kernel(kind_ref, kv_block_ref, q_ref, k_ref, v_ref, q_pos_ref, kv_pos_ref, *rest,
                cfg: Config, nq: int, nt: int, bc: int):  # fmt: skip
    if cfg.use_segments:
        q_seg_ref, kv_seg_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref = rest
    else:
        q_seg_ref = kv_seg_ref = None
        o_ref, lse_ref, m_ref, l_ref, acc_ref = rest
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    kind = kind_ref[(b * nq + i) * nt + j].astype(jnp.int32)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def sub_block(start, masked: bool):
        cols = pl.ds(start, bc)
        s, _ = capped_scores(cfg, _dot(q_ref[...], k_ref[cols, :], _NT))
        if masked:
            mask = visible(
                cfg,
                q_pos_ref[...],
                kv_pos_ref[:1, cols],
                None if q_seg_ref is None else q_seg_ref[...],
                None if kv_seg_ref is None else kv_seg_ref[:1, cols],
                widen_q=lambda x: _tile_lanes(x, bc),
            )
            if mask is not None:
                s = jnp.where(mask, s, -jnp.inf)
        m_prev = m_ref[...]
        m_next = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
        # A row that has seen only masked keys keeps m = -inf; shift it by 0 so that
        # exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN. NaN scores still give NaN.
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        p = jnp.exp(s - _tile_lanes(m_safe, bc))
        alpha = jnp.exp(m_prev - m_safe)
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=-1, keepdims=True)
        m_ref[...] = m_next
        pv = _dot(p.astype(v_ref.dtype), v_ref[cols, :], _NN)
        acc_ref[...] = _tile_lanes(alpha, acc_ref.shape[1]) * acc_ref[...] + pv

    def step(masked: bool):
        sub_blocks(k_ref.shape[0] // bc, bc, lambda start: sub_block(start, masked))

    pl.when(kind == FULL)(lambda: step(False))
    pl.when(kind == PARTIAL)(lambda: step(True))

    @pl.when(j == nt - 1)
    def _finish():
        denom = l_ref[...]
        # Rows that saw no key (denominator exactly 0): out 0, lse -inf. NaN stays NaN.
        seen = denom != 0.0
        l_t = _tile_lanes(denom, acc_ref.shape[1])
        out = jnp.where(l_t != 0.0, acc_ref[...] / jnp.where(l_t != 0.0, l_t, 1.0), 0.0)
        o_ref[...] = out.astype(o_ref.dtype)
        lse = jnp.where(seen, m_ref[...] + jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf)
        # [bq, 128] (equal lanes) -> [128, bq]: the row statistic lane-dense.
        lse_ref[...] = lse.T[:NUM_SUBLANES, :]


class QuerySide(NamedTuple):
    """The query side as the kernels read it, built once per query shard: `qh` `[b, q_heads,
    padded_sq, d]`, the padded ids with their tiles, and the unpadded length."""

    qh: jax.Array
    ids: Side
    seq: int

    def chunks(self, rows: int) -> "list[QuerySide]":
        """This side cut along its padded sequence into pieces of `rows` rows (a multiple of
        `block_q`; the last may be shorter), each with its ids and its unpadded length.
        Padding is only at the end and shorter than a block, so every piece has real rows."""
        out = []
        for lo in range(0, self.qh.shape[2], rows):
            hi = lo + rows
            pos = self.ids.pos[:, lo:hi]
            seg = None if self.ids.seg is None else self.ids.seg[:, lo:hi]
            tiles = (None, None) if seg is None else (lanes(seg), sublanes(seg))
            ids = Side(pos, seg, lanes(pos), sublanes(pos), *tiles)
            out.append(QuerySide(self.qh[:, :, lo:hi], ids, min(self.seq, hi) - lo))
        return out


def query_side(cfg: Config, qh, q_positions, q_segment_ids) -> QuerySide:
    """Pad heads-major queries and their ids to `block_q` and tile the ids."""
    padded = pad_axis(qh, -qh.shape[2] % cfg.block_q, 2, 0)
    return QuerySide(padded, query_ids(cfg, q_positions, q_segment_ids), qh.shape[2])


class KvSide(NamedTuple):
    """One K/V block as the kernels read it: K and V (`KvOperand`, flat where the head dims
    allow), the padded ids with their tiles, and the unpadded length."""

    k: KvOperand
    v: KvOperand
    ids: Side
    seq: int


def kv_side(cfg: Config, k, v, kv_positions, kv_segment_ids, *, heads_major: bool) -> KvSide:
    """K/V `[b, kv_seq, kv_heads, dim]` (heads-major `[b, kv_heads, kv_seq, dim]` when
    `heads_major`) and their ids, padded to `block_k`; no transpose when the dims allow."""
    seq = k.shape[2] if heads_major else k.shape[1]
    return KvSide(
        kv_operand(k, cfg.block_k, heads_major=heads_major),
        kv_operand(v, cfg.block_k, heads_major=heads_major),
        kv_ids(cfg, kv_positions, kv_segment_ids),
        seq,
    )


def side_ids(qs: QuerySide, kvs: KvSide) -> Ids:
    return Ids(qs.ids.pos, kvs.ids.pos, qs.ids.seg, kvs.ids.seg)


def forward_padded(cfg: Config, qs: QuerySide, kvs: KvSide, sched: Schedule):
    """The forward kernel on padded sides.

    **Returns:** `(out [b, q_heads, padded_sq, dv], lse [b, q_heads, 8, padded_sq] float32)`.
    """
    qh = qs.qh
    b, hq, sq, d = qh.shape
    hk, sk, dv = kvs.k.heads, kvs.k.seq, kvs.v.dim
    bq, bk = cfg.block_q, cfg.block_k
    nq, nk, g = sq // bq, sk // bk, hq // hk
    nt = cfg.steps(nk)
    bc, vmem = kernel_vmem(cfg, head_dim=d, v_head_dim=dv, itemsize=qh.dtype.itemsize)

    def kv_index(bi, i, j, kv_block):
        return kv_block[(bi * nq + i) * nt + j].astype(jnp.int32)

    def kv_block(bi, h, i, j, kind, kvb):
        # GQA/MQA: the group's K/V head, never a repeated copy. Skipped pairs re-point at
        # the resident block (`Schedule.kv_block`), so Pallas issues no DMA for them.
        # `g` as int32: under jax_enable_x64 lax.div would get it as int64 beside the
        # int32 grid index, and refuse the pair.
        return bi, lax.div(h, jnp.int32(g)), kv_index(bi, i, j, kvb)

    in_specs = [
        pl.BlockSpec((None, None, bq, d), lambda bi, h, i, j, kind, kvb: (bi, h, i, 0)),
        kvs.k.spec(bk, kv_block),
        kvs.v.spec(bk, kv_block),
    ]
    q_col = pl.BlockSpec((None, bq, NUM_LANES), lambda bi, h, i, j, kind, kvb: (bi, i, 0))
    kv_row = pl.BlockSpec(
        (None, NUM_SUBLANES, bk), lambda bi, h, i, j, kind, kvb: (bi, 0, kv_index(bi, i, j, kvb))
    )
    operands = [qh, kvs.k.x, kvs.v.x, qs.ids.pos_lanes, kvs.ids.pos_rows]
    in_specs += [q_col, kv_row]
    if cfg.use_segments:
        operands += [qs.ids.seg_lanes, kvs.ids.seg_rows]
        in_specs += [q_col, kv_row]
    out_specs = [
        pl.BlockSpec((None, None, bq, dv), lambda bi, h, i, j, kind, kvb: (bi, h, i, 0)),
        pl.BlockSpec((None, None, NUM_SUBLANES, bq), lambda bi, h, i, j, kind, kvb: (bi, h, 0, i)),
    ]  # fmt: skip
    out_shape = [
        out_struct((b, hq, sq, dv), qh.dtype, *sched, *operands),
        out_struct((b, hq, NUM_SUBLANES, sq), jnp.float32, *sched, *operands),
    ]
    scratch = [
        pltpu.VMEM((bq, NUM_LANES), jnp.float32),
        pltpu.VMEM((bq, NUM_LANES), jnp.float32),
        pltpu.VMEM((bq, dv), jnp.float32),
    ]
    itemsize = qh.dtype.itemsize
    cost = pl.CostEstimate(
        flops=2 * b * hq * sq * nt * bk * (d + dv),  # the grid's steps, skipped or not
        transcendentals=b * hq * sq * nt * bk * (1 if cfg.softcap is None else 2),
        bytes_accessed=itemsize
        * (qh.size + b * hq * sq * dv + nq * g * (kvs.k.x.size + kvs.v.x.size)),
    )
    build = lambda interpret: pl.pallas_call(  # noqa: E731
        functools.partial(_fwd_kernel, cfg=cfg, nq=nq, nt=nt, bc=bc),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, hq, nq, nt),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem,
        ),
        interpret=interpret,
        cost_estimate=cost,
        name="eqx_longctx_flash_fwd",
    )
    return call_kernel(cfg.interpret, build, sched.row_kind, sched.kv_block, *operands)


def to_seq_major(x):
    return jnp.swapaxes(x, 1, 2)


def _heads_major_like(x):
    """A `[b, h, s, d]` array described as `[b, s, h, d]` (for the shared checks)."""
    if x.ndim != 4:
        return x
    return jax.ShapeDtypeStruct((x.shape[0], x.shape[2], x.shape[1], x.shape[3]), x.dtype)


def forward_sides(cfg: Config, qs: QuerySide, kvs: KvSide):
    """Forward of prepared sides: `(out [b, h, sq, dv], lse [b, h, sq])`, heads-major,
    padding cut. Batch rows go in as many calls as keep the schedule in SMEM, and queries in
    as many pieces (each row's output and logsumexp are its own: the pieces concatenate)."""
    rows = query_chunk(cfg, qs.qh.shape[2], kvs.k.seq)
    parts = [
        by_batch_rows(
            cfg, functools.partial(_forward_rows, cfg), part.qh.shape[2], kvs.k.seq, part, kvs
        )  # fmt: skip
        for part in qs.chunks(rows)
    ]
    if len(parts) == 1:
        return parts[0]
    return tuple(jnp.concatenate(xs, axis=2) for xs in zip(*parts, strict=True))


def _forward_rows(cfg, qs: QuerySide, kvs: KvSide):
    ids = side_ids(qs, kvs)
    run = lambda cfg, sched: forward_padded(cfg, qs, kvs, sched)  # noqa: E731
    out, lse = with_fallback(cfg, ids, schedule(cfg, ids), run)
    return out[:, :, : qs.seq], lse[:, :, 0, : qs.seq]


def flash_forward_heads_major(
    cfg: Config, qh, kh, vh, q_positions, kv_positions, q_segment_ids, kv_segment_ids
):
    """Forward on heads-major inputs with a validated `cfg`: `(out [b, h, s, dv], lse
    [b, h, s])`."""
    qs = query_side(cfg, qh, q_positions, q_segment_ids)
    kvs = kv_side(cfg, kh, vh, kv_positions, kv_segment_ids, heads_major=True)
    return forward_sides(cfg, qs, kvs)


def pallas_flash_forward_heads_major(
    qh, kh, vh, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None, *,
    causal: bool, window: int | None = None, scale: float | None = None,
    block_q: int | None = None, block_k: int | None = None, interpret=None,
    max_live_blocks: int | None = None, block_k_compute: int | None = None,
    softcap: float | None = None, chunk: int | None = None,
):  # fmt: skip
    """`pallas_flash_forward` in the heads-major layout the kernels use, so that a caller
    that attends the same queries to many K/V blocks (the ring) transposes them once.

    **Arguments:** `qh` `[batch, q_heads, seq, head_dim]`, `kh` `[batch, kv_heads, kv_seq,
    head_dim]`, `vh` `[batch, kv_heads, kv_seq, v_head_dim]`; the rest as in
    `pallas_flash_forward`.

    **Returns:** `(out [batch, q_heads, seq, v_head_dim], lse [batch, q_heads, seq])`.

    **Raises:** as `pallas_flash_forward`.
    """
    masks = (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    hm = _heads_major_like
    check_inputs(hm(qh), hm(kh), hm(vh), *masks)
    cfg = make_config(
        _heads_major_like(qh), _heads_major_like(kh), q_segment_ids, causal=causal,
        window=window, scale=scale, block_q=block_q, block_k=block_k, interpret=interpret,
        max_live_blocks=max_live_blocks, block_k_compute=block_k_compute,
        softcap=softcap, chunk=chunk,
    )  # fmt: skip
    return flash_forward_heads_major(cfg, qh, kh, vh, *masks)


def pallas_flash_forward(
    q: Query,
    k: Key,
    v: Value,
    q_positions: Positions,
    kv_positions: KvPositions,
    q_segment_ids: SegmentIds | None = None,
    kv_segment_ids: KvSegmentIds | None = None,
    *,
    causal: bool,
    window: int | None = None,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    interpret=None,
    max_live_blocks: int | None = None,
    block_k_compute: int | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
) -> tuple[AttnOut, LogSumExp]:
    """Flash-attention forward (Pallas TPU kernel) with masks from positions and segments.

    A query sees a key iff `(not causal or q_pos >= kv_pos)` and `(window is None or
    q_pos - kv_pos < window)` and `(chunk is None or q_pos // chunk == kv_pos // chunk)`
    and `(no segments or q_seg == kv_seg)`. Positions are any token indices (zig-zag or
    striped layouts, ring hops), not necessarily `0..n-1`.
    FlashAttention-2 (arXiv:2307.08691) online softmax with float32 accumulation.

    **Arguments:**

    - `q`: `[batch, seq, q_heads, head_dim]`, float32 or bfloat16.
    - `k`, `v`: `[batch, kv_seq, kv_heads, head_dim]` and `[..., v_head_dim]`, same dtype;
      `q_heads` a multiple of `kv_heads` (GQA/MQA read K/V heads by index, never repeated).
    - `q_positions`, `kv_positions`: `[batch, seq]` / `[batch, kv_seq]` ints.
    - `q_segment_ids`, `kv_segment_ids`: `[batch, seq]` / `[batch, kv_seq]` ints, or both
      `None`. Ids must be above `-2**31 + 1` (the two lowest values mark padding).
    - `causal`: the `q_pos >= kv_pos` rule.
    - `window`: positive sliding window (needs `causal=True`), or `None`.
    - `scale`: score scale; default `head_dim ** -0.5`.
    - `block_q`, `block_k`: block lengths, positive multiples of 128; default per TPU
      generation (`default_block_sizes`). Shorter sequences use one block.
    - `interpret`: `None` (compiled on TPU, `interpret=True` elsewhere), a bool, or
      `pltpu.InterpretParams` (see `race_detecting_interpret`).
    - `max_live_blocks`: optional static bound on the non-empty partner blocks of any block
      (key blocks per query block, query blocks per key block). The sequential grid axes
      then take that many steps instead of one per block, as splash attention shrinks its
      grid. `None` with a `window` takes the window's bound for positions in order
      (`window_live_blocks`, about `window / block_k + 2`). If some block has more
      non-empty partners, the call runs the whole grid instead (decided at run time), so a
      bound costs time when wrong, never a wrong number.
    - `block_k_compute`: the key sub-block each grid step walks its key block in (a
      multiple of 128 that divides `block_k`), which sizes the score temporaries in VMEM;
      default the largest that keeps every kernel within the VMEM budget (`_vmem`).
    - `softcap`: scaled scores `x` become `softcap * tanh(x / softcap)` (in float32, before
      the mask and the softmax; Gemma 2), or `None`.
    - `chunk`: chunked attention (Llama 4; needs `causal=True`), or `None`. Key blocks in
      no chunk of a query block are skipped like the window's, and `max_live_blocks`
      defaults to the bound of a window of `chunk` tokens.

    **Returns:** `(out, lse)`: `out` `[batch, seq, q_heads, v_head_dim]` in `q`'s dtype and
    the float32 logsumexp of the scaled scores `[batch, seq, q_heads]`. Rows that see no key
    get `out = 0`, `lse = -inf`; a NaN on a visible pair makes its row NaN.

    **Raises:** `ValueError` (eagerly, naming the rule) for shapes that do not fit together
    (ranks, batch, head_dim, `q_heads` not a multiple of `kv_heads`), mixed or non-float
    dtypes, positions or segment ids of the wrong shape, only one of the segment ids,
    `block_q` / `block_k` not positive multiples of 128, a `window` or `chunk` that is not
    a positive int or comes without `causal`, a `softcap` that is not a finite number > 0,
    a `max_live_blocks` that is not a positive int, a `block_k_compute` that is not a
    multiple of 128 dividing `block_k`, or blocks whose kernels would not fit in the VMEM
    budget.
    """
    masks = (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    check_inputs(q, k, v, *masks)
    cfg = make_config(q, k, q_segment_ids, causal=causal, window=window, scale=scale,
                      block_q=block_q, block_k=block_k, interpret=interpret,
                      max_live_blocks=max_live_blocks,
                      block_k_compute=block_k_compute, softcap=softcap,
                      chunk=chunk)  # fmt: skip
    qs = query_side(cfg, to_seq_major(q), q_positions, q_segment_ids)
    kvs = kv_side(cfg, k, v, kv_positions, kv_segment_ids, heads_major=False)
    out, lse = forward_sides(cfg, qs, kvs)
    return to_seq_major(out), to_seq_major(lse)
