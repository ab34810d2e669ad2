"""Flash-attention backward as two Pallas TPU kernels: dQ, then dK/dV.

Both recompute the probabilities `p = exp(scale * q k^T - lse)` from the row logsumexp and
form `ds = p * (dp - delta)` with `dp = dout v^T` and `delta = rowsum(dout * out) - dlse`
(FlashAttention-2, arXiv:2307.08691, Algorithm 2, split in two passes so neither needs
atomics):

- dQ: grid `(batch, q_heads, nq, steps)`, key blocks sequential; `dq += scale * ds k`.
- dK/dV: grid `(batch, kv_heads, nk, group, steps)`, the query heads of the GQA group and
  the query blocks sequential, accumulating into the K/V head's `dk`, `dv`. Scores are
  formed keys-major (`[block_k, block_q]`, queries in lanes), so the row statistics are
  read lane-dense and both products are plain matmuls.

`lse` and `delta` are the *global* row statistics: when this call sees only some of a row's
keys (a ring hop), `dk`, `dv` are still exact for these keys and `dq` is their share.
Empty block pairs are skipped, full pairs skip the mask, as in the forward.
"""

import functools

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
    Schedule,
    by_batch_rows,
    call_kernel,
    make_config,
    query_chunk,
    schedule,
    visible,
    with_fallback,
)
from ._checks import check_inputs
from ._flash_pallas import (
    _NN,
    _NT,
    KvSide,
    QuerySide,
    _dot,
    _heads_major_like,
    _tile_lanes,
    capped_scores,
    kv_side,
    query_side,
    side_ids,
    sub_blocks,
    to_seq_major,
)
from ._operands import (
    NUM_LANES,
    NUM_SUBLANES,
    out_struct,
    pad_axis,
    rows_to_kernel,
    vary_like,
)
from ._vmem import kernel_vmem


