"""`generate`: prefill, then one compiled step per new token that samples from the last
logits and decodes the sampled token. The temperature, `top_k` and `top_p` values are
traced, so every step and every value reuses one compiled function; turning `top_k` /
`top_p` filtering on or off is the one setting that compiles another."""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from .._checks import check_bool, check_int
from ._checks import check_model, check_prompts, check_room
from ._run import _decode_impl, decode_core, init_cache, prefill
from ._sampling import _sample, check_sampling


def _choose(logits, done, key, step, settings, *, filtered: bool):
    """The tokens to emit (`pad` for rows past their `eos`) and the rows now done."""
    temperature, top_k, top_p, eos, pad = settings
    tokens = _sample(logits, jax.random.fold_in(key, step), temperature, top_k, top_p,
                     filtered=filtered)  # fmt: skip
    out = jnp.where(done, pad, tokens).astype(jnp.int32)
    return out, done | jnp.any(tokens[:, None] == eos[None, :], axis=-1)


@eqx.filter_jit
def _choose_jit(logits, done, key, step, settings, filtered):
    return _choose(logits, done, key, step, settings, filtered=filtered)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _step_jit(static, arrays, cache):
    """Sample, then decode the sampled tokens; only the cache (the last argument) is donated.

    `static` is `(the model's static part, impl, filtered)` and `arrays` `(the model's arrays,
    logits, done, key, step, settings)`: `generate` splits the model once, so a step's
    dispatch is a plain `jax.jit` call (an `eqx.filter_jit` call re-partitioned the model
    every token: about 0.15 ms of a 1 ms step on the benchmark's tiny model)."""
    model_static, impl, filtered = static
    model_arrays, logits, done, key, step, settings = arrays
    model = eqx.combine(model_arrays, model_static)
    out, done = _choose(logits, done, key, step, settings, filtered=filtered)
    logits, cache = decode_core(model, cache, out, impl)
    return out, done, logits, cache


def _token_id(value: Any, name: str, vocab: int) -> int:
    value = check_int(value, f"generate's {name}", minimum=None)
    if not 0 <= value < vocab:
        raise ValueError(
            f"generate's {name} must be a token id in [0, vocab_size={vocab}); got {value}."
        )
    return value


