"""What Gated DeltaNet and Kimi Delta Attention share: the orchestration of a layer
(`AbstractDeltaLayer`: training, the prefill's states and windows, the decode step's
convolution and rule on the cached state), the per-head short convolution, the decay and
the input checks.

Einsum letters: `b` batch, `s` sequence, `n` the copies of a decoded token (one per
sequence shard), `h` heads, `d` head width, `j` a window's slots.
"""

import abc
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from .._layout import from_layout, to_layout
from .._sharding import ShardingSpec
from ..attention import XlaBlockImpl
from ..linear import gated_delta_rule, gated_delta_step, short_conv, short_conv_step


def rule_impl(impl, spec: ShardingSpec | None):
    """The gated delta rule's `impl` for a layer called with the block-attention `impl`
    (or, when that is `None`, its spec's): `"xla"` or an `XlaBlockImpl` keeps the layer on
    the XLA path too; anything else lets `eqx_longctx.linear.resolve_gated_delta_impl`
    pick (the Pallas kernels on a TPU where they run the shape, the XLA path elsewhere)."""
    impl = spec.impl if impl is None and spec is not None else impl
    xla = isinstance(impl, XlaBlockImpl) or (isinstance(impl, str) and impl == "xla")
    return "xla" if xla else None


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
    flat, w = x.reshape(b, s, h * d), weight.reshape(h * d, -1)
    if spec is not None and _pieces_too_short(spec, s, w.shape[1]):
        # A sequence too short for halos from one neighbouring piece (a short prompt's
        # prefill, say: 16 tokens zig-zagged over 8 devices): the convolution of the
        # natural order, the few tokens moved there and back.
        seg = None if segment_ids is None else from_layout(segment_ids, spec, axis=1)
        natural = short_conv(from_layout(flat, spec, axis=1), w, activation="silu",
                             segment_ids=seg)  # fmt: skip
        return jnp.asarray(to_layout(natural, spec, axis=1)).reshape(b, s, h, d)
    out = short_conv(flat, w, activation="silu", segment_ids=segment_ids, spec=spec)
    return out.reshape(b, s, h, d)


def _pieces_too_short(spec: ShardingSpec, seq: int, kernel: int) -> bool:
    """Whether `short_conv` under `spec` would refuse `seq` tokens: its contiguous and
    zig-zag pieces must each hold the `K - 1` inputs of a halo."""
    n = spec.context_parallel_size
    if n == 1 or spec.load_balance == "striped":
        return False
    pieces = 2 * n if spec.load_balance == "zigzag" else n
    return seq // pieces < kernel - 1


# ---- inference ---------------------------------------------------------------------------


