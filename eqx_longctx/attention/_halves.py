"""Zig-zag's causal halves: one attention call split where the layout hides a quarter of it.

Under the zig-zag layout over `N` shards, shard `j` holds chunks `j` and `2N-1-j` of `2N`,
so the first half of every shard lies before the sequence's midpoint (*early* tokens) and
the second half after it (*late* ones). Positions follow the layout (the dispatcher builds
them with `layout_order`), so under a causal mask no early query sees a late key: the
early queries attend to the early keys alone and the late queries to every key, two calls
of `block_attention` that compute 3/4 of the (query, key) pairs, exactly.

The blockwise XLA path skips the same pairs by itself once its tiles are aligned with the
chunks (`_tiling_policy.block_size`), which chunks shorter than `MIN_ALIGNED_BLOCK` tokens
are not: one tile then covers every query of a device, and smaller tiles cost more per
block than they skip. There (`_tiling_policy.zigzag_halves`) all-gather and Ulysses call
`zigzag_attention`, which splits for implementations that ask for it
(`AbstractBlockImpl.splits_zigzag_halves`: the XLA path, not the Pallas kernels, which pad
each call's queries to 128 rows). A `PlatformChoice` of two implementations chooses per platform at
lowering, so a TPU program lowered on another host keeps one kernel call.
"""

import functools
from typing import Any

import jax.numpy as jnp
from jax import lax

from ._block import BlockImpl, BlockOptions, PlatformChoice, block_attention


def half(x: Any, shards: int, which: int) -> Any:
    """The first (`which=0`) or second half of each of the `shards` equal shards of `x`'s
    sequence axis (axis 1), in shard order (a JAX or NumPy array); `None` stays `None`."""
    if x is None:
        return None
    b, s = x.shape[:2]
    if shards == 1:  # a slice, not a gather
        return x[:, which * (s // 2) : (which + 1) * (s // 2)]
    split = x.reshape(b, shards, 2, s // (2 * shards), *x.shape[2:])
    return split[:, :, which].reshape(b, s // 2, *x.shape[2:])


def join(early, late, shards: int):
    """The inverse of `half`: the sequence whose shards' halves are `early` and `late`."""
    b, s = early.shape[0], 2 * early.shape[1]
    parts = [x.reshape(b, shards, 1, s // (2 * shards), *x.shape[2:]) for x in (early, late)]
    return jnp.concatenate(parts, axis=2).reshape(b, s, *early.shape[2:])


def zigzag_attention(
    impl: BlockImpl,
    q,
    k,
    v,
    q_pos,
    kv_pos,
    q_seg,
    kv_seg,
    options: BlockOptions,
    *,
    q_shards: int,
    kv_shards: int,
):
    """`block_attention(impl, q, k, v, ...)` for a call whose queries are `q_shards` whole
    zig-zag shards and whose keys are `kv_shards` (all-gather: 1 and `N`; Ulysses: `N` and
    `N`), split into its causal halves where `impl` asks for it.

    **Returns:** `(out, lse)`, `[batch, q_seq, heads, v_head_dim]` and float32 `[batch,
    q_seq, heads]`, in `q`'s order.
    """
    ids = () if q_seg is None else (q_seg, kv_seg)
    args = (q, k, v, q_pos, kv_pos, *ids)
    side = lambda impl: functools.partial(_attend, impl, options, q_shards, kv_shards)  # noqa: E731
    if isinstance(impl, PlatformChoice):  # both sides stay differentiable functions
        return lax.platform_dependent(*args, tpu=side(impl.tpu), default=side(impl.default))
    return side(impl)(*args)


def _attend(impl, options, q_shards, kv_shards, q, k, v, q_pos, kv_pos, q_seg=None, kv_seg=None):
    """One implementation's side of `zigzag_attention`: the halves, or the call whole."""
    if not (impl.splits_zigzag_halves and options.causal):
        return block_attention(impl, q, k, v, q_pos, kv_pos, q_seg, kv_seg, options)
    early_k, early_v, early_pos, early_seg = (half(x, kv_shards, 0) for x in (k, v, kv_pos, kv_seg))
    qa, qa_pos, qa_seg, qb, qb_pos, qb_seg = (
        half(x, q_shards, i) for i in (0, 1) for x in (q, q_pos, q_seg)
    )
    out_a, lse_a = block_attention(
        impl, qa, early_k, early_v, qa_pos, early_pos, qa_seg, early_seg, options
    )
    out_b, lse_b = block_attention(impl, qb, k, v, qb_pos, kv_pos, qb_seg, kv_seg, options)
    return join(out_a, out_b, q_shards), join(lse_a, lse_b, q_shards)