def _dq_kernel(kind_ref, kv_block_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               q_pos_ref, kv_pos_ref, *rest, cfg: Config, nq: int, nt: int, bc: int):  # fmt: skip
    if cfg.use_segments:
        q_seg_ref, kv_seg_ref, dq_in_ref, dq_ref = rest
    else:
        q_seg_ref = kv_seg_ref = None
        dq_in_ref, dq_ref = rest
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    kind = kind_ref[(b * nq + i) * nt + j].astype(jnp.int32)

    @pl.when(j == 0)
    def _init():  # the caller's accumulator, aliased to the output: updated in place
        dq_ref[...] = dq_in_ref[...]

    def sub_block(start, masked: bool):
        cols = pl.ds(start, bc)
        k = k_ref[cols, :]
        s, t = capped_scores(cfg, _dot(q_ref[...], k, _NT))
        p = jnp.exp(s - lse_ref[0][:, None])
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
                p = jnp.where(mask, p, 0.0)
        dp = _dot(do_ref[...], v_ref[cols, :], _NT)
        ds = p * (dp - delta_ref[0][:, None])
        if t is not None:  # d(c tanh(x / c)) / dx = 1 - tanh(x / c)^2
            ds = ds * (1.0 - t * t)
        dq = _dot(ds.astype(k.dtype), k, _NN)
        dq_ref[...] += dq * cfg.scale

    def step(masked: bool):
        sub_blocks(k_ref.shape[0] // bc, bc, lambda start: sub_block(start, masked))

    pl.when(kind == FULL)(lambda: step(False))
    pl.when(kind == PARTIAL)(lambda: step(True))


def _dkv_kernel(kind_ref, q_block_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                kv_pos_ref, q_pos_ref, *rest, cfg: Config, nk: int, nt: int, bc: int):  # fmt: skip
    if cfg.use_segments:
        kv_seg_ref, q_seg_ref, dk_ref, dv_ref = rest
    else:
        kv_seg_ref = q_seg_ref = None
        dk_ref, dv_ref = rest
    b, j, gi, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    kind = kind_ref[(b * nk + j) * nt + i].astype(jnp.int32)
    bq = q_ref.shape[0]

    @pl.when((gi == 0) & (i == 0))
    def _init():
        dk_ref[...] = jnp.zeros(dk_ref.shape, jnp.float32)
        dv_ref[...] = jnp.zeros(dv_ref.shape, jnp.float32)

    def sub_block(start, masked: bool):
        # Keys-major: the sub-block's key rows against the whole query block.
        rows = pl.ds(start, bc)
        q, do = q_ref[...], do_ref[...]
        s_t, t_t = capped_scores(cfg, _dot(k_ref[rows, :], q, _NT))
        p_t = jnp.exp(s_t - lse_ref[:1, :])
        if masked:
            mask = visible(
                cfg,
                q_pos_ref[:1, :],
                kv_pos_ref[rows, :],
                None if q_seg_ref is None else q_seg_ref[:1, :],
                None if kv_seg_ref is None else kv_seg_ref[rows, :],
                widen_kv=lambda x: _tile_lanes(x, bq),
            )
            if mask is not None:
                p_t = jnp.where(mask, p_t, 0.0)
        dv_ref[rows, :] += _dot(p_t.astype(do.dtype), do, _NN)
        dp_t = _dot(v_ref[rows, :], do, _NT)
        ds_t = p_t * (dp_t - delta_ref[:1, :])
        if t_t is not None:
            ds_t = ds_t * (1.0 - t_t * t_t)
        dk = _dot(ds_t.astype(q.dtype), q, _NN)
        dk_ref[rows, :] += dk * cfg.scale

    def step(masked: bool):
        sub_blocks(k_ref.shape[0] // bc, bc, lambda start: sub_block(start, masked))

    pl.when(kind == FULL)(lambda: step(False))
    pl.when(kind == PARTIAL)(lambda: step(True))


def backward_padded(cfg: Config, qs: QuerySide, kvs: KvSide, sched: Schedule, do, lse, delta,
                    dq_in):  # fmt: skip
    """Both backward kernels on padded sides (`do` `[b, q_heads, sq, dv]` in the inputs'
    dtype, `lse`/`delta` `[b, q_heads, 8, sq]` float32, `dq_in` `[b, q_heads, sq, d]`
    float32, all padded).

    **Returns:** float32 `(dq_in + dq, dk, dv)`, padded; `dq` heads-major (written over
    `dq_in`'s buffer), `dk`, `dv` in the layout of `kvs.k`, `kvs.v`.
    """
    qh = qs.qh
    b, hq, sq, d = qh.shape
    hk, sk, dv = kvs.k.heads, kvs.k.seq, kvs.v.dim
    bq, bk = cfg.block_q, cfg.block_k
    nq, nk, g = sq // bq, sk // bk, hq // hk
    ntk, ntq = cfg.steps(nk), cfg.steps(nq)
    bc, vmem = kernel_vmem(cfg, head_dim=d, v_head_dim=dv, itemsize=qh.dtype.itemsize)
    # Costs count the grid's steps (a bounded grid is cut; its skipped steps still count).
    pairs_q, pairs_k = b * hq * sq * ntk * bk, b * hq * ntq * bq * sk
    exps = 1 if cfg.softcap is None else 2  # exp, and tanh for the cap
    itemsize = qh.dtype.itemsize
    kv_size = kvs.k.x.size + kvs.v.x.size

    # dQ: grid (b, h, i, j).
    def kvj(bi, i, j, kvb):
        return kvb[(bi * nq + i) * ntk + j].astype(jnp.int32)

    q_spec = lambda width: pl.BlockSpec(  # noqa: E731
        (None, None, bq, width), lambda bi, h, i, j, kind, kvb: (bi, h, i, 0)
    )

    def kv_block(bi, h, i, j, kind, kvb):
        # `g` as int32 under jax_enable_x64 too (as the forward's index map).
        return bi, lax.div(h, jnp.int32(g)), kvj(bi, i, j, kvb)

    row_spec = pl.BlockSpec(
        (None, None, NUM_SUBLANES, bq), lambda bi, h, i, j, kind, kvb: (bi, h, 0, i)
    )
    q_col = pl.BlockSpec((None, bq, NUM_LANES), lambda bi, h, i, j, kind, kvb: (bi, i, 0))
    kv_row = pl.BlockSpec(
        (None, NUM_SUBLANES, bk), lambda bi, h, i, j, kind, kvb: (bi, 0, kvj(bi, i, j, kvb))
    )
    in_specs = [q_spec(d), kvs.k.spec(bk, kv_block), kvs.v.spec(bk, kv_block), q_spec(dv),
                row_spec, row_spec, q_col, kv_row]  # fmt: skip
    operands = [qh, kvs.k.x, kvs.v.x, do, lse, delta, qs.ids.pos_lanes, kvs.ids.pos_rows]
    if cfg.use_segments:
        in_specs += [q_col, kv_row]
        operands += [qs.ids.seg_lanes, kvs.ids.seg_rows]
    in_specs.append(q_spec(d))
    operands.append(vary_like(dq_in, *sched, *operands))
    build_dq = lambda interpret: pl.pallas_call(  # noqa: E731
        functools.partial(_dq_kernel, cfg=cfg, nq=nq, nt=ntk, bc=bc),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, hq, nq, ntk),
            in_specs=in_specs,
            out_specs=q_spec(d),
        ),
        out_shape=out_struct((b, hq, sq, d), jnp.float32, *sched, *operands),
        # dq_in (after the two prefetch tables) is the output's buffer.
        input_output_aliases={2 + len(operands) - 1: 0},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem,
        ),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(
            flops=2 * pairs_q * (2 * d + dv),
            transcendentals=exps * pairs_q,
            bytes_accessed=itemsize * nq * g * kv_size + 4 * 3 * qh.size,
        ),
        name="eqx_longctx_flash_bwd_dq",
    )
    dq = call_kernel(cfg.interpret, build_dq, sched.row_kind, sched.kv_block, *operands)

    # dK/dV: grid (b, kv head, j, group member, i).
    def qi(bi, j, i, qb):
        return qb[(bi * nk + j) * ntq + i].astype(jnp.int32)

    q_spec2 = lambda width: pl.BlockSpec(  # noqa: E731
        (None, None, bq, width),
        lambda bi, hki, j, gi, i, kind, qb: (bi, hki * g + gi, qi(bi, j, i, qb), 0),
    )

    def kv_block2(bi, hki, j, gi, i, kind, qb):
        return bi, hki, j

    row_spec2 = pl.BlockSpec(
        (None, None, NUM_SUBLANES, bq),
        lambda bi, hki, j, gi, i, kind, qb: (bi, hki * g + gi, 0, qi(bi, j, i, qb)),
    )
    kv_col = pl.BlockSpec((None, bk, NUM_LANES), lambda bi, hki, j, gi, i, kind, qb: (bi, j, 0))
    q_row = pl.BlockSpec(
        (None, NUM_SUBLANES, bq), lambda bi, hki, j, gi, i, kind, qb: (bi, 0, qi(bi, j, i, qb))
    )
    k_spec2, v_spec2 = kvs.k.spec(bk, kv_block2), kvs.v.spec(bk, kv_block2)
    in_specs = [q_spec2(d), k_spec2, v_spec2, q_spec2(dv), row_spec2, row_spec2, kv_col, q_row]
    operands = [qh, kvs.k.x, kvs.v.x, do, lse, delta, kvs.ids.pos_lanes, qs.ids.pos_rows]
    if cfg.use_segments:
        in_specs += [kv_col, q_row]
        operands += [kvs.ids.seg_lanes, qs.ids.seg_rows]
    build_dkv = lambda interpret: pl.pallas_call(  # noqa: E731
        functools.partial(_dkv_kernel, cfg=cfg, nk=nk, nt=ntq, bc=bc),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, hk, nk, g, ntq),
            in_specs=in_specs,
            out_specs=[k_spec2, v_spec2],  # dK, dV in the layout of K, V
        ),
        out_shape=[
            out_struct(kvs.k.out_shape(d), jnp.float32, *sched, *operands),
            out_struct(kvs.v.out_shape(dv), jnp.float32, *sched, *operands),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=vmem,
        ),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(
            flops=4 * pairs_k * (d + dv),
            transcendentals=exps * pairs_k,
            bytes_accessed=itemsize * nk * (qh.size + do.size) + 4 * kv_size,
        ),
        name="eqx_longctx_flash_bwd_dkv",
    )
    dk, dv_ = call_kernel(cfg.interpret, build_dkv, sched.col_kind, sched.q_block, *operands)
    return dq, dk, dv_


