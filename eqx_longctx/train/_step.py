"""The functional core of training: loss, optimizer, one jitted update, evaluation.

Everything here is a pure function of its arguments; the loop in `_loop.py` owns all state.
"""

import itertools
import math
from collections.abc import Callable, Iterable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float

from eqx_longctx.data import ByteTokenizer

_LN2 = math.log(2.0)
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


def loss_fn(model, batch) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """Masked mean token cross-entropy in nats.

    **Arguments:**

    - `model`: called as `model(tokens, positions, segment_ids) -> logits [batch, seq, vocab]`;
      a model with a `spec` (a `ShardingSpec`) has its loss computed under that spec.
    - `batch`: a `Batch` with `tokens`, `targets`, `positions`, `segment_ids`, `loss_mask`.

    **Returns:** `(loss, num_tokens)`: the mean over tokens with `loss_mask > 0`, and their
    count (the loss is 0 when the count is 0).

    **Raises:** as the model's call (e.g. `eqx_longctx.nn.AbstractDecoder.__call__`) for
    inputs it rejects.
    """
    logits = model(batch.tokens, positions=batch.positions, segment_ids=batch.segment_ids)
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels
    spec = getattr(model, "spec", None)
    if spec is not None:
        # On an Explicit mesh the gradient of optax's label lookup (a scatter into sharded
        # logits) asks for an output sharding (JAX 0.12); with Auto axes XLA picks it.
        cross_entropy = spec.auto_axes(cross_entropy, spec.token_pspec())
    ce = cross_entropy(logits.astype(jnp.float32), batch.targets)
    mask = batch.loss_mask.astype(jnp.float32)
    num_tokens = jnp.sum(mask)
    return jnp.sum(ce * mask) / jnp.maximum(num_tokens, 1.0), num_tokens


def _learning_rate(opt_state) -> Float[Array, ""]:
    hyperparams = getattr(opt_state, "hyperparams", None)
    if isinstance(hyperparams, dict) and "learning_rate" in hyperparams:
        return jnp.asarray(hyperparams["learning_rate"], jnp.float32)
    return jnp.asarray(jnp.nan, jnp.float32)


def byte_ids_of(tokenizer: Any) -> int | None:
    """**Returns:** the number of token ids that are one byte each (ids `0..n-1`) when
    `tokenizer`'s tokens are bytes (it has `byte_ids`, as `ByteTokenizer`), else `None`:
    bits per byte are reported only then."""
    n = getattr(tokenizer, "byte_ids", None)
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _units(loss, num_tokens, batch, byte_ids: int | None) -> dict[str, Array]:
    """Bits per token and, for a byte tokenizer, bits per byte of the loss-bearing text:
    all bits (end-of-document tokens included: a code must mark them too) over the bytes."""
    out = {"bits_per_token": loss / _LN2}
    if byte_ids is not None:
        mask = batch.loss_mask.astype(jnp.float32)
        num_bytes = jnp.sum(mask * (batch.targets < byte_ids))
        out["bpb"] = loss * num_tokens / _LN2 / jnp.maximum(num_bytes, 1.0)
        out["bytes"] = num_bytes
    return out


