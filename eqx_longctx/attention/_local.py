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
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

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

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512
# Padded query rows and padded keys get segment ids that match nothing real.
_PAD_Q_SEGMENT = -2
_PAD_KV_SEGMENT = -1


class _Config(NamedTuple):
    causal: bool
    scale: float
    use_segments: bool


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
    scale: float | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
) -> tuple[AttnOut, LogSumExp]:
    """Attention of `q` over `k`/`v` with masks computed from positions and segment ids.

    The causal rule is `q_position >= kv_position`; the segment rule is
    `q_segment == kv_segment`. Positions are token indices in the original sequence, so the
    same function serves any token layout and any ring step. Key blocks that no query of a
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
    - `causal`, `scale`: as in `attention`.
    - `block_q`, `block_k`: tile sizes.

    **Returns:** `(out, lse)`: out `[batch, seq, q_heads, v_head_dim]` in `q`'s dtype and
    the float32 logsumexp of the scaled scores `[batch, seq, q_heads]`. Rows that see no
    key get `out = 0` and `lse = -inf`.
    """
    b, sq, hq, d = q.shape
    _, sk, hk, _ = k.shape
    dv = v.shape[-1]
    g = hq // hk
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(
            "flash_attention needs q_segment_ids and kv_segment_ids together (or neither); "
            f"got q_segment_ids={'None' if q_segment_ids is None else 'array'} and "
            f"kv_segment_ids={'None' if kv_segment_ids is None else 'array'}."
        )
    if scale is None:
        scale = 1.0 / float(np.sqrt(d))
    bq = min(block_q, sq)
    bk = min(block_k, sk)
    nq = -(-sq // bq)
    nk = -(-sk // bk)
    pad_q = nq * bq - sq
    pad_k = nk * bk - sk

    if q_positions is None:
        q_positions = jnp.broadcast_to(jnp.arange(sq, dtype=jnp.int32), (b, sq))
    if kv_positions is None:
        kv_positions = jnp.broadcast_to(jnp.arange(sk, dtype=jnp.int32), (b, sk))
    use_segments = q_segment_ids is not None or pad_k > 0
    if use_segments:
        if q_segment_ids is None:
            q_segment_ids = jnp.zeros((b, sq), jnp.int32)
            kv_segment_ids = jnp.zeros((b, sk), jnp.int32)
        q_seg = _pad_seq(q_segment_ids.astype(jnp.int32), pad_q, _PAD_Q_SEGMENT)
        kv_seg = _pad_seq(kv_segment_ids.astype(jnp.int32), pad_k, _PAD_KV_SEGMENT)
        q_seg = q_seg.reshape(b, nq, bq).transpose(1, 0, 2)
        kv_seg = kv_seg.reshape(b, nk, bk).transpose(1, 0, 2)
    else:
        q_seg = kv_seg = None
    q_pos = _pad_seq(q_positions.astype(jnp.int32), pad_q, 0)
    kv_pos = _pad_seq(kv_positions.astype(jnp.int32), pad_k, 0)
    q_pos = q_pos.reshape(b, nq, bq).transpose(1, 0, 2)
    kv_pos = kv_pos.reshape(b, nk, bk).transpose(1, 0, 2)

    # [b, s, h, d] -> [n, b, k, g, block, d]: heads of one GQA group share a K/V head.
    qb = _pad_seq(q, pad_q, 0).reshape(b, nq, bq, hk, g, d).transpose(1, 0, 3, 4, 2, 5)
    kb = _pad_seq(k, pad_k, 0).reshape(b, nk, bk, hk, d).transpose(1, 0, 3, 2, 4)
    vb = _pad_seq(v, pad_k, 0).reshape(b, nk, bk, hk, dv).transpose(1, 0, 3, 2, 4)

    config = _Config(causal=bool(causal), scale=float(scale), use_segments=use_segments)
    ob, lseb = _flash(config, qb, kb, vb, q_pos, kv_pos, q_seg, kv_seg)

    out = ob.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * bq, hq, dv)[:, :sq]
    lse = lseb.transpose(1, 0, 4, 2, 3).reshape(b, nq * bq, hq)[:, :sq]
    return out.astype(q.dtype), lse


def _pad_seq(x, pad: int, value):
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _block_mask(config: _Config, q_pos, kv_pos, q_seg, kv_seg):
    """Visibility `[b, 1, 1, bq, bk]` of one query block against one key block."""
    mask = None
    if config.causal:
        mask = q_pos[:, :, None] >= kv_pos[:, None, :]
    if config.use_segments:
        same = q_seg[:, :, None] == kv_seg[:, None, :]
        mask = same if mask is None else mask & same
    return None if mask is None else mask[:, None, None]


def _block_is_empty(config: _Config, q_pos, kv_pos, q_seg, kv_seg):
    """True when no query of the block sees any key of the block, for every batch row."""
    empty = jnp.zeros(q_pos.shape[:1], bool)
    if config.causal:
        empty = empty | (q_pos.max(-1) < kv_pos.min(-1))
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
                pv = jnp.einsum(
                    "bkgst,bktv->bkgsv",
                    p.astype(vb.dtype),
                    vb[j],
                    preferred_element_type=jnp.float32,
                )
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
        seen = row_sum > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, row_sum, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, row_sum, 1.0)), -jnp.inf)
        return out.astype(qb.dtype), lse

    q_seg_blocks = q_seg if q_seg is not None else jnp.zeros(q_pos.shape, jnp.int32)
    return lax.map(one_q_block, (qb, q_pos, q_seg_blocks))