def backward_sides(cfg: Config, qs: QuerySide, kvs: KvSide, do, lse, delta, dq_in):
    """Backward of prepared sides, with `do`, `lse`, `delta`, `dq_in` padded as
    `backward_padded` takes them. **Returns:** float32 `(dq_in + dq, dk, dv)`: `dq` padded
    heads-major, `dk`, `dv` in `kvs`' layouts, padded. Batch rows go in as many calls as
    keep the schedule in SMEM, and queries in as many pieces (their dQ concatenate, their
    dK and dV add up)."""
    rows = query_chunk(cfg, qs.qh.shape[2], kvs.k.seq)
    parts = []
    for lo, part in zip(range(0, qs.qh.shape[2], rows), qs.chunks(rows), strict=True):
        piece = slice(lo, lo + rows)  # do, dq_in [b, h, s, d]; lse, delta [b, h, 8, s]
        rows_of = (do[:, :, piece], lse[..., piece], delta[..., piece], dq_in[:, :, piece])
        parts.append(by_batch_rows(cfg, functools.partial(_backward_rows, cfg),
                                   part.qh.shape[2], kvs.k.seq, part, kvs, *rows_of))  # fmt: skip
    if len(parts) == 1:
        return parts[0]
    dqs, dks, dvs = zip(*parts, strict=True)
    return jnp.concatenate(dqs, axis=2), sum(dks[1:], dks[0]), sum(dvs[1:], dvs[0])


