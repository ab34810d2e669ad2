"""The naive float32 attention oracle: materializes every score. Tests compare against it."""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._types import AttnOut

# NumPy arrays are welcome too (the oracle converts everything to float32 JAX arrays).
_Query = Float[Array | np.ndarray, "batch seq q_heads head_dim"]
_Key = Float[Array | np.ndarray, "batch kv_seq kv_heads head_dim"]
_Value = Float[Array | np.ndarray, "batch kv_seq kv_heads v_head_dim"]
_SegmentIds = Int[Array | np.ndarray, "batch seq"]


def reference_attention(
    q: _Query,
    k: _Key,
    v: _Value,
    *,
    causal: bool = True,
    window: int | None = None,
    segment_ids: _SegmentIds | None = None,
    scale: float | None = None,
) -> AttnOut:
    """Softmax attention computed the obvious way, in float32.

    Shares no code with the blockwise implementation. Rows with no visible key (possible
    only with segment ids) return zeros. A row's output depends only on the keys it sees:
    NaN or inf in its query, or in a key or value it sees, makes it non-finite; a non-finite
    value it does not see leaves it alone (`0 * inf` of a masked value is not formed).

    **Arguments:**

    - `q`: `[batch, seq, q_heads, head_dim]`.
    - `k`: `[batch, seq, kv_heads, head_dim]`; `q_heads` must be a multiple of `kv_heads`.
    - `v`: `[batch, seq, kv_heads, v_head_dim]`.
    - `causal`: query `i` sees keys `j <= i`.
    - `window`: with `causal`, query `i` sees keys `j` with `i - j < window` only.
    - `segment_ids`: `[batch, seq]` ints; query and key must share a segment.
    - `scale`: score scale, default `1/sqrt(head_dim)`.

    **Returns:** `[batch, seq, q_heads, v_head_dim]` in float32.
    """
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    b, s, hq, d = q.shape
    hk = k.shape[2]
    scale = 1.0 / float(np.sqrt(d)) if scale is None else scale
    k = jnp.repeat(k, hq // hk, axis=2)
    v = jnp.repeat(v, hq // hk, axis=2)
    scores = jnp.einsum("bshd,bthd->bhst", q, k, precision="highest") * scale
    t = k.shape[1]
    mask = jnp.ones((b, 1, s, t), bool)
    if causal:
        mask = mask & (jnp.arange(s)[:, None] >= jnp.arange(t)[None, :])
    if window is not None:
        mask = mask & (jnp.arange(s)[:, None] - jnp.arange(t)[None, :] < window)
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(denom == 0, 1.0, denom)
    finite_v = jnp.isfinite(v)
    out = jnp.einsum("bhst,bthd->bshd", probs, jnp.where(finite_v, v, 0.0), precision="highest")
    # A value entry a row sees but that is not finite: naive softmax would multiply it in
    # (NaN or inf); a masked one must not reach the row (0 * inf would).
    seen = jnp.broadcast_to(mask, scores.shape).astype(jnp.float32)
    sees_bad = jnp.einsum("bhst,bthd->bshd", seen, (~finite_v).astype(jnp.float32)) > 0
    return jnp.where(sees_bad, jnp.nan, out)
