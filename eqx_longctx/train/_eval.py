"""Scoring a model on held-out batches, and the host-side check of a batch's token ids."""

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ._bits import LN2, batch_bytes, byte_ids_of
from ._step import _BYTES, loss_fn


@eqx.filter_jit
def _eval_sums(model, batch, byte_ids) -> tuple[Float[Array, ""], ...]:
    batch, num_bytes = batch_bytes(batch, byte_ids)
    loss, num_tokens = loss_fn(model, batch)
    if num_bytes is None:
        num_bytes = jnp.zeros((), jnp.float32)
    return loss * num_tokens, num_tokens, num_bytes


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
    out = {"loss": loss, "bits_per_token": loss / LN2, "tokens": count}
    if byte_ids is not None:
        out.update(bpb=total / LN2 / max(num_bytes, 1.0), bytes=num_bytes)
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