def _backward_rows(cfg, qs, kvs, do, lse, delta, dq_in):
    ids = side_ids(qs, kvs)
    run = lambda cfg, sched: backward_padded(cfg, qs, kvs, sched, do, lse, delta, dq_in)  # noqa: E731
    return with_fallback(cfg, ids, schedule(cfg, ids), run)


def query_rows(qs: QuerySide, dout, lse, delta):
    """`dout` `[b, h, s, dv]`, `lse`, `delta` `[b, h, s]` -> padded as the kernels read
    them (`dout` in the queries' dtype)."""
    sqp = qs.qh.shape[2]
    do = pad_axis(dout.astype(qs.qh.dtype), sqp - dout.shape[2], 2, 0)
    return do, rows_to_kernel(lse, sqp), rows_to_kernel(delta, sqp)


def flash_backward_heads_major(cfg: Config, qh, kh, vh, q_positions, kv_positions,
                               q_segment_ids, kv_segment_ids, dout, lse, delta):  # fmt: skip
    """Backward on heads-major inputs with a validated `cfg`; `dout` `[b, h, s, dv]`,
    `lse`, `delta` `[b, h, s]`. **Returns:** float32 heads-major `(dq, dk, dv)`."""
    qs = query_side(cfg, qh, q_positions, q_segment_ids)
    kvs = kv_side(cfg, kh, vh, kv_positions, kv_segment_ids, heads_major=True)
    dq, dk, dv = backward_sides(cfg, qs, kvs, *query_rows(qs, dout, lse, delta),
                                jnp.zeros(qs.qh.shape, jnp.float32))  # fmt: skip
    return (dq[:, :, : qs.seq], kvs.k.result(dk, kvs.seq, heads_major=True),
            kvs.v.result(dv, kvs.seq, heads_major=True))  # fmt: skip