def _flash_fwd(config, qb, kb, vb, q_pos, kv_pos, q_seg, kv_seg):
    out, lse = _flash_fwd_impl(config, qb, kb, vb, q_pos, kv_pos, q_seg, kv_seg)
    return (out, lse), (qb, kb, vb, q_pos, kv_pos, q_seg, kv_seg, out, lse)


def _flash_bwd(config, residuals, cotangents):
    qb, kb, vb, q_pos, kv_pos, q_seg, kv_seg, out, lse = residuals
    dout, dlse = cotangents
    nq = qb.shape[0]
    # d(loss)/d(score) = p * (dp - delta) with delta = rowsum(dout * out) - dlse.
    delta = jnp.einsum(
        "nbkgsv,nbkgsv->nbkgs",
        dout.astype(jnp.float32),
        out.astype(jnp.float32),
    ) - dlse.astype(jnp.float32)
    lse_safe = jnp.where(lse == -jnp.inf, 0.0, lse)
    dout = dout.astype(qb.dtype)

    def one_kv_block(dq, args):
        kj, vj, kpj, ksj = args

        def q_step(i, carry):
            def compute(carry):
                dk, dv, dq = carry
                qsi = None if q_seg is None else q_seg[i]
                mask = _block_mask(config, q_pos[i], kpj, qsi, ksj)
                s = _scores(config, qb[i], kj, mask)
                p = jnp.exp(s - lse_safe[i][..., None])
                if mask is not None:
                    p = jnp.where(mask, p, 0.0)
                dv = dv + jnp.einsum(
                    "bkgst,bkgsv->bktv",
                    p.astype(vj.dtype),
                    dout[i],
                    preferred_element_type=jnp.float32,
                )
                dp = jnp.einsum(
                    "bkgsv,bktv->bkgst", dout[i], vj, preferred_element_type=jnp.float32
                )
                ds = (p * (dp - delta[i][..., None]) * config.scale).astype(qb.dtype)
                dq_i = jnp.einsum("bkgst,bktd->bkgsd", ds, kj, preferred_element_type=jnp.float32)
                dk = dk + jnp.einsum(
                    "bkgst,bkgsd->bktd", ds, qb[i], preferred_element_type=jnp.float32
                )
                dq = dq.at[i].add(dq_i)
                return dk, dv, dq

            qsi = None if q_seg is None else q_seg[i]
            empty = _block_is_empty(config, q_pos[i], kpj, qsi, ksj)
            return lax.cond(empty, lambda c: c, compute, carry)

        init = (
            jnp.zeros(kj.shape, jnp.float32),
            jnp.zeros(vj.shape, jnp.float32),
            dq,
        )
        dk, dv, dq = lax.fori_loop(0, nq, q_step, init)
        return dq, (dk.astype(kj.dtype), dv.astype(vj.dtype))

    kv_seg_blocks = kv_seg if kv_seg is not None else jnp.zeros(kv_pos.shape, jnp.int32)
    dq0 = jnp.zeros(qb.shape, jnp.float32)
    dq, (dk, dv) = lax.scan(one_kv_block, dq0, (kb, vb, kv_pos, kv_seg_blocks))
    return dq.astype(qb.dtype), dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
