"""Kimi Delta Attention: the gated delta rule with a decay per key channel, as in Kimi Linear.

Einsum letters: `b` batch, `s` sequence, `e` embed, `h` heads, `d` head dim, `r` the rank
of the low-rank gate projections.

Reference: Kimi Team 2025, "Kimi Linear: An Expressive, Efficient Attention Architecture"
(arXiv:2510.26692); transformers' `KimiLinearDeltaAttention`.
"""

from typing import ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._checks import check_spec
from .._sharding import ShardingSpec
from .._types import Hidden, Positions, SegmentIds
from ..attention import check_tensor_heads
from ._delta_parts import (
    AbstractDeltaLayer,
    inverse_softplus,
    uniform_conv,
)
from ._rope import RotaryTables

_L2_EPS = 1e-6  # transformers' l2norm (and flash-linear-attention's)


@final
class KimiDeltaAttention(AbstractDeltaLayer):
    """Kimi Delta Attention (KDA): Gated DeltaNet's layer with a decay per key channel
    through a low-rank projection, and a low-rank sigmoid output gate.

    Per token (`x` `[embed]`), as transformers' `KimiLinearDeltaAttention` computes it:

    - `q, k, v` `[heads, head_dim]`: linear projections, each through its own short causal
      convolution with SiLU (`eqx_longctx.linear.short_conv`), reset at each document;
    - `q, k <- q / sqrt(|q|^2 + 1e-6)`, in float32;
    - the forget gate, per head and key channel:
      `g = -exp(a_log[h]) softplus(f_b(f_a(x)) + dt_bias)` (`<= 0`);
    - `beta = sigmoid(x wb)` per head;
    - `o = gated_delta_rule(q, k, v, g, beta)` (scale `head_dim ** -0.5`);
    - `o <- rmsnorm(o) * norm * sigmoid(g_b(g_a(x)))` in float32, then `out = o wo`.

    Weights keep heads as their own axis, so the rules table splits them over a tensor
    axis. The Hugging Face arrays map directly: `q_proj`/`k_proj`/`v_proj` are `wq`/`wk`/
    `wv` flattened over `(heads, head_dim)`, `q_conv1d`/`k_conv1d`/`v_conv1d` (transformers
    stacks them into one `conv1d`) are `conv_q`/`conv_k`/`conv_v`, `f_a_proj`, `f_b_proj`,
    `g_a_proj`, `g_b_proj`, `b_proj`, `o_proj` are `f_a`, `f_b`, `g_a`, `g_b`, `wb`, `wo`,
    `A_log` `[1, 1, heads, 1]` is `a_log` and `dt_bias` `[heads * head_dim]` is `dt_bias`.

    `positions` are accepted and unused. Under a `spec`, inputs are in the spec's token
    layout and the convolutions and the rule run split over the sequence.
    """

    wq: Float[Array, "embed heads head_dim"]
    wk: Float[Array, "embed heads head_dim"]
    wv: Float[Array, "embed heads head_dim"]
    conv_q: Float[Array, "heads head_dim conv"]
    conv_k: Float[Array, "heads head_dim conv"]
    conv_v: Float[Array, "heads head_dim conv"]
    f_a: Float[Array, "embed gate_rank"]
    f_b: Float[Array, "gate_rank heads head_dim"]
    dt_bias: Float[Array, "heads head_dim"]
    a_log: Float[Array, " heads"]
    wb: Float[Array, "embed heads"]
    g_a: Float[Array, "embed gate_rank"]
    g_b: Float[Array, "gate_rank heads head_dim"]
    norm: Float[Array, " head_dim"]
    wo: Float[Array, "heads head_dim embed"]
    n_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    conv_size: int = eqx.field(static=True)
    norm_eps: float = eqx.field(static=True)
    chunk: int = eqx.field(static=True)
    spec: ShardingSpec | None = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        n_heads: int,
        head_dim: int,
        *,
        key: PRNGKeyArray,
        gate_rank: int | None = None,
        conv_size: int = 4,
        norm_eps: float = 1e-6,
        chunk: int = 64,
        init_std: float = 0.02,
        out_init_std: float | None = None,
        dtype=jnp.float32,
        spec: ShardingSpec | None = None,
    ):
        """**Arguments:**

        - `dim`: model width (`embed`).
        - `n_heads`, `head_dim`: heads and their width (`linear_num_heads`,
          `linear_head_dim`; keys and values alike).
        - `key`: PRNG key of the initialisation.
        - `gate_rank`: rank of the forget and output gates' projections (default
          `head_dim`, as Kimi Linear).
        - `conv_size`: width `K` of the short convolutions.
        - `norm_eps`: epsilon of the gated RMSNorm.
        - `chunk`: tokens per chunk of the rule's chunked form.
        - `init_std`, `out_init_std`: standard deviations of the projections and of `wo`
          (default `init_std`). As transformers (and flash-linear-attention) initialise
          them: `a_log = log(uniform(1, 16))`, `dt_bias` the inverse softplus of a
          log-uniform step in `[1e-3, 1e-1]`, the norm at 1; the convolutions as PyTorch's
          `Conv1d` (uniform in `+-1/sqrt(K)`).
        - `dtype`: parameter dtype.
        - `spec`: the sharding spec of the convolutions and the rule; `None` = one device.

        **Raises:** `TypeError` for a `spec` that is not a `ShardingSpec`; `ValueError`
        for a size that is not positive, or heads that do not divide over the spec's tensor
        axis.
        """
        check_spec(spec, "KimiDeltaAttention")
        out_init_std = init_std if out_init_std is None else out_init_std
        rank = head_dim if gate_rank is None else gate_rank
        keys = jax.random.split(key, 14)
        normal = lambda k, shape, std=init_std: std * jax.random.normal(k, shape, dtype)  # noqa: E731
        self.wq = normal(keys[0], (dim, n_heads, head_dim))
        self.wk = normal(keys[1], (dim, n_heads, head_dim))
        self.wv = normal(keys[2], (dim, n_heads, head_dim))
        conv_shape = (n_heads, head_dim, conv_size)
        self.conv_q = uniform_conv(keys[3], conv_shape, dtype)
        self.conv_k = uniform_conv(keys[4], conv_shape, dtype)
        self.conv_v = uniform_conv(keys[5], conv_shape, dtype)
        self.f_a = normal(keys[6], (dim, rank))
        self.f_b = normal(keys[7], (rank, n_heads, head_dim))
        log_dt = jax.random.uniform(
            keys[8], (n_heads, head_dim), jnp.float32, jnp.log(1e-3), jnp.log(1e-1)
        )
        self.dt_bias = inverse_softplus(jnp.maximum(jnp.exp(log_dt), 1e-4)).astype(dtype)
        decay_rate = jax.random.uniform(keys[9], (n_heads,), jnp.float32, 1.0, 16.0)
        self.a_log = jnp.log(decay_rate).astype(dtype)
        self.wb = normal(keys[10], (dim, n_heads))
        self.g_a = normal(keys[11], (dim, rank))
        self.g_b = normal(keys[12], (rank, n_heads, head_dim))
        self.norm = jnp.ones((head_dim,), dtype)
        self.wo = normal(keys[13], (n_heads, head_dim, dim), out_init_std)
        self.n_heads, self.head_dim = n_heads, head_dim
        self.conv_size, self.norm_eps, self.chunk = conv_size, float(norm_eps), chunk
        self.spec = spec

    def __check_init__(self):
        sizes = dict(
            n_heads=self.n_heads, head_dim=self.head_dim, conv_size=self.conv_size,
            chunk=self.chunk, gate_rank=self.f_a.shape[1],
        )  # fmt: skip
        for name, value in sizes.items():
            if not value > 0:
                raise ValueError(f"KimiDeltaAttention needs {name} > 0; got {name}={value}.")
        if not self.norm_eps > 0:
            raise ValueError(f"KimiDeltaAttention needs norm_eps > 0; got {self.norm_eps}.")
        if self.spec is not None:
            check_tensor_heads(self.spec, self.n_heads, self.n_heads)

    def __call__(
        self,
        x: Hidden,
        positions: Positions | RotaryTables,
        segment_ids: SegmentIds | None = None,
    ) -> Hidden:
        """**Arguments:**

        - `x`: `[batch, seq, embed]` (normalised) activations, in the spec's token layout.
        - `positions`: `[batch, seq]` (or RoPE tables), unused.
        - `segment_ids`: `[batch, seq]` packed-document ids, or `None` (one document):
          the convolutions and the recurrent state restart at each document.

        **Returns:** `[batch, seq, embed]` in the dtype of `x`.

        **Raises:** `ValueError` for `x` not `[batch, seq, embed]` or `segment_ids` not
        `[batch, seq]`; as `short_conv` and `gated_delta_rule` under a spec.
        """
        del positions
        return self._mix(x, segment_ids)

    def _project(self, x):
        """`((q, k, v), None)`: q, k and v before the convolution (the gates are projected
        from `x` where they are used)."""
        qkv = (
            jnp.einsum("bse,ehd->bshd", x, w.astype(x.dtype)) for w in (self.wq, self.wk, self.wv)
        )
        return tuple(qkv), None

    def _convs(self):
        return self.conv_q, self.conv_k, self.conv_v

    def _rule_inputs(self, x, q, k, v, extra):
        """The rule's `(q, k, v, g, beta)` from `x` and the convolved q, k, v."""
        dtype = x.dtype
        q, k = _l2_normalize(q), _l2_normalize(k)
        gate = jnp.einsum("bse,er->bsr", x, self.f_a.astype(dtype))
        gate = jnp.einsum("bsr,rhd->bshd", gate, self.f_b.astype(dtype)).astype(jnp.float32)
        rate = jnp.exp(self.a_log.astype(jnp.float32))[:, None]
        g = -rate * jax.nn.softplus(gate + self.dt_bias.astype(jnp.float32))
        beta = jax.nn.sigmoid(jnp.einsum("bse,eh->bsh", x, self.wb.astype(dtype)))
        return q, k, v, g, beta

    def _output(self, x, o, extra):
        dtype = x.dtype
        o = o.astype(dtype)
        out_gate = jnp.einsum("bse,er->bsr", x, self.g_a.astype(dtype))
        out_gate = jnp.einsum("bsr,rhd->bshd", out_gate, self.g_b.astype(dtype))
        o = self._gated_norm(o, out_gate)
        return jnp.einsum("bshd,hde->bse", o, self.wo.astype(dtype))

    def _gated_norm(self, o, gate):
        """transformers' `KimiLinearRMSNormGated`: all in float32 (normalised, scaled by the
        weight, gated by `sigmoid(gate)`), cast back at the end."""
        o32 = o.astype(jnp.float32)
        mean_square = jnp.mean(jnp.square(o32), axis=-1, keepdims=True)
        normed = o32 * jax.lax.rsqrt(mean_square + self.norm_eps) * self.norm.astype(jnp.float32)
        return (normed * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(o.dtype)

    # ---- inference (eqx_longctx.inference): fixed-size states, no per-token entries ----

    decay: ClassVar[str] = "channel"
    """One log decay per key channel (KDA's gate), as the planner's linear cost model
    reads it (`eqx_longctx.linear.linear_attention_cost`'s `gate`)."""

    def cache_state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """**Returns:** the per-row shape of each fixed-size state, heads first: the
        recurrent state `(heads, head_dim, head_dim)`, then the windows of the q, k and v
        convolutions, each `(heads, head_dim, K-1)`: the last `conv_size - 1` inputs before
        the convolution (transformers' stacked `conv_state` `[3 heads head_dim, K-1]`,
        split by projection and head)."""
        window = (self.n_heads, self.head_dim, self.conv_size - 1)
        return ((self.n_heads, self.head_dim, self.head_dim), window, window, window)

    def prefill(
        self,
        x: Hidden,
        positions: Positions,
        segment_ids: SegmentIds | None = None,
        *,
        impl=None,
        lengths: Int[Array, " batch"] | None = None,
    ) -> tuple[Hidden, tuple[Array, ...]]:
        """`__call__`, also returning what the cache keeps: each row's states after its
        last real token (as [`GatedDeltaNet.prefill`][eqx_longctx.nn.GatedDeltaNet.prefill]).

        **Arguments:** as `__call__`; `impl` as for `GatedDeltaNet.prefill`; `lengths`
        `[batch]` each row's real tokens (`None`: all), the padding after them leaving the
        state unchanged.

        **Returns:** `(out, (state, window_q, window_k, window_v))`, float32 `[batch, ...]`
        states of `cache_state_shapes` (replicated over the sequence axes under a spec).

        **Raises:** as `__call__`.
        """
        return self._prefill(x, segment_ids, positions, lengths, impl)

    def decode(
        self, x: Hidden, positions: Positions, cache, cache_positions, *, impl
    ) -> tuple[Hidden, tuple[Array, ...]]:
        """One new token per row from the cached states (as
        [`GatedDeltaNet.decode`][eqx_longctx.nn.GatedDeltaNet.decode]: one step of each
        convolution and of the rule, on each sequence shard's copy of the token).

        **Returns:** `(out [batch, n, embed], new states [batch, n, ...] each)`.
        """
        del positions, cache_positions, impl
        return self._step(x, cache)


def _l2_normalize(x):
    """transformers' Kimi Linear `l2norm`, in float32: `x / sqrt(|x|^2 + 1e-6)` (a division,
    where Qwen3-Next multiplies by `rsqrt`)."""
    x = x.astype(jnp.float32)
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _L2_EPS)
