"""What one layer keeps for the backward pass, per device, under each remat policy.

The planner does not guess a transformer's saved activations from a formula: it asks JAX.
For each `LayerStack` of a model it builds the same stack with one layer at the shapes one
device computes with (the local batch and sequence shard, heads and hidden widths divided
by the tensor axis; no mesh, so attention is the local blockwise kernel) and lists what
the backward pass saves (`saved_residuals`, the function behind JAX's public
`jax.ad_checkpoint.print_saved_residuals`), leaving out the weights. Everything is
abstract: no array is allocated, so an 8B or 671B model at a million tokens costs a trace.

The context-parallel strategies add what the local kernel does not have (`strategy_extra`):
all-gather keeps the gathered K/V for the backward, Ulysses the all-to-all'd Q/K/V/output.
"""

import dataclasses
import math
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from . import _compat
from .nn import LayerStack, MoE

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


def local_config(family: str, config: Any, tensor: int, expert: int = 1) -> Any:
    """The family's config for one layer of each kind, with the per-device widths of a
    tensor axis of size `tensor` (heads and feed-forward widths divided).

    Under expert parallelism over `expert` devices, each device's experts multiply the rows
    its buffers receive: `expert x tokens x top_k` of them when dropless (every buffer has
    room for all of a device's copies), `capacity_factor x tokens x top_k` with a capacity.
    The local layer gets as many rows by routing each token to that many experts (greedy
    routing, so that any count is allowed)."""
    c = config
    if family == "llama":
        return dataclasses.replace(
            c, n_layers=1, layer_types=None, n_heads=c.n_heads // tensor,
            n_kv_heads=c.n_kv_heads // tensor, hidden_dim=c.hidden_dim // tensor,
            head_dim=c.head_dim,
        )  # fmt: skip
    if family == "deepseek":
        dense, moe = min(1, c.first_k_dense), min(1, c.n_layers - c.first_k_dense)
        routing = {}
        if expert > 1:
            cf = c.capacity_factor
            rows = c.top_k * expert if cf is None else math.ceil(c.top_k * cf)
            routing = dict(top_k=min(c.n_routed_experts, rows), topk_method="greedy", n_group=1,
                           topk_group=1, capacity_factor=None)  # fmt: skip
        return dataclasses.replace(
            c, n_layers=dense + moe, first_k_dense=dense, n_heads=c.n_heads // tensor,
            hidden_dim=c.hidden_dim // tensor, moe_hidden_dim=c.moe_hidden_dim // tensor,
            **routing,
        )  # fmt: skip
    raise ValueError(f"the planner knows families 'llama' and 'deepseek'; got {family!r}.")


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
    family: str, config: Any, *, batch: int, seq: int, tensor: int = 1, expert: int = 1
) -> list[StackActivations]:
    """Saved bytes per layer of each `LayerStack` of a model, on one device.

    **Arguments:**

    - `family`: `"llama"` or `"deepseek"`.
    - `config`: the model's config (full size).
    - `batch`, `seq`: the batch rows and tokens one device holds.
    - `tensor`: the tensor axis size (heads and hidden widths are divided by it).
    - `expert`: the expert axis size (see `local_config`).

    **Returns:** one `StackActivations` per stack of the full model, in model order.
    """
    from models import family as model_family

    fam = model_family(family)
    full = eqx.filter_eval_shape(fam.model, config, key=jax.random.key(0))
    full_stacks = stacks(full)
    counts = {path: s.n_layers for path, s in full_stacks.items()}
    local = dataclasses.replace(local_config(family, config, tensor, expert), max_seq_len=seq)
    dtype = jnp.dtype(config.compute_dtype)
    x = jax.ShapeDtypeStruct((batch, seq, config.dim), dtype)
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    out = []
    by_policy: dict[str, dict[str, int]] = {}
    for remat in ("none", "dots", "full"):
        model = eqx.filter_eval_shape(
            fam.model, dataclasses.replace(local, remat=remat), key=jax.random.key(0)
        )
        for path, stack in stacks(model).items():
            by_policy.setdefault(path, {})[remat] = _saved_bytes(stack, x, ids)
    for path, n in counts.items():
        key = path if path in by_policy else _first_of_kind(path, by_policy)
        saved = dict(by_policy[key])
        layer_input = math.prod(x.shape) * dtype.itemsize
        # "offload" keeps the layer inputs in host memory and recomputes the rest, as "full"
        saved["offload"] = saved["full"] - layer_input
        host = {r: layer_input if r == "offload" else 0 for r in REMATS}
        moe = any(isinstance(m, MoE) for m in jax.tree.leaves(full_stacks[path], is_leaf=_is_moe))
        out.append(StackActivations(path, n, saved, host, saved["none"], layer_input, moe))
    return out


def _is_moe(x: Any) -> bool:
    return isinstance(x, MoE)


def _first_of_kind(path: str, by_policy: dict) -> str:
    # A model whose layers run as several stacks of the same kind (windows that differ):
    # each is priced like the local model's stack.
    return next(iter(by_policy))


def _saved_bytes(stack: LayerStack, x, ids) -> int:
    params, static = eqx.partition(stack, lambda a: isinstance(a, jax.ShapeDtypeStruct))

    def layer(params, x, positions, segment_ids):
        return eqx.combine(params, static)(x, positions, segment_ids)

    total = 0
    for aval, why in _compat.saved_residuals(layer, params, x, ids, ids):
        if _compat.is_argument_residual(why) and not _compat.is_argument_residual(why, "x"):
            continue  # weights (counted as parameters), positions and segment ids (batch)
        shape, dtype = getattr(aval, "shape", ()), getattr(aval, "dtype", jnp.float32)
        total += math.prod(shape) * jnp.dtype(dtype).itemsize
    return total
