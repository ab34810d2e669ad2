"""One attention entry point; the sharding spec picks how it runs.

With `spec=None` the sequence lives on one device and the blockwise (flash) XLA path runs.
With a `ShardingSpec`, the inputs (global arrays in the spec's token layout) are placed on
the mesh and one of the context-parallel strategies runs under `jax.shard_map`:
`_all_gather.py`, `_ulysses.py`, `_ring.py`, `_usp.py`. Every strategy computes masks from
the original token positions of the layout, so every layout works with every strategy.
"""

from collections.abc import Callable
from typing import Any, cast, no_type_check

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from .._block_contract import AbstractBlockImpl as AbstractBlockImpl
from .._block_contract import BlockOptions as BlockOptions
from .._layout import layout_order
from .._partition import local_shape, param_pspecs
from .._sharding import ShardingSpec
from . import _halo
from ._all_gather import all_gather_latent_attention
from ._block import PlatformChoice as PlatformChoice
from ._block import apply_sinks as apply_sinks
from ._block import block_attention as block_attention
from ._block import merge_partials as merge_partials
from ._choose import choose_strategy as choose_strategy
from ._choose import explain as explain
from ._choose import plan as plan_attention
from ._choose import resolve_strategy as resolve_strategy
from ._cost import DEFAULT_BYTES_PER_S as DEFAULT_BYTES_PER_S
from ._cost import DEFAULT_FLOPS_PER_S as DEFAULT_FLOPS_PER_S
from ._cost import STRATEGY_ORDER as STRATEGY_ORDER
from ._decode import LayerCache as LayerCache
from ._decode import decode_attention as decode_attention
from ._explain import Plan as Plan
from ._halo import halo_latent_attention, halo_plan
from ._impls import check_impl as check_impl
from ._impls import flash_attention as flash_attention
from ._impls import resolve_block_impl as resolve_block_impl
from ._local import XlaBlockImpl as XlaBlockImpl
from ._reference import reference_attention as reference_attention
from ._ring import _kv_identity, ring_latent_attention
from ._tiling_policy import ring_hops, tiling, zigzag_halves
from ._ulysses import ulysses_attention
from ._usp import usp_attention
from ._validate import (
    as_float_arrays,
    as_ids,
    check_attention_inputs,
)
from ._validate import check_options as check_options
from ._validate import check_sinks as check_sinks
from ._validate import check_spec_inputs as check_spec_inputs
from ._validate import check_tensor_heads as check_tensor_heads
from ._validate import check_variants as check_variants


