"""Where every weight lives: logical axes, one rules table, and the placement it implies.

Every weight names its dimensions in its jaxtyping annotation (`wq: Float[Array, "embed
q_heads head_dim"]`); those names are its *logical axes*, and weights inside a `LayerStack`
get a leading `"layers"` axis. One table, `ShardingRules`, maps logical axes to mesh axes
(the idea of jax-llm-examples' `ShardingRules` and MaxText's logical axis rules):

| logical axes                              | mesh axes (default)      | parallelism          |
|-------------------------------------------|--------------------------|----------------------|
| `embed`                                   | `spec.fsdp_axis`         | FSDP (ZeRO-3)        |
| `q_heads`, `kv_heads`, `heads`, `key_heads`, `hidden` | `spec.tensor_axis` | tensor (Megatron) |
| `vocab`                                   | `spec.tensor_axis`       | vocabulary-parallel  |
| `experts`                                 | `spec.expert_axis`       | expert               |
| `q_lora_rank`, `kv_lora_rank` (MLA)       | `spec.fsdp_axis`, as a fallback | FSDP          |
| everything else (`layers`, `head_dim`, norms, latent widths) | replicated |                |

A *fallback* axis takes the fsdp axes only where no other dimension of the same weight
does and its size divides: MLA's up-projections `wq_b` `[q_lora_rank, heads, ...]` and
`wkv_b` `[kv_lora_rank, heads, ...]` have no `embed` dimension, and would otherwise stay
whole on every device (12.4 GiB per chip for DeepSeek-V3 in float32), while `wq_a`
`[embed, q_lora_rank]` keeps its split on `embed`. Naming a fallback axis in
`ShardingSpec(rules=...)` makes it an ordinary entry.

Column-parallel (Q/K/V, gate, up: `[embed, heads|hidden]`) and row-parallel (O, down:
`[heads|hidden, embed]`) layouts follow from the same table. A layer computes with its
weights *gathered* over the fsdp axes (`param_pspecs(..., gathered=True)`); `LayerStack`
gathers one layer at a time inside its scan.
"""

import dataclasses
import math
import typing
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

from ._sharding import ShardingSpec

# The parallelism each logical axis takes by default ("fsdp", "tensor", "expert"), or None.
DEFAULT_ROLES: dict[str, str | None] = {
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "heads": "tensor",
    "key_heads": "tensor",  # Gated DeltaNet's query/key heads (its value heads are "heads")
    "hidden": "tensor",
    "vocab": "tensor",
    "experts": "expert",
    "q_lora_rank": "fsdp_fallback",
    "kv_lora_rank": "fsdp_fallback",
    **{
        name: None
        for name in (
            "layers", "head_dim", "dim", "qk_head_dim", "v_head_dim", "latent_and_rope",
            "nope_and_v", "nope_plus_v", "conv", "gate_rank",
        )
    },
}  # fmt: skip