def generate(
    model: Any,
    prompts: Any,
    *,
    max_new_tokens: int,
    lengths: Any = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    key: Any = None,
    eos_id: int | Sequence[int] | None = None,
    pad_id: int = 0,
    max_len: int | None = None,
    return_logits: bool = False,
    impl: Any = None,
    on_token: Callable[[int, np.ndarray], Any] | None = None,
):
    """Generate `max_new_tokens` tokens after each prompt, on one device or under the
    model's sharding spec (any strategy and layout: the KV cache splits over the sequence
    axes, and each new token merges every device's `(out, logsumexp)` partial).

    **Arguments:**

    - `model`: a model of the zoo (`models.llama.Llama`, `models.deepseek.DeepSeek`, or a
      family that lists its `layer_stacks`).
    - `prompts`: `[batch, prompt_len]` token ids in natural order (NumPy or JAX),
      right-padded when `lengths` is given.
    - `max_new_tokens`: tokens to generate per row (> 0).
    - `lengths`: `[batch]` prompt length of each row, or `None` for `prompt_len`.
    - `temperature`: 0 is greedy; otherwise the logits are divided by it before sampling.
    - `top_k`, `top_p`: keep only the `top_k` most likely tokens, then the smallest set
      whose probability reaches `top_p` (nucleus), before sampling; `None` = off.
    - `key`: a PRNG key, required when sampling; a fixed key gives the same tokens on one
      device and under any spec (each row and step draws from its own fold of it).
    - `eos_id`: a stop token, or several (Llama 3's instruct models have three): after a
      row emits one, the rest of that row is `pad_id`; `None` = never stop.
    - `pad_id`: the token that fills a row after its `eos_id`.
    - `max_len`: the cache's length in tokens (default: the longest prompt plus
      `max_new_tokens`).
    - `return_logits`: also return the logits each token was chosen from.
    - `impl`: the block implementation (`"xla"`, `"pallas"`, `"auto"`, or an
      `AbstractBlockImpl`); default the spec's.
    - `on_token`: called as `on_token(step, tokens)` with each step's `[batch]` NumPy
      tokens as soon as they are chosen (streaming).

    **Returns:** `[batch, max_new_tokens]` int32 new tokens; with `return_logits`,
    `(tokens, logits)` where `logits` is `[batch, max_new_tokens, vocab]` float32: the
    model's logits before temperature, top-k and top-p.

    **Raises:** `TypeError` for arguments of the wrong type (float prompts, a key that is
    not a PRNG key); `ValueError` for `max_new_tokens <= 0`, a prompt plus new tokens longer
    than `max_seq_len` or `max_len`, `temperature < 0`, `top_k < 1`, `top_p` outside
    `(0, 1]`, sampling without a `key`, `lengths` outside `1..prompt_len`, `eos_id` or
    `pad_id` outside the vocabulary, or token ids outside it.
    """
    check_model(model)
    new = check_int(max_new_tokens, "generate's max_new_tokens")
    check_sampling(temperature, top_k, top_p, key, owner="generate")
    return_logits = check_bool(return_logits, "generate's return_logits")
    if on_token is not None and not callable(on_token):
        raise TypeError(
            f"generate's on_token must be None or a function on_token(step, tokens); got "
            f"{type(on_token).__name__}."
        )
    vocab = model.config.vocab_size
    several: Any = () if eos_id is None else eos_id
    if not (isinstance(several, (list, tuple)) or np.ndim(several) == 1):
        several = [several]
    eos = [_token_id(i, "eos_id", vocab) for i in several] or [-1]
    pad = _token_id(pad_id, "pad_id", vocab)
    tokens, lengths = check_prompts(model, None, prompts, lengths)
    b, s = tokens.shape
    longest = int(lengths.max())
    need = longest + new
    limit = model.config.max_seq_len
    if max_len is None:
        max_len = need
    max_len = check_int(max_len, "generate's max_len")
    if need > limit:
        raise ValueError(
            f"the prompt ({longest} tokens) plus max_new_tokens={new} must fit the model's "
            f"max_seq_len={limit}; got {need} tokens. Generate at most {max(limit - longest, 0)} "
            "tokens, shorten the prompt, or use a model built with a larger max_seq_len."
        )
    if need > max_len:
        raise ValueError(
            f"the prompt ({longest} tokens) plus max_new_tokens={new} must fit max_len="
            f"{max_len}, the cache's length; got {need} tokens. Raise max_len to at least "
            f"{need} (at most max_seq_len={limit}), generate fewer tokens, or shorten the prompt."
        )
    cache = init_cache(model, b, max_len)
    logits, cache = prefill(model, cache, tokens, lengths, impl=impl)
    check_room(cache, new - 1)  # the last token is chosen, not decoded
    block_impl = _decode_impl(model, impl)
    filtered = top_k is not None or top_p is not None
    settings = (
        jnp.float32(temperature), jnp.int32(0 if top_k is None else min(top_k, vocab)),
        jnp.float32(1.0 if top_p is None else top_p), jnp.asarray(eos, jnp.int32), jnp.int32(pad),
    )  # fmt: skip
    key = jax.random.key(0) if key is None else key
    done = jnp.zeros((b,), bool)
    if model.spec is not None:
        # Replicated on the mesh, as the step returns it: a `done` on one device is another
        # input sharding (under Explicit axes, another type), which compiled the step twice.
        done = jax.device_put(done, model.spec.sharding(PartitionSpec()))
    model_arrays, model_static = eqx.partition(model, eqx.is_array)
    static = (model_static, block_impl, filtered)
    out, seen = [], []
    for t in range(new):
        step = jnp.int32(t)
        if return_logits:
            seen.append(logits)
        if t < new - 1:
            arrays = (model_arrays, logits, done, key, step, settings)
            tok, done, logits, cache = _step_jit(static, arrays, cache)
        else:
            tok, done = _choose_jit(logits, done, key, step, settings, filtered)
        out.append(tok)
        if on_token is not None:
            on_token(t, np.asarray(tok))
    result = jnp.stack(out, axis=1)
    if return_logits:
        return result, jnp.stack(seen, axis=1).astype(jnp.float32)
    return result
