"""All-gather context parallelism: gather K/V over the context axis, attend locally.

Each device keeps its own queries and gathers every key and value (with their positions and
segment ids), so its attention sees the whole sequence; the causal mask comes from the
gathered token positions, so any layout works. Memory grows with the full sequence length
(the gathered K/V), communication is one all-gather of K and V per layer (Llama 3
training, Dubey et al. 2024, arXiv:2407.21783, uses this for its long-context stage).
"""

import jax
from jax import lax

from .._types import AxisName
from ._local import flash_attention
from ._tiles import DEFAULT_TILING, Tiling


def all_gather_latent_attention(
    q,
    source,
    expand,
    params,
    positions,
    segment_ids,
    *,
    axis: AxisName,
    causal: bool,
    scale,
    tiling: Tiling = DEFAULT_TILING,
    window: int | None = None,
):
    """Gather a K/V *source* (K/V themselves, or MLA's latent) and expand it locally.

    `expand(params, source) -> (k, v)` runs on the gathered source, so only the source
    crosses the wire; autodiff sends its gradient back with a reduce-scatter.
    """
    gather = lambda x: lax.all_gather(x, axis, axis=1, tiled=True)  # noqa: E731
    k, v = expand(params, jax.tree.map(gather, source))
    kv_segments = None if segment_ids is None else gather(segment_ids)
    out, _ = flash_attention(
        q,
        k,
        v,
        q_positions=positions,
        kv_positions=gather(positions),
        q_segment_ids=segment_ids,
        kv_segment_ids=kv_segments,
        causal=causal,
        window=window,
        scale=scale,
        **tiling.kwargs(),
    )
    return out
