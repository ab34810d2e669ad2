"""Pre-norm decoder block and a stack of identical blocks run with `lax.scan`.

Einsum letters: none (the arithmetic lives in the sublayers).

The stack stores every layer's weights with a leading `layers` axis (built by
`eqx.filter_vmap` over the constructor), so a 32-layer model compiles one layer body once
instead of 32 copies.
"""

from collections.abc import Callable
from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import PRNGKeyArray

from .._checks import check_spec
from .._config_checks import REMAT_POLICIES
from .._partition import gather_for_compute
from .._sharding import ShardingSpec
from .._types import Hidden, Positions, SegmentIds
from ..attention import LayerCache
from ._norm import RMSNorm
from ._rope import RotaryTables

OFFLOAD_NAME = "layer_input"


@final
class DecoderBlock(eqx.Module):
    """The pre-norm residual block: `x + attn(attn_norm(x))`, then `x + mlp(mlp_norm(x))`.

    One block serves every family: it takes its two sublayers built, so Llama, Qwen2/3 and
    Mistral pass a `SelfAttention` and a `SwiGLU`, DeepSeek a `MultiHeadLatentAttention`
    and a `SwiGLU` or `MoE`. The norms are `RMSNorm`s over `dim`. With `post_norms`, each
    sublayer's output is normalised too before it joins the residual stream,
    `x + attn_post_norm(attn(attn_norm(x)))` and likewise for the MLP (four norms per
    block, as Gemma 2 and 3).
    """

    attn_norm: RMSNorm
    attn: Callable[[Hidden, Positions | RotaryTables, SegmentIds | None], Hidden]
    mlp_norm: RMSNorm
    mlp: Callable[[Hidden], Hidden]
    attn_post_norm: RMSNorm | None
    mlp_post_norm: RMSNorm | None

    def __init__(
        self,
        attn: Callable[[Hidden, Positions | RotaryTables, SegmentIds | None], Hidden],
        mlp: Callable[[Hidden], Hidden],
        *,
        dim: int,
        norm_eps: float = 1e-5,
        dtype=jnp.float32,
        zero_centred_norms: bool = False,
        post_norms: bool = False,
    ):
        """**Arguments:**

        - `attn`: the attention sublayer, called as `attn(x, positions, segment_ids) -> x`
          (e.g. `SelfAttention`, `MultiHeadLatentAttention`). One with a
          `rotary_tables(positions)` method is passed those tables in place of the positions
          by `LayerStack` (see `rotary_tables`).
        - `mlp`: the feed-forward sublayer, called as `mlp(x) -> x` (e.g. `SwiGLU`, `MoE`).
        - `dim`: model width (`embed`), the size the two RMSNorms normalise.
        - `norm_eps`: RMSNorm epsilon.
        - `dtype`: dtype of the norm weights.
        - `zero_centred_norms`: the norms scale by `1 + weight` (`RMSNorm`'s
          `zero_centred`, as Gemma and Qwen3-Next).
        - `post_norms`: normalise each sublayer's output as well (`attn_post_norm`,
          `mlp_post_norm`), before the residual addition.

        **Raises:** `TypeError` when `attn` or `mlp` is not a callable Equinox module; as
        `RMSNorm` for `dim` or `norm_eps`.
        """
        for name, layer in (("attn", attn), ("mlp", mlp)):
            if not (isinstance(layer, eqx.Module) and callable(layer)):
                raise TypeError(
                    f"DecoderBlock's {name} must be a callable Equinox module (e.g. "
                    f"{'SelfAttention' if name == 'attn' else 'SwiGLU'}(...)); got "
                    f"{type(layer).__name__}."
                )

        def norm():
            return RMSNorm(dim, eps=norm_eps, dtype=dtype, zero_centred=zero_centred_norms)

        self.attn_norm, self.mlp_norm = norm(), norm()
        self.attn_post_norm, self.mlp_post_norm = (norm(), norm()) if post_norms else (None, None)
        self.attn = attn
        self.mlp = mlp

    def __call__(
        self,
        x: Hidden,
        positions: Positions | RotaryTables,
        segment_ids: SegmentIds | None = None,
    ) -> Hidden:
        """**Arguments:**

        - `x`: `[batch, seq, embed]` residual stream.
        - `positions`: `[batch, seq]` RoPE positions, or their `rotary_tables` (passed on
          to the attention as they are).
        - `segment_ids`: `[batch, seq]` packed-document ids, or `None`.

        **Returns:** the updated residual stream, same shape and dtype.

        **Raises:** as the sublayers' `__call__` (e.g.
        [`SelfAttention.__call__`][eqx_longctx.nn.SelfAttention.__call__]).
        """
        with jax.named_scope("attention"):
            x = x + _post(self.attn_post_norm, self.attn(self.attn_norm(x), positions, segment_ids))
        with jax.named_scope("mlp"):
            return self._mlp_residual(x)

    def _mlp_residual(self, x: Hidden) -> Hidden:
        return x + _post(self.mlp_post_norm, self.mlp(self.mlp_norm(x)))

    def rotary_tables(self, positions: Positions) -> RotaryTables | None:
        """**Returns:** the attention's RoPE tables at `positions` where it takes them in
        place of the positions (it has a `rotary_tables` method, as `SelfAttention` and
        `MultiHeadLatentAttention` do), else `None`."""
        tables = getattr(self.attn, "rotary_tables", None)
        return None if tables is None else tables(positions)

    def prefill(
        self,
        x: Hidden,
        positions: Positions,
        segment_ids: SegmentIds | None = None,
        *,
        impl=None,
        lengths=None,
    ):
        """`__call__`, also returning the attention's cache entry (`attn.prefill`, which
        gets the block implementation `impl`: `None` for the spec's; and `lengths`, each
        row's real tokens, when given: a layer with a fixed-size state takes it)."""
        kw = {} if lengths is None else {"lengths": lengths}
        with jax.named_scope("attention"):
            a, entry = self.attn.prefill(self.attn_norm(x), positions, segment_ids, impl=impl, **kw)  # pyright: ignore[reportAttributeAccessIssue]
        x = x + _post(self.attn_post_norm, a)
        with jax.named_scope("mlp"):
            return self._mlp_residual(x), entry

    def decode(self, x: Hidden, positions: Positions, cache: tuple, cache_positions, *, impl):
        """One new token per row (`attn.decode`); **returns** `(x, new cache entry)`."""
        with jax.named_scope("attention"):
            a, entry = self.attn.decode(  # pyright: ignore[reportAttributeAccessIssue]
                self.attn_norm(x), positions, cache, cache_positions, impl=impl
            )
        x = x + _post(self.attn_post_norm, a)
        with jax.named_scope("mlp"):
            return self._mlp_residual(x), entry


