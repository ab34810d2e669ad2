"""What one layer keeps for the backward pass, per device, under each remat policy.

The planner does not guess a transformer's saved activations from a formula: it asks JAX.
For each `LayerStack` of a model it builds the same stack with one layer at the shapes one
device computes with (the local batch and sequence shard, heads and hidden widths divided
by the tensor axis; no mesh, so attention is the local blockwise kernel) and lists what
the backward pass saves (`saved_residuals`, the function behind JAX's public
`jax.ad_checkpoint.print_saved_residuals`), leaving out the weights. Everything is
abstract: no array is allocated, so an 8B or 671B model at a million tokens costs a trace.

What a context-parallel strategy keeps beyond the local kernel's residuals (all-gather: the
gathered K/V; a linear-attention layer's wider chunk states) is added by `_step_plan.py`.

The full model's stacks are paired with the local model's by kind (`kind`: the classes of
the modules a layer is built from), so a hybrid's `local_config` keeps one layer per kind
and a 48-layer 3:1 hybrid (24 stacks) traces two layers, not 24.
"""

import dataclasses
import math
import re
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend.core import Var

from .. import _compat
from .._family import ModelFamily
from ..nn import LayerStack, MoE

REMATS = ("none", "dots", "offload", "full")


class StackActivations(NamedTuple):
    """Per-device bytes one layer of one `LayerStack` saves for the backward pass."""

    path: str  # where the stack sits in the model, e.g. "layers" or "moe_layers"
    n_layers: int  # layers of this kind in the full model
    saved: dict  # remat policy -> bytes one layer keeps on the device
    host: dict  # remat policy -> bytes one layer keeps in host memory (offload)
    recompute: int  # bytes of one layer's full set of residuals ("none"): what a
    # rematerialised layer rebuilds in its backward
    layer_input: int  # the `[batch, seq, embed]` input of one layer
    moe: bool  # the layer has a mixture of experts
    shared: int = 0  # bytes the stack keeps once for all its layers (RoPE's tables)


def stacks(model: Any) -> dict[str, LayerStack]:
    """**Returns:** every `LayerStack` of `model` by its attribute path (`"layers"`,
    `"layers[1]"`, `"moe_layers"`)."""
    found: dict[str, LayerStack] = {}
    is_stack = lambda x: isinstance(x, LayerStack)  # noqa: E731
    for path, leaf in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_stack)[0]:
        if isinstance(leaf, LayerStack):
            found[jax.tree_util.keystr(path).lstrip(".")] = leaf
    return found


def stack_activations(
    family: ModelFamily, config: Any, *, batch: int, seq: int, tensor: int = 1, expert: int = 1
) -> list[StackActivations]:
    """Saved bytes per layer of each `LayerStack` of a model, on one device.

    **Arguments:**

    - `family`: the model's `ModelFamily`.
    - `config`: the model's config (full size).
    - `batch`, `seq`: the batch rows and tokens one device holds.
    - `tensor`, `expert`: the tensor and expert axis sizes (see
      `ModelFamily.local_config`).

    **Returns:** one `StackActivations` per stack of the full model, in model order.
    """
    full = eqx.filter_eval_shape(family.model, config, key=jax.random.key(0))
    full_stacks = stacks(full)
    counts = {path: s.n_layers for path, s in full_stacks.items()}
    local = family.local_config(config, tensor=tensor, expert=expert)
    local = dataclasses.replace(local, max_seq_len=seq)
    dtype = jnp.dtype(config.compute_dtype)
    x = jax.ShapeDtypeStruct((batch, seq, config.dim), dtype)
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    out = []
    by_policy: dict[str, dict[str, int]] = {}
    shared: dict[str, int] = {}
    kinds: dict[str, tuple] = {}
    for remat in ("none", "dots", "full"):
        model = eqx.filter_eval_shape(
            family.model, dataclasses.replace(local, remat=remat), key=jax.random.key(0)
        )
        for path, stack in stacks(model).items():
            kinds[path] = kind(stack)
            tables = _stack_tables(stack, ids)
            by_policy.setdefault(path, {})[remat] = _saved_bytes(stack, x, ids, tables)
            shared[path] = sum(math.prod(t.shape) * t.dtype.itemsize for t in tables)
    for path, n in counts.items():
        local_path = _local_path(path, by_policy, kinds, kind(full_stacks[path]))
        saved = dict(by_policy[local_path])
        layer_input = math.prod(x.shape) * dtype.itemsize
        # "offload" keeps the layer inputs in host memory and recomputes the rest, as "full"
        saved["offload"] = saved["full"] - layer_input
        host = {r: layer_input if r == "offload" else 0 for r in REMATS}
        moe = any(isinstance(m, MoE) for m in jax.tree.leaves(full_stacks[path], is_leaf=_is_moe))
        out.append(
            StackActivations(
                path, n, saved, host, saved["none"], layer_input, moe, shared[local_path]
            )  # fmt: skip
        )
    return out


def _stack_tables(stack: LayerStack, ids) -> list:
    """The avals of the RoPE tables `stack` computes once for all its layers (none when
    its attention takes positions)."""
    rotary = getattr(stack.layers, "rotary_tables", None)
    if rotary is None:
        return []
    return jax.tree.leaves(eqx.filter_eval_shape(rotary, ids))


def _is_moe(x: Any) -> bool:
    return isinstance(x, MoE)


def kind(stack: LayerStack) -> tuple:
    """A stack's kind: the classes of the modules its layers are built from, nested in tree
    order (a linear-attention block and a softmax one differ, a dense MLP and a MoE differ;
    a sliding window, head counts or widths do not)."""
    return _module_kinds(stack.layers)


