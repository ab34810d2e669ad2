"""`ShardingSpec`: which mesh axis carries the batch, the sequence, the heads.

Every module that touches sharded data receives one explicitly; nothing reads a global mesh.
"""

from collections.abc import Callable
from typing import Any, final, no_type_check

import equinox as eqx
import jax
from jax.core import Tracer
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from ._block_contract import AbstractBlockImpl, PlatformChoice

STRATEGIES = ("all_gather", "ulysses", "ring", "usp", "auto")
LOAD_BALANCES = ("none", "zigzag", "striped")
IMPLS = ("auto", "xla", "pallas", "pallas_gpu")
_DEFAULT_BATCH_AXIS = "data"


class _DataIfPresent:
    """`ShardingSpec`'s default `batch_axis`: `"data"` when the mesh has that axis."""

    def __repr__(self) -> str:
        return "'data' if the mesh has it, else None"


_DATA_IF_PRESENT = _DataIfPresent()


@final
class ShardingSpec(eqx.Module):
    """How a long sequence is split over a device mesh, and how attention communicates.

    Immutable and validated on construction; hashable, so modules keep it as a static field.

    **Arguments:**

    - `mesh`: a `jax.sharding.Mesh` (from `jax.make_mesh`, Explicit axes, or `Mesh(...)`,
      Auto axes: both work).
    - `strategy`: `"all_gather"` (gather K/V), `"ulysses"` (all-to-all over heads), `"ring"`
      (K/V blocks passed around a ring), `"usp"` (Ulysses over `ulysses_axis`, ring over
      `context_axis`) or `"auto"` (chosen per call by a cost model).
    - `load_balance`: token layout for causal balance: `"none"` (contiguous chunks),
      `"zigzag"` (device `i` holds chunks `i` and `2N-1-i` of `2N`) or `"striped"` (token `t`
      on device `t mod N`).
    - `batch_axis`: mesh axis for the batch dimension, or `None`. Left out, `"data"` when
      the mesh has such an axis, else `None`; named, the mesh must have it.
    - `context_axis`: mesh axis the sequence is split over (the ring axis under `"usp"`).
    - `ulysses_axis`: the all-to-all axis; required by `"usp"`, allowed with `"auto"` (the
      sequence is then split over both axes, and a strategy other than USP runs over the
      two together).
    - `tensor_axis`: mesh axis for tensor (Megatron) parallelism, or `None`: it splits the
      attention heads and MLP hidden units of both the weights and the activations, and the
      vocabulary of the embedding and output head.
    - `fsdp_axis`: mesh axis, or tuple of axes, that parameters, gradients and optimizer
      state are split over (ZeRO-3); each layer's weights are gathered just before use. It
      may include the sequence axes (`("fsdp", "context")` splits the weights over every
      chip of a context-parallel run). Default `()`: weights are not split this way.
    - `expert_axis`: mesh axis the routed experts of MoE layers are split over (tokens are
      dispatched to their experts' devices by all-to-all), or `None`.
    - `impl`: the block-attention implementation every layer under this spec runs:
      `"auto"` (the Pallas TPU kernels on TPU, the Pallas GPU kernels on a CUDA or ROCm
      GPU, XLA elsewhere), `"xla"`, `"pallas"` (TPU kernels), `"pallas_gpu"` (GPU
      kernels), or an `AbstractBlockImpl` instance of your own.
    - `rules`: overrides of the logical-axis rules table, `{logical_axis: mesh axes}` (see
      `eqx_longctx.ShardingRules`), e.g. `{"vocab": None}` to keep the vocabulary whole.

    The batch is split over `batch_axes`: `batch_axis`, every fsdp axis that is not a
    sequence axis, and `expert_axis`.

    **Raises:** `TypeError` when an axis role, `impl` or `rules` has the wrong type;
    `ValueError` when `mesh` is not a `jax.sharding.Mesh` (the message says how to build
    one), for an unknown `strategy`, `load_balance` or `impl`, an axis the mesh does not
    have, one mesh axis in two roles (only the sequence axes may also be fsdp axes),
    `"usp"` without a `ulysses_axis` of size > 1, or a `ulysses_axis` under a strategy other
    than `"usp"` or `"auto"`.
    """

    mesh: Mesh = eqx.field(static=True)
    strategy: str = eqx.field(static=True, default="ring")
    load_balance: str = eqx.field(static=True, default="zigzag")
    batch_axis: str | None = eqx.field(static=True, default=_DEFAULT_BATCH_AXIS)
    context_axis: str = eqx.field(static=True, default="context")
    ulysses_axis: str | None = eqx.field(static=True, default=None)
    tensor_axis: str | None = eqx.field(static=True, default=None)
    impl: Any = eqx.field(static=True, default="auto")  # a name, or an AbstractBlockImpl
    fsdp_axis: tuple[str, ...] = eqx.field(static=True, default=())
    expert_axis: str | None = eqx.field(static=True, default=None)
    rules: tuple[tuple[str, tuple[str, ...]], ...] = eqx.field(static=True, default=())

    @no_type_check  # validated eagerly, with errors that say what to fix
    def __init__(
        self,
        mesh: object,  # checked below, with an error that says how to build one
        strategy: str = "ring",
        load_balance: str = "zigzag",
        batch_axis: Any = _DATA_IF_PRESENT,
        context_axis: str = "context",
        ulysses_axis: str | None = None,
        tensor_axis: str | None = None,
        impl: Any = "auto",
        fsdp_axis: Any = (),
        expert_axis: str | None = None,
        rules: Any = None,
    ):
        if not isinstance(mesh, Mesh):
            raise ValueError(
                f"ShardingSpec needs a jax.sharding.Mesh; got {type(mesh).__name__}. Build one "
                "with jax.make_mesh((data, context), ('data', 'context'))."
            )
        if batch_axis is _DATA_IF_PRESENT:
            batch_axis = _default_batch_axis(mesh)
        self.mesh = mesh
        self.strategy = strategy
        self.load_balance = load_balance
        self.batch_axis = batch_axis
        self.context_axis = context_axis
        self.ulysses_axis = ulysses_axis
        self.tensor_axis = tensor_axis
        self.impl = impl
        self.fsdp_axis = _axes_tuple("fsdp_axis", fsdp_axis)
        self.expert_axis = expert_axis
        self.rules = _rules_tuple(rules)

    def __check_init__(self):
        for role in ("strategy", "load_balance", "context_axis"):
            value = getattr(self, role)
            if not isinstance(value, str):
                fix = {
                    "context_axis": "name the mesh axis the sequence is split over (for one "
                    "device, call attention with spec=None instead)",
                    "strategy": f"choose one of {STRATEGIES}",
                    "load_balance": f"choose one of {LOAD_BALANCES}",
                }[role]
                raise TypeError(
                    f"ShardingSpec: {role} must be a str; got {value!r} of type "
                    f"{type(value).__name__}: {fix}."
                )
        for role in ("batch_axis", "ulysses_axis", "tensor_axis", "expert_axis"):
            value = getattr(self, role)
            if value is not None and not isinstance(value, str):
                raise TypeError(
                    f"ShardingSpec: {role} must be a mesh axis name (a str) or None; got "
                    f"{value!r} of type {type(value).__name__}."
                )
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"ShardingSpec: unknown strategy {self.strategy!r}; choose one of {STRATEGIES}."
            )
        if not isinstance(self.impl, str | AbstractBlockImpl | PlatformChoice):
            raise TypeError(
                f"ShardingSpec: impl must be one of {IMPLS}, an AbstractBlockImpl or a "
                f"PlatformChoice of two; got "
                f"{self.impl!r} of type {type(self.impl).__name__}."
            )
        if isinstance(self.impl, str) and self.impl not in IMPLS:
            raise ValueError(
                f"ShardingSpec: unknown impl {self.impl!r}; choose one of {IMPLS} ('auto' runs "
                "the Pallas kernels on TPU and GPU and the XLA path elsewhere)."
            )
        if self.load_balance not in LOAD_BALANCES:
            raise ValueError(
                f"ShardingSpec: unknown load_balance {self.load_balance!r}; choose one of "
                f"{LOAD_BALANCES}."
            )
        names = self.mesh.axis_names
        roles = {
            "batch_axis": self.batch_axis,
            "context_axis": self.context_axis,
            "ulysses_axis": self.ulysses_axis,
            "tensor_axis": self.tensor_axis,
            "expert_axis": self.expert_axis,
        }
        for axis in self.fsdp_axis:
            if axis not in names:
                raise ValueError(
                    f"ShardingSpec: fsdp_axis={self.fsdp_axis!r} names {axis!r}, which is not "
                    f"an axis of the mesh, whose axes are {tuple(names)}. Use those names."
                )
            if axis in (self.batch_axis, self.tensor_axis, self.expert_axis):
                role = next(r for r, a in roles.items() if a == axis)
                raise ValueError(
                    f"ShardingSpec: mesh axis {axis!r} is used twice, as fsdp_axis and {role}. "
                    "FSDP may share only the sequence axes (context/ulysses); the batch is "
                    "already split over every fsdp axis, so drop it from one of the roles."
                )
        if len(set(self.fsdp_axis)) != len(self.fsdp_axis):
            raise ValueError(
                f"ShardingSpec: fsdp_axis={self.fsdp_axis!r} names an axis twice; name each "
                "mesh axis once."
            )
        for role, axis in roles.items():
            if axis is not None and axis not in names:
                raise ValueError(
                    f"ShardingSpec: {role}={axis!r} is not an axis of the mesh, whose axes are "
                    f"{tuple(names)}. Use one of those names, or None."
                )
        used = [(r, a) for r, a in roles.items() if a is not None]
        for i, (role_a, axis_a) in enumerate(used):
            for role_b, axis_b in used[i + 1 :]:
                if axis_a == axis_b:
                    raise ValueError(
                        f"ShardingSpec: mesh axis {axis_a!r} is used twice, as {role_a} and "
                        f"{role_b}; each role needs its own mesh axis (set one of them to None "
                        "or add an axis to the mesh)."
                    )
        if self.strategy == "usp":
            if self.ulysses_axis is None:
                raise ValueError(
                    "ShardingSpec: strategy='usp' needs ulysses_axis (the all-to-all axis; the "
                    f"ring runs over context_axis={self.context_axis!r}). Add an axis to the "
                    "mesh for it, or use strategy='ring' or 'ulysses'."
                )
            if self.mesh.shape[self.ulysses_axis] == 1:
                raise ValueError(
                    f"ShardingSpec: strategy='usp' needs ulysses_axis {self.ulysses_axis!r} of "
                    "size > 1, got size 1. Use strategy='ring' over the context axis instead."
                )
        elif self.ulysses_axis is not None and self.strategy != "auto":
            raise ValueError(
                f"ShardingSpec: ulysses_axis={self.ulysses_axis!r} is used only by "
                f"strategy='usp' (or 'auto', which may pick it), got strategy="
                f"{self.strategy!r}. Drop ulysses_axis or set strategy='usp'."
            )

    def replace(self, **changes: Any) -> "ShardingSpec":
        """**Returns:** a copy with the given fields changed (and validated again). With a new
        `mesh` and no `batch_axis`, a batch axis that was its old mesh's default (`"data"`
        when that mesh had it, else `None`) becomes the new mesh's; any other stays.

        **Raises:** `TypeError` for a name that is not a field; otherwise as the constructor.
        """
        fields = (
            "mesh", "strategy", "load_balance", "batch_axis", "context_axis", "ulysses_axis",
            "tensor_axis", "impl", "fsdp_axis", "expert_axis", "rules",
        )  # fmt: skip
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"ShardingSpec.replace: unknown fields {sorted(unknown)}.")
        kwargs = {f: getattr(self, f) for f in fields}
        kwargs.update(changes)
        if "mesh" in changes and "batch_axis" not in changes:
            # A batch axis that is its old mesh's default follows the new mesh's default.
            if self.batch_axis == _default_batch_axis(self.mesh):
                kwargs["batch_axis"] = _DATA_IF_PRESENT
        return ShardingSpec(**kwargs)

    # ---- derived sizes -------------------------------------------------------------------

    @property
    def platform(self) -> str:
        """The platform of the mesh's devices (`"cpu"`, `"gpu"`, `"tpu"`)."""
        return self.mesh.devices.flat[0].platform

    def axis_size(self, axis: str | None) -> int:
        """Number of devices along `axis` (1 for `None`)."""
        return 1 if axis is None else int(self.mesh.shape[axis])

    @property
    def sequence_axes(self) -> tuple[str, ...]:
        """Mesh axes the sequence is split over, major to minor."""
        if self.ulysses_axis is not None:
            return (self.ulysses_axis, self.context_axis)
        return (self.context_axis,)

    @property
    def context_parallel_size(self) -> int:
        """Number of sequence shards `N` (ulysses x context under `"usp"`)."""
        n = 1
        for axis in self.sequence_axes:
            n *= self.axis_size(axis)
        return n

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """Mesh axes the batch is split over: `batch_axis`, the fsdp axes that are not
        sequence axes, then `expert_axis`."""
        axes = () if self.batch_axis is None else (self.batch_axis,)
        axes += tuple(a for a in self.fsdp_axis if a not in self.sequence_axes)
        if self.expert_axis is not None:
            axes += (self.expert_axis,)
        return axes

    @property
    def batch_parallel_size(self) -> int:
        """Number of batch shards (the product of the `batch_axes` sizes)."""
        n = 1
        for axis in self.batch_axes:
            n *= self.axis_size(axis)
        return n

    def batch_entry(self) -> str | tuple[str, ...] | None:
        """The batch dimension's entry in a `PartitionSpec`."""
        axes = self.batch_axes
        return None if not axes else axes[0] if len(axes) == 1 else axes

    def check_batch(self, batch: int, what: str = "the batch") -> None:
        """Check that `batch` rows split evenly over the `batch_axes`; `what` names the
        batch in the message.

        **Raises:** `ValueError` unless `batch` is divisible by `batch_parallel_size`.
        """
        nb = self.batch_parallel_size
        if batch % nb:
            axes = " x ".join(f"{a!r} ({self.axis_size(a)})" for a in self.batch_axes)
            raise ValueError(
                f"the batch is split over {axes}: {nb} devices, so {what} must be divisible "
                f"by {nb}; got batch={batch}. Use a batch of {-(-batch // nb) * nb}, or move "
                "devices from those axes to 'context' (the fsdp axes may include 'context', "
                "e.g. fsdp_axis=('fsdp', 'context'), which splits the weights but not the batch)."
            )

    # ---- shardings ---------------------------------------------------------------------

    def token_pspec(self) -> PartitionSpec:
        """Partition spec of `[batch, seq]` arrays (tokens, positions, segment ids)."""
        return PartitionSpec(self.batch_entry(), self.sequence_axes)

    def activation_pspec(self) -> PartitionSpec:
        """Partition spec of `[batch, seq, embed]` activations."""
        return PartitionSpec(self.batch_entry(), self.sequence_axes, None)

    def heads_pspec(self) -> PartitionSpec:
        """Partition spec of `[batch, seq, heads, head_dim]` arrays."""
        return PartitionSpec(self.batch_entry(), self.sequence_axes, self.tensor_axis, None)

    def sharding(self, pspec: PartitionSpec) -> NamedSharding:
        """**Returns:** `NamedSharding(self.mesh, pspec)`."""
        return NamedSharding(self.mesh, pspec)

    @property
    def is_explicit(self) -> bool:
        """Whether the mesh has Explicit axes (the `jax.make_mesh` default)."""
        return _is_explicit(self.mesh)

    def compute_mesh(self) -> Mesh:
        """The mesh to place and `shard_map` with right now.

        The spec's own mesh, except inside `jax.sharding.auto_axes` (how the models run an
        Explicit mesh, so that autodiff of dense layers needs no output-sharding
        annotations), where the same devices are used with Auto axes.
        """
        if self.is_explicit and _in_auto_context(self.mesh):
            types = (jax.sharding.AxisType.Auto,) * len(self.mesh.axis_names)
            return Mesh(self.mesh.devices, self.mesh.axis_names, axis_types=types)
        return self.mesh

    def place(self, x, pspec: PartitionSpec):
        """Constrain `x` to `pspec` on this mesh, under `jit` or eagerly, Explicit or Auto."""
        mesh = self.compute_mesh()
        sharding = NamedSharding(mesh, pspec)
        if _is_explicit(mesh):
            return jax.sharding.reshard(x, sharding)
        if isinstance(x, Tracer):
            return jax.lax.with_sharding_constraint(x, sharding)
        return jax.device_put(x, sharding)

    def hint(self, x, pspec: PartitionSpec):
        """Suggest `pspec` for `x` to XLA's sharding propagation (`with_sharding_constraint`)
        when the mesh in use has Auto axes, as inside the models; on an Explicit mesh the
        array's sharding type already decides, and `x` is returned as is."""
        mesh = self.compute_mesh()
        if _is_explicit(mesh) or not isinstance(x, Tracer):
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, pspec))

    def auto_axes(self, fn: Callable[..., Any], out_pspec: Any) -> Callable[..., Any]:
        """Run `fn` with this mesh's axes Auto when the mesh is Explicit (else as is);
        `out_pspec` is the `PartitionSpec` of its output, or a pytree of them."""
        if not self.is_explicit or _in_auto_context(self.mesh):
            return fn
        shardings = jax.tree.map(
            self.sharding, out_pspec, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )
        return jax.sharding.auto_axes(fn, axes=tuple(self.mesh.axis_names), out_sharding=shardings)


