"""Blockwise (flash) attention in XLA: online softmax forward, recomputing backward.

This is the block function every context-parallel strategy builds on: it attends a query
block to a key/value block given their token positions and segment ids, and returns
`(out, logsumexp)` so partial results from different key blocks can be merged.

Einsum letters: `b` batch, `k` kv heads, `g` query heads per kv head, `s` query tokens,
`t` key tokens, `d` head dim, `v` value head dim, `n` block index.

References: Dao et al. 2022, "FlashAttention" (arXiv:2205.14135); Dao 2023,
"FlashAttention-2" (arXiv:2307.08691).
"""

import functools
from typing import no_type_check

import jax
import jax.numpy as jnp
from jax import lax

from .._checks import check_int
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
from ._tiles import (
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_Q,
    TILE_BYTES,
    QueryTiles,
    _Blocks,
    _Config,
    _dq_from_transposed,
    _map_head_tiles,
    _zeros_dq_transposed,
)
from ._validate import (
    as_float_arrays,
    as_ids,
    check_attention_inputs,
    check_options,
    check_token_array,
)


@no_type_check  # validated eagerly, with errors that say what to fix
def flash_attention(
    q: Query,
    k: Key,
    v: Value,
    *,
    q_positions: Positions | None = None,
    kv_positions: KvPositions | None = None,
    q_segment_ids: SegmentIds | None = None,
    kv_segment_ids: KvSegmentIds | None = None,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    tile_bytes: int = TILE_BYTES,
) -> tuple[AttnOut, LogSumExp]:
    """Attention of `q` over `k`/`v` with masks computed from positions and segment ids.

    The causal rule is `q_position >= kv_position`, the window rule
    `q_position - kv_position < window`, the segment rule `q_segment == kv_segment`.
    Positions are token indices in the original sequence, so the same function serves any
    token layout and any ring step. Key blocks that no query of a
    query block can see are skipped. Differentiable in `q`, `k`, `v` through a custom
    backward that recomputes scores blockwise (no `seq x seq` residuals); the cotangent of
    the logsumexp is honoured too, which lets callers merge partial results under autodiff.

    **Arguments:**

    - `q`: `[batch, seq, q_heads, head_dim]`.
    - `k`, `v`: `[batch, kv_seq, kv_heads, head_dim]` and `[..., v_head_dim]`.
    - `q_positions`, `kv_positions`: `[batch, seq]` / `[batch, kv_seq]` ints; default
      `0..seq-1` and `0..kv_seq-1`.
    - `q_segment_ids`, `kv_segment_ids`: `[batch, seq]` / `[batch, kv_seq]` ints, or `None`
      (both or neither).
    - `causal`, `window`, `scale`: as in `attention`.
    - `block_q`, `block_k`: tile sizes.
    - `tile_bytes`: bytes one block of float32 scores may take; heads are tiled to fit.

    **Returns:** `(out, lse)`: out `[batch, seq, q_heads, v_head_dim]` in `q`'s dtype and
    the float32 logsumexp of the scaled scores `[batch, seq, q_heads]`. Rows that see no
    key get `out = 0` and `lse = -inf`.
    """
    q, k, v, masks = _check_flash_inputs(
        q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, causal, window,
        scale, block_q, block_k, tile_bytes,
    )  # fmt: skip
    blocks = _Blocks.make(q, k, *masks, block_q, block_k, tile_bytes)
    config = blocks.config(causal, scale, q.shape[-1], window)
    ob, lseb = _flash(  # pyright: ignore[reportGeneralTypeIssues]  (custom_vjp typing)
        config, blocks.split_q(q), blocks.split_kv(k), blocks.split_kv(v), *blocks.masks
    )
    return blocks.merge_q(ob).astype(q.dtype), blocks.merge_rows(lseb)


