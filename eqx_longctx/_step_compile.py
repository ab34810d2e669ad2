"""Compile the real train step for abstract arrays, to check the planner against XLA.

Nothing is allocated: the model, the optimizer state and the batch are
`jax.ShapeDtypeStruct`s carrying the shardings the trainer gives them
(`eqx_longctx.param_shardings` for the weights, the same layout for Adam's moments), and the
step is `eqx_longctx.train`'s, with the model and optimizer state donated as the trainer
does. `compiled_step_bytes` reads XLA's memory analysis of the result.
"""

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from ._partition import param_shardings
from ._sharding import ShardingSpec


class CompiledBytes(NamedTuple):
    """Per-device bytes of a compiled program (XLA's memory analysis)."""

    device: int  # arguments + outputs + temporaries - donated (aliased) buffers
    host: int  # the same in host memory (offloaded activations)
    arguments: int
    outputs: int
    temporaries: int
    aliased: int


def _is_shape(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _is_inexact(x: Any) -> bool:
    return _is_shape(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def abstract_train_state(family: str, config: Any, spec: ShardingSpec, optimizer):
    """The model and optimizer state as sharded `jax.ShapeDtypeStruct`s.

    **Returns:** `(arrays, static, opt_state, param_sh, opt_sh)`: the model split into its
    arrays and the rest, the optimizer state, and the shardings of the model's inexact
    arrays and of the optimizer state.
    """
    from models import family as model_family

    fam = model_family(family)
    model = eqx.filter_eval_shape(fam.model, config, key=jax.random.key(0), spec=spec)
    arrays, static = eqx.partition(model, _is_shape)
    shardings = param_shardings(model, spec)
    arrays = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), arrays, shardings
    )
    params = eqx.filter(arrays, _is_inexact)
    param_sh = jax.tree.map(lambda a: a.sharding, params)
    plain = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    state = jax.eval_shape(optimizer.init, plain)
    params_def = jax.tree.structure(plain)
    replicated = NamedSharding(spec.mesh, PartitionSpec())

    def is_params(x) -> bool:  # a subtree shaped like the parameters: Adam's moments
        return not _is_shape(x) and jax.tree.structure(x) == params_def

    opt_sh = jax.tree.map(
        lambda x: param_sh if is_params(x) else replicated, state, is_leaf=is_params
    )
    opt_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, opt_sh
    )
    return arrays, static, opt_state, param_sh, opt_sh


def abstract_batch(spec: ShardingSpec, batch: int, seq: int):
    """A `Batch` of `jax.ShapeDtypeStruct`s in the spec's token layout."""
    from .data import Batch

    tokens = spec.sharding(spec.token_pspec())
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=tokens)
    mask = jax.ShapeDtypeStruct((batch, seq), jnp.float32, sharding=tokens)
    fields: list[Any] = [ids, ids, ids, ids, mask]  # abstract, where a Batch holds arrays
    return Batch(*fields)


def compile_train_step(family: str, config: Any, spec: ShardingSpec, *, batch: int, seq: int):
    """Compile (never run) `eqx_longctx.train`'s step for abstract sharded inputs.

    **Arguments:**

    - `family`, `config`: the model (`config.remat` is the policy compiled).
    - `spec`: the sharding spec (mesh, strategy, fsdp/tensor/expert axes).
    - `batch`, `seq`: global batch rows and sequence length.

    **Returns:** the `jax.stages.Compiled` step.
    """
    from .train._step import make_optimizer, make_train_step

    optimizer = make_optimizer(1e-3, 10, 100)
    arrays, static, opt_state, param_sh, opt_sh = abstract_train_state(
        family, config, spec, optimizer
    )
    # The trainer's step keeps gradients and the new state in these layouts (ZeRO); the
    # donation happens in the jit below, which the abstract inputs go through.
    step = make_train_step(optimizer, shardings=(param_sh, opt_sh))

    def run(arrays, opt_state, batch):
        model, new_state, metrics = step(eqx.combine(arrays, static), opt_state, batch)
        return eqx.filter(model, eqx.is_array), new_state, metrics

    array_sh = jax.tree.map(lambda a: a.sharding, arrays)
    jitted = jax.jit(run, donate_argnums=(0, 1), out_shardings=(array_sh, opt_sh, None))
    return jitted.lower(arrays, opt_state, abstract_batch(spec, batch, seq)).compile()


def compiled_step_bytes(compiled) -> CompiledBytes:
    """Per-device bytes of a compiled program from XLA's memory analysis.

    XLA:CPU leaves `peak_memory_in_bytes` at 0, so the device number is arguments + outputs
    + temporaries - aliased (donated) buffers: what the program holds at once at most.
    """
    m = compiled.memory_analysis()
    device = (
        m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )  # fmt: skip
    host = sum(
        getattr(m, f"host_{name}_size_in_bytes", 0) for name in ("argument", "output", "temp")
    ) - getattr(m, "host_alias_size_in_bytes", 0)
    return CompiledBytes(
        int(device), int(host), int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
        int(m.temp_size_in_bytes), int(m.alias_size_in_bytes),
    )  # fmt: skip
