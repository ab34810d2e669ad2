"""The functional core of training: loss, optimizer, one jitted update, evaluation.

Everything here is a pure function of its arguments; the loop in `_loop.py` owns all state.
"""

import math
import re
from collections.abc import Callable, Iterable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float

_LN2 = math.log(2.0)

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


_NO_DECAY = re.compile(r"norm|bias|^b[a-z]?$")


def _decay_mask(params):
    # Matrices decay; norm scales and biases do not. Stacked layers give those a leading
    # `layers` axis, so the rank alone cannot tell them apart: their names do.
    def decay(path, x):
        names = [str(getattr(k, "name", getattr(k, "key", ""))) for k in path]
        return x.ndim >= 2 and not any(_NO_DECAY.search(n) for n in names)

    return jax.tree_util.tree_map_with_path(decay, params)


def make_optimizer(
    lr: float,
    warmup_steps: int,
    total_steps: int,
    weight_decay: float = 0.1,
    clip_norm: float = 1.0,
    *,
    b1: float = 0.9,
    b2: float = 0.95,
) -> optax.GradientTransformation:
    """AdamW with linear warmup + cosine decay and global-norm gradient clipping.

    The learning rate is injected as a hyperparameter, so the one used for the latest
    update can be read back with `opt_state.hyperparams["learning_rate"]`.

    **Arguments:**

    - `lr`, `warmup_steps`, `total_steps`: see [`make_schedule`][].
    - `weight_decay`: decoupled weight decay, applied to matrices only (not to leaves
      whose path names a norm or a bias).
    - `clip_norm`: gradients are rescaled so their global norm is at most this.
    - `b1`, `b2`: Adam moment decay rates.

    **Returns:** an `optax.GradientTransformation`.
    """
    check_optimizer_settings(weight_decay=weight_decay, clip_norm=clip_norm)
    schedule = make_schedule(lr, warmup_steps, total_steps)

    def build(learning_rate):
        return optax.chain(
            optax.clip_by_global_norm(clip_norm),
            optax.adamw(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay, mask=_decay_mask),
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


def make_train_step(optimizer: optax.GradientTransformation) -> TrainStep:
    """Build the jitted `train_step(model, opt_state, batch) -> (model, opt_state, metrics)`.

    A step whose loss or gradient norm is not finite changes nothing: the returned model
    and optimizer state are the inputs (selected inside the jitted function, so no
    non-finite value ever leaves it) and `metrics["finite"]` is `False`. The caller decides
    whether to skip such a step or stop.

    **Arguments:**

    - `optimizer`: e.g. from [`make_optimizer`][]; its state must come from
      `optimizer.init(eqx.filter(model, eqx.is_inexact_array))`.

    **Returns:** the step function. `metrics` holds scalars `loss` (nats per token), `bpb`
    (bits per byte, for the byte-level tokenizer), `grad_norm` (before clipping), `lr`
    (used for this update), `tokens` (loss-bearing tokens) and `finite`.
    """

    @eqx.filter_jit
    def train_step(model, opt_state, batch):
        params, static = eqx.partition(model, eqx.is_inexact_array)

        def loss_of_params(p):
            return loss_fn(eqx.combine(p, static), batch)

        (loss, num_tokens), grads = jax.value_and_grad(loss_of_params, has_aux=True)(params)
        grad_norm = optax.tree.norm(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = eqx.apply_updates(params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jnp.where(finite, new, old)
        new_params = jax.tree.map(keep, new_params, params)
        new_opt_state = jax.tree.map(keep, new_opt_state, opt_state)
        metrics = {
            "loss": loss,
            "bpb": loss / _LN2,
            "grad_norm": grad_norm,
            "lr": _learning_rate(new_opt_state),
            "tokens": num_tokens,
            "finite": finite,
        }
        return eqx.combine(new_params, static), new_opt_state, metrics

    return train_step


@eqx.filter_jit
def _eval_sums(model, batch) -> tuple[Float[Array, ""], Float[Array, ""]]:
    loss, num_tokens = loss_fn(model, batch)
    return loss * num_tokens, num_tokens


def evaluate(
    model,
    dataset,
    batch_size: int,
    *,
    max_batches: int | None = None,
    put: Callable[[Any], Any] | None = None,
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

    **Returns:** `{"loss": nats per token, "bpb": bits per byte, "tokens": count}`.
    """
    batches: Iterable = dataset.eval_batches(batch_size)
    keep = None
    num_rows = getattr(dataset, "num_rows", None)
    if max_batches is not None and isinstance(num_rows, int):
        num_batches = -(-num_rows // batch_size)
        picks = np.linspace(0, num_batches - 1, min(max_batches, num_batches))
        keep = set(np.round(picks).astype(int).tolist())
    total, count = 0.0, 0.0
    for i, batch in enumerate(batches):
        if keep is None and max_batches is not None and i >= max_batches:
            break
        if keep is not None and i not in keep:
            continue
        if put is not None:
            batch = put(batch)
        loss_sum, num_tokens = _eval_sums(model, batch)
        total += float(loss_sum)
        count += float(num_tokens)
    if count == 0:
        raise ValueError(
            "evaluate needs at least one loss-bearing token; the dataset yielded none "
            f"(batch_size={batch_size}, max_batches={max_batches}). Use a larger validation "
            "split (more data or a larger val_fraction) or a smaller batch size."
        )
    loss = total / count
    return {"loss": loss, "bpb": loss / _LN2, "tokens": count}


def check_batch(batch, vocab_size: int) -> None:
    """Check once, on the host, that every token and target id lies in `[0, vocab_size)`.

    **Arguments:**

    - `batch`: a `Batch`.
    - `vocab_size`: the model's vocabulary size.

    **Returns:** nothing; raises `ValueError` naming the offending ids otherwise.
    """
    for name in ("tokens", "targets"):
        ids = np.asarray(getattr(batch, name))
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"every {name} id must lie in [0, vocab_size) = [0, {vocab_size}); got ids in "
                f"[{lo}, {hi}]. Use a tokenizer whose vocab_size fits the model, or build the "
                f"model with vocab_size >= {hi + 1}."
            )