def make_train_step(
    optimizer: optax.GradientTransformation,
    *,
    tokenizer: Any = _BYTES,
    shardings: tuple[Any, Any] | None = None,
    donate: bool = False,
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
      package's); bits per byte are reported only when its tokens are bytes.
    - `shardings`: `(param_shardings, opt_state_shardings)` (see `Placement`): gradients
      and the new parameters and optimizer state are kept in these layouts (ZeRO-3: each
      device reduces and updates only its shard). `None`: XLA chooses.
    - `donate`: reuse the buffers of the model and optimizer state passed in for the ones
      returned (their memory is not held twice; the inputs must not be used afterwards).

    **Returns:** the step function. `metrics` holds scalars `loss` (nats per token),
    `bits_per_token`, `grad_norm` (before clipping), `lr` (used for this update), `tokens`
    (loss-bearing tokens), `finite`, and for a byte tokenizer `bpb` (bits per byte of
    text) and `bytes`.
    """
    byte_ids = byte_ids_of(tokenizer)
    param_sh, opt_sh = (None, None) if shardings is None else shardings

    def constrain(tree, sh):
        return tree if sh is None else jax.lax.with_sharding_constraint(tree, sh)

    # The batch goes first so that `donate` spares it (a caller may score it again).
    @eqx.filter_jit(donate="all-except-first" if donate else "none")
    def step(batch, model, opt_state):
        params, static = eqx.partition(model, eqx.is_inexact_array)

        def loss_of_params(p):
            return loss_fn(eqx.combine(p, static), batch)

        (loss, num_tokens), grads = jax.value_and_grad(loss_of_params, has_aux=True)(params)
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
            **_units(loss, num_tokens, batch, byte_ids),
            "grad_norm": grad_norm,
            "lr": _learning_rate(new_opt_state),
            "tokens": num_tokens,
            "finite": finite,
        }
        return eqx.combine(new_params, static), new_opt_state, metrics

    def train_step(model, opt_state, batch):
        return step(batch, model, opt_state)

    return train_step


def lower_train_step(
    optimizer: optax.GradientTransformation,
    model,
    opt_state,
    batch,
    *,
    tokenizer: Any = _BYTES,
    shardings: tuple[Any, Any] | None = None,
) -> jax.stages.Lowered:
    """Lower (trace, never run) the step [`make_train_step`][] builds, for abstract inputs:
    what one step of a run compiles to, without allocating its model.

    The model and optimizer state are donated, as the trainer's step (`donate=True`)
    donates them, so the compiled program's memory analysis is what a step holds.

    **Arguments:**

    - `optimizer`, `tokenizer`, `shardings`: as for [`make_train_step`][] (a run's
      `shardings` are `Placement.step_shardings`).
    - `model`: the model with `jax.ShapeDtypeStruct` arrays carrying their shardings
      (`Placement.abstract_model`), or with real arrays.
    - `opt_state`: its optimizer state, likewise (`Placement.abstract_opt_state`).
    - `batch`: a `Batch` of `jax.ShapeDtypeStruct`s (`Placement.abstract_batch`) or arrays.

    **Returns:** the `jax.stages.Lowered` step; `.compile().memory_analysis()` gives its
    bytes per device.
    """
    step = make_train_step(optimizer, tokenizer=tokenizer, shardings=shardings)
    arrays, static = eqx.partition(model, _is_array_or_shape)

    def run(arrays, opt_state, batch):
        new_model, new_opt_state, metrics = step(eqx.combine(arrays, static), opt_state, batch)
        return eqx.filter(new_model, eqx.is_array), new_opt_state, metrics

    # The step's own jit runs inside this one, which holds the donation.
    return jax.jit(run, donate_argnums=(0, 1)).lower(arrays, opt_state, batch)


def _is_array_or_shape(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)


@eqx.filter_jit
def _eval_sums(model, batch, byte_ids) -> tuple[Float[Array, ""], ...]:
    loss, num_tokens = loss_fn(model, batch)
    units = _units(loss, num_tokens, batch, byte_ids)
    return loss * num_tokens, num_tokens, units.get("bytes", jnp.zeros((), jnp.float32))


def evaluate(
    model,
    dataset,
    batch_size: int,
    *,
    max_batches: int | None = None,
    put: Callable[[Any], Any] | None = None,
    tokenizer: Any = _BYTES,
) -> dict[str, float]:
    """Token-weighted cross-entropy of `model` over a dataset's evaluation batches.

    **Arguments:**

    - `model`: the model to score.
    - `dataset`: has `eval_batches(batch_size)` yielding `Batch`es (e.g. the validation
      split from `eqx_longctx.data.load_datasets`).
    - `batch_size`: rows per batch.
    - `max_batches`: score only this many batches (`None`: the whole split), evenly
      spaced over the split when the dataset has `num_rows` (so a partial evaluation
      estimates the full one), else the first ones.
    - `put`: places each batch on devices (e.g. shards it); default leaves it as is.
    - `tokenizer`: as for [`make_train_step`][].

    **Returns:** `{"loss": nats per token, "bits_per_token", "tokens": count}`, and for a
    byte tokenizer `"bpb"` (bits per byte of text) and `"bytes"`.

    **Raises:** `ValueError` when the batches scored hold no loss-bearing token (an empty
    split, or `max_batches=0`), and as `dataset.eval_batches` / `dataset.get` (e.g.
    `GrainEvalBatches.eval_batches` for a `batch_size` other than its own).
    """
    byte_ids = byte_ids_of(tokenizer)
    num_rows = getattr(dataset, "num_rows", None)
    picks: list[int] | None = None
    if max_batches is not None and isinstance(num_rows, int):
        num_batches = -(-num_rows // batch_size)
        spaced = np.linspace(0, num_batches - 1, min(max_batches, num_batches))
        picks = sorted(set(np.round(spaced).astype(int).tolist()))
    if picks is not None and callable(getattr(dataset, "get", None)):
        batches: Iterable = (dataset.get(i) for i in picks)  # random access: read only those
    elif picks is not None:
        keep = set(picks)
        batches = (b for i, b in enumerate(dataset.eval_batches(batch_size)) if i in keep)
    else:
        batches = itertools.islice(dataset.eval_batches(batch_size), max_batches)
    total, count, num_bytes = 0.0, 0.0, 0.0
    for batch in batches:
        if put is not None:
            batch = put(batch)
        loss_sum, num_tokens, batch_bytes = _eval_sums(model, batch, byte_ids)
        total += float(loss_sum)
        count += float(num_tokens)
        num_bytes += float(batch_bytes)
    if count == 0:
        raise ValueError(
            "evaluate needs at least one loss-bearing token; the dataset yielded none "
            f"(batch_size={batch_size}, max_batches={max_batches}). Use a larger validation "
            "split (more data or a larger val_fraction) or a smaller batch size."
        )
    loss = total / count
    out = {"loss": loss, "bits_per_token": loss / _LN2, "tokens": count}
    if byte_ids is not None:
        out.update(bpb=total / _LN2 / max(num_bytes, 1.0), bytes=num_bytes)
    return out


def check_batch(batch, vocab_size: int) -> None:
    """Check once, on the host, that every token and target id lies in `[0, vocab_size)`.

    **Arguments:**

    - `batch`: a `Batch` of host arrays, or of global `jax.Array`s (then the shards this
      process holds are checked: each process checks its own part).
    - `vocab_size`: the model's vocabulary size.

    **Raises:** `ValueError` naming the range of ids seen when a token or target id lies
    outside `[0, vocab_size)`.
    """
    for name in ("tokens", "targets"):
        parts = _host_parts(getattr(batch, name))
        lo, hi = min(int(p.min()) for p in parts), max(int(p.max()) for p in parts)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"every {name} id must lie in [0, vocab_size) = [0, {vocab_size}); got ids in "
                f"[{lo}, {hi}]. Use a tokenizer whose vocab_size fits the model, or build the "
                f"model with vocab_size >= {hi + 1}."
            )


def _host_parts(x) -> list[np.ndarray]:
    """The parts of `x` this process can read: a host array whole, a `jax.Array` as its
    addressable shards (in a multi-process run the rest lives on other hosts)."""
    if isinstance(x, jax.Array):
        return [np.asarray(s.data) for s in x.addressable_shards]
    return [np.asarray(x)]
