"""`pallas_flash_attention`: the public `flash_attention` with a `PallasBlockImpl`.

No gradient rule of its own: it runs the block contract's `custom_vjp`
(`eqx_longctx/attention/_block.py`), the path every strategy takes with `impl="pallas"`.
"""

import jax

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
from ..attention._impls import flash_attention
from ._impl import PallasBlockImpl


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
    """Differentiable flash attention on the Pallas TPU kernels (FlashAttention-2,
    arXiv:2307.08691): `eqx_longctx.flash_attention(..., impl=PallasBlockImpl(...))`.

    The backward is the block contract's: `pallas_flash_backward`'s kernels given
    `delta = rowsum(dout * out) - dlse`, so the cotangent of `lse` is honoured as well as
    that of `out`.

    **Arguments:** as `pallas_flash_forward` (`interpret=None`: compiled on a TPU, Pallas'
    interpreter elsewhere).

    **Returns:** `(out, lse)` as `pallas_flash_forward`; gradients flow to `q`, `k`, `v`.

    **Raises:** as `eqx_longctx.flash_attention`, and `ValueError` as
    `pallas_flash_forward` for block lengths, `window` and `max_live_blocks`.
    """
    default = PallasBlockImpl.for_platform(jax.devices()[0].platform, interpret)
    impl = PallasBlockImpl(
        default.block_q if block_q is None else block_q,
        default.block_k if block_k is None else block_k,
        default.interpret,
        max_live_blocks,
    )
    return flash_attention(
        q, k, v, q_positions=q_positions, kv_positions=kv_positions,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, causal=causal,
        window=window, scale=scale, impl=impl,
    )  # fmt: skip
