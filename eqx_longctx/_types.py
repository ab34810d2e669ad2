"""Shape-annotated array aliases shared across the code base.

Dimension names used everywhere: `batch`, `seq` (query sequence), `kv_seq`, `q_heads`,
`kv_heads`, `head_dim`, `v_head_dim`, `embed`, `vocab`, `hidden`.
"""

from jaxtyping import Array, Float, Int

Tokens = Int[Array, "batch seq"]
SegmentIds = Int[Array, "batch seq"]
Positions = Int[Array, "batch seq"]
KvPositions = Int[Array, "batch kv_seq"]
KvSegmentIds = Int[Array, "batch kv_seq"]
Query = Float[Array, "batch seq q_heads head_dim"]
Key = Float[Array, "batch kv_seq kv_heads head_dim"]
Value = Float[Array, "batch kv_seq kv_heads v_head_dim"]
AttnOut = Float[Array, "batch seq q_heads v_head_dim"]
LogSumExp = Float[Array, "batch seq q_heads"]
Hidden = Float[Array, "batch seq embed"]
Logits = Float[Array, "batch seq vocab"]
# Any per-head activation (queries or keys) before or after RoPE.
Heads = Float[Array, "batch seq heads head_dim"]

__all__ = [
    "Array",
    "AxisName",
    "AttnOut",
    "Float",
    "Heads",
    "Hidden",
    "Int",
    "Key",
    "KvPositions",
    "KvSegmentIds",
    "LogSumExp",
    "Logits",
    "Positions",
    "Query",
    "SegmentIds",
    "Tokens",
    "Value",
]

# A mesh axis name, or several mesh axes acting as one (collectives accept both).
AxisName = str | tuple[str, ...]
