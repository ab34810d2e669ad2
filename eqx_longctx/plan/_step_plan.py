"""The whole-step memory planner: what one training step holds on each device.

For a model family, a preset, a sequence length, a batch and a mesh, `plan_train_step`
predicts the per-device memory of a train step (AdamW, `eqx_longctx.train`) for every
context-parallel strategy the mesh can run and every remat policy, and picks the fastest
(strategy, remat) that fits a memory budget. The breakdown, per device:

- **parameters**: `eqx_longctx.param_bytes_per_device` (the rules table: fsdp, tensor and
  expert axes split the weights, everything else is replicated);
- **gradients**: the same layout and dtype as the parameters (ZeRO-3: each device keeps
  the reduce-scattered shard);
- **optimizer state**: AdamW's two moments, in the parameters' layout and dtype (float32
  for float32 parameters);
- **batch**: the five `[batch, seq]` int32/float32 arrays of the local tokens;
- **activations**: what every layer keeps for the backward pass under the remat policy
  (`_activations.py` asks JAX for one layer's saved residuals at the local shapes), times
  the number of layers; `"offload"` keeps the layer inputs in host memory instead (the
  **host** column, not counted on the device);
- **layer backward**: the working set of the layer being differentiated: its attention
  temporaries (the attention cost model, `eqx_longctx.attention._cost`; a linear-attention
  layer's from `eqx_longctx.linear.linear_attention_cost`, which also adds what its
  sequence split keeps beyond the one-device trace) and, when the layer is recomputed
  (`"full"`, `"dots"`, `"offload"`), the activations it rebuilds;
- **logits and loss**: float32 logits over the device's vocabulary shard (the tensor
  axis splits the vocabulary), their softmax and their gradient: of one chunk of tokens
  under the chunked loss (the trainer's default, `loss_chunk=None`), of all the device's
  tokens with `loss_chunk=0`; with fsdp axes also the output head gathered, and its
  gradient before the reduce-scatter.

The peak is parameters + gradients + optimizer state + batch + activations + the larger of
the layer backward and the logits. The parameters and optimizer state passed in are donated
(the trainer's step does so), so the updated ones take no extra memory.

Each row also has the step's time on the busiest device, every layer's matmuls and attention
(`_step_time.py`), at the FLOP/s and link bytes/s given or of a `chip` (`_chips.py`), and
the MFU that time implies; the choice is the fastest row that fits.

The model is known only through its `eqx_longctx.ModelFamily`: the planner asks it for the
model, the local config one device computes with, the attention and routed-experts shapes
and the active parameters.

`--compile` (`_compile.py`) checks the prediction against XLA's memory analysis of the
trainer's own step under the trainer's `Placement`, compiled for abstract arrays on fake
CPU devices.
"""

import dataclasses
import math
from typing import Any, NamedTuple, no_type_check

import equinox as eqx
import jax
import jax.numpy as jnp

from .._checks import check_memory_budget, check_names, check_spec
from .._family import ModelFamily, MoEShape, model_family
from .._partition import param_bytes_per_device, param_pspecs
from .._sharding import ShardingSpec
from .._units import gib
from ..attention import (
    DEFAULT_BYTES_PER_S,
    DEFAULT_FLOPS_PER_S,
    STRATEGY_ORDER,
    check_tensor_heads,
    plan_attention,
)
from ..nn import check_loss_chunk, loss_chunk_tokens, vocab_axes
from ._activations import REMATS, stack_activations, stacks
from ._chips import Chip, as_chip
from ._explain import step_table
from ._step_time import linear_costs, mfu, model_flops, stack_linear, stack_windows, step_time

