"""Where a run's arrays live: one device, or a mesh with a `ShardingSpec`.

On a mesh the batch is split over the spec's `batch_axes` (`"data"`, the fsdp axes that are
not sequence axes, `"expert"`), the sequence over `"context"` (and `"ulysses"` under USP) in
the spec's load-balanced layout. Every parameter is placed by the rules table
(`eqx_longctx.param_shardings`): split over the fsdp axes (ZeRO-3), the `"tensor"` axis
(Megatron) and the `"expert"` axis, replicated over the rest; the optimizer state is laid
out like the parameters it tracks, and the train step keeps both layouts.

A `Placement` takes parsed values (axis sizes, axis names) and speaks of values in its
errors; the command lines build one from their flags with
[`placement_from_flags`][eqx_longctx.run.placement_from_flags], which words the errors in
flags.
"""

from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from .._sharding import ShardingSpec

MESH_AXES = ("data", "fsdp", "expert", "ulysses", "context", "tensor")
"""The mesh axes a placement knows: `data` splits the batch, `fsdp` the weights (and the
batch), `expert` the routed experts (and the batch), `ulysses` and `context` the sequence,
`tensor` heads and widths."""


class SpecError(ValueError):
    """The `ShardingSpec` a placement's values make refused them: the message names the
    values, `reason` is the spec's own (a command line words the values as its flags)."""

    def __init__(self, message: str, *, reason: str):
        super().__init__(message)
        self.reason = reason