def _check_flash_inputs(
    q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, causal, window, scale,
    block_q, block_k, tile_bytes,
):  # fmt: skip
    """`flash_attention`'s eager checks; **returns** `(q, k, v, masks)` as JAX arrays."""
    where = "flash_attention"
    check_options(where, None, causal, scale, window)
    for name, value in (("block_q", block_q), ("block_k", block_k), ("tile_bytes", tile_bytes)):
        check_int(value, name, minimum=1, where=where)
    q, k, v = as_float_arrays(where, q=q, k=k, v=v)
    check_attention_inputs(q, k, v, None, self_attention=False)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(
            "flash_attention needs q_segment_ids and kv_segment_ids together (or neither); "
            f"got q_segment_ids={'None' if q_segment_ids is None else 'array'} and "
            f"kv_segment_ids={'None' if kv_segment_ids is None else 'array'}."
        )
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    masks = []
    for name, x, seq in (
        ("q_positions", q_positions, sq),
        ("kv_positions", kv_positions, sk),
        ("q_segment_ids", q_segment_ids, sq),
        ("kv_segment_ids", kv_segment_ids, sk),
    ):
        x = as_ids(x, name)
        if x is not None:
            check_token_array(x, name, (b, seq))
        masks.append(x)
    return q, k, v, tuple(masks)