@no_type_check  # validated eagerly, with errors that say what to fix
def attention(
    # Types and shapes are checked eagerly (`_validate.py`), with errors that say what to
    # fix, hence the loose annotations; the docstring gives the shapes.
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    spec: ShardingSpec | None = None,
    causal: bool = True,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: ArrayLike | None = None,
    segment_ids: ArrayLike | None = None,
    scale: float | None = None,
    impl: str | None = None,
) -> Float[Array, "batch seq q_heads v_head_dim"]:
    """Scaled dot-product attention over long sequences, on one device or context-parallel.

    Supports MHA, GQA and MQA (`q_heads` a multiple of `kv_heads`, K/V never repeated on one
    device), `v_head_dim != head_dim`, any sequence length on one device, float32 or
    bfloat16 inputs with float32 accumulation. Memory is O(seq): scores are computed block
    by block with an online softmax, blocks the causal mask or the segment ids leave empty
    are skipped, and the backward pass recomputes scores blockwise instead of storing them.

    **Arguments:**

    - `q`: `[batch, seq, q_heads, head_dim]`.
    - `k`: `[batch, seq, kv_heads, head_dim]`.
    - `v`: `[batch, seq, kv_heads, v_head_dim]`.
    - `spec`: a `ShardingSpec`, or `None` for one device. With a spec, all arrays are global
      arrays (sharded or not) in the spec's token layout (see `to_layout`).
    - `causal`: query `i` attends keys `j <= i` (by original token index).
    - `window`: sliding-window size `W`, or `None`: query `i` then sees keys `j` with
      `0 <= i - j < W` (Hugging Face's `sliding_window` rule; needs `causal=True`). Blocks
      and ring hops wholly outside the window are skipped, so the cost is O(W) per query.
    - `chunk`: chunked attention (Llama 4), or `None`: query `i` sees key `j <= i` only if
      `i // chunk == j // chunk` (original token positions; needs `causal=True`). Blocks
      and ring hops outside every chunk are skipped. Composes with `window`.
    - `softcap`: soft-capping of the scaled scores, `x -> softcap * tanh(x / softcap)`
      before the softmax (Gemma 2), or `None`.
    - `sinks`: `[q_heads]` float learned logits (GPT-OSS's attention sinks), or `None`: each
      joins every row's softmax denominator and carries no value. Applied once after the
      partial results are merged, so every strategy and layout supports it; its gradient is
      exact (under a mesh, summed over the devices that hold each head).
    - `segment_ids`: `[batch, seq]` ints; tokens attend only within their own segment
      (packed documents stay isolated).
    - `scale`: score scale, default `1/sqrt(head_dim)`.
    - `impl`: the block implementation: `"auto"` (the Pallas TPU kernels on TPU, the Pallas
      GPU kernels on a GPU, XLA elsewhere), `"xla"`, `"pallas"` (TPU kernels) or
      `"pallas_gpu"` (GPU kernels; on a CPU, either in Pallas interpret mode); `None` takes
      the spec's `impl` (`"auto"` without a spec).

    **Returns:** `[batch, seq, q_heads, v_head_dim]` (layout order) in the common dtype of
    `q`, `k`, `v` (mixed float dtypes are promoted; NumPy arrays are accepted).

    **Raises:** `TypeError` for non-float q/k/v or sinks, or a `spec` that is not a
    `ShardingSpec`; `ValueError` for shapes that do not fit together or do not split over
    the spec's mesh, `sinks` not `[q_heads]`, `softcap <= 0`, `chunk < 1` or `chunk`
    without `causal`.

    NaN and inf propagate as in naive softmax attention: a non-finite value in a query, or
    in a key or value that the query sees, makes that query's output non-finite. Keys a
    query does not see never affect it.
    """
    window = check_options("attention", spec, causal, scale, window)
    softcap, chunk = check_variants("attention", causal, softcap, chunk)
    impl = _impl_name(impl, spec)
    q, k, v = as_float_arrays("attention", q=q, k=k, v=v)
    segment_ids = as_ids(segment_ids, "segment_ids")
    check_attention_inputs(q, k, v, segment_ids)
    sinks = check_sinks("attention", sinks, q.shape[2])
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)
    if spec is None:
        out, lse = flash_attention(
            q,
            k,
            v,
            q_segment_ids=segment_ids,
            kv_segment_ids=segment_ids,
            causal=causal,
            window=window,
            chunk=chunk,
            softcap=softcap,
            scale=scale,
            impl=impl,
        )
        return out if sinks is None else apply_sinks(out, lse, sinks)
    options = BlockOptions.make(causal, window, scale, q.shape[-1], softcap, chunk)
    strategy = resolve_strategy(spec, q, k, _reach_window(options))
    check_spec_inputs(spec, q, k, strategy)
    out = _context_parallel(
        spec, strategy, q, (k, v), _kv_identity, (), segment_ids, options, impl, sinks=sinks
    )
    return cast(Array, out)


def _reach_window(options: BlockOptions) -> int | None:
    """The window that bounds what a query sees (`window`, `chunk`, whichever is tighter),
    as the strategy's cost and the ring's hops count it; `None`: unbounded."""
    reach = options.reach
    return None if reach is None else reach + 1


