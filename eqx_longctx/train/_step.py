"""The functional core of training: loss, optimizer, one jitted update, evaluation.

Everything here is a pure function of its arguments; the loop in `_loop.py` owns all state.
"""

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float

from ..data import ByteTokenizer
from ..nn import AbstractDecoder, check_loss_chunk, chunked_cross_entropy
from ._bits import batch_bytes, byte_ids_of, units
from ._offload import check_host_offload, to_device, to_host

_BYTES = ByteTokenizer()

TrainStep = Callable[[Any, optax.OptState, Any], tuple[Any, optax.OptState, dict[str, Array]]]


# Optimizer settings: (CLI flag, rule, test, example). NaN fails every test.
_OPTIMIZER_RULES = {
    "lr": ("--lr", "finite and > 0", lambda x: x > 0, "3e-3"),
    "total_steps": ("--steps", "at least 1", lambda x: x >= 1, "200"),
    "warmup_steps": ("--warmup-steps", "at least 0", lambda x: x >= 0, "20"),
    "weight_decay": ("--weight-decay", "finite and >= 0", lambda x: x >= 0, "0.1"),
    "clip_norm": ("--clip-norm", "finite and > 0 (a global gradient norm)", lambda x: x > 0, "1.0"),
}


def check_optimizer_settings(**settings: float | int | None) -> None:
    """Raise `ValueError` for the first optimizer setting out of range, naming the setting,
    its CLI flag, the value and the fix. The one place these rules live: `make_schedule`,
    `make_optimizer` and `TrainConfig` all call it.

    **Arguments:**

    - `**settings`: any of `lr`, `total_steps`, `warmup_steps`, `weight_decay`,
      `clip_norm` (`None`: not checked).
    """
    for name, value in settings.items():
        flag, rule, ok, example = _OPTIMIZER_RULES[name]
        if value is not None and not (math.isfinite(value) and ok(value)):
            raise ValueError(
                f"{name} ({flag}) must be {rule}; got {name}={value}. Pass e.g. "
                f"{name}={example} ({flag} {example})."
            )


def make_schedule(lr: float, warmup_steps: int, total_steps: int) -> optax.Schedule:
    """Linear warmup to `lr` over `warmup_steps`, then cosine decay to `lr / 10` at `total_steps`.

    The first update already uses `lr / warmup_steps` (not 0), so no step is wasted.

    **Arguments:**

    - `lr`: peak learning rate.
    - `warmup_steps`: steps of linear warmup (clipped to `total_steps - 1`).
    - `total_steps`: length of the whole schedule.

    **Returns:** an `optax.Schedule` mapping the update count to a learning rate.

    **Raises:** `ValueError` unless `lr` is finite and `> 0`, `warmup_steps >= 0` and
    `total_steps >= 1`.
    """
    check_optimizer_settings(lr=lr, warmup_steps=warmup_steps, total_steps=total_steps)
    warmup = min(warmup_steps, total_steps - 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=lr / max(warmup, 1),
        peak_value=lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=lr / 10,
    )


# A heads axis and the per-head width after it are one feature axis split in two: a bias
# `[q_heads, head_dim]` is a vector, a projection `[embed, q_heads, head_dim]` a matrix.
_HEAD_AXES = ("q_heads", "kv_heads", "heads")


def matrix_rank(axes: PartitionSpec) -> int:
    """The rank of a weight as the linear map it is, from its logical axes.

    The leading `"layers"` axis of a stacked weight does not count, and a heads axis
    followed by the per-head width counts once.

    **Arguments:**

    - `axes`: the weight's logical axes, e.g. `P("layers", "embed", "q_heads", "head_dim")`.

    **Returns:** e.g. 2 for that projection, 1 for a norm scale or a per-head bias.
    """
    names = list(axes)
    if names and names[0] == "layers":
        names = names[1:]
    fused = sum(1 for name in names[:-1] if name in _HEAD_AXES)
    return len(names) - fused


