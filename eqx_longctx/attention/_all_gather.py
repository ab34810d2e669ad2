"""All-gather context parallelism: gather K/V over the context axis, attend locally.

Each device keeps its own queries and gathers every key and value (with their positions and
segment ids), so its attention sees the whole sequence; the causal mask comes from the
gathered token positions, so any layout works. Memory grows with the full sequence length
(the gathered K/V), communication is one all-gather of K and V per layer (Llama 3
training, Dubey et al. 2024, arXiv:2407.21783, uses this for its long-context stage).
"""

from jax import lax

from .._types import AxisName
from ._local import flash_attention


def all_gather_attention(q, k, v, positions, segment_ids, *, axis: AxisName, causal: bool, scale):
    """Attention for the local query shard against K/V gathered over `axis`."""
    gather = lambda x: lax.all_gather(x, axis, axis=1, tiled=True)  # noqa: E731
    kv_segments = None if segment_ids is None else gather(segment_ids)
    out, _ = flash_attention(
        q,
        gather(k),
        gather(v),
        q_positions=positions,
        kv_positions=gather(positions),
        q_segment_ids=segment_ids,
        kv_segment_ids=kv_segments,
        causal=causal,
        scale=scale,
    )
    return out