def _module_kinds(tree: Any) -> tuple:
    is_module = lambda x: isinstance(x, eqx.Module) and x is not tree  # noqa: E731
    return tuple(
        (type(m).__name__, _module_kinds(m))
        for m in jax.tree.leaves(tree, is_leaf=is_module)
        if isinstance(m, eqx.Module)
    )


def _local_path(path: str, by_policy: dict, kinds: dict | None = None, want=None) -> str:
    """The local model's stack that prices the full model's stack at `path`: the local
    stack of the same kind (`kinds`: local path -> `kind`; `want`: the full stack's), the
    same path first; else the same path, or for a model whose layers run as several stacks
    of one kind (a tuple of stacks whose windows differ, `"layers[1]"`) the local stack of
    that kind (`"layers"`). So a hybrid's local model needs one stack per kind, in any
    order, however many runs of layers the full model has."""
    if kinds is not None and want is not None:
        same = [p for p in by_policy if kinds.get(p) == want]
        if same:
            return path if path in same else same[0]
    name = re.sub(r"\[\d+\]$", "", path)
    for key in (path, name):
        if key in by_policy:
            return key
    raise ValueError(
        f"the family's local_config builds a model whose layer stacks are {sorted(by_policy)}, "
        f"with none for the full model's stack {path!r}; local_config must keep one stack of "
        "each kind the full model has (see eqx_longctx.ModelFamily.local_config)."
    )


def _saved_bytes(stack: LayerStack, x, ids, tables: list) -> int:
    """Bytes one layer of `stack` (a stack of one layer) saves for its backward, without
    the stack's `tables`: those are kept once for every layer (`StackActivations.shared`),
    which a stack of one layer cannot tell from its own."""
    params, static = eqx.partition(stack, lambda a: isinstance(a, jax.ShapeDtypeStruct))

    def layer(params, x, positions, segment_ids):
        return eqx.combine(params, static)(x, positions, segment_ids)

    once = [(tuple(t.shape), jnp.dtype(t.dtype)) for t in tables]
    total = 0
    for aval, why in _compat.saved_residuals(layer, params, x, ids, ids):
        if _compat.is_argument_residual(why) and not _compat.is_argument_residual(why, "x"):
            continue  # weights (counted as parameters), positions and segment ids (batch)
        shape, dtype = getattr(aval, "shape", ()), getattr(aval, "dtype", jnp.float32)
        if (tuple(shape), jnp.dtype(dtype)) in once:
            once.remove((tuple(shape), jnp.dtype(dtype)))
            continue
        total += math.prod(shape) * jnp.dtype(dtype).itemsize
    return total


def forward_working_set(
    family: ModelFamily,
    config: Any,
    *,
    batch: int,
    seq: int,
    tensor: int = 1,
    expert: int = 1,
    attention: int = 0,
) -> dict[str, int]:
    """Per-device bytes one layer holds at once in a forward pass (inference: nothing is
    kept for a backward), for each `LayerStack` path of the full model.

    Asked of JAX: one layer's `prefill` (its output and cache entry) is traced at the local
    shapes (as `stack_activations`) and its equations are walked in order, each result
    live from the equation that makes it to the last that reads it; the most bytes live at
    once, the layer input included and the weights left out (counted as parameters), is the
    working set. A nested call (a `jnp` function) counts its results, not its own
    temporaries; the attention's `custom_vjp` call adds `attention` bytes (its temporaries,
    from the attention cost model) to what is live beside it.

    **Returns:** path -> bytes.
    """
    full = eqx.filter_eval_shape(family.model, config, key=jax.random.key(0))
    local = family.local_config(config, tensor=tensor, expert=expert)
    local = dataclasses.replace(local, max_seq_len=seq, remat="none")
    model = eqx.filter_eval_shape(family.model, local, key=jax.random.key(0))
    dtype = jnp.dtype(config.compute_dtype)
    x = jax.ShapeDtypeStruct((batch, seq, config.dim), dtype)
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    local_stacks = stacks(model)
    by_path = {
        path: _forward_peak(stack, x, ids, attention) for path, stack in local_stacks.items()
    }
    kinds = {path: kind(stack) for path, stack in local_stacks.items()}
    return {
        path: by_path[_local_path(path, by_path, kinds, kind(stack))]
        for path, stack in stacks(full).items()
    }


def _forward_peak(stack: LayerStack, x, ids, attention: int) -> int:
    params, static = eqx.partition(stack.layers, lambda a: isinstance(a, jax.ShapeDtypeStruct))
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)

    def layer(params, x, positions):
        return eqx.combine(params, static).prefill(x, positions, None)

    closed = jax.make_jaxpr(layer)(one, x, ids)
    jaxpr = closed.jaxpr
    weights = set(jaxpr.invars[: len(jax.tree.leaves(one))])
    last = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, Var):
                last[v] = i
    for v in jaxpr.outvars:
        if isinstance(v, Var):
            last[v] = len(jaxpr.eqns)
    live = {v: _nbytes(v) for v in jaxpr.invars if v not in weights and v in last}
    peak = sum(live.values())
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.outvars:
            live[v] = _nbytes(v)
        extra = attention if eqn.primitive.name.startswith("custom_vjp") else 0
        peak = max(peak, sum(live.values()) + extra)
        for v in [v for v in live if last.get(v, -1) <= i]:
            del live[v]
    return peak


def _nbytes(v: Any) -> int:
    aval = v.aval
    return (
        math.prod(getattr(aval, "shape", ()))
        * jnp.dtype(getattr(aval, "dtype", jnp.float32)).itemsize
    )