def _in_auto_context(mesh: Mesh) -> bool:
    current = jax.sharding.get_abstract_mesh()
    if current is None or getattr(current, "empty", True):
        return False
    if tuple(current.axis_names) != tuple(mesh.axis_names):
        return False
    return not _is_explicit(current)


def _is_explicit(mesh: Mesh | AbstractMesh) -> bool:
    types = getattr(mesh, "axis_types", ())
    return any(str(t).endswith("Explicit") for t in types)


def _axes_tuple(role: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(a, str) for a in value):
        return tuple(value)
    raise TypeError(
        f"ShardingSpec: {role} must be a mesh axis name, a tuple of names, or None; got "
        f"{value!r} of type {type(value).__name__}."
    )


def _rules_tuple(rules: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
    if rules is None:
        return ()
    if isinstance(rules, tuple) and all(isinstance(r, tuple) and len(r) == 2 for r in rules):
        rules = dict(rules)
    if not isinstance(rules, dict):
        raise TypeError(
            f"ShardingSpec: rules must be a dict {{logical_axis: mesh axes}}; got "
            f"{type(rules).__name__} {rules!r}."
        )
    out = []
    for name, axes in rules.items():
        if not isinstance(name, str):
            raise TypeError(f"ShardingSpec: rules keys are logical axis names; got {name!r}.")
        out.append((name, _axes_tuple(f"rules[{name!r}]", axes)))
    return tuple(sorted(out))


def _default_batch_axis(mesh: Mesh) -> str | None:
    return _DEFAULT_BATCH_AXIS if _DEFAULT_BATCH_AXIS in mesh.axis_names else None
