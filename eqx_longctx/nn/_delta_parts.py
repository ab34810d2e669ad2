"""What Gated DeltaNet and Kimi Delta Attention share: the per-head short convolution, the
decay and the input checks.

Einsum-free. Shapes: `b` batch, `s` sequence, `h` heads, `d` head width.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._sharding import ShardingSpec
from ..linear import short_conv


def conv_heads(
    x: Float[Array, "batch seq heads dim"],
    weight: Float[Array, "heads dim conv"],
    segment_ids,
    spec: ShardingSpec | None,
) -> Float[Array, "batch seq heads dim"]:
    """The causal depthwise convolution of each head's channels, then SiLU: heads and
    widths flattened head-major into channels, so that a tensor axis splitting the heads
    splits the channels the same way."""
    b, s, h, d = x.shape
    out = short_conv(
        x.reshape(b, s, h * d), weight.reshape(h * d, -1), activation="silu",
        segment_ids=segment_ids, spec=spec,
    )  # fmt: skip
    return out.reshape(b, s, h, d)


def check_hidden(where: str, x, dim: int, segment_ids) -> None:
    """**Raises:** `ValueError` unless `x` is `[batch, seq, dim]` and `segment_ids`
    (when given) `[batch, seq]`."""
    if x.ndim != 3 or x.shape[-1] != dim:
        raise ValueError(
            f"{where} needs x of shape [batch, seq, embed] with embed = {dim} (the layer's "
            f"width); got x{tuple(x.shape)}. Add a batch axis (x[None]) or build the layer "
            "with this width."
        )
    if segment_ids is not None and tuple(segment_ids.shape) != tuple(x.shape[:2]):
        raise ValueError(
            f"{where}: segment_ids must be [batch, seq] = {tuple(x.shape[:2])} like x; got "
            f"{tuple(segment_ids.shape)}."
        )


def uniform_conv(key, shape, dtype):
    """PyTorch's default `Conv1d` initialisation for a depthwise kernel of width `K`
    (`fan_in = K`): uniform in `[-1/sqrt(K), 1/sqrt(K)]`."""
    bound = shape[-1] ** -0.5
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def inverse_softplus(y):
    """`x` with `softplus(x) = y`, stable for small `y > 0`."""
    return y + jnp.log(-jnp.expm1(-y))