def _post(norm: RMSNorm | None, out: Hidden) -> Hidden:
    """A sublayer's output through its post-norm, if the block has one."""
    return out if norm is None else norm(out)


@final
class LayerStack(eqx.Module):
    """`n_layers` identical layers with stacked weights, applied in order with `lax.scan`.

    Each layer is called as `layer(x, positions, segment_ids) -> x`. The remat policy
    decides what the backward pass keeps from each layer's forward pass:

    - `"none"`: keep every intermediate (fastest, most memory).
    - `"full"`: keep only the layer inputs; recompute the layer in the backward pass.
    - `"dots"`: keep the results of matmuls without batch dimensions (the projections),
      recompute the cheap elementwise work (`jax.checkpoint_policies.
      dots_with_no_batch_dims_saveable`).
    - `"offload"`: as `"full"`, but the layer inputs are kept in pinned host memory
      (`jax.checkpoint_policies.save_and_offload_only_these_names`) rather than on the
      device; needs a backend with a `pinned_host` memory space (TPU, GPU, and CPU).

    With a spec whose `fsdp_axis` is set, each layer's weights are gathered over the fsdp
    axes inside the scan, just before the layer runs: one layer's full weights at a time.
    """

    __stacked_fields__ = {"layers": ("layers",)}  # `logical_axes`: the leading axis

    layers: eqx.Module
    n_layers: int = eqx.field(static=True)
    remat: str = eqx.field(static=True)
    spec: ShardingSpec | None = eqx.field(static=True)

    def __init__(
        self,
        make_layer: Callable[[PRNGKeyArray], eqx.Module],
        n_layers: int,
        *,
        key: PRNGKeyArray,
        remat: str = "none",
        spec: ShardingSpec | None = None,
    ):
        """**Arguments:**

        - `make_layer`: builds one layer from a PRNG key; vmapped over `n_layers` keys, so
          every array in the result gets a leading `layers` axis.
        - `n_layers`: number of layers (> 0).
        - `key`: PRNG key, split once per layer.
        - `remat`: one of `REMAT_POLICIES`.
        - `spec`: the sharding spec (its fsdp axes decide the per-layer gather), or `None`.

        **Raises:** `TypeError` when `spec` is not a `ShardingSpec` (or `None`); `ValueError`
        for `n_layers <= 0` or a `remat` not in `REMAT_POLICIES`.
        """
        check_spec(spec, "LayerStack")
        if n_layers <= 0:
            raise ValueError(f"LayerStack needs at least one layer; got n_layers={n_layers}.")
        self.layers = eqx.filter_vmap(make_layer)(jax.random.split(key, n_layers))
        self.n_layers = n_layers
        self.remat = remat
        self.spec = spec

    def __check_init__(self):
        if self.remat not in REMAT_POLICIES:
            raise ValueError(
                f"remat must be one of {REMAT_POLICIES}; got remat={self.remat!r}. "
                "Use 'none' to keep activations, 'full' to recompute each layer, 'dots' to "
                "keep only projection outputs."
            )

    def layer(self, i: int) -> eqx.Module:
        """**Returns:** layer `i` alone, its weights sliced out of the stack.

        **Raises:** `ValueError` unless `0 <= i < n_layers`.
        """
        if not 0 <= i < self.n_layers:
            raise ValueError(f"layer index must be in [0, {self.n_layers}); got i={i}.")
        params, static = eqx.partition(self.layers, eqx.is_array)
        return eqx.combine(jax.tree.map(lambda a: a[i], params), static)

    def __call__(
        self, x: Hidden, positions: Positions, segment_ids: SegmentIds | None = None
    ) -> Hidden:
        """**Arguments:**

        - `x`: `[batch, seq, embed]` residual stream.
        - `positions`: `[batch, seq]` RoPE positions.
        - `segment_ids`: `[batch, seq]` packed-document ids, or `None`.

        **Returns:** the residual stream after all layers, same shape and dtype.

        **Raises:** as each layer's `__call__` (e.g. `SelfAttention`'s, for a batch or
        sequence the spec's mesh does not split); with fsdp axes, `ValueError` as
        `eqx_longctx.param_pspecs` for a weight that does not split over the mesh.
        """
        params, static = eqx.partition(self.layers, eqx.is_array)
        # Layers whose attention takes RoPE tables in place of positions get them computed
        # here, once for every layer and for the backward's recomputation (they are the
        # same for all): in each layer they were 2.4% of the main job's CPU time (libm's
        # sincosf). They are closed over; nothing else depends on them alone.
        rotary = getattr(self.layers, "rotary_tables", None)
        tables = None if rotary is None else rotary(positions)

        # Positions and segment ids go in as per-layer inputs, not closed over: under
        # differentiation JAX hoists whatever depends only on loop invariants out of the
        # scan, which would materialise every attention block mask of every ring hop
        # (O(local seq x seq) bytes) instead of computing each one where it is used.
        def body(h, xs):
            layer_params, positions, segment_ids = xs
            with jax.named_scope("layer"):
                layer = gather_for_compute(eqx.combine(layer_params, static), self.spec)
                if self.remat == "offload":
                    h = checkpoint_name(h, OFFLOAD_NAME)
                return layer(h, positions if tables is None else tables, segment_ids), None

        if self.remat == "full":
            body = jax.checkpoint(body, prevent_cse=False)
        elif self.remat == "dots":
            body = jax.checkpoint(
                body,
                prevent_cse=False,
                policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            )
        elif self.remat == "offload":
            policy = jax.checkpoint_policies.save_and_offload_only_these_names(
                names_which_can_be_saved=[],
                names_which_can_be_offloaded=[OFFLOAD_NAME],
                offload_src="device",
                offload_dst="pinned_host",
            )
            body = jax.checkpoint(body, prevent_cse=False, policy=policy)

        def per_layer(a):
            return None if a is None else jnp.broadcast_to(a, (self.n_layers, *a.shape))

        per_layer_positions = per_layer(positions) if tables is None else None
        with jax.named_scope("layer_stack"):
            x, _ = lax.scan(body, x, (params, per_layer_positions, per_layer(segment_ids)))
        return x

    def _compute_layer(self, layer_params):
        static = eqx.filter(self.layers, eqx.is_array, inverse=True)
        return gather_for_compute(eqx.combine(layer_params, static), self.spec)

    def prefill(
        self, x: Hidden, positions: Positions, segment_ids, store: Callable, *, impl=None,
        lengths=None,
    ):  # fmt: skip
        """Run the layers as `__call__` does (no remat: inference), keeping each layer's
        cache entry as `store` turns it into cache slots.

        **Arguments:** as `__call__`; `store(entry) -> stored` maps one layer's `[batch, seq,
        ...]` cache entry (what `layer.prefill` returns) to what the cache keeps; `impl` the
        block implementation every layer's attention runs (`None`: the spec's); `lengths`
        `[batch]` each row's real tokens (the rest is padding), for layers that keep a
        fixed-size state (`None`: every token is real).

        **Returns:** `(x, stored)`: the residual stream after all layers and the stored
        entries, stacked over the layers.
        """

        def body(h, layer_params):
            layer = self._compute_layer(layer_params)
            kw = {} if lengths is None else {"lengths": lengths}
            h, entry = layer.prefill(h, positions, segment_ids, impl=impl, **kw)  # pyright: ignore[reportAttributeAccessIssue]
            return h, store(entry)

        with jax.named_scope("layer_stack"):
            return lax.scan(body, x, eqx.filter(self.layers, eqx.is_array))

    def decode(self, x: Hidden, positions: Positions, cache: tuple, cache_positions, *, impl):
        """One new token per row through every layer, each reading its layer of `cache`
        (arrays stacked over the layers, handed to the layer as a `LayerCache` view, so the
        layer's slice is read in place rather than copied out) and `cache_positions`.

        **Returns:** `(x, new)`: the residual stream and the new token's cache entries,
        stacked over the layers (the caller writes them into the cache).
        """
        cache = tuple(cache)

        def body(h, xs):
            layer_params, index = xs
            layer = self._compute_layer(layer_params)
            view = LayerCache(cache, index)
            return layer.decode(h, positions, view, cache_positions, impl=impl)  # pyright: ignore[reportAttributeAccessIssue]

        layers = jnp.arange(self.n_layers, dtype=jnp.int32)
        with jax.named_scope("layer_stack"):
            return lax.scan(body, x, (eqx.filter(self.layers, eqx.is_array), layers))
