"""All-gather context parallelism: gather K/V over the context axis, attend locally.

Each device keeps its own queries and gathers every key and value (with their positions and
segment ids), so its attention sees the whole sequence; the causal mask comes from the
gathered token positions, so any layout works. Memory grows with the full sequence length
(the gathered K/V), communication is one all-gather of K and V per layer (Llama 3
training, Dubey et al. 2024, arXiv:2407.21783, uses this for its long-context stage).

Float32 K, V, their positions and segment ids travel in one collective (`gather_together`:
the ids ride bitcast in float lanes). Each collective is a rendezvous of every device of
the axis; one per layer instead of four took the main job's step from 611 / 640 ms to
589 / 591 ms (8 fake CPU devices, 8x256 tokens, two alternated runs).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._types import AxisName
from ._block import AbstractBlockImpl, BlockOptions, block_attention


def all_gather_latent_attention(
    q,
    source,
    expand,
    params,
    positions,
    segment_ids,
    *,
    axis: AxisName,
    impl: AbstractBlockImpl,
    options: BlockOptions,
):
    """Gather a K/V *source* (K/V themselves, or MLA's latent) and expand it locally.

    `expand(params, source) -> (k, v)` runs on the gathered source, so only the source
    crosses the wire; autodiff sends its gradient back with a reduce-scatter. The local
    attention is `impl`'s (`_block.block_attention`).
    """
    source, kv_positions, kv_segments = gather_together((source, positions, segment_ids), axis)
    k, v = expand(params, source)
    out, _ = block_attention(
        impl, q, k, v, positions, kv_positions, segment_ids, kv_segments, options
    )
    return out


def gather_together(tree, axis: AxisName):
    """`lax.all_gather(x, axis, axis=1, tiled=True)` of every `[batch, seq, ...]` array leaf
    of `tree`, with one collective per dtype.

    Integer ids of 4 bytes ride in the lanes of float32 leaves when there are any (bitcast,
    which moves bits and never rounds them; no gradient flows through them), so float32
    K/V with their positions and segment ids take one collective. Other float dtypes get
    a collective of their own: XLA may widen a 2-byte float on the way, which would not
    keep an integer's bits. `None` leaves stay `None`; the gradient of each group is one
    reduce-scatter, as for separate gathers.
    """
    leaves, treedef = jax.tree.flatten(tree)
    has_f32 = any(x.dtype == jnp.float32 for x in leaves)

    def lane(x):
        if jnp.issubdtype(x.dtype, jnp.integer) and np.dtype(x.dtype).itemsize == 4:
            return jnp.dtype(jnp.float32 if has_f32 else jnp.int32)
        return x.dtype

    out: list = [None] * len(leaves)
    for dtype in dict.fromkeys(lane(x) for x in leaves):
        group = [i for i, x in enumerate(leaves) if lane(x) == dtype]
        parts = []
        for i in group:
            x = leaves[i]
            if x.dtype != dtype:
                x = lax.stop_gradient(lax.bitcast_convert_type(x, dtype))
            parts.append(x.reshape(x.shape[:2] + (-1,)))
        whole = lax.all_gather(
            parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1),
            axis, axis=1, tiled=True,
        )  # fmt: skip
        start = 0
        for i, part in zip(group, parts, strict=True):
            x, width = leaves[i], part.shape[-1]
            piece = whole[..., start : start + width]
            start += width
            if x.dtype != dtype:
                piece = lax.bitcast_convert_type(piece, x.dtype)
            out[i] = piece.reshape(whole.shape[:2] + x.shape[2:])
    return jax.tree.unflatten(treedef, out)