def default_mesh(devices: int) -> dict[str, int]:
    """The mesh of a run on `devices` devices by default: the batch over 2 of them if it can,
    the sequence over the rest (context parallelism)."""
    if devices >= 4 and devices % 2 == 0:
        return {"data": 2, "context": devices // 2}
    return {"context": devices}


class Placement:
    """The devices, mesh and sharding spec of one run.

    **Arguments:**

    - `devices`: how many devices to use; 1 without `mesh` keeps everything on the default
      device.
    - `mesh`: axis sizes such as `{"fsdp": 2, "context": 4}` (axes from `MESH_AXES`, their
      product `devices`), or `None` for [`default_mesh`][]`(devices)` (on one device: no
      mesh). `"tensor"` and `"expert"` axes, when present, become the spec's
      `tensor_axis` and `expert_axis`, a `"ulysses"` axis its `ulysses_axis`.
    - `strategy`, `load_balance`: the `ShardingSpec`'s (see `eqx_longctx.ShardingSpec`).
    - `fsdp_axes`: the mesh axes the weights are split over; `None`: `("fsdp",)` when the
      mesh has that axis, else none.
    - `vocab_size`: the model's vocabulary; one the tensor axis does not divide (the byte
      tokenizer's 259) is kept whole rather than split over it (the embedding and output
      head then hold every row on each tensor shard; the arithmetic is unchanged).

    **Raises:** `ValueError` when `devices` is not in `[1, len(jax.devices())]` (in a
    multi-process run: not the global device count), when the mesh's sizes do not
    multiply to `devices` or name an axis outside `MESH_AXES`, when `fsdp_axes` is given
    without a mesh; and as `eqx_longctx.ShardingSpec` for `strategy`, `load_balance`,
    `fsdp_axes` and the spec the mesh makes (a `SpecError`, a `ValueError` prefixed with
    the mesh and strategy whose `reason` is the spec's own message).
    """

    def __init__(
        self,
        devices: int,
        mesh: Mapping[str, int] | None = None,
        strategy: str = "ring",
        load_balance: str = "zigzag",
        fsdp_axes: tuple[str, ...] | None = None,
        vocab_size: int | None = None,
    ):
        available = jax.devices()  # global: every process's devices
        check_device_count(devices, len(available), jax.process_count())
        self.num_devices = devices
        self.spec: ShardingSpec | None = None
        self.device = available[0]
        self.whole_vocab = False
        if devices == 1 and mesh is None:
            if fsdp_axes:
                raise ValueError(
                    f"fsdp_axes split the weights over mesh axes, but one device without a "
                    f"mesh has none; got fsdp_axes={tuple(fsdp_axes)}. Pass a mesh, or no "
                    "fsdp_axes."
                )
            return
        shape = dict(default_mesh(devices) if mesh is None else mesh)
        check_mesh(shape, devices)
        if fsdp_axes is None:
            fsdp_axes = ("fsdp",) if "fsdp" in shape else ()
        self.mesh = Mesh(device_grid(available[:devices], tuple(shape.values())), tuple(shape))
        tensor = shape.get("tensor", 1)
        self.whole_vocab = vocab_size is not None and tensor > 1 and vocab_size % tensor != 0
        try:
            self.spec = ShardingSpec(
                self.mesh,
                strategy=strategy,
                load_balance=load_balance,
                ulysses_axis="ulysses" if "ulysses" in shape else None,
                tensor_axis="tensor" if "tensor" in shape else None,
                fsdp_axis=tuple(fsdp_axes),
                expert_axis="expert" if "expert" in shape else None,
                rules={"vocab": None} if self.whole_vocab else None,
            )
        except ValueError as e:
            axes = ",".join(f"{k}={v}" for k, v in shape.items())
            raise SpecError(
                f"mesh {axes} with strategy {strategy!r} and fsdp_axes {tuple(fsdp_axes)}: {e}",
                reason=str(e),
            ) from None
        self._replicated = NamedSharding(self.mesh, jax.sharding.PartitionSpec())

    # ---- checks ------------------------------------------------------------------------

    def check_run(
        self,
        batch_size: int,
        seq_len: int,
        model_config,
        family=None,
        grad_accum: int = 1,
        *,
        name: Callable[[str], str] | None = None,
    ) -> None:
        """Check that a run's batches, the model's heads and its experts split over this
        mesh, before anything is built or traced.

        The rules are the attention's own (`ShardingSpec.check_batch`,
        `check_sequence_length`, the tensor and Ulysses head checks), applied to the shapes
        every step will have, and the expert axis's (the routed experts divide over it);
        their messages are prefixed with the values that set them (`batch_size=8`, or
        as `name` writes them: the trainer passes its flag names, `--batch-size 8`).

        **Arguments:**

        - `batch_size`, `seq_len`: rows per step and tokens per row.
        - `grad_accum`: micro-batches per step; each micro-batch of `batch_size / grad_accum` rows
          must split over the batch axes.
        - `model_config`: the model's config.
        - `family`: its `eqx_longctx.ModelFamily` (or that family's name), which gives the
          attention heads (`attention_shape`) and the routed experts (`moe_shape`);
          `None`: the installed or registered family whose `config` class `model_config`
          is.
        - `name`: how the messages name a value, `name("batch_size") -> "--batch-size"`;
          `None`: by its argument name.

        **Raises:** `ValueError` (nothing on one device) when `family` is `None` and no
        family has `model_config`'s class; when `batch_size` (a micro-batch of it with
        `grad_accum`) does not split over the batch axes or `seq_len` over the spec's
        layout; the mesh has an `expert` axis but the model has no routed experts, or their
        number is not divisible by it; or the heads (MLA's too: they split over `tensor`
        like GQA's) do not split over the `tensor` axis, or under `"ulysses"` / `"usp"`
        (also when `"auto"` picks one) over the all-to-all axis.
        """
        if self.spec is None:
            return
        from .._layout import check_sequence_length
        from ..attention import check_spec_inputs, resolve_strategy

        def shown(field: str, value) -> str:
            return f"{field}={value}" if name is None else f"{name(field)} {value}"

        family = _family(family, model_config)
        spec, mesh = self.spec, dict(self.mesh.shape)
        rows = shown("batch_size", batch_size)
        if grad_accum > 1:
            micro = batch_size // grad_accum
            what = f"{rows} / {shown('grad_accum', grad_accum)} = {micro} rows"
            spec.check_batch(micro, what=f"a micro-batch ({what})")
        else:
            spec.check_batch(batch_size, what=rows)
        try:
            check_sequence_length(spec, seq_len)
        except ValueError as e:
            raise ValueError(f"{shown('seq_len', seq_len)}: {e}") from None
        self._check_experts(model_config, family, shown)
        q_heads, kv_heads, head_dim, _ = family.attention_shape(model_config)
        q = jax.ShapeDtypeStruct((batch_size, seq_len, q_heads, head_dim), np.float32)
        k = jax.ShapeDtypeStruct((batch_size, seq_len, kv_heads, head_dim), np.float32)
        try:
            check_spec_inputs(spec, q, k, resolve_strategy(spec, q, k))
        except ValueError as e:
            raise ValueError(
                f"{shown('strategy', repr(spec.strategy))} on mesh {mesh} with the model's "
                f"{q_heads} query / {kv_heads} key-value heads: {e}"
            ) from None

    def _check_experts(self, model_config, family, shown) -> None:
        spec = self.spec
        if spec is None or spec.expert_axis is None:
            return
        n = spec.axis_size(spec.expert_axis)
        moe = family.moe_shape(model_config)
        name = type(model_config).__name__
        axis = shown("mesh", f"expert={n}")
        if moe is None:
            raise ValueError(
                f"{axis} splits the routed experts of MoE layers, but the model ({name}) has "
                "none. Use a model with routed experts, or move those devices to data= or "
                "fsdp=."
            )
        if moe.experts % n:
            raise ValueError(
                f"{axis} splits the model's {moe.experts} routed experts ({name}), so they "
                f"must be divisible by {n}. Use an expert axis whose size divides "
                f"{moe.experts}."
            )

    def describe(self) -> str:
        """**Returns:** one line on the placement, e.g. `"8 devices (mesh data=2,
        context=4; strategy=ring, load_balance=zigzag, weights split over fsdp axes none)"`,
        or `"1 device"`."""
        if self.spec is None:
            return "1 device"
        axes = ", ".join(f"{k}={v}" for k, v in self.mesh.shape.items())
        weights = ",".join(self.spec.fsdp_axis) or "none"
        vocab = ", vocabulary kept whole over tensor" if self.whole_vocab else ""
        processes = jax.process_count()
        where = f" on {processes} processes" if processes > 1 else ""
        return (
            f"{self.num_devices} devices{where} (mesh {axes}; strategy={self.spec.strategy}, "
            f"load_balance={self.spec.load_balance}, weights split over fsdp axes "
            f"{weights}{vocab})"
        )

    # ---- model and optimizer state -----------------------------------------------------

    def build_model(self, make: Callable[[ShardingSpec | None], Any]):
        """Build the model straight into its shards (no device holds the whole model).

        **Arguments:**

        - `make`: `make(spec) -> model`, e.g. `lambda spec: Llama(config, key=key,
          spec=spec)`.

        **Returns:** the model, its arrays placed by `eqx_longctx.param_shardings` (on one
        device: the default device).

        **Raises:** `ValueError` as `eqx_longctx.param_pspecs`, for a weight dimension the
        mesh axes it is split over do not divide.
        """
        if self.spec is None:
            model = make(None)
            arrays, rest = eqx.partition(model, eqx.is_array)
            return eqx.combine(jax.device_put(arrays, self.device), rest)
        from .._partition import init_sharded

        spec = self.spec
        return init_sharded(lambda: make(spec), spec)

    def abstract_model(self, make: Callable[[ShardingSpec | None], Any]):
        """**Returns:** the model with every array a `jax.ShapeDtypeStruct` carrying the
        sharding `build_model` would give it: a restore target that allocates nothing.

        **Raises:** `ValueError` as [`build_model`][].
        """
        shapes = eqx.filter_eval_shape(make, self.spec)
        arrays, rest = eqx.partition(shapes, _is_abstract)
        shardings = self.param_shardings(shapes)
        if shardings is None:
            shardings = jax.tree.map(
                lambda _: jax.sharding.SingleDeviceSharding(self.device), arrays
            )
        placed = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), arrays, shardings
        )
        return eqx.combine(placed, rest)

    def param_shardings(self, model):
        """**Returns:** the `NamedSharding` of every inexact array of `model` (the tree of
        `eqx.filter(model, eqx.is_inexact_array)`), or `None` on one device.

        **Raises:** `ValueError` as [`build_model`][].
        """
        if self.spec is None:
            return None
        from .._partition import param_shardings

        shardings = param_shardings(model, self.spec)
        inexact = eqx.filter(model, _is_inexact)
        return jax.tree.map(
            lambda x, s: s if x is not None else None,
            inexact,
            shardings,
            is_leaf=lambda x: x is None,
        )

    def opt_state_shardings(self, optimizer: optax.GradientTransformation, model):
        """The layout of `optimizer`'s state for `model`: every subtree shaped like the
        parameters (Adam's moments) sharded as the parameters are, everything else (step
        counts, hyperparameters) replicated. `None` on one device.

        **Arguments:**

        - `optimizer`: the optimizer.
        - `model`: the model, or its `abstract_model`.

        **Raises:** `ValueError` as [`build_model`][].
        """
        if self.spec is None:
            return None
        params = eqx.filter(model, _is_inexact)
        params_def = jax.tree.structure(params)
        param_sh = self.param_shardings(model)
        state = jax.eval_shape(optimizer.init, _as_shapes(params))

        def is_params(x) -> bool:
            return not _is_abstract(x) and jax.tree.structure(x) == params_def

        def layout(x):
            return param_sh if is_params(x) else self._replicated

        return jax.tree.map(layout, state, is_leaf=is_params)

    def step_shardings(self, optimizer: optax.GradientTransformation, model):
        """**Returns:** `(param_shardings, opt_state_shardings)`, the layouts the train step
        keeps its gradients, parameters and optimizer state in (`make_train_step`'s
        `shardings`), or `None` on one device.

        **Raises:** `ValueError` as [`build_model`][].
        """
        if self.spec is None:
            return None
        return self.param_shardings(model), self.opt_state_shardings(optimizer, model)

    def abstract_opt_state(self, optimizer: optax.GradientTransformation, model):
        """**Returns:** the optimizer state of `model` (or its `abstract_model`) as
        `jax.ShapeDtypeStruct`s carrying their shardings: a restore target.

        **Raises:** `ValueError` as [`build_model`][].
        """
        params = _as_shapes(eqx.filter(model, _is_inexact))
        state = jax.eval_shape(optimizer.init, params)
        shardings = self.opt_state_shardings(optimizer, model)
        if shardings is None:
            single = jax.sharding.SingleDeviceSharding(self.device)
            shardings = jax.tree.map(lambda _: single, state)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
        )

    def init_opt_state(self, optimizer: optax.GradientTransformation, model):
        """**Returns:** `optimizer.init` of the model's inexact arrays, built straight into
        the layout of [`opt_state_shardings`][].

        **Raises:** `ValueError` as [`build_model`][].
        """
        params = eqx.filter(model, eqx.is_inexact_array)
        if self.spec is None:
            return jax.device_put(optimizer.init(params), self.device)
        shardings = self.opt_state_shardings(optimizer, model)
        return jax.jit(optimizer.init, out_shardings=shardings)(params)

    def abstract_batch(self, batch_size: int, seq_len: int):
        """**Returns:** a `Batch` of `jax.ShapeDtypeStruct`s `[batch_size, seq_len]` placed
        as `eqx_longctx.data.place_batch` places a host batch (int32 tokens, targets, positions and
        segment ids, a float32 loss mask): the step's input, allocating nothing."""
        from eqx_longctx.data import Batch

        if self.spec is None:
            sharding = jax.sharding.SingleDeviceSharding(self.device)
        else:
            sharding = self.spec.sharding(self.spec.token_pspec())
        ids = jax.ShapeDtypeStruct((batch_size, seq_len), np.int32, sharding=sharding)
        mask = jax.ShapeDtypeStruct((batch_size, seq_len), np.float32, sharding=sharding)
        fields: list[Any] = [ids, ids, ids, ids, mask]  # abstract, where a Batch holds arrays
        return Batch(*fields)