@no_type_check  # validated eagerly, with errors that say what to fix
def latent_attention(
    q: ArrayLike,
    latent,
    up_project: Callable,
    *,
    spec: ShardingSpec | None = None,
    causal: bool = True,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: ArrayLike | None = None,
    segment_ids: ArrayLike | None = None,
    scale: float | None = None,
    impl: str | None = None,
) -> Float[Array, "batch seq q_heads v_head_dim"]:
    """Attention whose keys and values are up-projected from a compressed per-token latent.

    For multi-head latent attention (DeepSeek-V2, arXiv:2405.04434): the K/V of every token
    are a function of a small latent (the normalised KV compression plus the shared RoPE
    key). Context-parallel strategies then move the latent instead of per-head K/V:
    `"all_gather"` gathers latents, `"ring"` passes latents around the ring (and latent-sized
    gradient accumulators back), and each device runs the up-projection for the tokens it
    holds. `"ulysses"` and `"usp"` up-project the local tokens first and split heads as usual.

    Under a `tensor_axis` the heads split over it as DeepSeek's own tensor parallelism does:
    `q` and the output are split over heads, the latent stays whole on every tensor shard,
    and the up-projection's arrays split over heads as the rules table splits their logical
    axes (`eqx_longctx.ShardingRules`), so each shard up-projects its own heads.

    **Arguments:**

    - `q`: `[batch, seq, q_heads, head_dim]`.
    - `latent`: a pytree of `[batch, seq, ...]` arrays (e.g. `(c_kv, k_rope)`).
    - `up_project`: `up_project(latent) -> (k, v)` with `k` `[batch, seq, kv_heads,
      head_dim]` and `v` `[batch, seq, kv_heads, v_head_dim]`; an Equinox module (its arrays
      are differentiated, and replicated over the mesh except for a `tensor_axis`, over
      which they split as their annotations' logical axes say, e.g. `Float[Array,
      "kv_lora_rank heads nope_plus_v"]`) or a function (then no `tensor_axis`).
    - `spec`, `causal`, `window`, `chunk`, `softcap`, `sinks`, `segment_ids`, `scale`,
      `impl`: as in `attention`.

    **Returns:** `[batch, seq, q_heads, v_head_dim]` (layout order) in the common dtype of
    `q` and the arrays `up_project` returns (mixed float dtypes are promoted).

    **Raises:** as `attention`; also `TypeError` when `up_project` is not callable or
    returns non-float arrays, and `ValueError` when it does not return a pair `(k, v)`, a
    latent array is not laid out `[batch, seq, ...]` like `q`, the heads do not divide over
    the spec's `tensor_axis`, or under a `tensor_axis` the up-projection's arrays have no
    logical axes or, split by them, do not give each device its share of the heads.
    """
    window = check_options("latent_attention", spec, causal, scale, window)
    softcap, chunk = check_variants("latent_attention", causal, softcap, chunk)
    impl = _impl_name(impl, spec)
    if not callable(up_project):
        raise TypeError(
            f"latent_attention: up_project must be callable, up_project(latent) -> (k, v); got "
            f"{type(up_project).__name__}."
        )
    (q,) = as_float_arrays("latent_attention", q=q)
    latent = jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), latent)
    segment_ids = as_ids(segment_ids, "segment_ids")
    params, static = eqx.partition(up_project, eqx.is_array)
    k_shape, v_shape = _kv_shapes(up_project, latent)
    check_attention_inputs(q, k_shape, v_shape, segment_ids)
    sinks = check_sinks("latent_attention", sinks, q.shape[2])
    if spec is None:
        k, v = up_project(latent)
        return attention(
            q, k, v, causal=causal, window=window, chunk=chunk, softcap=softcap, sinks=sinks,
            segment_ids=segment_ids, scale=scale, impl=impl,
        )  # fmt: skip
    for leaf in jax.tree.leaves(latent):
        if tuple(leaf.shape[:2]) != tuple(q.shape[:2]):
            raise ValueError(
                f"every latent array must be laid out [batch, seq, ...] like q {tuple(q.shape[:2])}"
                f"; got a latent array of shape {tuple(leaf.shape)}."
            )
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)
    options = BlockOptions.make(causal, window, scale, q.shape[-1], softcap, chunk)
    strategy = resolve_strategy(spec, q, k_shape, _reach_window(options))
    check_spec_inputs(spec, q, k_shape, strategy)
    expand = _Expand(static)
    params_specs = _up_projection_pspecs(spec, up_project, params, expand, latent, k_shape)
    out = _context_parallel(
        spec, strategy, q, latent, expand, params, segment_ids, options, impl, params_specs,
        sinks=sinks,
    )  # fmt: skip
    return cast(Array, out)


