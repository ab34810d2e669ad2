"""Root-mean-square layer normalisation.

Reference: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"
(arXiv:1910.07467).
"""

from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


@final
class RMSNorm(eqx.Module):
    """RMSNorm over the last axis: `x / sqrt(mean(x**2) + eps) * weight`.

    The statistics are computed in float32 whatever the input dtype; the normalised value
    is cast back to the input dtype before the weight is applied (the Hugging Face Llama
    order, so bfloat16 activations round exactly as in those checkpoints).

    With `zero_centred`, the scale is stored as its offset from one: `x / sqrt(mean(x**2)
    + eps) * (1 + weight)`, the weight starting at zero (Gemma's and Qwen3-Next's norm, so
    their checkpoints' weights are read and written as they are). That form scales in
    float32 and casts the product back, as those checkpoints' code does.
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)
    zero_centred: bool = eqx.field(static=True, default=False)

    def __init__(
        self, dim: int, *, eps: float = 1e-5, dtype=jnp.float32, zero_centred: bool = False
    ):
        """**Arguments:**

        - `dim`: size of the normalised (last) axis.
        - `eps`: added to the mean square before the reciprocal square root.
        - `dtype`: dtype of the learned scale (initialised to ones, or to zeros when
          `zero_centred`).
        - `zero_centred`: scale by `1 + weight` instead of `weight`.

        **Raises:** `ValueError` unless `eps > 0`.
        """
        self.zero_centred = bool(zero_centred)
        self.weight = (jnp.zeros if self.zero_centred else jnp.ones)((dim,), dtype)
        self.eps = float(eps)

    def __check_init__(self):
        if not self.eps > 0:
            raise ValueError(
                f"RMSNorm needs eps > 0 to keep the reciprocal square root finite; got "
                f"eps={self.eps}. Use a small positive value such as 1e-5 or 1e-6."
            )

    def __call__(self, x: Float[Array, "batch *rest dim"]) -> Float[Array, "batch *rest dim"]:
        """**Arguments:**

        - `x`: `[batch, ..., dim]` activations (explicit batch axis, any middle axes).

        **Returns:** the normalised and scaled activations, same shape and dtype as `x`.
        """
        x32 = x.astype(jnp.float32)
        mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = x32 * jax.lax.rsqrt(mean_square + self.eps)
        if self.zero_centred:
            return (normed * (1.0 + self.weight.astype(jnp.float32))).astype(x.dtype)
        return normed.astype(x.dtype) * self.weight.astype(x.dtype)