@typing.final
class ShardingRules:
    """The table from logical axis names to mesh axes, for one `ShardingSpec`.

    Built by `ShardingRules.for_spec(spec)`: the default roles above resolved against the
    spec's `fsdp_axis`, `tensor_axis` and `expert_axis`, then the spec's `rules` overrides.

    **Arguments:**

    - `table`: logical axis name -> tuple of mesh axis names (`()` = replicated).
    - `spec`: the spec the table belongs to (for mesh sizes and the fsdp axes).
    - `fallback`: names whose entry applies only where no other dimension of a weight uses
      those mesh axes and the size divides (otherwise the dimension stays whole).
    """

    def __init__(
        self,
        table: Mapping[str, tuple[str, ...]],
        spec: ShardingSpec,
        fallback: frozenset[str] = frozenset(),
    ):
        self.table = dict(table)
        self.spec = spec
        self.fallback = frozenset(fallback)

    @classmethod
    def for_spec(cls, spec: ShardingSpec) -> "ShardingRules":
        """**Returns:** the default table for `spec`, with `spec.rules` applied on top.

        **Raises:** `ValueError` when `spec.rules` names an axis the mesh does not have.
        """
        by_role = {
            "fsdp": spec.fsdp_axis,
            "fsdp_fallback": spec.fsdp_axis,
            "tensor": () if spec.tensor_axis is None else (spec.tensor_axis,),
            "expert": () if spec.expert_axis is None else (spec.expert_axis,),
            None: (),
        }
        table = {name: by_role[role] for name, role in DEFAULT_ROLES.items()}
        fallback = {name for name, role in DEFAULT_ROLES.items() if role == "fsdp_fallback"}
        names = spec.mesh.axis_names
        for name, axes in spec.rules:
            for axis in axes:
                if axis not in names:
                    raise ValueError(
                        f"ShardingSpec rules[{name!r}]={axes!r} names {axis!r}, which is not an "
                        f"axis of the mesh {tuple(names)}. Use those names, or None."
                    )
            table[name] = axes
            fallback.discard(name)
        return cls(table, spec, frozenset(fallback))

    def mesh_axes(self, name: str, where: str = "a weight") -> tuple[str, ...]:
        """**Returns:** the mesh axes logical axis `name` is split over (`where` names the
        array in messages).

        **Raises:** `ValueError` when the table does not map `name`.
        """
        if name not in self.table:
            raise ValueError(
                f"{where} has logical axis {name!r}, which the rules table does not map; known "
                f"axes: {sorted(self.table)}. Name the dimension after one of them in the "
                f"weight's annotation, or add it: ShardingSpec(..., rules={{{name!r}: None}})."
            )
        return self.table[name]

    def pspec(
        self, names: tuple[str, ...], shape: tuple[int, ...], where: str, *, gathered: bool = False
    ) -> PartitionSpec:
        """The mesh `PartitionSpec` of an array with logical axes `names` and `shape`.

        **Arguments:**

        - `names`, `shape`: one logical name per dimension, and the sizes.
        - `where`: the array's path, for messages.
        - `gathered`: leave out the fsdp axes (the layout a layer computes with).

        **Returns:** the spec. A fallback axis (`self.fallback`) is split only where its mesh
        axes are free in this array and its size divides; otherwise it stays whole.

        **Raises:** `ValueError` if the table does not map a name, a mesh axis would be used
        twice, or a dimension does not divide over its mesh axes.
        """
        entries: list[Any] = [None] * len(names)
        used: dict[str, str] = {}
        order = sorted(range(len(names)), key=lambda i: names[i] in self.fallback)
        for i in order:
            name, size = names[i], shape[i]
            axes = self.mesh_axes(name, where)
            if gathered:
                axes = tuple(a for a in axes if a not in self.spec.fsdp_axis)
            if name in self.fallback:
                n = math.prod(self.spec.axis_size(a) for a in axes)
                if any(a in used for a in axes) or size % n:
                    continue  # whole: the axes are taken here, or the size does not divide
            for axis in axes:
                if axis in used:
                    raise ValueError(
                        f"{where}: mesh axis {axis!r} is used twice, for logical axes "
                        f"{used[axis]!r} and {name!r} (logical axes {names}). A mesh axis can "
                        "split one dimension of a weight; change the rules table "
                        "(ShardingSpec(..., rules=...)) so they differ."
                    )
                used[axis] = name
            n = math.prod(self.spec.axis_size(a) for a in axes)
            if size % n:
                sizes = " x ".join(f"{a}={self.spec.axis_size(a)}" for a in axes)
                raise ValueError(
                    f"{where}: logical axis {name!r} has size {size}, which does not split over "
                    f"mesh axes {sizes} ({n} shards). Choose mesh sizes that divide {size}, pad it "
                    f"to a multiple of {n} (e.g. {-(-size // n) * n}), or keep it whole: "
                    f"ShardingSpec(..., rules={{{name!r}: None}})."
                )
            entries[i] = None if not axes else axes[0] if len(axes) == 1 else axes
        return PartitionSpec(*entries)


def _annotation_dims(annotation: Any) -> tuple[str, ...] | None:
    """The dimension names of a jaxtyping annotation (`Float[Array, "a b"] | None`)."""
    candidates = typing.get_args(annotation) or (annotation,)
    for t in candidates:
        dims = getattr(t, "dims", None)
        if dims is not None and hasattr(t, "dim_str"):
            names = tuple(getattr(d, "name", None) for d in dims)
            if all(isinstance(n, str) for n in names):
                return tuple(typing.cast(str, n) for n in names)
            return None
    return None