def _kv_shapes(up_project, latent):
    """Shapes of `up_project(latent)`, which must be a pair `(k, v)` of float arrays."""
    out = jax.eval_shape(up_project, latent)
    is_pair = isinstance(out, tuple | list) and len(out) == 2
    if not is_pair or not all(isinstance(x, jax.ShapeDtypeStruct) for x in out):
        got = jax.tree.map(lambda x: getattr(x, "shape", x), out)
        raise ValueError(
            "latent_attention needs up_project(latent) to return a pair (k, v) of arrays, k "
            "[batch, seq, kv_heads, head_dim] and v [batch, seq, kv_heads, v_head_dim]; got "
            f"{type(out).__name__} {got}. Return `k, v`."
        )
    for name, x in zip(("k", "v"), out, strict=True):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"latent_attention needs up_project to return floating-point k and v; got "
                f"{name} of dtype {x.dtype}."
            )
    return out


def _up_projection_pspecs(spec, up_project, params, expand, latent, k_shape):
    """Where the up-projection's arrays live inside the strategies: replicated over the
    batch and sequence axes and, under a tensor axis, split over their `heads` as the rules
    table splits them (the layout `SelfAttention`'s projections get from the same table).
    Each tensor shard then up-projects its own heads from the whole latent, which stays
    replicated over the tensor axis; the latent's gradient is summed over it.

    **Raises:** `ValueError` when, split that way, `up_project` does not give each tensor
    shard its share of the K/V heads (arrays with no logical axes, or held in a closure).
    """
    nt = spec.axis_size(spec.tensor_axis)
    if nt == 1:
        return jax.tree.map(lambda _: PartitionSpec(), params)
    where = f"latent_attention under tensor_axis={spec.tensor_axis!r} ({nt} devices)"
    try:
        pspecs = param_pspecs(up_project, spec, gathered=True)
    except ValueError as e:
        raise ValueError(
            f"{where} splits the up-projection's weights by their logical axes: {e}"
        ) from None
    local = jax.tree.map(
        lambda x, ps: jax.ShapeDtypeStruct(local_shape(spec, x.shape, ps), x.dtype), params, pspecs
    )
    k_local, _ = jax.eval_shape(expand, local, latent)
    want = k_shape.shape[2] // nt
    if k_local.shape[2] != want:
        raise ValueError(
            f"{where} runs each device's {want} of the {k_shape.shape[2]} K/V heads, but "
            f"up_project, with its arrays split as the rules table says, makes "
            f"{k_local.shape[2]}. Make up_project an Equinox module whose weights name their "
            'head dimension "heads" (e.g. Float[Array, "kv_lora_rank heads head_dim"]), not '
            "a function closing over arrays, or use tensor_axis=None."
        )
    return pspecs


class _Expand(eqx.Module):
    """`expand(params, source) -> (k, v)`: the up-projection rebuilt from its arrays."""

    static: Any = eqx.field(static=True)

    def __call__(self, params, source):
        return eqx.combine(params, self.static)(source)


def _impl_name(impl, spec) -> Any:
    """The implementation to run: `impl`, else the spec's (a name checked against `IMPLS`,
    or an `AbstractBlockImpl`), resolved later by `resolve_block_impl`."""
    if impl is None:
        impl = "auto" if spec is None else spec.impl
    return check_impl(impl)


