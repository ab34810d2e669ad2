"""All-gather context parallelism: gather K/V over the context axis, attend locally.

Each device keeps its own queries and gathers every key and value (with their positions and
segment ids), so its attention sees the whole sequence; the causal mask comes from the
gathered token positions, so any layout works. Memory grows with the full sequence length
(the gathered K/V), communication is one all-gather of K and V per layer (Llama 3
training, Dubey et al. 2024, arXiv:2407.21783, uses this for its long-context stage).
With a causal zig-zag layout of short chunks the local attention is split into its causal
halves (`_halves.py`), which skips the quarter of the scores no query sees.
"""

import jax
from jax import lax

from .._types import AxisName
from ._block import BlockImpl, BlockOptions, block_attention
from ._halves import zigzag_attention


def all_gather_latent_attention(
    q,
    source,
    expand,
    params,
    positions,
    segment_ids,
    *,
    axis: AxisName,
    impl: BlockImpl,
    options: BlockOptions,
    halves: bool = False,
):
    """Gather a K/V *source* (K/V themselves, or MLA's latent) and expand it locally.

    `expand(params, source) -> (k, v)` runs on the gathered source, so only the source
    crosses the wire; autodiff sends its gradient back with a reduce-scatter. The local
    attention is `impl`'s (`_block.block_attention`), split into zig-zag's causal halves
    when `halves` (`_halves.zigzag_attention`, `_tiling_policy.zigzag_halves`).

    **Returns:** `(out, lse)` of this device's queries.
    """
    gather = lambda x: lax.all_gather(x, axis, axis=1, tiled=True)  # noqa: E731
    k, v = expand(params, jax.tree.map(gather, source))
    kv_segments = None if segment_ids is None else gather(segment_ids)
    args = (q, k, v, positions, gather(positions), segment_ids, kv_segments, options)
    if halves:  # this device's queries are one zig-zag shard, the keys all of them
        return zigzag_attention(impl, *args, q_shards=1, kv_shards=lax.axis_size(axis))
    return block_attention(impl, *args)
