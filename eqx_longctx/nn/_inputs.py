"""Validation and defaults for a decoder's `(tokens, positions, segment_ids)`, shared by
every model family: clear `ValueError`s instead of XLA shape errors."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from .._checks import as_int32_ids
from .._layout import check_sequence_length, layout_order
from .._sharding import ShardingSpec


def check_token_ids(tokens, vocab_size: int, config_name: str) -> None:
    """Raise `ValueError` if a concrete token id lies outside `[0, vocab_size)`.

    **Arguments:**

    - `tokens`: concrete token ids (a JAX or NumPy array; not a tracer).
    - `vocab_size`: the model's vocabulary size.
    - `config_name`: the config class named in the message's fix (e.g. `"LlamaConfig"`).

    **Raises:** `ValueError` for an id out of range, or for a tracer (call it outside `jit`).
    """
    if isinstance(tokens, Tracer):
        raise ValueError(
            "check_tokens needs concrete token ids, but got a tracer (called inside jit, "
            "grad or vmap). Check the batch before entering the transformed function."
        )
    ids = np.asarray(tokens)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(
            f"token ids must lie in [0, vocab_size={vocab_size}); got ids in "
            f"[{ids.min()}, {ids.max()}]. Use a tokenizer that matches the model, or build the "
            f"model with {config_name}(vocab_size=...) large enough."
        )


def check_shapes(
    batch_seq,
    what: str,
    positions,
    segment_ids,
    *,
    max_seq_len: int,
    config_name: str,
    spec: ShardingSpec | None = None,
) -> None:
    """Check that a decoder's inputs fit the model and the mesh.

    The sequence fits `max_seq_len` and, under `spec`, the batch splits over its batch
    axes and the sequence over its layout; positions and segment ids are `[batch, seq]`
    integer arrays.

    **Arguments:**

    - `batch_seq`: the `(batch, seq)` shape of the tokens (or embeddings).
    - `what`: what that shape belongs to, for messages (`"tokens"`).
    - `positions`, `segment_ids`: `[batch, seq]` integer arrays, or `None`.
    - `max_seq_len`: the model's longest sequence.
    - `config_name`: the config class named in the messages' fixes.
    - `spec`: the sharding spec, or `None` for one device.

    **Raises:** `TypeError` when positions or segment ids are not arrays; `ValueError` when
    the sequence is longer than `max_seq_len`, the batch or sequence does not split over
    the spec's mesh and layout, or positions or segment ids have another shape or a
    non-integer dtype.
    """
    batch, seq = batch_seq
    if seq > max_seq_len:
        raise ValueError(
            f"sequence length must be <= max_seq_len={max_seq_len}; got {what} of shape "
            f"{tuple(batch_seq)} (seq={seq}). Split the sequence or build the model with a "
            f"larger {config_name}(max_seq_len=...)."
        )
    if spec is not None:
        spec.check_batch(batch, f"the batch of the {what}")
        check_sequence_length(spec, seq)
    for name, ids in (("positions", positions), ("segment_ids", segment_ids)):
        if ids is None:
            continue
        if not hasattr(ids, "shape") or not hasattr(ids, "dtype"):
            raise TypeError(
                f"{name} must be a [batch, seq] integer array (JAX or NumPy) or None; got "
                f"{type(ids).__name__}. Convert it with jnp.asarray(..., jnp.int32)."
            )
        if tuple(ids.shape) != (batch, seq):
            raise ValueError(
                f"{name} must have the [batch, seq] shape of the {what}, {(batch, seq)}; got "
                f"{tuple(ids.shape)}."
            )
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(
                f"{name} must be integers; got dtype {ids.dtype}. Cast with .astype(jnp.int32)."
            )


def _as_array(x, name: str):
    """`x` as a JAX array (NumPy arrays and nested lists of ints just work; integer ids must
    fit int32)."""
    if isinstance(x, jax.Array | Tracer):
        return x
    try:
        arr = np.asarray(x)
        out = jnp.asarray(arr)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{name} must be a [batch, seq] array of integers (JAX or NumPy); got "
            f"{type(x).__name__}, which jnp.asarray cannot convert ({e})."
        ) from None
    as_int32_ids(arr, name)
    return out


def prepare_inputs(
    tokens,
    positions,
    segment_ids,
    *,
    spec: ShardingSpec | None,
    vocab_size: int,
    max_seq_len: int,
    config_name: str,
):
    """Check a decoder's inputs and fill in default positions.

    Tokens arrive in the spec's layout order, so each token's default RoPE position is its
    original index (`layout_order`); on one device, `0..seq-1`. Token ids are range-checked
    when they are concrete.

    **Arguments:**

    - `tokens`: `[batch, seq]` integer ids (JAX or NumPy array, or nested lists).
    - `positions`: `[batch, seq]` RoPE positions, or `None` for the default.
    - `segment_ids`: `[batch, seq]` packed-document ids, or `None`.
    - `spec`: the sharding spec, or `None` for one device.
    - `vocab_size`, `max_seq_len`: the model's limits.
    - `config_name`: the config class named in the messages' fixes.

    **Returns:** `(tokens, positions, segment_ids)` as JAX arrays (`segment_ids` may be None).

    **Raises:** `TypeError` for inputs that are not integer arrays; `ValueError` for tokens
    not of rank 2 or not integers, an id out of range, and as `check_shapes`.
    """
    tokens = _as_array(tokens, "tokens")
    if tokens.ndim != 2:
        raise ValueError(
            f"tokens must have rank 2, laid out [batch, seq]; got shape "
            f"{tuple(tokens.shape)}. Add a batch axis with tokens[None] for one sequence."
        )
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(
            f"tokens must be integer ids; got dtype {tokens.dtype}. Cast with .astype(jnp.int32)."
        )
    positions = None if positions is None else _as_array(positions, "positions")
    segment_ids = None if segment_ids is None else _as_array(segment_ids, "segment_ids")
    check_shapes(
        tokens.shape, "tokens", positions, segment_ids,
        max_seq_len=max_seq_len, config_name=config_name, spec=spec,
    )  # fmt: skip
    if positions is None:
        batch, seq = tokens.shape
        order = np.arange(seq) if spec is None else layout_order(spec, seq)
        positions = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (batch, seq))
    if not isinstance(tokens, Tracer):
        check_token_ids(tokens, vocab_size, config_name)
    return tokens, positions, segment_ids
