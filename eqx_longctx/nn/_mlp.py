"""SwiGLU feed-forward block (and GeGLU, its GELU-gated twin).

Einsum letters: `b` batch, `s` sequence, `e` embed, `f` hidden (feed-forward width).

Reference: Shazeer 2020, "GLU Variants Improve Transformer" (arXiv:2002.05202).
"""

from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, PRNGKeyArray

from .._checks import check_spec
from .._config_checks import check_choice
from .._sharding import ShardingSpec
from .._types import Hidden

GATE_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}
"""The gate activations of `SwiGLU(activation=...)`: `"silu"` (SwiGLU) and `"gelu_tanh"`,
GELU's tanh approximation (GeGLU; transformers' `gelu_pytorch_tanh`)."""


@final
class SwiGLU(eqx.Module):
    """`down(silu(x @ gate) * (x @ up))`, without biases (the Llama MLP); with
    `activation="gelu_tanh"` the gate goes through GELU's tanh approximation instead
    (GeGLU, Gemma's MLP).

    Weights are stored `[in, out]`; they are cast to the activation dtype at use, so float32
    parameters serve bfloat16 compute.
    """

    w_gate: Float[Array, "embed hidden"]
    w_up: Float[Array, "embed hidden"]
    w_down: Float[Array, "hidden embed"]
    spec: ShardingSpec | None = eqx.field(static=True)
    activation: str = eqx.field(static=True, default="silu")

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        *,
        key: PRNGKeyArray,
        init_std: float = 0.02,
        out_init_std: float | None = None,
        dtype=jnp.float32,
        spec=None,
        activation: str = "silu",
    ):
        """**Arguments:**

        - `dim`: model width (`embed`).
        - `hidden_dim`: feed-forward width.
        - `key`: PRNG key for the normal initialisation.
        - `init_std`: standard deviation of `w_gate` and `w_up`.
        - `out_init_std`: standard deviation of `w_down` (default `init_std`); deep stacks
          pass a smaller value so the residual stream does not grow with depth.
        - `dtype`: parameter dtype.
        - `spec`: the sharding spec, or `None` for one device; with a `tensor_axis`, the
          hidden activations are split over it (the weights are placed by the rules table).
        - `activation`: the gate's activation, a key of `GATE_ACTIVATIONS` (`"silu"`, or
          `"gelu_tanh"` for GeGLU).

        **Raises:** `TypeError` when `spec` is not a `ShardingSpec` (or `None`); `ValueError`
        for a width that is not positive or an `activation` not in `GATE_ACTIVATIONS`.
        """
        check_spec(spec, "SwiGLU")
        self.activation = check_choice(activation, "SwiGLU activation", GATE_ACTIVATIONS)
        if dim <= 0 or hidden_dim <= 0:
            raise ValueError(
                f"SwiGLU needs positive widths; got dim={dim}, hidden_dim={hidden_dim}."
            )
        out_init_std = init_std if out_init_std is None else out_init_std
        k_gate, k_up, k_down = jax.random.split(key, 3)
        self.w_gate = init_std * jax.random.normal(k_gate, (dim, hidden_dim), dtype)
        self.w_up = init_std * jax.random.normal(k_up, (dim, hidden_dim), dtype)
        self.w_down = out_init_std * jax.random.normal(k_down, (hidden_dim, dim), dtype)
        self.spec = spec

    def __call__(self, x: Hidden) -> Hidden:
        """**Arguments:**

        - `x`: `[batch, seq, embed]`.

        **Returns:** `[batch, seq, embed]` in the dtype of `x`.
        """
        dtype = x.dtype
        gate = jnp.einsum("bse,ef->bsf", x, self.w_gate.astype(dtype))
        up = jnp.einsum("bse,ef->bsf", x, self.w_up.astype(dtype))
        if self.spec is not None and self.spec.tensor_axis is not None:
            # Column-parallel gate/up: each device keeps its slice of the hidden units, so
            # the down projection (row-parallel) ends in one all-reduce over tensor_axis.
            hidden = PartitionSpec(*self.spec.activation_pspec()[:2], self.spec.tensor_axis)
            gate, up = self.spec.hint(gate, hidden), self.spec.hint(up, hidden)
        hidden = GATE_ACTIVATIONS[self.activation](gate) * up
        return jnp.einsum("bsf,fe->bse", hidden, self.w_down.astype(dtype))