def decay_mask(params):
    """Which parameters weight decay applies to: the matrices (`matrix_rank >= 2`:
    projections, embeddings, experts), not norm scales, biases or routing biases.

    **Arguments:**

    - `params`: `eqx.filter(model, eqx.is_inexact_array)` (or updates of that structure).

    **Returns:** a pytree of bools of the same structure (`None` where `params` has none).

    **Raises:** `ValueError` as `eqx_longctx.logical_axes`, for an array whose field
    annotation names no dimensions or another rank.
    """
    from .._partition import logical_axes

    def decay(axes: PartitionSpec) -> bool:
        return matrix_rank(axes) >= 2

    return jax.tree.map(decay, logical_axes(params), is_leaf=lambda x: isinstance(x, PartitionSpec))


def make_optimizer(
    lr: float,
    warmup_steps: int,
    total_steps: int,
    weight_decay: float = 0.1,
    clip_norm: float = 1.0,
    *,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
) -> optax.GradientTransformation:
    """AdamW with linear warmup + cosine decay and global-norm gradient clipping.

    The learning rate is injected as a hyperparameter, so the one used for the latest
    update can be read back with `opt_state.hyperparams["learning_rate"]`.

    **Arguments:**

    - `lr`, `warmup_steps`, `total_steps`: see [`make_schedule`][].
    - `weight_decay`: decoupled weight decay, applied to matrices only (see
      [`decay_mask`][]: chosen by the rank of each weight's logical axes, so norm scales and
      biases are spared whatever their names).
    - `clip_norm`: gradients are rescaled so their global norm is at most this.
    - `b1`, `b2`, `eps`: Adam's moment decay rates and denominator epsilon.

    **Returns:** an `optax.GradientTransformation`.

    **Raises:** `ValueError` as [`make_schedule`][], and unless `weight_decay` is finite and
    `>= 0` and `clip_norm` finite and `> 0`.
    """
    check_optimizer_settings(weight_decay=weight_decay, clip_norm=clip_norm)
    schedule = make_schedule(lr, warmup_steps, total_steps)

    def build(learning_rate):
        return optax.chain(
            optax.clip_by_global_norm(clip_norm),
            optax.adamw(
                learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask
            ),
        )

    return optax.inject_hyperparams(build)(learning_rate=schedule)