def pallas_flash_backward_heads_major(
    qh, kh, vh, q_positions, kv_positions, q_segment_ids, kv_segment_ids, dout, lse, delta, *,
    causal: bool, window: int | None = None, scale: float | None = None,
    block_q: int | None = None, block_k: int | None = None, interpret=None,
    max_live_blocks: int | None = None, block_k_compute: int | None = None,
    softcap: float | None = None, chunk: int | None = None,
):  # fmt: skip
    """`pallas_flash_backward` in the heads-major layout.

    **Arguments:** `qh`, `kh`, `vh` as in `pallas_flash_forward_heads_major`; `dout`
    `[batch, q_heads, seq, v_head_dim]`; `lse`, `delta` `[batch, q_heads, seq]`; positions,
    segment ids and the keywords as in `pallas_flash_forward`.

    **Returns:** float32 `(dq, dk, dv)`, heads-major.

    **Raises:** as `pallas_flash_backward`.
    """
    masks = (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    hm = _heads_major_like
    check_inputs(hm(qh), hm(kh), hm(vh), *masks)
    _check_row_shapes(_heads_major_like(qh), _heads_major_like(vh), to_seq_major(dout),
                      to_seq_major(lse), to_seq_major(delta))  # fmt: skip
    cfg = make_config(
        _heads_major_like(qh), _heads_major_like(kh), q_segment_ids, causal=causal,
        window=window, scale=scale, block_q=block_q, block_k=block_k, interpret=interpret,
        max_live_blocks=max_live_blocks, block_k_compute=block_k_compute,
        softcap=softcap, chunk=chunk,
    )  # fmt: skip
    return flash_backward_heads_major(cfg, qh, kh, vh, *masks, dout, lse, delta)


def _check_row_shapes(q, v, dout, lse, delta):
    b, sq, hq, _ = q.shape
    want = (b, sq, hq, v.shape[-1])
    if dout.shape != want or lse.shape != want[:3] or delta.shape != want[:3]:
        raise ValueError(
            f"dout must be [batch, seq, q_heads, v_head_dim]={want} and lse, delta "
            f"[batch, seq, q_heads]={want[:3]}; got dout {dout.shape}, lse {lse.shape}, "
            f"delta {delta.shape}."
        )


def pallas_flash_backward(
    q: Query,
    k: Key,
    v: Value,
    q_positions: Positions,
    kv_positions: KvPositions,
    q_segment_ids: SegmentIds | None,
    kv_segment_ids: KvSegmentIds | None,
    dout: AttnOut,
    lse: LogSumExp,
    delta: LogSumExp,
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
) -> tuple[Query, Key, Value]:
    """Flash-attention gradients of `q` against this `k`/`v` block (Pallas TPU kernels).

    With `lse` the logsumexp of each query row over *all* the keys it attends (possibly
    spread over several calls, as in ring attention) and `delta = rowsum(dout * out) - dlse`,
    the recomputed probabilities are exact, so `dk`, `dv` are this block's full gradients
    and `dq` is its share of the query gradient (sum the shares over the blocks).

    **Arguments:**

    - `q`, `k`, `v`, positions, segment ids and the keywords: as in `pallas_flash_forward`.
    - `dout`: `[batch, seq, q_heads, v_head_dim]`, the output's cotangent.
    - `lse`: `[batch, seq, q_heads]` float32, the global row logsumexp (`-inf` for rows that
      see no key).
    - `delta`: `[batch, seq, q_heads]` float32, `rowsum(dout * out) - dlse`.

    **Returns:** `(dq, dk, dv)` float32, shaped like `q`, `k`, `v`.

    **Raises:** as `pallas_flash_forward`, and `ValueError` when `dout`, `lse` or `delta`
    do not have the shapes above.
    """
    masks = (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    check_inputs(q, k, v, *masks)
    _check_row_shapes(q, v, dout, lse, delta)
    cfg = make_config(q, k, q_segment_ids, causal=causal, window=window, scale=scale,
                      block_q=block_q, block_k=block_k, interpret=interpret,
                      max_live_blocks=max_live_blocks,
                      block_k_compute=block_k_compute, softcap=softcap,
                      chunk=chunk)  # fmt: skip
    t = to_seq_major
    qs = query_side(cfg, t(q), q_positions, q_segment_ids)
    kvs = kv_side(cfg, k, v, kv_positions, kv_segment_ids, heads_major=False)
    dq, dk, dv = backward_sides(cfg, qs, kvs, *query_rows(qs, t(dout), t(lse), t(delta)),
                                jnp.zeros(qs.qh.shape, jnp.float32))  # fmt: skip
    return (t(dq[:, :, : qs.seq]), kvs.k.result(dk, kvs.seq, heads_major=False),
            kvs.v.result(dv, kvs.seq, heads_major=False))  # fmt: skip
