"""Compile what the planners predict, to check them against XLA: one attention call, the
trainer's own train step, or inference's own prefill and decode step, for abstract arrays
(nothing is allocated). Only public names of `train` and `inference` are used: the programs
are theirs.

The train step is the trainer's, built by the trainer's code: `trainer_run` turns a run's
`eqx_longctx.train.TrainConfig` into the model config (`build_model_config`) and the
`eqx_longctx.run.Placement` (mesh, spec and layouts of `--mesh`, `--strategy`,
`--load-balance`, `--fsdp-axes`), as `Trainer` does; `compile_train_step` lowers
`lower_train_step` (the step `make_train_step` builds, with `Placement.step_shardings` and
the trainer's donation) for the model, optimizer state and batch of
`Placement.abstract_model`, `abstract_opt_state` and `abstract_batch`. `compile_generate`
compiles `eqx_longctx.inference.lower_prefill` and `lower_decode`. `compiled_bytes` reads
XLA's memory analysis of a compiled program.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._family import ModelFamily
from .._sharding import ShardingSpec
from ..attention import attention


class CompiledBytes(NamedTuple):
    """Per-device bytes of a compiled program (XLA's memory analysis)."""

    device: int  # arguments + outputs + temporaries - donated (aliased) buffers
    host: int  # the same in host memory (offloaded activations)
    arguments: int
    outputs: int
    temporaries: int
    aliased: int


def compiled_bytes(compiled) -> CompiledBytes:
    """Per-device bytes of a compiled program from XLA's memory analysis.

    XLA:CPU leaves `peak_memory_in_bytes` at 0, so the device number is arguments + outputs
    + temporaries - aliased (donated) buffers: what the program holds at once at most.

    **Arguments:**

    - `compiled`: a `jax.stages.Compiled` program.

    **Returns:** its `CompiledBytes`.
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


def compiled_memory(compiled) -> int:
    """Per-device bytes of a compiled program: `compiled_bytes(compiled).device`
    (arguments + outputs + temporaries - donated buffers)."""
    return compiled_bytes(compiled).device


def compiled_attention(
    spec: ShardingSpec,
    *,
    batch: int,
    seq: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    v_head_dim: int | None = None,
    dtype=jnp.float32,
    causal: bool = True,
    window: int | None = None,
    segment_ids: bool = False,
    backward: bool = False,
):
    """Compile (never run) `attention` under `spec` for abstract sharded inputs.

    With `backward`, the program is `jax.value_and_grad` of the summed output with respect
    to q, k, v: the forward output stays live, as it would inside a model.

    **Returns:** the `jax.stages.Compiled` program.
    """
    dv = head_dim if v_head_dim is None else v_head_dim
    heads, tokens = spec.sharding(spec.heads_pspec()), spec.sharding(spec.token_pspec())
    q = jax.ShapeDtypeStruct((batch, seq, q_heads, head_dim), dtype, sharding=heads)
    k = jax.ShapeDtypeStruct((batch, seq, kv_heads, head_dim), dtype, sharding=heads)
    v = jax.ShapeDtypeStruct((batch, seq, kv_heads, dv), dtype, sharding=heads)
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=tokens)

    def forward(q, k, v, ids):
        return attention(
            q, k, v, spec=spec, causal=causal, window=window,
            segment_ids=ids if segment_ids else None,
        )  # fmt: skip

    fn = forward
    if backward:
        loss = lambda q, k, v, ids: jnp.sum(forward(q, k, v, ids).astype(jnp.float32))  # noqa: E731
        fn = jax.value_and_grad(loss, argnums=(0, 1, 2))
    return jax.jit(fn).lower(q, k, v, ids).compile()


class TrainerRun(NamedTuple):
    """What `eqx_longctx.train.Trainer` builds for a run's settings before it reads data:
    the `family`, the model `config`, the settings `train` and the `placement`."""

    family: ModelFamily
    config: Any
    train: Any  # eqx_longctx.train.TrainConfig
    placement: Any  # eqx_longctx.run.Placement


def trainer_run(train: Any, vocab_size: int | None = None) -> TrainerRun:
    """The model config and placement of a run, built by the trainer's own code:
    `build_model_config` (the preset, `max_seq_len` raised to `seq_len`, the
    `model_overrides` parsed as the trainer's `--override`) and `Placement` (the mesh, spec
    and layouts of `--mesh`, `--strategy`, `--load-balance`, `--fsdp-axes`).

    **Arguments:**

    - `train`: the run's `eqx_longctx.train.TrainConfig`; its `devices` must exist.
    - `vocab_size`: the vocabulary (the trainer's is its tokenizer's); `None`: the
      preset's. A `vocab_size` override wins.

    **Returns:** a `TrainerRun`.

    **Raises:** `ValueError` as `eqx_longctx.model_family` for an unknown family, as
    `eqx_longctx.run.resolve_overrides` for an unknown preset or override, and as
    `eqx_longctx.run.placement_from_flags`.
    """
    from .._family import model_family
    from ..run import placement_from_flags, resolve_overrides
    from ..train import build_model_config

    family = model_family(train.model)
    resolve_overrides(train.preset, train.model_overrides, model=train.model)
    vocab = family.presets[train.preset].vocab_size if vocab_size is None else vocab_size
    config = build_model_config(train, vocab)
    placement = placement_from_flags(
        train.devices, train.mesh, train.strategy, train.load_balance, train.fsdp_axes,
        vocab_size=config.vocab_size,
    )  # fmt: skip
    return TrainerRun(family, config, train, placement)


def compile_train_step(run: TrainerRun):
    """Compile (never run) the train step of a run, as `eqx_longctx.train.Trainer` builds
    it: its optimizer (`make_optimizer` of the run's settings), the model, optimizer state
    and batch as the placement lays them out (abstract), and `lower_train_step`.

    **Arguments:**

    - `run`: a `TrainerRun` (`run.config.remat` is the policy compiled).

    **Returns:** the `jax.stages.Compiled` step.
    """
    from ..train import host_offload_of, lower_train_step, make_optimizer

    t, placement = run.train, run.placement
    optimizer = make_optimizer(t.lr, t.warmup_steps, t.steps, t.weight_decay, t.clip_norm)

    def make(spec):
        return run.family.model(run.config, key=jax.random.key(t.seed), spec=spec)

    model = placement.abstract_model(make)
    opt_state = placement.abstract_opt_state(optimizer, model)
    shardings = placement.step_shardings(optimizer, model)
    batch = placement.abstract_batch(t.batch_size, t.seq_len)
    lowered = lower_train_step(
        optimizer, model, opt_state, batch, shardings=shardings, grad_accum=t.grad_accum,
        loss_chunk=t.loss_chunk, host_offload=host_offload_of(t.host_offload),
    )  # fmt: skip
    return lowered.compile()


# ---- inference ---------------------------------------------------------------------------


def compile_generate(model: Any, *, batch: int, seq: int, prompt_len: int | None = None,
                     cache_dtype: Any = None) -> tuple[Any, Any]:  # fmt: skip
    """Compile (never run) the prefill and the decode step of `eqx_longctx.prefill` and
    `decode_step` for an abstract model and cache (`eqx_longctx.inference.lower_prefill`
    and `lower_decode`: the programs those calls run).

    **Arguments:**

    - `model`: the model, e.g. its `eqx.filter_eval_shape` (its arrays are laid out as
      `eqx_longctx.param_pspecs` says under `model.spec`).
    - `batch`, `seq`: rows and the cache's `max_len`; `prompt_len`: the prompt (default
      `seq`); `cache_dtype`: as `init_cache`'s `dtype`.

    **Returns:** `(prefill, decode)`, two `jax.stages.Compiled` programs.
    """
    from ..inference import lower_decode, lower_prefill

    first = lower_prefill(
        model, batch=batch, max_len=seq, prompt_len=prompt_len, cache_dtype=cache_dtype
    )
    step = lower_decode(model, batch=batch, max_len=seq, cache_dtype=cache_dtype)
    return first.compile(), step.compile()