def conv_windows(xs: tuple, positions, lengths, width: int) -> tuple:
    """Each row's convolution window after its prefill: the last `width` inputs before the
    convolution, `[batch, heads, dim, width]` float32 per array of `xs` (`[batch, seq,
    heads, dim]`, in the spec's layout under a spec), oldest first, zeros before the row's
    start. Row `b`'s last real token is `lengths[b] - 1` (all of `seq` when `None`).

    A one-hot contraction over the sequence (a local product and one small all-reduce
    under a spec, never a gather of the sequence), at the highest precision: exact."""
    b, seq = positions.shape
    end = jnp.full((b,), seq, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    want = end[:, None] - width + jnp.arange(width, dtype=jnp.int32)  # [b, j]
    pick = (positions[:, :, None] == want[:, None, :]).astype(jnp.float32)
    return tuple(
        jnp.einsum("bsj,bshd->bhdj", pick, x.astype(jnp.float32), precision=lax.Precision.HIGHEST)
        for x in xs
    )


def hold_padding(g, beta, positions, lengths):
    """`g` and `beta` with the padding after each row's `lengths` tokens set to zero: a
    token with `g = 0` and `beta = 0` leaves the recurrent state unchanged, so the rule's
    final state is the state after each row's last real token."""
    if lengths is None:
        return g, beta
    real = positions < lengths[:, None]
    beta = jnp.where(real[..., None], beta, 0)
    g = jnp.where(real.reshape(*real.shape, *(1,) * (g.ndim - 2)), g, 0)
    return g, beta


def conv_step(window, x, weight):
    """The decode step's convolution of each head's channels, then SiLU: `window`
    `[batch, heads, dim, K-1]` (one layer's cached window), `x` `[batch, n, heads, dim]`
    (the new token on each of the `n` sequence shards), `weight` `[heads, dim, K]`.

    **Returns:** `(out [batch, n, heads, dim], new window [batch, n, heads, dim, K-1])`,
    per copy of the token."""
    b, n, h, d = x.shape
    window = jnp.broadcast_to(window[:, None], (b, n, *window.shape[1:]))
    out, new = short_conv_step(
        window.reshape(b, n, h * d, -1), x.reshape(b, n, h * d), weight.reshape(h * d, -1),
        activation="silu",
    )  # fmt: skip
    return out.reshape(b, n, h, d), new.reshape(b, n, h, d, -1)


def cached_arrays(cache) -> tuple:
    """One layer's cached arrays: from a stack's `LayerCache` view (`arrays()`), or the
    arrays themselves."""
    arrays = getattr(cache, "arrays", None)
    return tuple(arrays() if arrays is not None else cache)


def per_copy(state, n: int):
    """A cached `[batch, ...]` state repeated for the `n` copies of the decoded token
    (`[batch, n, ...]`): each sequence shard runs the step on its own copy."""
    return jnp.broadcast_to(state[:, None], (state.shape[0], n, *state.shape[1:]))


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


# ---- the layers' shared orchestration ------------------------------------------------------


class AbstractDeltaLayer(eqx.Module):
    """What a gated-delta-rule layer runs, whatever its projections and gates: project,
    convolve q, k and v (each head's channels, with halos under a spec), make the rule's
    inputs, run the rule, gate and project the output; and for inference the same with
    the states kept (`prefill`), or one step from them (`decode`). `GatedDeltaNet` and
    `KimiDeltaAttention` supply the four hooks:

    - `_project(x)`: `((q, k, v), extra)` before the convolutions, `[batch, seq, heads,
      dim]` each; `extra` whatever else the layer projects from `x` (or `None`);
    - `_convs()`: the q, k and v convolution weights `[heads, dim, K]`;
    - `_rule_inputs(x, q, k, v, extra)`: `(q, k, v, g, beta)` for `gated_delta_rule`;
    - `_output(x, o, extra)`: the gated norm and the output projection of the rule's `o`.
    """

    wq: eqx.AbstractVar[Array]
    head_dim: eqx.AbstractVar[int]
    conv_size: eqx.AbstractVar[int]
    chunk: eqx.AbstractVar[int]
    spec: eqx.AbstractVar[ShardingSpec | None]

    cache_split_heads: ClassVar[bool] = True
    """The states' heads split over the spec's tensor axis, like the layer's heads; the
    states are replicated over the sequence axes (each device runs the decode step's
    recurrence for its rows and heads)."""

    window: ClassVar[None] = None
    """No sliding window: the layer keeps no per-token cache."""

    @abc.abstractmethod
    def _project(self, x) -> tuple[tuple[Array, Array, Array], Any]: ...

    @abc.abstractmethod
    def _convs(self) -> tuple[Array, Array, Array]: ...

    @abc.abstractmethod
    def _rule_inputs(self, x, q, k, v, extra) -> tuple[Array, ...]: ...

    @abc.abstractmethod
    def _output(self, x, o, extra) -> Array: ...

    def cache_shapes(self) -> tuple[tuple[int, int], ...]:
        """**Returns:** `()`: nothing is cached per token."""
        return ()

    def _rule_args(self, x, segment_ids):
        """`(raw, extra, (q, k, v, g, beta))`: the projections before the convolutions,
        the layer's `extra`, and the rule's inputs."""
        check_hidden(type(self).__name__, x, self.wq.shape[0], segment_ids)
        raw, extra = self._project(x)
        q, k, v = (
            conv_heads(t, w.astype(x.dtype), segment_ids, self.spec)
            for t, w in zip(raw, self._convs(), strict=True)
        )
        return raw, extra, self._rule_inputs(x, q, k, v, extra)

    def _mix(self, x, segment_ids) -> Array:
        """The layer over a sequence (training)."""
        _, extra, (q, k, v, g, beta) = self._rule_args(x, segment_ids)
        o = gated_delta_rule(
            q, k, v, g, beta, segment_ids=segment_ids, spec=self.spec, chunk=self.chunk,
            impl=rule_impl(None, self.spec),
        )  # fmt: skip
        return self._output(x, o, extra)

    def _prefill(self, x, segment_ids, positions, lengths, impl) -> tuple[Array, tuple]:
        """The layer over a prompt, and the states a prefill caches: `(out, (state,
        *windows))`, the padding after `lengths` leaving the state as it was (its `g` and
        `beta` are zero)."""
        raw, extra, (q, k, v, g, beta) = self._rule_args(x, segment_ids)
        g, beta = hold_padding(g, beta, positions, lengths)
        o, state = gated_delta_rule(
            q, k, v, g, beta, segment_ids=segment_ids, spec=self.spec, chunk=self.chunk,
            return_state=True, impl=rule_impl(impl, self.spec),
        )  # fmt: skip
        windows = conv_windows(raw, positions, lengths, self.conv_size - 1)
        return self._output(x, o, extra), (state, *windows)

    def _step(self, x, cache):
        """One decode step from one layer's cached states: `(out, new states)`."""
        state, *windows = cached_arrays(cache)
        raw, extra = self._project(x)
        convs = [
            conv_step(w, t, c.astype(x.dtype))
            for w, t, c in zip(windows, raw, self._convs(), strict=True)
        ]
        (q, _), (k, _), (v, _) = convs
        q, k, v, g, beta = self._rule_inputs(x, q, k, v, extra)
        o, state = gated_delta_step(
            per_copy(state, x.shape[1]), q, k, v, g, beta, scale=self.head_dim**-0.5
        )
        return self._output(x, o, extra), (state, *(c[1] for c in convs))
