"""Gated DeltaNet: linear attention by the gated delta rule, as in Qwen3-Next and Qwen3.5.

Einsum letters: `b` batch, `s` sequence, `e` embed, `k` key (and query) heads, `h` value
heads (the heads the rule runs: `h = r k`, grouped value attention), `d` key head dim,
`v` value head dim.

References: Yang, Kautz and Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with
Delta Rule" (arXiv:2412.06464); Qwen3-Next and Qwen3.5 (transformers'
`Qwen3NextGatedDeltaNet`, `Qwen3_5GatedDeltaNet`).
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
    uniform_conv,
)
from ._rope import RotaryTables

_L2_EPS = 1e-6  # transformers' l2norm (and flash-linear-attention's)


@final
class GatedDeltaNet(AbstractDeltaLayer):
    """Gated DeltaNet (GDN): projections, a short causal convolution with SiLU, L2-normalised
    queries and keys, the gated delta rule, a gated RMSNorm and the output projection.

    Per token (`x` `[embed]`), as transformers' `Qwen3NextGatedDeltaNet` computes it:

    - `q, k` `[key_heads, head_dim]`, `v, z` `[heads, v_head_dim]`, `b, a` `[heads]`: linear
      projections of `x`;
    - `q, k, v <- silu(short_conv(.))`, each channel's causal convolution of width
      `conv_size` (`eqx_longctx.linear.short_conv`), reset at each packed document;
    - `q, k <- q / sqrt(|q|^2 + 1e-6)`, in float32;
    - grouped value attention: key head `j` serves value heads `j r .. j r + r - 1`,
      `r = n_heads / n_key_heads` (q and k repeated, as `repeat_interleave`);
    - `beta = sigmoid(b)`, `g = -exp(a_log) softplus(a + dt_bias)` (the log decay, `<= 0`);
    - `o = gated_delta_rule(q, k, v, g, beta)` (scale `head_dim ** -0.5`);
    - `o <- rmsnorm(o) * norm * silu(z)` per value head, then `out = o wo`.

    Weights keep heads as their own axis, so the rules table splits them over a tensor
    axis (`heads` and `key_heads`; a key head's value heads stay on its device). The
    Hugging Face projections are these arrays flattened: `in_proj_qkv` (Qwen3.5) is
    `[wq | wk | wv]` over `(heads, dim)`, and Qwen3-Next's `in_proj_qkvz` interleaves
    `[q, k, v, z]` per key head; `conv1d.weight` `[channels, 1, K]` is
    `[conv_q | conv_k | conv_v]`.

    `positions` are accepted and unused (the layer sees order through the convolution and
    the recurrence), so `DecoderBlock` and `LayerStack` run it like the other attention
    layers. Under a `spec`, inputs are in the spec's token layout and the convolution and
    the rule run split over the sequence (`spec=` of `short_conv` and `gated_delta_rule`).
    """

    wq: Float[Array, "embed key_heads head_dim"]
    wk: Float[Array, "embed key_heads head_dim"]
    wv: Float[Array, "embed heads v_head_dim"]
    wz: Float[Array, "embed heads v_head_dim"]
    wb: Float[Array, "embed heads"]
    wa: Float[Array, "embed heads"]
    conv_q: Float[Array, "key_heads head_dim conv"]
    conv_k: Float[Array, "key_heads head_dim conv"]
    conv_v: Float[Array, "heads v_head_dim conv"]
    a_log: Float[Array, " heads"]
    dt_bias: Float[Array, " heads"]
    norm: Float[Array, " v_head_dim"]
    wo: Float[Array, "heads v_head_dim embed"]
    n_heads: int = eqx.field(static=True)
    n_key_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    v_head_dim: int = eqx.field(static=True)
    conv_size: int = eqx.field(static=True)
    norm_eps: float = eqx.field(static=True)
    chunk: int = eqx.field(static=True)
    spec: ShardingSpec | None = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_key_heads: int,
        head_dim: int,
        v_head_dim: int,
        *,
        key: PRNGKeyArray,
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
        - `n_heads`: value heads, the heads the rule runs (`linear_num_value_heads`).
        - `n_key_heads`: query and key heads (`linear_num_key_heads`); `n_heads` must be a
          multiple.
        - `head_dim`, `v_head_dim`: query/key and value widths per head.
        - `key`: PRNG key of the initialisation.
        - `conv_size`: width `K` of the short convolution (`linear_conv_kernel_dim`).
        - `norm_eps`: epsilon of the gated RMSNorm (`rms_norm_eps`).
        - `chunk`: tokens per chunk of the rule's chunked form.
        - `init_std`, `out_init_std`: standard deviations of the input projections and of
          `wo` (default `init_std`). The convolutions start as PyTorch's `Conv1d` (uniform in
          `+-1/sqrt(K)`), `a_log` as `log(uniform(0.01, 16))`, `dt_bias` at 1 and the norm
          at 1, as transformers initialises them.
        - `dtype`: parameter dtype.
        - `spec`: the sharding spec of the convolution and the rule; `None` = one device.

        **Raises:** `TypeError` for a `spec` that is not a `ShardingSpec`; `ValueError`
        when `n_heads` is not a multiple of `n_key_heads`, a size is not positive, or the
        heads do not divide over the spec's tensor axis.
        """
        check_spec(spec, "GatedDeltaNet")
        out_init_std = init_std if out_init_std is None else out_init_std
        keys = jax.random.split(key, 11)
        normal = lambda k, shape, std=init_std: std * jax.random.normal(k, shape, dtype)  # noqa: E731
        self.wq = normal(keys[0], (dim, n_key_heads, head_dim))
        self.wk = normal(keys[1], (dim, n_key_heads, head_dim))
        self.wv = normal(keys[2], (dim, n_heads, v_head_dim))
        self.wz = normal(keys[3], (dim, n_heads, v_head_dim))
        self.wb = normal(keys[4], (dim, n_heads))
        self.wa = normal(keys[5], (dim, n_heads))
        self.conv_q = uniform_conv(keys[6], (n_key_heads, head_dim, conv_size), dtype)
        self.conv_k = uniform_conv(keys[7], (n_key_heads, head_dim, conv_size), dtype)
        self.conv_v = uniform_conv(keys[8], (n_heads, v_head_dim, conv_size), dtype)
        decay_rate = jax.random.uniform(keys[9], (n_heads,), jnp.float32, 0.01, 16.0)
        self.a_log = jnp.log(decay_rate).astype(dtype)
        self.dt_bias = jnp.ones((n_heads,), dtype)
        self.norm = jnp.ones((v_head_dim,), dtype)
        self.wo = normal(keys[10], (n_heads, v_head_dim, dim), out_init_std)
        self.n_heads, self.n_key_heads = n_heads, n_key_heads
        self.head_dim, self.v_head_dim = head_dim, v_head_dim
        self.conv_size, self.norm_eps, self.chunk = conv_size, float(norm_eps), chunk
        self.spec = spec

    def __check_init__(self):
        sizes = dict(
            n_heads=self.n_heads, n_key_heads=self.n_key_heads, head_dim=self.head_dim,
            v_head_dim=self.v_head_dim, conv_size=self.conv_size, chunk=self.chunk,
        )  # fmt: skip
        for name, value in sizes.items():
            if not value > 0:
                raise ValueError(f"GatedDeltaNet needs {name} > 0; got {name}={value}.")
        if self.n_heads % self.n_key_heads:
            raise ValueError(
                "GatedDeltaNet needs n_heads (value heads) to be a multiple of n_key_heads "
                f"(each key head serves a group of value heads); got n_heads={self.n_heads}, "
                f"n_key_heads={self.n_key_heads}."
            )
        if not self.norm_eps > 0:
            raise ValueError(f"GatedDeltaNet needs norm_eps > 0; got {self.norm_eps}.")
        if self.spec is not None:
            check_tensor_heads(self.spec, self.n_heads, self.n_key_heads)

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
          the convolution and the recurrent state restart at each document.

        **Returns:** `[batch, seq, embed]` in the dtype of `x`.

        **Raises:** `ValueError` for `x` not `[batch, seq, embed]` or `segment_ids` not
        `[batch, seq]`; as `short_conv` and `gated_delta_rule` under a spec (a batch or
        sequence the mesh does not split).
        """
        del positions
        return self._mix(x, segment_ids)

    def _project(self, x):
        """`((q, k, v), (z, b, a))`: the projections, q, k and v before the convolution."""
        dtype = x.dtype
        q = jnp.einsum("bse,ekd->bskd", x, self.wq.astype(dtype))
        k = jnp.einsum("bse,ekd->bskd", x, self.wk.astype(dtype))
        v = jnp.einsum("bse,ehv->bshv", x, self.wv.astype(dtype))
        z = jnp.einsum("bse,ehv->bshv", x, self.wz.astype(dtype))
        b = jnp.einsum("bse,eh->bsh", x, self.wb.astype(dtype))
        a = jnp.einsum("bse,eh->bsh", x, self.wa.astype(dtype))
        return (q, k, v), (z, b, a)

    def _convs(self):
        return self.conv_q, self.conv_k, self.conv_v

    def _rule_inputs(self, x, q, k, v, extra):
        """The rule's `(q, k, v, g, beta)` from the convolved q, k, v and the gates' inputs:
        q and k L2-normalised and repeated for their value heads."""
        _, b, a = extra
        q, k = _l2_normalize(q), _l2_normalize(k)
        groups = self.n_heads // self.n_key_heads
        if groups > 1:
            q, k = jnp.repeat(q, groups, axis=2), jnp.repeat(k, groups, axis=2)
        beta = jax.nn.sigmoid(b)
        rate = jnp.exp(self.a_log.astype(jnp.float32))
        g = -rate * jax.nn.softplus(a.astype(jnp.float32) + self.dt_bias.astype(jnp.float32))
        return q, k, v, g, beta

    def _output(self, x, o, extra):
        dtype, z = x.dtype, extra[0]
        o = self._gated_norm(o.astype(dtype), z)
        return jnp.einsum("bshv,hve->bse", o, self.wo.astype(dtype))

    def _gated_norm(self, o, z):
        """transformers' `Qwen3NextRMSNormGated`: normalised in float32, cast back, scaled,
        then gated by `silu(z)` in float32."""
        o32 = o.astype(jnp.float32)
        mean_square = jnp.mean(jnp.square(o32), axis=-1, keepdims=True)
        normed = (o32 * jax.lax.rsqrt(mean_square + self.norm_eps)).astype(o.dtype)
        normed = self.norm.astype(o.dtype) * normed
        return (normed * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)

    # ---- inference (eqx_longctx.inference): fixed-size states, no per-token entries ----

    decay: ClassVar[str] = "head"
    """One log decay per head (a GDN gate), as the planner's linear cost model reads it
    (`eqx_longctx.linear.linear_attention_cost`'s `gate`)."""

    def cache_state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """**Returns:** the per-row shape of each fixed-size state, heads first: the
        recurrent state `(heads, head_dim, v_head_dim)`, then the convolution's windows,
        the last `conv_size - 1` inputs (before the convolution) of q, k and v,
        `(key_heads, head_dim, K-1)`, `(key_heads, head_dim, K-1)`,
        `(heads, v_head_dim, K-1)` (transformers' `conv_state` `[channels, K-1]`, split by
        head)."""
        window = self.conv_size - 1
        return (
            (self.n_heads, self.head_dim, self.v_head_dim),
            (self.n_key_heads, self.head_dim, window),
            (self.n_key_heads, self.head_dim, window),
            (self.n_heads, self.v_head_dim, window),
        )

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
        last real token.

        **Arguments:** as `__call__` (`positions` the tokens' natural positions, in the
        spec's layout); `impl` the block implementation the model's attention runs: `"xla"`
        (or an `XlaBlockImpl`) keeps the rule on its XLA path too, anything else lets
        `eqx_longctx.linear.resolve_gated_delta_impl` pick;
        `lengths` `[batch]` each row's real tokens, the rest padding (`None`: all real).
        Padding leaves the state as it was (its `g` and `beta` are zero), so the state is
        the one after token `lengths - 1`, wherever the layout put it.

        **Returns:** `(out, (state, window_q, window_k, window_v))`: the layer's output and
        the float32 states of `cache_state_shapes` per row, `[batch, ...]` (replicated over
        the sequence axes under a spec). With `segment_ids`, the state is the last
        document's.

        **Raises:** as `__call__`.
        """
        return self._prefill(x, segment_ids, positions, lengths, impl)

    def decode(
        self, x: Hidden, positions: Positions, cache, cache_positions, *, impl
    ) -> tuple[Hidden, tuple[Array, ...]]:
        """One new token per row from the cached states: one step of the convolution
        (`eqx_longctx.linear.short_conv_step`) and of the rule
        (`eqx_longctx.linear.gated_delta_step`).

        **Arguments:** `x` `[batch, n, embed]` the new token repeated on the spec's `n`
        sequence shards; `positions` `[batch, n]` (unused); `cache` this layer's states
        (`(state, window_q, window_k, window_v)`, `[batch, ...]` each, or a stack's
        `LayerCache` view of them); `cache_positions` and `impl` unused.

        **Returns:** `(out, new states)`: `[batch, n, embed]`, and each new state per copy
        of the token, `[batch, n, ...]` (equal along `n`: every shard runs the step on its
        own copy, so the states never move).
        """
        del positions, cache_positions, impl
        return self._step(x, cache)


def _l2_normalize(x):
    """transformers' Qwen3-Next `l2norm`, in float32: `x / sqrt(|x|^2 + 1e-6)`."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _L2_EPS)
