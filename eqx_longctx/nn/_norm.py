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
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float = 1e-5, dtype=jnp.float32):
        """**Arguments:**

        - `dim`: size of the normalised (last) axis.
        - `eps`: added to the mean square before the reciprocal square root.
        - `dtype`: dtype of the learned scale (initialised to ones).

        **Raises:** `ValueError` unless `eps > 0`.
        """
        self.weight = jnp.ones((dim,), dtype)
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
        normed = (x32 * jax.lax.rsqrt(mean_square + self.eps)).astype(x.dtype)
        return normed * self.weight.astype(x.dtype)