def _path_text(path) -> str:
    return "".join(
        f".{k.name}"
        if isinstance(k, GetAttrKey)
        else f"[{getattr(k, 'idx', getattr(k, 'key', k))!r}]"
        for k in path
    )


def _axes_of(root: Any, path, leaf, leading: tuple[str, ...]) -> PartitionSpec:
    obj, prefix, dims = root, leading, None
    for key in path:
        if isinstance(key, GetAttrKey):
            field = next((f for f in dataclasses.fields(obj) if f.name == key.name), None)
            if field is not None:
                dims = _annotation_dims(field.type)
            prefix += getattr(type(obj), "__stacked_fields__", {}).get(key.name, ())
            obj = getattr(obj, key.name)
        elif isinstance(key, SequenceKey):
            obj = obj[key.idx]
        elif isinstance(key, DictKey):
            obj = obj[key.key]
        else:  # flattened attributes of a non-module pytree: keep the field's annotation
            continue
    where = f"weight {type(root).__name__}{_path_text(path)}"
    if dims is None:
        raise ValueError(
            f"{where} (shape {tuple(leaf.shape)}) declares no logical axes: annotate its field "
            'with named dimensions, e.g. Float[Array, "embed hidden"].'
        )
    names = prefix + dims
    if len(names) != leaf.ndim:
        raise ValueError(
            f"{where} has shape {tuple(leaf.shape)} but logical axes {names}: the annotation "
            "and the array disagree in rank."
        )
    return PartitionSpec(*names)


def logical_axes(model: Any, *, leading: tuple[str, ...] = ()) -> Any:
    """The logical axes of every array in `model`.

    **Arguments:**

    - `model`: a module (or `eqx.filter_eval_shape` output).
    - `leading`: names of leading axes the annotations do not show (`("layers",)` for a
      stacked layer taken out of its `LayerStack`).

    **Returns:** a pytree shaped like `eqx.filter(model, eqx.is_array)` whose leaves are
    `PartitionSpec`s of logical names, e.g. `P("layers", "embed", "hidden")`.

    **Raises:** `ValueError` for an array whose field annotation names no dimensions, or
    whose rank differs from its annotation's.
    """
    arrays = eqx.filter(model, _is_array_like)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: _axes_of(model, path, leaf, leading), arrays
    )


def _is_array_like(x: Any) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or eqx.is_array(x)


def _spec_of(model: Any, spec: ShardingSpec | None) -> ShardingSpec | None:
    if spec is None:
        spec = getattr(model, "spec", None)
    if spec is not None and not isinstance(spec, ShardingSpec):
        raise TypeError(f"spec must be a ShardingSpec or None; got {type(spec).__name__}.")
    return spec


def param_pspecs(
    model: Any,
    spec: ShardingSpec | None = None,
    *,
    gathered: bool = False,
    leading: tuple[str, ...] = (),
) -> Any:
    """The mesh `PartitionSpec` of every array in `model` under the rules table.

    **Arguments:**

    - `model`: a module or its `eqx.filter_eval_shape` output.
    - `spec`: the sharding spec (default `model.spec`); `None` on both gives `P()`
      everywhere.
    - `gathered`: leave out the fsdp axes (how a layer computes).
    - `leading`: as in `logical_axes`.

    **Returns:** a pytree shaped like `eqx.filter(model, eqx.is_array)`.

    **Raises:** `TypeError` when `spec` is not a `ShardingSpec`; `ValueError` as
    `logical_axes`, for a logical axis the rules table does not map, a mesh axis used twice
    by one array, or a dimension that does not divide over its mesh axes.
    """
    spec = _spec_of(model, spec)
    axes = logical_axes(model, leading=leading)
    arrays = eqx.filter(model, _is_array_like)
    if spec is None:
        return jax.tree.map(lambda _: PartitionSpec(), arrays)
    rules = ShardingRules.for_spec(spec)
    name = type(model).__name__

    def one(path, names, leaf):
        where = f"weight {name}{_path_text(path)}"
        return rules.pspec(tuple(names), tuple(leaf.shape), where, gathered=gathered)

    return jax.tree_util.tree_map_with_path(one, axes, arrays)


