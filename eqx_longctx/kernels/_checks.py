"""Input rules of the Pallas flash-attention wrappers, checked eagerly before any kernel is
built: the arrays' shapes and dtypes, and the softmax variants' options (soft-cap, chunk).
Each raises a one-line `ValueError` that names the rule, the values and the fix."""

import jax.numpy as jnp
import numpy as np


def check_inputs(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    """Shape and dtype rules shared by the forward and backward wrappers."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            "q, k, v must be [batch, seq, heads, dim]; got "
            f"q.shape={q.shape}, k.shape={k.shape}, v.shape={v.shape}."
        )
    b, sq, hq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[:3] != v.shape[:3] or k.shape[3] != d:
        raise ValueError(
            "k and v must share batch, kv_seq and kv_heads with each other, and batch and "
            f"head_dim with q; got q.shape={q.shape}, k.shape={k.shape}, v.shape={v.shape}."
        )
    hk = k.shape[2]
    if hq % hk:
        raise ValueError(
            f"q_heads must be a multiple of kv_heads (GQA/MQA); got q_heads={hq}, "
            f"kv_heads={hk}. Repeat or regroup the K/V heads."
        )
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1 or dtypes.pop() not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(
            "q, k, v must share one dtype, float32 or bfloat16; got "
            f"{q.dtype}, {k.dtype}, {v.dtype}. Cast them first."
        )
    sk = k.shape[1]
    if q_positions.shape != (b, sq) or kv_positions.shape != (b, sk):
        raise ValueError(
            f"q_positions must be [batch, seq]={(b, sq)} and kv_positions [batch, kv_seq]="
            f"{(b, sk)}; got {q_positions.shape} and {kv_positions.shape}."
        )
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(
            "q_segment_ids and kv_segment_ids go together (or both None); got "
            f"q_segment_ids={'None' if q_segment_ids is None else 'array'}, "
            f"kv_segment_ids={'None' if kv_segment_ids is None else 'array'}."
        )
    if q_segment_ids is not None and (
        q_segment_ids.shape != (b, sq) or kv_segment_ids.shape != (b, sk)
    ):
        raise ValueError(
            f"q_segment_ids must be [batch, seq]={(b, sq)} and kv_segment_ids [batch, kv_seq]="
            f"{(b, sk)}; got {q_segment_ids.shape} and {kv_segment_ids.shape}."
        )


def check_variants(causal, softcap, chunk) -> tuple[float | None, int | None]:
    """`(softcap, chunk)` as float and int. **Raises:** `ValueError` for a softcap that is
    not a finite number > 0, a chunk that is not a positive int, or a chunk without causal."""
    if softcap is not None:
        if not isinstance(softcap, int | float | np.integer | np.floating) or not (
            np.isfinite(softcap) and softcap > 0
        ):
            raise ValueError(
                "softcap must be a finite number > 0 (scaled scores x become softcap * "
                f"tanh(x / softcap)) or None; got softcap={softcap!r}."
            )
        softcap = float(softcap)
    if chunk is not None:
        if not isinstance(chunk, int | np.integer) or isinstance(chunk, bool) or chunk <= 0:
            raise ValueError(
                "chunk must be a positive int (q_pos // chunk == kv_pos // chunk is visible) "
                f"or None; got chunk={chunk!r}."
            )
        if not causal:
            raise ValueError(
                f"chunk={chunk} needs causal=True (chunked attention looks back within its "
                "chunk); got causal=False. Pass causal=True, or chunk=None."
            )
        chunk = int(chunk)
    return softcap, chunk
