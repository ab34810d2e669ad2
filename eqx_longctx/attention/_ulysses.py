"""Ulysses context parallelism: all-to-all from sequence shards to head shards and back.

Jacobs et al. 2023, "DeepSpeed Ulysses" (arXiv:2309.14509). Each device trades its slice of
the sequence for a slice of the heads, runs full-sequence attention on those heads, and
trades back. Two beyond-the-paper properties:

- GQA/MQA with `kv_heads` not divisible by the Ulysses degree `N` (but `q_heads` is): each
  K/V head is repeated `r = N / gcd(kv_heads, N)` times before the all-to-all, so every
  device receives the K/V heads its query heads use (for MQA that is one head per device).
- Load-balanced layouts: token positions travel with the tokens (all-gathered), so the
  causal mask stays correct whatever order the sequence is in. With a causal zig-zag
  layout of short chunks the attention is split into its causal halves (`_halves.py`).
"""

import math

import jax.numpy as jnp
from jax import lax

from .._types import AxisName
from ._block import BlockImpl, BlockOptions, block_attention
from ._halves import zigzag_attention
from ._pack import together


def kv_repeats(kv_heads: int, degree: int) -> int:
    """How many times each K/V head is repeated so that the heads split over `degree`."""
    return degree // math.gcd(kv_heads, degree)


def ulysses_attention(
    q,
    k,
    v,
    positions,
    segment_ids,
    *,
    axis: AxisName,
    impl: BlockImpl,
    options: BlockOptions,
    inner=None,
    halves: bool = False,
):
    """Sequence-sharded in, sequence-sharded out; heads are sharded over `axis` inside.

    `inner(q, k, v, positions, segment_ids)` attends the head shard over the full sequence
    gathered over `axis` (default: `impl`'s local attention, split into zig-zag's causal
    halves when `halves`; USP passes the ring), and returns `(out, lse)`.

    **Returns:** `(out, lse)` of this device's sequence shard, all heads.
    """
    degree = lax.axis_size(axis)
    r = kv_repeats(k.shape[2], degree)
    if r > 1:
        k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
    to_heads = lambda x: lax.all_to_all(x, axis, 2, 1, tiled=True)  # noqa: E731
    gather = lambda x: lax.all_gather(x, axis, axis=1, tiled=True)  # noqa: E731
    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    positions, segment_ids = together((positions, segment_ids), gather)
    if inner is None and halves:  # the whole sequence: every zig-zag shard, both sides
        args = (q, k, v, positions, positions, segment_ids, segment_ids, options)
        out, lse = zigzag_attention(impl, *args, q_shards=degree, kv_shards=degree)
    elif inner is None:
        out, lse = block_attention(
            impl, q, k, v, positions, positions, segment_ids, segment_ids, options
        )
    else:
        out, lse = inner(q, k, v, positions, segment_ids)
    to_tokens = lambda x: lax.all_to_all(x, axis, 1, 2, tiled=True)  # noqa: E731
    return to_tokens(out), to_tokens(lse)
