"""Eager checks of the inference calls' arguments: clear errors before anything runs."""

from typing import Any

import numpy as np
from jax.core import Tracer

from .._checks import check_int
from ..nn import AbstractDecoder
from ._cache import KVCache, slots_per_device


def check_model(model: Any) -> None:
    """**Raises:** `TypeError` unless `model` is an `AbstractDecoder` (a model family)."""
    if not isinstance(model, AbstractDecoder):
        raise TypeError(
            f"model must be a decoder of the zoo (an eqx_longctx.nn.AbstractDecoder, e.g. "
            f"models.llama.Llama); got {type(model).__name__}."
        )


def check_cache(model: Any, batch: Any, max_len: Any) -> tuple[int, int]:
    """Check `init_cache`'s sizes; **returns** `(batch, max_len)` as ints."""
    batch = check_int(batch, "init_cache's batch")
    max_len = check_int(max_len, "init_cache's max_len")
    limit = model.config.max_seq_len
    if max_len > limit:
        raise ValueError(
            f"init_cache's max_len must be <= the model's max_seq_len={limit}; got "
            f"max_len={max_len}. Use a shorter cache, or build the model with a larger "
            f"{type(model.config).__name__}(max_seq_len=...)."
        )
    if model.spec is not None:
        model.spec.check_batch(batch, "init_cache's batch")
    return batch, max_len


def check_owner(model: Any, cache: Any) -> None:
    """**Raises:** `TypeError` when `cache` is not a `KVCache`; `ValueError` when it was
    built for another model config or spec."""
    if not isinstance(cache, KVCache):
        raise TypeError(
            f"cache must be a KVCache from eqx_longctx.init_cache(model, batch, max_len); got "
            f"{type(cache).__name__}."
        )
    if cache.config != model.config:
        raise ValueError(
            "the cache was built for another model: its config differs from model.config "
            f"({type(cache.config).__name__} vs {type(model.config).__name__}). Build it "
            "with init_cache(model, ...) for this model."
        )
    if cache.spec != model.spec:
        raise ValueError(
            f"the cache was built for another sharding spec ({cache.spec!r}) than the model's "
            f"({model.spec!r}). Build it with init_cache(model, ...) after sharding the model."
        )


def _ids(x: Any, name: str, ndim: int) -> np.ndarray:
    if isinstance(x, Tracer):
        raise TypeError(f"{name} must be concrete (call this outside jit); got a tracer.")
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be an integer array; got {type(x).__name__} ({e}).") from None
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(
            f"{name} must be integer token ids or lengths; got dtype {arr.dtype}. Cast with "
            ".astype(np.int32)."
        )
    if arr.ndim != ndim:
        shape = "[batch, prompt_len]" if ndim == 2 else "[batch]"
        raise ValueError(f"{name} must be {shape}; got shape {arr.shape}.")
    return arr


def check_vocab(model: Any, tokens: np.ndarray, name: str) -> None:
    """**Raises:** `ValueError` for a token id outside `[0, vocab_size)`."""
    vocab = model.config.vocab_size
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise ValueError(
            f"{name} must be token ids in [0, vocab_size={vocab}); got ids in "
            f"[{tokens.min()}, {tokens.max()}]. Use the model's tokenizer."
        )


def check_prompts(model: Any, cache: Any, prompts: Any, lengths: Any):
    """Check a prefill's prompts and lengths (against `cache`, unless `None`); **returns**
    `(tokens, lengths)` as NumPy int32 arrays, the tokens past each row's length set to 0
    and the columns past the longest row dropped (they are padding in every row, and a
    prefill that kept them would spend cache slots on them)."""
    tokens = _ids(prompts, "prompts", 2)
    b, s = tokens.shape
    if b < 1 or s < 1:
        raise ValueError(
            f"prompts must hold at least one row of at least one token; got shape {tokens.shape}."
        )
    if cache is not None:
        check_owner(model, cache)
        if b != cache.batch:
            raise ValueError(
                f"prompts has {b} rows but the cache was built for batch={cache.batch}. "
                f"Build the cache with init_cache(model, {b}, max_len)."
            )
    if lengths is None:
        lengths = np.full((b,), s, np.int32)
    else:
        lengths = _ids(lengths, "lengths", 1)
        if lengths.shape != (b,):
            raise ValueError(f"lengths must be [batch={b}]; got shape {lengths.shape}.")
        if lengths.min() < 1 or lengths.max() > s:
            raise ValueError(
                f"lengths must lie in 1..prompt_len={s} (each row's prompt tokens); got "
                f"lengths in [{lengths.min()}, {lengths.max()}]."
            )
    longest = int(lengths.max())
    if cache is not None and longest > cache.max_len:
        raise ValueError(
            f"the prompt ({longest} tokens) must fit the cache's max_len={cache.max_len}. "
            "Build the cache with a larger max_len."
        )
    tokens = tokens[:, :longest]
    tokens = np.where(np.arange(longest)[None, :] < lengths[:, None], tokens, 0)
    check_vocab(model, tokens, "prompts")
    return tokens.astype(np.int32), lengths.astype(np.int32)


def check_step_tokens(model: Any, cache: Any, tokens: Any):
    """Check a decode step's tokens and the cache's room; **returns** the tokens as int32."""
    check_owner(model, cache)
    ids = _ids(tokens, "tokens", 1)
    if ids.shape != (cache.batch,):
        raise ValueError(f"tokens must be [batch={cache.batch}], one per row; got {ids.shape}.")
    check_vocab(model, ids, "tokens")
    check_room(cache, 1)
    return ids.astype(np.int32)


def check_room(cache: KVCache, steps: int) -> None:
    """**Raises:** `ValueError` unless the prefilled `cache` has room for `steps` more
    decoded tokens per row, in tokens (`max_len`) and in every device's slots. A decode
    step's write past the last slot would not fail: it would overwrite a cached token."""
    longest = int(np.max(np.asarray(cache.lengths)))
    if longest < 1:
        raise ValueError("the cache is empty: call prefill(model, cache, prompts) first.")
    spec = cache.spec
    n = 1 if spec is None else spec.context_parallel_size
    used = int(cache.offset) + -(-(int(cache.step) + steps) // n)
    if longest + steps > cache.max_len or used > slots_per_device(spec, cache.max_len):
        limit = cache.config.max_seq_len
        fix = (
            f"Build the cache with a larger max_len (up to max_seq_len={limit})"
            if longest + steps <= limit
            else f"The model's max_seq_len={limit} binds: decode fewer tokens"
        )
        raise ValueError(
            f"the cache is full: a row holds {longest} tokens, {steps} more do not fit "
            f"max_len={cache.max_len}. {fix}."
        )