def loss_fn(
    model, batch, *, loss_chunk: int | None = None
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """Masked mean token cross-entropy in nats.

    **Arguments:**

    - `model`: an `eqx_longctx.nn.AbstractDecoder` (any model family), or any model called
      as `model(tokens, positions, segment_ids) -> logits [batch, seq, vocab]`; a model
      with a `spec` (a `ShardingSpec`) has its loss computed under that spec.
    - `batch`: a `Batch` with `tokens`, `targets`, `positions`, `segment_ids`, `loss_mask`.
    - `loss_chunk`: how a decoder's loss meets its logits. `None` (default): a chunk of
      tokens at a time, `eqx_longctx.nn.LOSS_CHUNK_BYTES` of float32 logits per device,
      recomputed in the backward (`eqx_longctx.nn.chunked_cross_entropy`); `k >= 1`: `k`
      tokens per chunk on each device; `0`: the whole logits from the model's call (what
      a model that is not a decoder always gets).

    **Returns:** `(loss, num_tokens)`: the mean over tokens with `loss_mask > 0`, and their
    count (the loss is 0 when the count is 0).

    **Raises:** as the model's call (e.g. `eqx_longctx.nn.AbstractDecoder.__call__`) for
    inputs it rejects; `ValueError` for a `loss_chunk` that is not `None` or an int `>= 0`.
    """
    total, num_tokens = loss_sum(model, batch, loss_chunk=loss_chunk)
    return total / jnp.maximum(num_tokens, 1.0), num_tokens


def loss_sum(
    model, batch, *, loss_chunk: int | None = None
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """The summed masked token cross-entropy in nats and the token count (`loss_fn` is
    their ratio): sums add over micro-batches, means do not.

    **Arguments:** as [`loss_fn`][].

    **Returns:** `(sum over tokens with loss_mask > 0, their count)`.

    **Raises:** as [`loss_fn`][].
    """
    check_loss_chunk(loss_chunk)
    mask = batch.loss_mask.astype(jnp.float32)
    if loss_chunk != 0 and isinstance(model, AbstractDecoder):
        hidden = model.hidden_states(
            batch.tokens, positions=batch.positions, segment_ids=batch.segment_ids
        )
        with jax.named_scope("loss"):
            return chunked_cross_entropy(
                hidden, model.head_weight(), batch.targets, mask, spec=model.spec,
                weight_pspec=model.head_pspec(), chunk_tokens=loss_chunk,
                softcap=model.logit_softcap(),
            )  # fmt: skip
    logits = model(batch.tokens, positions=batch.positions, segment_ids=batch.segment_ids)
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels
    spec = getattr(model, "spec", None)
    if spec is not None:
        # On an Explicit mesh the gradient of optax's label lookup (a scatter into sharded
        # logits) asks for an output sharding (JAX 0.12); with Auto axes XLA picks it.
        cross_entropy = spec.auto_axes(cross_entropy, spec.token_pspec())
    with jax.named_scope("loss"):
        ce = cross_entropy(logits.astype(jnp.float32), batch.targets)
        # One reduction of both, after the logits (a lone count could run beside the
        # layers' loop: see `eqx_longctx._after`).
        total, count = jnp.sum(jnp.stack([ce * mask, mask]), axis=(1, 2))
    return total, count


def micro_batches(batch, grad_accum: int):
    """`batch` (`[rows, ...]` arrays) as `grad_accum` micro-batches stacked on a new leading
    axis: micro-batch `k` holds rows `k, k + K, k + 2K, ...`, so that each device's rows
    (a contiguous block when the rows are split over the batch axes) hold an equal share of
    every micro-batch and splitting moves no data.

    **Arguments:**

    - `batch`: a `Batch` (any pytree of arrays with the rows first).
    - `grad_accum`: `K`, which must divide the rows.

    **Returns:** the same pytree of `[K, rows / K, ...]` arrays.
    """

    def split(x):
        x = x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(split, batch)


def _accumulated_grads(params, static, batch, grad_accum: int, constrain, loss_chunk):
    """`((loss, num_tokens), grads)` of the whole batch from `grad_accum` micro-batches run
    one after another in a `lax.scan`: float32 sums of the losses' sums, token counts and
    gradients, divided by the whole batch's token count once at the end (so the result is
    the one-batch mean, whatever tokens each micro-batch holds)."""

    def sum_of_params(p, micro):
        return loss_sum(eqx.combine(p, static), micro, loss_chunk=loss_chunk)

    def body(carry, micro):
        grads, total, count = carry
        (s, n), g = jax.value_and_grad(sum_of_params, has_aux=True)(params, micro)
        grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
        return (constrain(grads), total + s, count + n), None

    zeros = constrain(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    (grads, total, count), _ = jax.lax.scan(body, init, micro_batches(batch, grad_accum))
    denom = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grads, params)
    return (total / denom, count), grads


def _learning_rate(opt_state) -> Float[Array, ""]:
    hyperparams = getattr(opt_state, "hyperparams", None)
    if isinstance(hyperparams, dict) and "learning_rate" in hyperparams:
        return jnp.asarray(hyperparams["learning_rate"], jnp.float32)
    return jnp.asarray(jnp.nan, jnp.float32)


def make_train_step(
    optimizer: optax.GradientTransformation,
    *,
    tokenizer: Any = _BYTES,
    shardings: tuple[Any, Any] | None = None,
    donate: bool = False,
    grad_accum: int = 1,
    loss_chunk: int | None = None,
    host_offload: tuple[str, ...] = (),
) -> TrainStep:
    """Build the jitted `train_step(model, opt_state, batch) -> (model, opt_state, metrics)`.

    A step whose loss or gradient norm is not finite changes nothing: the returned model
    and optimizer state are the inputs (selected inside the jitted function, so no
    non-finite value ever leaves it) and `metrics["finite"]` is `False`. The caller decides
    whether to skip such a step or stop.

    **Arguments:**

    - `optimizer`: e.g. from [`make_optimizer`][]; its state must come from
      `optimizer.init(eqx.filter(model, eqx.is_inexact_array))`.
    - `tokenizer`: what the batches were encoded with (default: `ByteTokenizer`, the data
      package's); bits per byte are reported when its tokens are bytes or it counts the
      bytes each id stands for (`eqx_longctx.data.HFTokenizer`).
    - `shardings`: `(param_shardings, opt_state_shardings)` (see `Placement`): gradients
      and the new parameters and optimizer state are kept in these layouts (ZeRO-3: each
      device reduces and updates only its shard). `None`: XLA chooses.
    - `donate`: reuse the buffers of the model and optimizer state passed in for the ones
      returned (their memory is not held twice; the inputs must not be used afterwards).
    - `grad_accum`: `K`, the batch's rows are run as `K` micro-batches one after another
      (a `lax.scan`; see [`micro_batches`][]), their loss sums, token counts and gradients
      summed in float32, and the optimizer applied once: the same update as the whole
      batch at once (up to summation order), holding one micro-batch's activations. `K`
      must divide the batch's rows (and each micro-batch split over the batch axes).
    - `loss_chunk`: how the loss meets the logits (see [`loss_fn`][]): `None` (default) a
      chunk of tokens at a time, recomputed in the backward, so the step never holds the
      whole logits; `k` tokens per chunk; `0` the whole logits.
    - `host_offload`: what lives in host memory between steps, among `"opt_state"` (AdamW's
      moments) and `"params"` (the model's arrays): the step takes and returns them there
      (`jax.memory.Space.Host`, pinned host memory where the platform has it) and streams
      them to the device inside the compiled step, so that they take no device memory
      between steps and XLA may overlap their transfers with compute. The arithmetic is
      unchanged. The caller places them in host memory first ([`to_host`][]).

    **Returns:** the step function. `metrics` holds scalars `loss` (nats per token),
    `bits_per_token`, `grad_norm` (before clipping), `lr` (used for this update), `tokens`
    (loss-bearing tokens), `finite`, and where the tokenizer's bytes can be counted `bpb`
    (bits per byte of text) and `bytes`.

    **Raises:** `ValueError` when `grad_accum` is not an int `>= 1` or `loss_chunk` not
    `None` or an int `>= 0`; the step raises it when `grad_accum` does not divide a
    batch's rows.
    """
    check_loss_chunk(loss_chunk)
    check_host_offload(host_offload)
    state_offloaded, params_offloaded = ("opt_state" in host_offload), ("params" in host_offload)
    if not isinstance(grad_accum, int) or isinstance(grad_accum, bool) or grad_accum < 1:
        raise ValueError(
            f"grad_accum (--grad-accum) must be an int >= 1 (micro-batches per optimizer "
            f"step); got {grad_accum!r}. Pass e.g. grad_accum=1 (no accumulation)."
        )
    byte_ids = byte_ids_of(tokenizer)
    param_sh, opt_sh = (None, None) if shardings is None else shardings

    def constrain(tree, sh):
        return tree if sh is None else jax.lax.with_sharding_constraint(tree, sh)

    # The batch goes first so that `donate` spares it (a caller may score it again).
    @eqx.filter_jit(donate="all-except-first" if donate else "none")
    def step(batch, model, opt_state):
        if params_offloaded:
            model = to_device(model)
        if state_offloaded:
            opt_state = to_device(opt_state)
        params, static = eqx.partition(model, eqx.is_inexact_array)
        batch, num_bytes = batch_bytes(batch, byte_ids)

        def loss_of_params(p):
            return loss_fn(eqx.combine(p, static), batch, loss_chunk=loss_chunk)

        if grad_accum == 1:
            value_and_grad = jax.value_and_grad(loss_of_params, has_aux=True)
            (loss, num_tokens), grads = value_and_grad(params)
        else:
            rows = batch.tokens.shape[0]
            if rows % grad_accum:
                raise ValueError(
                    f"a batch of {rows} rows does not split into grad_accum={grad_accum} "
                    f"micro-batches; pass a batch size that is a multiple of {grad_accum} "
                    "(--batch-size is the rows per optimizer step)."
                )
            (loss, num_tokens), grads = _accumulated_grads(
                params, static, batch, grad_accum, lambda t: constrain(t, param_sh), loss_chunk
            )
        grads = constrain(grads, param_sh)
        grad_norm = optax.tree.norm(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = eqx.apply_updates(params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jnp.where(finite, new, old)
        new_params = constrain(jax.tree.map(keep, new_params, params), param_sh)
        new_opt_state = constrain(jax.tree.map(keep, new_opt_state, opt_state), opt_sh)
        metrics = {
            "loss": loss,
            **units(loss, num_tokens, num_bytes),
            "grad_norm": grad_norm,
            "lr": _learning_rate(new_opt_state),
            "tokens": num_tokens,
            "finite": finite,
        }
        if params_offloaded:
            new_params = to_host(new_params)
        if state_offloaded:
            new_opt_state = to_host(new_opt_state)
        return eqx.combine(new_params, static), new_opt_state, metrics

    def train_step(model, opt_state, batch):
        model, opt_state = _onto_batch_mesh((model, opt_state), batch)
        return step(batch, model, opt_state)

    return train_step


def _onto_batch_mesh(tree: Any, batch: Any) -> Any:
    """`tree` with every array that sits on one device (a model built without
    `init_sharded`, or its fresh optimizer state) replicated over the mesh the batch is on,
    so that the first step compiles for the same input types as every later one.

    The step returns its model and optimizer state on that mesh (typed with its axes under
    Explicit sharding); had they stayed on one device, the second step would trace and
    compile again. The values are unchanged: the compiled step replicates such inputs too.
    """
    sharding = getattr(batch.tokens, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return tree
    mesh = sharding.mesh
    if mesh.size == 1 or mesh.is_multi_process:
        return tree
    replicated = jax.sharding.NamedSharding(mesh, PartitionSpec())

    def place(x):
        one_device = isinstance(x, jax.Array) and isinstance(
            x.sharding, jax.sharding.SingleDeviceSharding
        )
        return jax.device_put(x, replicated) if one_device else x

    return jax.tree.map(place, tree)


def lower_train_step(
    optimizer: optax.GradientTransformation,
    model,
    opt_state,
    batch,
    *,
    tokenizer: Any = _BYTES,
    shardings: tuple[Any, Any] | None = None,
    grad_accum: int = 1,
    loss_chunk: int | None = None,
    host_offload: tuple[str, ...] = (),
) -> jax.stages.Lowered:
    """Lower (trace, never run) the step [`make_train_step`][] builds, for abstract inputs:
    what one step of a run compiles to, without allocating its model.

    The model and optimizer state are donated, as the trainer's step (`donate=True`)
    donates them, so the compiled program's memory analysis is what a step holds.

    **Arguments:**

    - `optimizer`, `tokenizer`, `shardings`, `grad_accum`, `loss_chunk`, `host_offload`:
      as for [`make_train_step`][]
      (a run's `shardings` are `Placement.step_shardings`).
    - `model`: the model with `jax.ShapeDtypeStruct` arrays carrying their shardings
      (`Placement.abstract_model`), or with real arrays.
    - `opt_state`: its optimizer state, likewise (`Placement.abstract_opt_state`).
    - `batch`: a `Batch` of `jax.ShapeDtypeStruct`s (`Placement.abstract_batch`) or arrays.

    **Returns:** the `jax.stages.Lowered` step; `.compile().memory_analysis()` gives its
    bytes per device.
    """
    step = make_train_step(optimizer, tokenizer=tokenizer, shardings=shardings,
                           grad_accum=grad_accum, loss_chunk=loss_chunk,
                           host_offload=host_offload)  # fmt: skip
    arrays, static = eqx.partition(model, _is_array_or_shape)

    def run(arrays, opt_state, batch):
        new_model, new_opt_state, metrics = step(eqx.combine(arrays, static), opt_state, batch)
        return eqx.filter(new_model, eqx.is_array), new_opt_state, metrics

    # The step's own jit runs inside this one, which holds the donation.
    return jax.jit(run, donate_argnums=(0, 1)).lower(arrays, opt_state, batch)


def _is_array_or_shape(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)