def _context_parallel(
    spec, strategy, q, source, expand, params, segment_ids, options, impl, params_specs=None,
    *, sinks=None,
):  # fmt: skip
    """Run `strategy` under `shard_map`; `expand(params, source) -> (k, v)` builds K/V from
    `params` laid out as `params_specs` (default: replicated). Every strategy returns
    `(out, lse)`; `sinks` join them after the `shard_map` (`apply_sinks`), where each
    device's heads take their own sinks and their gradients sum over the devices."""
    b, s = q.shape[:2]
    positions = jnp.broadcast_to(jnp.asarray(layout_order(spec, s)), (b, s))
    heads, tokens = spec.heads_pspec(), spec.token_pspec()
    dense = expand is _kv_identity

    def source_pspec(x):
        if dense:
            return heads
        return PartitionSpec(spec.batch_entry(), spec.sequence_axes, *([None] * (x.ndim - 2)))

    source_specs = jax.tree.map(source_pspec, source)
    q = spec.place(q, heads)
    source = jax.tree.map(spec.place, source, source_specs)
    positions = spec.place(positions, tokens)
    if params_specs is None:
        params_specs = jax.tree.map(lambda _: PartitionSpec(), params)
    else:
        params = jax.tree.map(spec.place, params, params_specs)
    exchange = None
    if strategy in _halo.HALO_REPLACES:  # a local layer: a neighbour exchange, not whole shards
        exchange = halo_plan(layout_order(spec, s), spec.context_parallel_size, options)
        strategy = strategy if exchange is None else "halo"
    hops = None
    if strategy in ("ring", "usp"):
        hops = ring_hops(spec, s, options.causal, _reach_window(options))
    # Outside USP, a strategy runs over every sequence axis (two of them when "auto" had a
    # ulysses axis to choose with); collectives accept a tuple of mesh axes.
    axes = spec.sequence_axes
    axis = axes[0] if len(axes) == 1 else axes

    block_impl = resolve_block_impl(impl, spec=spec, tiling=tiling(spec, s), dtype=q.dtype)
    kw: dict[str, Any] = dict(impl=block_impl, options=options)
    halves = zigzag_halves(spec, s, options.causal)

    def local(q, params, source, positions, segment_ids):
        with jax.named_scope(f"{strategy}_attention"):  # how a profile names the strategy
            out, lse = strategy_local(q, params, source, positions, segment_ids)
        return out if sinks is None else (out, lse)

    def strategy_local(q, params, source, positions, segment_ids):
        if strategy == "all_gather":
            fn = all_gather_latent_attention
            return fn(
                q, source, expand, params, positions, segment_ids, axis=axis, halves=halves, **kw
            )
        if strategy == "halo":
            assert exchange is not None  # set with the strategy
            fn = halo_latent_attention
            return fn(
                q, source, expand, params, positions, segment_ids, axis=axis, plan=exchange, **kw
            )
        if strategy == "ring":
            fn = ring_latent_attention
            return fn(q, source, expand, params, positions, segment_ids, axis=axis, hops=hops, **kw)
        k, v = expand(params, source)  # Ulysses splits heads of up-projected K/V
        if strategy == "ulysses":
            return ulysses_attention(
                q, k, v, positions, segment_ids, axis=axis, halves=halves, **kw
            )
        return usp_attention(
            q,
            k,
            v,
            positions,
            segment_ids,
            ulysses_axis=spec.ulysses_axis,
            ring_axis=spec.context_axis,
            hops=hops,
            **kw,
        )

    in_specs = (heads, params_specs, source_specs, tokens)
    args = (q, params, source, positions)
    if segment_ids is not None:
        args, in_specs = (*args, spec.place(segment_ids, tokens)), (*in_specs, tokens)
    mesh = spec.compute_mesh()

    fn = local
    if segment_ids is None:
        fn = lambda q, p, src, pos: local(q, p, src, pos, None)  # noqa: E731
    out_specs = heads if sinks is None else (heads, PartitionSpec(*heads[:3]))
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    if sinks is None:
        return mapped(*args)
    out, lse = mapped(*args)
    return apply_sinks(out, lse, spec.place(sinks, PartitionSpec(heads[2])))


__all__ = [
    "DEFAULT_BYTES_PER_S",
    "DEFAULT_FLOPS_PER_S",
    "STRATEGY_ORDER",
    "AbstractBlockImpl",
    "BlockOptions",
    "LayerCache",
    "Plan",
    "XlaBlockImpl",
    "apply_sinks",
    "attention",
    "block_attention",
    "check_impl",
    "check_options",
    "check_sinks",
    "check_spec_inputs",
    "check_tensor_heads",
    "check_variants",
    "choose_strategy",
    "decode_attention",
    "explain",
    "flash_attention",
    "latent_attention",
    "merge_partials",
    "PlatformChoice",
    "plan_attention",
    "reference_attention",
    "resolve_block_impl",
    "resolve_strategy",
]