def check_mesh(shape: Mapping[str, int], devices: int) -> None:
    """Check a mesh's axis sizes against the device count.

    **Raises:** `ValueError` when an axis is not one of `MESH_AXES`, a size is not a
    positive int, or the sizes do not multiply to `devices`.
    """
    axes = ",".join(f"{k}={v}" for k, v in shape.items())
    bad = [k for k in shape if k not in MESH_AXES]
    if bad:
        raise ValueError(
            f"a placement's mesh axes come from {MESH_AXES}; got mesh {axes} (unknown {bad}). "
            "Name each axis by what it splits, e.g. {'data': 2, 'context': 4}."
        )
    sizes = list(shape.values())
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes):
        raise ValueError(f"mesh axis sizes must be positive ints; got mesh {axes}.")
    if int(np.prod(sizes)) != devices:
        raise ValueError(
            f"the mesh's axis sizes must multiply to the device count; got mesh {axes} "
            f"({int(np.prod(sizes))} devices) for {devices} devices. Use sizes whose product "
            f"is {devices}."
        )


def check_device_count(devices: int, available: int, processes: int) -> None:
    """Check that a run on `devices` devices can have them.

    One process may use the first `devices` of its devices; a multi-process run uses all of
    them (every process must hold part of the mesh), so `devices` must be the global count
    (`--devices` on the command line).

    **Arguments:**

    - `devices`: the run's device count.
    - `available`: `len(jax.devices())` (global).
    - `processes`: `jax.process_count()`.
    """
    if processes > 1 and devices != available:
        raise ValueError(
            f"--devices is the global device count of a multi-process run and must equal the "
            f"devices of all {processes} processes together; got --devices {devices}, and the "
            f"processes have {available} ({available // processes} each). Pass --devices "
            f"{available} with a --mesh whose sizes multiply to {available}."
        )
    if not 1 <= devices <= available:
        raise ValueError(
            f"devices={devices} needs that many JAX devices (and at least 1); this "
            f"process has {available}. On CPU, pass --devices before JAX starts (the "
            "CLI does) or set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{devices}; or pass fewer devices."
        )