def flash_attention_backward(
    q: Query,
    k: Key,
    v: Value,
    dout: AttnOut,
    lse: LogSumExp,
    delta: LogSumExp,
    *,
    q_positions: Positions | None = None,
    kv_positions: KvPositions | None = None,
    q_segment_ids: SegmentIds | None = None,
    kv_segment_ids: KvSegmentIds | None = None,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    tile_bytes: int = TILE_BYTES,
):
    """Gradients of one query block against one key block, given the row statistics.

    With `lse` the logsumexp of a query row over *all* keys it attends (possibly spread over
    several key blocks, as in ring attention) and `delta = rowsum(dout * out) - dlse`, the
    probabilities `exp(s - lse)` restricted to this key block are exact, so the returned
    `dk`, `dv` are this block's full contribution and `dq` its share of the query gradient.

    **Returns:** `(dq, dk, dv)` in float32.
    """
    masks = (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    blocks = _Blocks.make(q, k, *masks, block_q, block_k, tile_bytes)
    config = blocks.config(causal, scale, q.shape[-1], window)
    qb = blocks.split_q(q)
    dq_t, dkb, dvb = _backward_blocks(
        config,
        qb,
        blocks.split_kv(k),
        blocks.split_kv(v),
        *blocks.masks,
        blocks.split_q(dout.astype(q.dtype)),
        blocks.split_rows(lse),
        blocks.split_rows(delta),
        _zeros_dq_transposed(qb),
    )
    dqb = _dq_from_transposed(dq_t)
    return blocks.merge_q(dqb), blocks.merge_kv(dkb), blocks.merge_kv(dvb)


def attend_tiles(qt: QueryTiles, k, v, kv_positions, kv_segment_ids):
    """`flash_attention` of the tiled queries against one K/V block: block-major
    `(out, lse)` (`qt.merge_q`, `qt.merge_rows` give the usual layouts)."""
    blocks, config = qt.hop(k, kv_positions, kv_segment_ids)
    kb, vb = blocks.split_kv(k), blocks.split_kv(v)
    return _flash_fwd_impl(config, qt.qb, kb, vb, *blocks.masks)


def attend_tiles_backward(qt: QueryTiles, k, v, kv_positions, kv_segment_ids, dout, lse, delta, dq):
    """`flash_attention_backward` of the tiled queries against one K/V block, with `dout`,
    `lse`, `delta` block-major (`qt.split_q`, `qt.split_rows`); adds the query gradient to the
    accumulator `dq` (`qt.zeros_dq`).

    **Returns:** `(dq, dk, dv)`: the accumulator, and float32 `dk`, `dv` of this block.
    """
    blocks, config = qt.hop(k, kv_positions, kv_segment_ids)
    kb, vb = blocks.split_kv(k), blocks.split_kv(v)
    dq, dkb, dvb = _backward_blocks(
        config, qt.qb, kb, vb, *blocks.masks, dout.astype(qt.qb.dtype), lse, delta, dq
    )
    return dq, blocks.merge_kv(dkb), blocks.merge_kv(dvb)


def _block_mask(config: _Config, q_pos, kv_pos, q_seg, kv_seg):
    """Visibility `[b, 1, 1, bq, bk]` of one query block against one key block."""
    mask = None
    if config.causal:
        mask = q_pos[:, :, None] >= kv_pos[:, None, :]
    if config.window is not None:
        mask = mask & (q_pos[:, :, None] - kv_pos[:, None, :] < config.window)
    if config.use_segments:
        same = q_seg[:, :, None] == kv_seg[:, None, :]
        mask = same if mask is None else mask & same
    return None if mask is None else mask[:, None, None]


def _block_mask_keys_major(config: _Config, q_pos, kv_pos, q_seg, kv_seg):
    """Visibility `[b, 1, bk, 1, bq]` of one query block against one key block, keys major."""
    mask = None
    if config.causal:
        mask = q_pos[:, None, :] >= kv_pos[:, :, None]
    if config.window is not None:
        mask = mask & (q_pos[:, None, :] - kv_pos[:, :, None] < config.window)
    if config.use_segments:
        same = q_seg[:, None, :] == kv_seg[:, :, None]
        mask = same if mask is None else mask & same
    return None if mask is None else mask[:, None, :, None, :]


def _block_is_empty(config: _Config, q_pos, kv_pos, q_seg, kv_seg):
    """True when no query of the block sees any key of the block, for every batch row."""
    empty = jnp.zeros(q_pos.shape[:1], bool)
    if config.causal:
        empty = empty | (q_pos.max(-1) < kv_pos.min(-1))
    if config.window is not None:  # every key at least `window` before every query
        empty = empty | (q_pos.min(-1) - kv_pos.max(-1) >= config.window)
    if config.use_segments:
        disjoint = (q_seg.max(-1) < kv_seg.min(-1)) | (q_seg.min(-1) > kv_seg.max(-1))
        empty = empty | disjoint
    return jnp.all(empty)


def _scores(config: _Config, qi, kj, mask):
    s = jnp.einsum("bkgsd,bktd->bkgst", qi, kj, preferred_element_type=jnp.float32)
    s = s * config.scale
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    return s


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(config, qb, kb, vb, q_pos, kv_pos, q_seg, kv_seg):
    out, lse = _flash_fwd_impl(config, qb, kb, vb, q_pos, kv_pos, q_seg, kv_seg)
    return out, lse


def _flash_fwd_impl(config, qb, kb, vb, q_pos, kv_pos, q_seg, kv_seg):
    def tile(qc, kc, vc):
        return _flash_fwd_tile(config, qc, kc, vc, q_pos, kv_pos, q_seg, kv_seg)

    return _map_head_tiles(tile, qb, kb, vb)


def _flash_fwd_tile(config, qb, kb, vb, q_pos, kv_pos, q_seg, kv_seg):
    """One head tile: `qb` `[n, b, k, g, block, d]`, `kb`/`vb` `[n, b, k, block, d]`."""
    nk = kb.shape[0]
    _, b, hk, g, bq, _ = qb.shape
    dv = vb.shape[-1]

    def one_q_block(args):
        qi, qpi, qsi = args

        def kv_step(j, carry):
            def compute(carry):
                m, row_sum, acc = carry
                ksj = None if kv_seg is None else kv_seg[j]
                mask = _block_mask(config, qpi, kv_pos[j], qsi, ksj)
                s = _scores(config, qi, kb[j], mask)
                m_new = jnp.maximum(m, s.max(-1))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                p = jnp.exp(s - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                row_sum = alpha * row_sum + p.sum(-1)
                pv = lax.cond(v_finite[j], _pv, _pv_nonfinite, p.astype(vb.dtype), vb[j], mask)
                return m_new, row_sum, alpha[..., None] * acc + pv

            ksj = None if kv_seg is None else kv_seg[j]
            empty = _block_is_empty(config, qpi, kv_pos[j], qsi, ksj)
            return lax.cond(empty, lambda c: c, compute, carry)

        init = (
            jnp.full((b, hk, g, bq), -jnp.inf, jnp.float32),
            jnp.zeros((b, hk, g, bq), jnp.float32),
            jnp.zeros((b, hk, g, bq, dv), jnp.float32),
        )
        m, row_sum, acc = lax.fori_loop(0, nk, kv_step, init)
        # `row_sum == 0` (not `> 0`): a NaN row sum must give a NaN row, not an empty one.
        empty = row_sum == 0
        denom = jnp.where(empty, 1.0, row_sum)
        out = jnp.where(empty[..., None], 0.0, acc / denom[..., None])
        lse = jnp.where(empty, -jnp.inf, m + jnp.log(denom))
        return out.astype(qb.dtype), lse

    # Per key block: whether every value is finite (then the plain product runs).
    v_finite = jnp.all(jnp.isfinite(vb), axis=tuple(range(1, vb.ndim)))
    q_seg_blocks = q_seg if q_seg is not None else jnp.zeros(q_pos.shape, jnp.int32)
    return lax.map(one_q_block, (qb, q_pos, q_seg_blocks))


def _pv(p, vj, mask):
    return jnp.einsum("bkgst,bktv->bkgsv", p, vj, preferred_element_type=jnp.float32)


def _pv_nonfinite(p, vj, mask):
    """`p @ v` for a key block holding NaN or inf values: a row gets NaN where it sees one
    (as naive softmax would), and a value it does not see never reaches it (`0 * inf` in the
    plain product would poison every row of the block)."""
    ok = jnp.isfinite(vj)
    pv = _pv(p, jnp.where(ok, vj, 0).astype(vj.dtype), mask)
    seen = jnp.ones(p.shape, jnp.float32) if mask is None else jnp.broadcast_to(mask, p.shape)
    hit = jnp.einsum("bkgst,bktv->bkgsv", seen.astype(jnp.float32), (~ok).astype(jnp.float32))
    return jnp.where(hit > 0, jnp.nan, pv)


def _flash_fwd(config, qb, kb, vb, q_pos, kv_pos, q_seg, kv_seg):
    out, lse = _flash_fwd_impl(config, qb, kb, vb, q_pos, kv_pos, q_seg, kv_seg)
    return (out, lse), (qb, kb, vb, q_pos, kv_pos, q_seg, kv_seg, out, lse)


def _flash_bwd(config, residuals, cotangents):
    qb, kb, vb, q_pos, kv_pos, q_seg, kv_seg, out, lse = residuals
    dout, dlse = cotangents
    # d(loss)/d(score) = p * (dp - delta) with delta = rowsum(dout * out) - dlse.
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)
    delta = delta - dlse.astype(jnp.float32)
    dout = dout.astype(qb.dtype)
    dq_t, dk, dv = _backward_blocks(
        config, qb, kb, vb, q_pos, kv_pos, q_seg, kv_seg, dout, lse, delta, _zeros_dq_transposed(qb)
    )
    return (
        _dq_from_transposed(dq_t).astype(qb.dtype),
        dk.astype(kb.dtype),
        dv.astype(vb.dtype),
        None,
        None,
        None,
        None,
    )


def _backward_blocks(config, qb, kb, vb, q_pos, kv_pos, q_seg, kv_seg, dout, lse, delta, dq_t):
    """Blockwise gradients (float32), one head tile after another. The query gradient is
    added to `dq_t` (transposed, see `_backward_tile`) and dK/dV to the K/V head tile's
    accumulator, both in place, so no gradient is ever stacked per tile.

    **Returns:** `(dq_t, dk, dv)`, block-major.
    """
    per_kv = qb.shape[0] // kb.shape[0]

    def tile(c, dq_t):
        kc = c // per_kv
        dq_c, dk, dv = _backward_tile(
            config, qb[c], kb[kc], vb[kc], q_pos, kv_pos, q_seg, kv_seg, dout[c], lse[c],
            delta[c], dq_t[c],
        )  # fmt: skip
        return dq_c, dk, dv

    if qb.shape[0] == 1:
        return jax.tree.map(lambda x: x[None], tile(0, dq_t))

    def step(c, carry):
        dq_t, dk, dv = carry
        dq_c, dk_c, dv_c = tile(c, dq_t)
        kc = c // per_kv
        return dq_t.at[c].set(dq_c), dk.at[kc].add(dk_c), dv.at[kc].add(dv_c)

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
    return lax.fori_loop(0, qb.shape[0], step, (dq_t, zeros(kb), zeros(vb)))


def _backward_tile(config, qb, kb, vb, q_pos, kv_pos, q_seg, kv_seg, dout, lse, delta, dq_t):
    """One head tile's gradients: outer loop over key blocks, inner over query blocks.

    Scores are formed keys-major (`[.., t, g, s]`), so every product contracts a minor
    dimension with a major one and XLA needs no transposed copy of a score tile; the query
    gradient is accumulated into `dq_t`, transposed (`[n, b, k, d, g, block]`) for the same
    reason (`_dq_from_transposed` turns it around once, after every key block is done).
    """
    nq = qb.shape[0]
    lse_safe = jnp.where(lse == -jnp.inf, 0.0, lse)

    def one_kv_block(dq_t, args):
        kj, vj, kpj, ksj = args

        def q_step(i, carry):
            dk, dv, dq_t = carry
            qsi = None if q_seg is None else q_seg[i]

            def compute(dk, dv):
                mask = _block_mask_keys_major(config, q_pos[i], kpj, qsi, ksj)
                s_t = jnp.einsum("bktd,bkgsd->bktgs", kj, qb[i], preferred_element_type=jnp.float32)
                p_t = jnp.exp(s_t * config.scale - lse_safe[i][:, :, None])
                if mask is not None:
                    p_t = jnp.where(mask, p_t, 0.0)
                dv = dv + jnp.einsum(
                    "bktgs,bkgsv->bktv",
                    p_t.astype(vj.dtype),
                    dout[i],
                    preferred_element_type=jnp.float32,
                )
                dp_t = jnp.einsum(
                    "bktv,bkgsv->bktgs", vj, dout[i], preferred_element_type=jnp.float32
                )
                ds_t = p_t * (dp_t - delta[i][:, :, None]) * config.scale
                dk = dk + jnp.einsum(
                    "bktgs,bkgsd->bktd",
                    ds_t.astype(qb.dtype),
                    qb[i],
                    preferred_element_type=jnp.float32,
                )
                # In float32: XLA:CPU has no unfused bf16 x bf16 -> f32 dot for this form.
                dq_i = jnp.einsum("bktd,bktgs->bkdgs", kj.astype(jnp.float32), ds_t)
                return dk, dv, dq_i

            def skip(dk, dv):
                return dk, dv, jnp.zeros(dq_t.shape[1:], jnp.float32)

            # dq stays out of the cond: a conditional copies its operands, and dq is the
            # whole query gradient.
            empty = _block_is_empty(config, q_pos[i], kpj, qsi, ksj)
            dk, dv, dq_i = lax.cond(empty, skip, compute, dk, dv)
            return dk, dv, dq_t.at[i].add(dq_i)

        init = (jnp.zeros(kj.shape, jnp.float32), jnp.zeros(vj.shape, jnp.float32), dq_t)
        dk, dv, dq_t = lax.fori_loop(0, nq, q_step, init)
        return dq_t, (dk, dv)

    kv_seg_blocks = kv_seg if kv_seg is not None else jnp.zeros(kv_pos.shape, jnp.int32)
    dq_t, (dk, dv) = lax.scan(one_kv_block, dq_t, (kb, vb, kv_pos, kv_seg_blocks))
    return dq_t, dk, dv


_flash.defvjp(_flash_fwd, _flash_bwd)
