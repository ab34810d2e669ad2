"""One attention entry point; the sharding spec picks how it runs.

With `spec=None` the sequence lives on one device and the blockwise (flash) XLA path runs.
"""

from jaxtyping import Array, Float, Int

from ._local import flash_attention as flash_attention
from ._reference import reference_attention as reference_attention
from ._validate import check_attention_inputs


def attention(
    # Shapes are checked by `check_attention_inputs`, whose errors say what to fix; the
    # docstring gives them.
    q: Float[Array, "..."],
    k: Float[Array, "..."],
    v: Float[Array, "..."],
    *,
    spec=None,
    causal: bool = True,
    segment_ids: Int[Array, "..."] | Float[Array, "..."] | None = None,
    scale: float | None = None,
) -> Float[Array, "batch seq q_heads v_head_dim"]:
    """Scaled dot-product attention over long sequences.

    Supports MHA, GQA and MQA (`q_heads` a multiple of `kv_heads`, K/V never repeated),
    `v_head_dim != head_dim`, any sequence length, float32 or bfloat16 inputs with float32
    accumulation. Memory is O(seq): scores are computed block by block with an online
    softmax, blocks the causal mask or the segment ids leave empty are skipped, and the
    backward pass recomputes scores blockwise instead of storing them.

    **Arguments:**

    - `q`: `[batch, seq, q_heads, head_dim]`.
    - `k`: `[batch, seq, kv_heads, head_dim]`.
    - `v`: `[batch, seq, kv_heads, v_head_dim]`.
    - `spec`: the sharding spec, or `None` for one device.
    - `causal`: query `i` attends keys `j <= i`.
    - `segment_ids`: `[batch, seq]` ints; tokens attend only within their own segment
      (packed documents stay isolated).
    - `scale`: score scale, default `1/sqrt(head_dim)`.

    **Returns:** `[batch, seq, q_heads, v_head_dim]` in the dtype of `q`.
    """
    check_attention_inputs(q, k, v, segment_ids)
    if spec is not None:
        raise ValueError(
            f"attention(spec=...) got {type(spec).__name__}; context-parallel strategies are "
            "not available in this build: pass spec=None to run on one device."
        )
    out, _ = flash_attention(
        q,
        k,
        v,
        q_segment_ids=segment_ids,
        kv_segment_ids=segment_ids,
        causal=causal,
        scale=scale,
    )
    return out


__all__ = ["attention", "flash_attention", "reference_attention"]