def device_grid(devices: list, shape: tuple[int, ...]) -> np.ndarray:
    """**Returns:** `devices` arranged in a mesh of `shape`: on TPU in the order that keeps
    neighbouring mesh positions on neighbouring chips (`mesh_utils.create_device_mesh`),
    elsewhere in device-id order (so on CPU each process holds a contiguous block)."""
    if devices and devices[0].platform == "tpu":
        from jax.experimental import mesh_utils

        try:
            return mesh_utils.create_device_mesh(shape, devices)
        except (ValueError, NotImplementedError, AssertionError):
            pass  # a shape the topology helper does not handle: plain order still works
    return np.array(devices).reshape(shape)


def _family(family, model_config):
    """The `ModelFamily` a run's config belongs to: `family` (or the family of that name),
    else the installed or registered family whose `config` class `model_config` is."""
    from .._family import ModelFamily, model_families, model_family  # noqa: I001

    if isinstance(family, ModelFamily):
        return family
    if family is not None:
        return model_family(family)
    for candidate in model_families().values():
        if isinstance(model_config, candidate.config):
            return candidate
    raise ValueError(
        f"no installed or registered model family has the config class "
        f"{type(model_config).__name__}; pass family= (an eqx_longctx.ModelFamily), or "
        "register the family with eqx_longctx.register_family."
    )


def bytes_on_device(tree, device) -> int:
    """**Returns:** the bytes of `tree`'s arrays that live on `device` (its shards)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                if shard.device == device:
                    total += shard.data.nbytes
    return total


def _is_abstract(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)


def _is_inexact(x: Any) -> bool:
    if isinstance(x, jax.ShapeDtypeStruct):
        return bool(np.issubdtype(x.dtype, np.inexact))
    return eqx.is_inexact_array(x)


def _as_shapes(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