_F32 = 4
_BATCH_FIELDS = 5  # tokens, targets, positions, segment ids (int32), loss mask (float32)
# Logits phase, in float32 [tokens, vocab] arrays: the logits (kept for the backward), their
# softmax and their gradient, partly fused: 2.5 copies measured (XLA:CPU, vocab 259 to 64K).
LOGIT_COPIES = 2.5
# The backward of a rematerialised MoE layer holds cotangents beside the residuals it
# rebuilt (the expert matmuls' inputs, on the CPU's tiled path per-tile weight slices too):
# about 1.5 times the residuals. Measured on the tiny preset, seq 8192, ring: context=8 with
# remat full / offload (predicted / compiled 1.03 / 1.00) and expert=2,context=4 with full /
# dots (0.92 / 0.94). (The 2 used before was fitted while the attention's forward loops were
# still partially evaluated under remat, which added stored scores to every compiled step.)
MOE_BACKWARD = 1.5


class StepMemory(NamedTuple):
    """Predicted per-device bytes of one train step under one (strategy, remat)."""

    strategy: str
    remat: str
    params: int
    grads: int
    opt_state: int
    batch: int
    activations: int  # saved for the backward pass, all layers
    layer_backward: int  # working set of the layer being differentiated
    attention: int  # attention temporaries (part of layer_backward; the largest stack's)
    logits: int  # logits, softmax and their gradient
    host: int  # in host memory: offloaded activations, and state offloaded between steps
    time_s: float  # the step's time: every layer's matmuls and attention (`_step_time`)
    offloaded_opt_state: int = 0  # the optimizer state's bytes kept in host memory
    flops: float = 0.0  # FLOPs the busiest device runs in the step, recomputation included
    attention_s: float = 0.0  # every layer's attention, communication included (in time_s)
    mfu: float = 0.0  # the plan's model FLOPs / (time_s x devices x FLOP/s)

    @property
    def device(self) -> int:
        """Predicted peak bytes on each device: the larger of the forward and backward
        (the optimizer state there unless it is offloaded) and the update (parameters,
        gradients, optimizer state and batch)."""
        on_device = self.opt_state - self.offloaded_opt_state
        fixed = self.params + self.grads + on_device + self.batch + self.activations
        update = self.params + self.grads + self.opt_state + self.batch
        return max(fixed + max(self.layer_backward, self.logits), update)

    def breakdown(self) -> dict:
        """The rows of the breakdown, name -> bytes per device (host memory separate)."""
        names = (
            "params", "grads", "opt_state", "batch", "activations", "layer_backward",
            "attention", "logits", "host",
        )  # fmt: skip
        return {name: int(getattr(self, name)) for name in names}


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What `plan_train_step` predicts: every candidate and the choice.

    - `problem`: the model, shapes, mesh and budget the prediction is for.
    - `rows`: a `StepMemory` per (strategy, remat) the mesh can run.
    - `chosen`: the fastest row that fits `memory_budget_bytes` (the fastest row when there
      is no budget); `None` when nothing fits.
    - `reason`: why it was chosen, or what would fit.
    """

    problem: dict
    rows: tuple[StepMemory, ...]
    chosen: StepMemory | None
    reason: str

    @property
    def model_flops(self) -> float:
        """Model FLOPs of one step, all devices: 6 per active parameter and token plus the
        causal attention's forward and backward (a linear-attention layer's chunked rule,
        `_step_time.py`), without recomputation (what MFU counts)."""
        return self.problem["model_flops"]

    def row(self, strategy: str, remat: str) -> StepMemory:
        """**Returns:** the prediction for one (strategy, remat).

        **Raises:** `ValueError` when that pair was not planned.
        """
        for r in self.rows:
            if (r.strategy, r.remat) == (strategy, remat):
                return r
        have = sorted({(r.strategy, r.remat) for r in self.rows})
        raise ValueError(
            f"no prediction for strategy={strategy!r}, remat={remat!r} on this mesh; the "
            f"planned ones are {have}."
        )

    def explain(self) -> str:
        """**Returns:** the breakdown of every candidate as a table, then the choice, as
        text."""
        return step_table(self)


@no_type_check  # validated eagerly, with errors that say what to fix
def plan_train_step(
    family: str | ModelFamily,
    config: Any,
    spec: ShardingSpec,
    *,
    batch: int,
    seq: int,
    remats: tuple[str, ...] = REMATS,
    strategies: tuple[str, ...] | None = None,
    memory_budget_bytes: int | float | None = None,
    flops_per_s: float | None = None,
    bytes_per_s: float | None = None,
    grad_accum: int = 1,
    loss_chunk: int | None = None,
    host_offload: tuple[str, ...] = (),
    chip: str | Chip | None = None,
) -> StepPlan:
    """Predict the per-device memory of a train step; choose a strategy and remat policy.

    **Arguments:**

    - `family`: the model family: a `ModelFamily`, or the name of an installed or
      registered one (`eqx_longctx.model_family`), e.g. `"llama"`.
    - `config`: the model's config (its `remat` is ignored: every policy in `remats` is
      planned).
    - `spec`: the `ShardingSpec` the model runs under (its mesh, fsdp, tensor and expert
      axes; its strategy, unless `"auto"`, is the only one planned).
    - `batch`, `seq`: global batch rows and sequence length.
    - `remats`: the remat policies to plan, among `"none"`, `"dots"`, `"offload"`, `"full"`.
    - `strategies`: the strategies to plan, among `"all_gather"`, `"ulysses"`, `"ring"`,
      `"usp"` (default: the spec's, or under `"auto"` every one this mesh can run).
    - `memory_budget_bytes`: per-device budget in bytes, `> 0`; `None`: the `chip`'s HBM
      per device, or without a chip the fastest row.
    - `flops_per_s`, `bytes_per_s`: a device's FLOP/s and one link's bytes/s (one
      direction) for the time; `None`: the `chip`'s, or without a chip the attention cost
      model's defaults (100 TFLOP/s, 50 GB/s).
    - `grad_accum`: `K` micro-batches per step (`eqx_longctx.train.make_train_step`): the
      activations, attention, logits and layer work are one micro-batch's (`batch / K`
      rows), plus a float32 gradient accumulator; the batch and the time are the step's.
    - `loss_chunk`: the trainer's `--loss-chunk` (`eqx_longctx.train.loss_fn`): `None`
      automatic chunks, `k` tokens per chunk, `0` the whole logits.
    - `host_offload`: the trainer's `--host-offload` (`eqx_longctx.train.make_train_step`):
      `"opt_state"` keeps AdamW's moments in host memory, on the device only for the
      update (after the backward has freed the activations); `"params"` keeps the
      parameters there between steps (the step brings them whole, so the device peak is
      unchanged). Both count in the host column.
    - `chip`: a `Chip` or the name of one in `eqx_longctx.plan.CHIPS` (`"v5p"`, `"v5e"`,
      `"v6e"`, `"tpu7x"`, `"h100"`, `"h200"`): its peak bfloat16 FLOP/s, link bytes/s and
      HBM per device stand in for the three arguments above left `None`.

    **Returns:** a `StepPlan`; when nothing fits the budget its `chosen` is `None` and its
    `reason` names what would fit.

    **Raises:** `ValueError` for an unknown `family` or `chip` name, an unknown name in
    `strategies` or `remats`, or an empty one; for a `grad_accum` that is not an int `>= 1`
    or does not divide `batch`; when `batch` (or a micro-batch) does not split over the
    batch axes or `seq` over its sequence shards (`2N` chunks under `"zigzag"`); when the
    heads do not divide over the `tensor_axis` (multi-head latent attention's too); when a
    weight dimension does not split over its mesh axes (as `eqx_longctx.param_pspecs`); or
    when a strategy in `strategies` cannot run these shapes. `TypeError` when `family` is
    neither a name nor a `ModelFamily`, `chip` neither a name nor a `Chip`, `spec` is not a
    `ShardingSpec`, or `strategies` or `remats` is not a tuple of names; `TypeError` or
    `ValueError` for `memory_budget_bytes`, `flops_per_s` or `bytes_per_s` that is not a
    finite number `> 0`.
    """
    where = "plan_train_step"
    fam = as_family(family, where)
    check_spec(spec, where, none_ok=False)
    remats = check_names(remats, where, "remats", "remat policy", REMATS)
    if strategies is not None:
        fix = " Or leave strategies=None to plan every strategy this mesh can run."
        strategies = check_names(strategies, where, "strategies", "strategy", STRATEGY_ORDER, fix)
    if chip is not None:
        chip = as_chip(chip, f"{where}: chip")
        if memory_budget_bytes is None:
            memory_budget_bytes = chip.device_hbm_bytes
        if flops_per_s is None:
            flops_per_s = chip.device_flops_per_s
        if bytes_per_s is None:
            bytes_per_s = chip.hop_bytes_per_s(spec.context_parallel_size)
    flops_per_s = DEFAULT_FLOPS_PER_S if flops_per_s is None else flops_per_s
    bytes_per_s = DEFAULT_BYTES_PER_S if bytes_per_s is None else bytes_per_s
    budget = check_memory_budget(memory_budget_bytes, where)
    check_loss_chunk(loss_chunk)
    from ..train import check_host_offload  # the trainer's rule (not at import)

    check_host_offload(host_offload)
    if not isinstance(grad_accum, int) or isinstance(grad_accum, bool) or grad_accum < 1:
        raise ValueError(f"{where}: grad_accum must be an int >= 1; got {grad_accum!r}.")
    if batch % grad_accum:
        raise ValueError(
            f"{where}: batch={batch} rows must split into grad_accum={grad_accum} "
            f"micro-batches; use a batch that is a multiple of {grad_accum}."
        )
    spec.check_batch(batch)
    spec.check_batch(batch // grad_accum, what=f"a micro-batch of batch={batch} / {grad_accum}")
    full_local = batch // spec.batch_parallel_size
    batch //= grad_accum  # what one micro-batch holds at a time
    n_seq = spec.context_parallel_size
    need = 2 * n_seq if spec.load_balance == "zigzag" else n_seq
    if seq % need:
        raise ValueError(
            f"seq={seq} must be divisible by {need} to split over the {n_seq} sequence shards "
            f"of the mesh ({spec.load_balance} layout); use seq={-(-seq // need) * need}."
        )
    heads = tuple(fam.attention_shape(config))
    nt = check_tensor_heads(spec, heads[0], heads[1])
    b_local, s_local = batch // spec.batch_parallel_size, seq // n_seq
    model = eqx.filter_eval_shape(fam.model, config, key=jax.random.key(0), spec=spec)
    params = param_bytes_per_device(model, spec)
    opt_state = 2 * params  # AdamW's first and second moments, laid out as the parameters
    grads = params
    if grad_accum > 1:  # and the float32 sum of the micro-batches' gradients
        grads += params * _F32 // jnp.dtype(config.param_dtype).itemsize
    batch_bytes = _BATCH_FIELDS * full_local * s_local * 4
    ne = spec.axis_size(spec.expert_axis)
    per_stack = stack_activations(fam, config, batch=b_local, seq=s_local, tensor=nt, expert=ne)
    dtype = jnp.dtype(config.compute_dtype)
    shape = dict(
        batch=batch, seq=seq, q_heads=heads[0], kv_heads=heads[1], head_dim=heads[2],
        v_head_dim=heads[3], dtype=dtype, segment_ids=True, flops_per_s=flops_per_s,
        bytes_per_s=bytes_per_s, where=where,
    )  # fmt: skip
    windows = stack_windows(stacks(model))  # each stack's attention is priced at its window
    linear = stack_linear(stacks(model))  # and a linear-attention stack by its own model
    distinct = dict.fromkeys(w for p, w in windows.items() if linear[p] is None) or {None: None}
    by_window = {window: plan_attention(spec, window=window, **shape) for window in distinct}
    attn = next(iter(by_window.values()))  # which strategies can run: the same for every window
    layer_windows = [(s.n_layers, windows[s.path]) for s in per_stack if linear[s.path] is None]
    counts = {s.path: s.n_layers for s in per_stack}
    rates = dict(flops_per_s=flops_per_s, bytes_per_s=bytes_per_s, dtype_bytes=dtype.itemsize)
    by_linear, linear_flops = linear_costs(spec, linear, counts, batch, seq, grad_accum, rates)
    active_params = fam.active_params(config)
    step_flops = model_flops(
        active_params, heads, layer_windows, batch=batch * grad_accum, seq=seq, linear=linear_flops
    )
    devices = math.prod(spec.mesh.shape.values())
    if strategies is None:
        strategies = tuple(
            name
            for name, c in attn.costs.items()
            if c.feasible and c.runnable and (spec.strategy in ("auto", name))
        )
    offloaded = opt_state if "opt_state" in host_offload else 0
    state_on_host = offloaded + (params if "params" in host_offload else 0)
    logits, head_recompute = _loss_bytes(model, spec, b_local * s_local, loss_chunk)
    gathered = _gathered_layer_bytes(model, spec)
    param_itemsize = jnp.dtype(config.param_dtype).itemsize
    if spec.fsdp_axis:  # the output head gathered over the fsdp axes, its compute-dtype
        # copy, and its gradient before the reduce-scatter
        head = config.vocab_size * config.dim // nt
        logits += head * (2 * param_itemsize + dtype.itemsize)
    active = active_params / nt
    rows = []
    for strategy in strategies:
        cost = attn.costs[strategy]
        if not cost.feasible:
            raise ValueError(
                f"strategy {strategy!r} cannot run these shapes on mesh "
                f"{dict(spec.mesh.shape)}: {cost.reason}."
            )
        layer_costs = [
            (s.n_layers, by_linear[s.path])
            if s.path in by_linear
            else (s.n_layers, by_window[windows[s.path]].costs[strategy])
            for s in per_stack
        ]
        temps = [
            c.temporaries
            if s.path in by_linear
            else _attention_temporaries(c.memory_train, b_local, s_local, nt, heads, dtype)
            for s, (_, c) in zip(per_stack, layer_costs, strict=True)
        ]
        attn_temp = max(temps, default=0)
        kept = _strategy_residuals(strategy, spec, b_local, s_local, nt, heads, dtype)
        ep = _dispatch_buffers(fam.moe_shape(config), config.dim, ne, b_local * s_local, dtype)
        for remat in remats:
            acts = host = work = 0
            for s, temp in zip(per_stack, temps, strict=True):
                # Under "none" a layer also keeps its gathered weights (fsdp; the copies cast
                # to the compute dtype that its matmuls read) and what the strategy's
                # backward needs beyond the local kernel's residuals.
                saved_weights = gathered[s.path] * dtype.itemsize // param_itemsize  # as cast
                # A linear stack keeps its sequence split's residuals (wider chunk states)
                # instead of a softmax strategy's.
                split = by_linear[s.path].saved_extra if s.path in by_linear else kept
                extra = saved_weights + split + ep * s.moe if remat == "none" else 0
                acts += s.n_layers * (s.saved[remat] + extra) + s.shared
                host += s.n_layers * s.host[remat]
                # Differentiating a layer: its gathered weights and their unreduced
                # gradient, the activations it rebuilds when rematerialised, attention.
                factor = MOE_BACKWARD if s.moe else 1
                rebuild = int(s.recompute * factor) if remat != "none" else 0
                if remat != "none" and s.path in by_linear:
                    rebuild += by_linear[s.path].saved_extra + by_linear[s.path].conv_rebuild
                weights = gathered[s.path] * (1 if remat == "none" else 2)
                work = max(work, rebuild + weights + temp)
            param_tokens = (active + head_recompute) * b_local * s_local
            t = step_time(param_tokens, layer_costs, remat, heads, flops_per_s, grad_accum)
            rows.append(
                StepMemory(
                    strategy,
                    remat,
                    params,
                    grads,
                    opt_state,
                    batch_bytes,
                    acts,
                    work,
                    attn_temp,
                    logits,
                    host + state_on_host,
                    t.time_s,
                    offloaded_opt_state=offloaded,
                    flops=t.flops,
                    attention_s=t.attention_s,
                    mfu=mfu(step_flops, t.time_s, devices, flops_per_s),
                )  # fmt: skip
            )
    budget = None if budget is None else int(budget)
    chosen, reason = _choose(rows, budget)
    problem = dict(
        model=fam.name, seq=seq, batch=batch * grad_accum, grad_accum=grad_accum,
        mesh=dict(spec.mesh.shape),
        fsdp_axes=list(spec.fsdp_axis), tensor_axis=spec.tensor_axis,
        expert_axis=spec.expert_axis, load_balance=spec.load_balance,
        param_dtype=str(jnp.dtype(config.param_dtype)), compute_dtype=str(dtype),
        n_layers=config.n_layers, local_batch=b_local, local_seq=s_local,
        memory_budget_bytes=budget, flops_per_s=flops_per_s, bytes_per_s=bytes_per_s,
        loss_chunk=loss_chunk, host_offload=list(host_offload),
        chip=None if chip is None else chip.name, devices=devices, model_flops=step_flops,
        layers=_layer_kinds(per_stack, windows, linear, by_window, strategies),
    )  # fmt: skip
    return StepPlan(problem, tuple(rows), chosen, reason)


def _layer_kinds(per_stack, windows, linear, by_window, strategies) -> list[dict]:
    """What each kind of softmax layer runs under each planned strategy, and the bytes one
    layer moves per device (forward + backward): a local layer (window or chunk) on the
    contiguous or zig-zag layout runs a neighbour exchange where ring or all_gather would
    send whole shards (`eqx_longctx.attention`'s halo)."""
    kinds: dict = {}
    for s in per_stack:
        if linear[s.path] is not None:
            continue
        window = windows[s.path]
        entry = kinds.setdefault(window, {"window": window, "layers": 0, "runs": {}})
        entry["layers"] += s.n_layers
        for strategy in strategies:
            c = by_window[window].costs[strategy]
            halo = c.reason.startswith("local layer")
            entry["runs"][strategy] = {
                "runs": "neighbour exchange" if halo else strategy,
                "comm_train_bytes": int(sum(c.comm_train.values())),
            }
    return list(kinds.values())


def as_family(family: Any, where: str) -> ModelFamily:
    """**Returns:** `family` if it is a `ModelFamily`, else the family of that name.

    **Raises:** `ValueError` for an unknown name; `TypeError` for anything else.
    """
    if isinstance(family, ModelFamily):
        return family
    if isinstance(family, str):
        return model_family(family)
    raise TypeError(
        f"{where} needs family=a ModelFamily or the name of one (e.g. 'llama'); got "
        f"{type(family).__name__} {family!r}. Pass eqx_longctx.model_family(name)."
    )


def _loss_bytes(model: Any, spec: ShardingSpec, tokens: int, loss_chunk: int | None):
    """`(bytes, head parameters run again per token)` of the loss on one device.

    The logits of a device's tokens are split over the axes that split the output head's
    vocabulary (the tensor axis): the whole logits (`loss_chunk=0`) are `tokens x vocab
    shard`, the chunked loss holds one chunk of `chunk x vocab shard` (all the tokens when
    one chunk takes them: nothing to recompute). With several chunks its backward runs the
    head's forward again (2 more FLOPs per head parameter and token, on top of 6).
    """
    axes = vocab_axes(model.head_pspec())
    local = model.config.vocab_size // math.prod(spec.axis_size(a) for a in axes)
    chunk = loss_chunk_tokens(local, tokens, loss_chunk)
    recompute = 0.0 if chunk >= tokens else model.config.dim * local / 3
    return int(LOGIT_COPIES * chunk * local * _F32), recompute


def _gathered_layer_bytes(model: Any, spec: ShardingSpec) -> dict[str, int]:
    """Bytes of one layer's weights gathered over the fsdp axes (still split over the
    tensor and expert axes), per `LayerStack` path: 0 without fsdp axes."""
    out = {}
    for path, stack in stacks(model).items():
        if not spec.fsdp_axis:
            out[path] = 0
            continue
        arrays = jax.tree.leaves(eqx.filter(stack, lambda a: isinstance(a, jax.ShapeDtypeStruct)))
        pspecs = jax.tree.leaves(param_pspecs(stack, spec, gathered=True))
        total = 0
        for leaf, ps in zip(arrays, pspecs, strict=True):
            shards = math.prod(
                spec.axis_size(a)
                for e in ps
                if e is not None
                for a in ((e,) if isinstance(e, str) else e)
            )
            total += math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize // shards
        out[path] = total // stack.n_layers
    return out


def _strategy_residuals(strategy, spec, b, s, nt, heads, dtype) -> int:
    """Bytes a strategy keeps per layer for its backward beyond the local kernel's
    residuals: all-gather keeps the gathered K/V (and their positions and segment ids)."""
    if strategy != "all_gather":
        return 0
    _, hk, d, dv = heads
    n = spec.context_parallel_size
    kv = b * s * (hk // nt) * (d + dv) * jnp.dtype(dtype).itemsize + 2 * b * s * 4
    return (n - 1) * kv


def _dispatch_buffers(moe: MoEShape | None, dim: int, ne: int, tokens: int, dtype) -> int:
    """Bytes an expert-parallel MoE layer keeps beyond its local experts' residuals: the
    buffers of token copies (`dim` wide) sent to and received back from the `ne` expert
    devices, each with room for `tokens x top_k` copies per destination when dropless, else
    `capacity_factor x tokens x top_k / ne`."""
    if ne == 1 or moe is None:
        return 0
    n = tokens * moe.top_k
    cf = moe.capacity_factor
    room = n if cf is None else min(n, math.ceil(cf * n / ne))
    return 2 * ne * room * dim * jnp.dtype(dtype).itemsize


def _attention_temporaries(memory_train: int, b, s, nt, heads, dtype) -> int:
    # The attention cost model counts its inputs and gradients (q, k, v and dq, dk, dv) in
    # its memory; in a model those are the layer's activations, counted there.
    hq, hk, d, dv = heads
    qkv = b * s * (hq * d + hk * (d + dv)) // nt * jnp.dtype(dtype).itemsize
    return max(0, int(memory_train) - 2 * qkv)


def _choose(rows: list[StepMemory], budget: int | None) -> tuple[StepMemory | None, str]:
    if not rows:
        return None, "no strategy can run these shapes on this mesh"
    fastest = min(rows, key=lambda r: r.time_s)
    if budget is None:
        return fastest, "the fastest predicted step (no memory budget given)"
    fits = [r for r in rows if r.device <= budget]
    if not fits:
        least = min(rows, key=lambda r: r.device)
        parts = {k: v for k, v in least.breakdown().items() if k not in ("attention", "host")}
        big = max(parts, key=lambda k: parts[k])
        return None, (
            f"nothing fits {gib(budget)} per device; the least is {least.strategy} with remat="
            f"{least.remat!r} at {gib(least.device)} (largest part: {big} {gib(parts[big])}), "
            f"which fits a budget of {gib(least.device)}. To fit {gib(budget)}, spread the "
            "tokens over more devices (a larger context axis, or a smaller batch: activations "
            "and logits scale with the tokens per device), or the weights over more axes "
            "(--fsdp-axes, tensor=, expert=)"
        )
    best = min(fits, key=lambda r: r.time_s)
    return best, (
        f"the fastest predicted step that fits {gib(budget)} ({gib(best.device)} per device)"
    )