def param_shardings(model: Any, spec: ShardingSpec | None = None) -> Any:
    """A `NamedSharding` per array of `model`, for `jit` in/out shardings, optimizer state
    and checkpoint restore targets.

    **Arguments:**

    - `model`: a module or its `eqx.filter_eval_shape` output.
    - `spec`: the sharding spec (default `model.spec`).

    **Returns:** a pytree shaped like `eqx.filter(model, eqx.is_array)`, of shardings on
    `spec.mesh`.

    **Raises:** `ValueError` when neither `spec` nor `model.spec` is set; otherwise as
    `param_pspecs`.
    """
    spec = _spec_of(model, spec)
    if spec is None:
        raise ValueError(
            "param_shardings needs a ShardingSpec: the model was built with spec=None and "
            "none was passed. Build the model with spec=..., or pass spec=."
        )
    return jax.tree.map(lambda ps: NamedSharding(spec.mesh, ps), param_pspecs(model, spec))


def init_sharded(make: Callable[[], Any], spec: ShardingSpec | None = None) -> Any:
    """Build a model straight into its shards: no device ever holds the whole model.

    **Arguments:**

    - `make`: builds the model, e.g. `lambda: Llama(config, key=key, spec=spec)`.
    - `spec`: the sharding spec (default: the built model's `spec`).

    **Returns:** the model, every array placed as `param_shardings` says. The key alone
    decides the values, whatever the spec: they equal `jax.jit(make)()` bit for bit (an
    eager `make()` may differ in the last bit, where XLA fuses an init scale into the
    normal draw).

    **Raises:** as `param_pspecs`.
    """
    shapes = eqx.filter_eval_shape(make)
    spec = _spec_of(shapes, spec)
    if spec is None:
        return make()
    arrays, rest = eqx.partition(shapes, _is_array_like)
    shardings = param_shardings(shapes, spec)
    build = jax.jit(lambda: eqx.filter(make(), eqx.is_array), out_shardings=shardings)
    return eqx.combine(build(), rest)


def param_bytes_per_device(model: Any, spec: ShardingSpec | None = None) -> int:
    """The bytes of `model`'s arrays that one device holds under the rules table.

    **Arguments:**

    - `model`: a module or its `eqx.filter_eval_shape` output.
    - `spec`: the sharding spec (default `model.spec`; with neither, every array is whole).

    **Returns:** the byte count, an `int`.

    **Raises:** as `param_pspecs`.
    """
    spec = _spec_of(model, spec)
    arrays = jax.tree.leaves(eqx.filter(model, _is_array_like))
    pspecs = jax.tree.leaves(param_pspecs(model, spec))
    total = 0
    for leaf, ps in zip(arrays, pspecs, strict=True):
        local = leaf.shape if spec is None else local_shape(spec, leaf.shape, ps)
        total += math.prod(local) * jnp.dtype(leaf.dtype).itemsize
    return total


def local_shape(spec: ShardingSpec, shape: tuple[int, ...], pspec: PartitionSpec):
    """**Returns:** the shape of one device's block of a `shape` array laid out as `pspec`
    on `spec.mesh`."""
    out = list(shape)
    for i, entry in enumerate(pspec):
        for axis in (entry,) if isinstance(entry, str) else entry or ():
            out[i] //= spec.axis_size(axis)
    return tuple(out)


def gather_for_compute(layer: Any, spec: ShardingSpec | None, leading=()) -> Any:
    """Constrain a layer's weights to their gathered layout (fsdp axes left out): inside a
    scan this is the one all-gather per layer of FSDP, and its transpose the gradient's
    reduce-scatter."""
    if spec is None or not spec.fsdp_axis:
        return layer
    arrays, rest = eqx.partition(layer, eqx.is_array)
    pspecs = param_pspecs(layer, spec, gathered=True, leading=leading)
    placed = jax.tree.map(spec.place, arrays, pspecs)
    return eqx.combine(placed, rest)
