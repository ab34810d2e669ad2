"""`pallas_flash_attention`: the differentiable Pallas flash attention (custom VJP).

The public wrapper validates; the private `jax.custom_vjp` behind it trusts its inputs and
runs the forward kernel, then the dQ and dK/dV kernels with
`delta = rowsum(dout * out) - dlse`, so the logsumexp output is differentiable too (callers
that merge partial results through their logsumexp, like ring attention, rely on it). The
XLA twin with the same contract is `eqx_longctx.attention._local.flash_attention`.
"""

import functools

import jax
import jax.numpy as jnp

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
from ._blocks import Config, check_inputs, make_config
from ._flash_pallas import flash_forward_heads_major, to_seq_major
from ._flash_pallas_bwd import flash_backward_heads_major


def pallas_flash_attention(
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
) -> tuple[AttnOut, LogSumExp]:
    """Differentiable flash attention on Pallas TPU kernels (FlashAttention-2,
    arXiv:2307.08691): `pallas_flash_forward` with a backward through
    `pallas_flash_backward` that honours the cotangent of `lse` as well as of `out`.

    **Arguments:** as `pallas_flash_forward`.

    **Returns:** `(out, lse)` as `pallas_flash_forward`; gradients flow to `q`, `k`, `v`.

    **Raises:** as `pallas_flash_forward`.
    """
    masks = (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    check_inputs(q, k, v, *masks)
    cfg = make_config(q, k, q_segment_ids, causal=causal, window=window, scale=scale,
                      block_q=block_q, block_k=block_k, interpret=interpret,
                      max_live_blocks=max_live_blocks)  # fmt: skip
    t = to_seq_major
    out, lse = _attention(  # pyright: ignore[reportGeneralTypeIssues]  (custom_vjp typing)
        cfg, t(q), t(k), t(v), *masks
    )
    return to_seq_major(out), to_seq_major(lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg: Config, qh, kh, vh, q_pos, kv_pos, q_seg, kv_seg):
    return flash_forward_heads_major(cfg, qh, kh, vh, q_pos, kv_pos, q_seg, kv_seg)


def _attention_fwd(cfg: Config, qh, kh, vh, q_pos, kv_pos, q_seg, kv_seg):
    out, lse = flash_forward_heads_major(cfg, qh, kh, vh, q_pos, kv_pos, q_seg, kv_seg)
    return (out, lse), (qh, kh, vh, q_pos, kv_pos, q_seg, kv_seg, out, lse)


def _attention_bwd(cfg: Config, residuals, cotangents):
    qh, kh, vh, q_pos, kv_pos, q_seg, kv_seg, out, lse = residuals
    dout, dlse = cotangents
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    delta = delta - dlse.astype(jnp.float32)
    dq, dk, dv = flash_backward_heads_major(
        cfg, qh, kh, vh, q_pos, kv_pos, q_seg, kv_seg, dout, lse, delta
    )
    return dq.astype(qh.dtype), dk.astype(kh.dtype), dv.astype(vh.dtype), None, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
