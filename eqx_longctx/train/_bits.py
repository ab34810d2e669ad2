"""Bits per token and per byte of text: how many bytes of text the loss-bearing targets
stand for, from what the tokenizer tells (`byte_ids_of`), counted on the devices."""

import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._after import after

LN2 = math.log(2.0)


def byte_ids_of(tokenizer: Any) -> int | np.ndarray | None:
    """How to count the bytes of text behind the targets, so that bits per byte can be
    reported: the number of ids that are one byte each (ids `0..n-1`) when `tokenizer`'s
    tokens are bytes (it has `byte_ids`, as `ByteTokenizer`); the bytes each id stands for
    when it counts them (`token_bytes`, as `eqx_longctx.data.HFTokenizer`); else `None`
    (bits per token only)."""
    table = getattr(tokenizer, "token_bytes", None)
    if isinstance(table, np.ndarray):
        return table.astype(np.float32)
    n = getattr(tokenizer, "byte_ids", None)
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def batch_bytes(batch, byte_ids) -> tuple[Any, Float[Array, ""] | None]:
    """The bytes of text the batch's loss-bearing targets stand for (`None` when the
    tokenizer's bytes cannot be counted, `byte_ids_of`), and the batch, its positions made
    to wait for that count (their values unchanged).

    The count is a reduction over the batch's devices that nothing else needs until the
    end, which XLA could otherwise run beside the layer stack's loop (`eqx_longctx._after`).
    """
    if byte_ids is None:
        return batch, None
    mask = batch.loss_mask.astype(jnp.float32)
    if isinstance(byte_ids, int):
        per_target = (batch.targets < byte_ids).astype(jnp.float32)
    else:
        per_target = jnp.asarray(byte_ids)[batch.targets]
    num_bytes = jnp.sum(mask * per_target)
    return batch._replace(positions=after(batch.positions, num_bytes)), num_bytes


def units(loss, num_tokens, num_bytes) -> dict[str, Array]:
    """Bits per token and, when the bytes are counted (`batch_bytes`), bits per byte of
    the loss-bearing text: all bits (end-of-document tokens included: a code must mark them
    too) over the bytes."""
    out = {"bits_per_token": loss / LN2}
    if num_bytes is not None:
        out["bpb"] = loss * num_tokens / LN2 / jnp.maximum(num_bytes, 1.0)
        out["bytes"] = num_bytes
    return out
