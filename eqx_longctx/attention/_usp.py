"""USP: Ulysses over one mesh axis, ring over another.

Fang & Zhao 2024, "USP: A Unified Sequence Parallelism Approach for Long Context Generative
AI" (arXiv:2405.07719). The all-to-all (fast, within a node) cuts the heads by the Ulysses
degree; the ring (P2P, across nodes) then splits the remaining sequence. The context
parallel degree is the product of the two axis sizes.
"""

import functools

from ._block import BlockImpl, BlockOptions
from ._ring import ring_attention
from ._ulysses import ulysses_attention


def usp_attention(
    q,
    k,
    v,
    positions,
    segment_ids,
    *,
    ulysses_axis: str,
    ring_axis: str,
    impl: BlockImpl,
    options: BlockOptions,
    hops: int | None = None,
):
    """Ulysses all-to-all over `ulysses_axis` around a ring over `ring_axis`."""
    ring = functools.partial(ring_attention, axis=ring_axis, impl=impl, options=options, hops=hops)
    return ulysses_attention(
        q, k, v, positions, segment_ids, axis=ulysses_axis, impl=impl, options=options, inner=ring
    )
