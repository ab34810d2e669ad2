"""Choosing the next token from logits: greedy, temperature, top-k and nucleus (top-p).

`sample_tokens` is the public, eagerly validated entry point; `_sample` is the jit-friendly
core that `generate`'s compiled decode step calls. In `_sample` the temperature, `top_k` and
`top_p` may be traced, so one compiled step serves every setting: top-k is a threshold at
the k-th largest logit of a descending sort (no `lax.top_k`, whose k must be static), and
temperature 0 selects the argmax through `jnp.where`.
"""

from typing import Any, no_type_check

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._checks import check_int, check_real, seen

_KEY_FIX = " Pass key=jax.random.key(seed) (or a legacy jax.random.PRNGKey(seed))."


def _legacy_key_shape() -> tuple[int, ...]:
    """The shape of a raw `uint32` key of the default PRNG implementation (`(2,)`)."""
    return tuple(jax.eval_shape(lambda: jax.random.PRNGKey(0)).shape)


def _check_key(key: Any, owner: str) -> None:
    dtype = getattr(key, "dtype", None)
    shape = tuple(getattr(key, "shape", ()))
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        if shape != ():
            raise ValueError(
                f"{owner}: key must be one PRNG key (shape ()); got a key array of shape "
                f"{shape}. Pass a single key: rows get their own keys by splitting it."
            )
        return
    legacy = _legacy_key_shape()
    if dtype is not None and np.dtype(dtype) == np.uint32 and shape == legacy:
        return
    if dtype is not None and np.dtype(dtype) == np.uint32:
        raise ValueError(
            f"{owner}: a raw uint32 key must have shape {legacy}; got shape {shape}. Pass a "
            "single key: rows get their own keys by splitting it."
        )
    raise TypeError(f"{owner}: key must be a JAX PRNG key; got {seen(key)}.{_KEY_FIX}")


@no_type_check  # validated here, with errors that say what to fix
def check_sampling(
    temperature: Any, top_k: Any, top_p: Any, key: Any, *, owner: str = "sample_tokens"
) -> None:
    """Check the sampling arguments eagerly, before anything is computed.

    **Arguments:**

    - `temperature`: a real number `>= 0` (0 is greedy).
    - `top_k`: `None`, or an int `>= 1`.
    - `top_p`: `None`, or a real number in `(0, 1]`.
    - `key`: `None`, or one JAX PRNG key (`jax.random.key` or a legacy `uint32[2]` key);
      required when `temperature > 0`.
    - `owner`: the public function that received them, for the messages.

    **Raises:** `TypeError` when an argument has the wrong type (a bool is not a number, a
    float is not an int, a key must be a PRNG key); `ValueError` when `temperature` is
    negative or not finite, `top_k < 1`, `top_p` is outside `(0, 1]`, a key has the wrong
    shape, or `temperature > 0` comes without a `key`.
    """
    t = check_real(
        temperature,
        f"{owner}: temperature",
        minimum=0.0,
        fix=" Use temperature=0.0 for greedy decoding, or a positive value such as 0.8.",
    )
    if t > float(np.finfo(np.float32).max):
        raise ValueError(
            f"{owner}: temperature must fit float32 (at most 3.4e38); got {t}. Use a "
            "temperature such as 0.8, or a large finite one such as 1e6 for near-uniform "
            "sampling."
        )
    if top_k is not None:
        check_int(
            top_k,
            f"{owner}: top_k",
            fix=" Use top_k=None to keep every token, or a count such as top_k=50.",
        )
    if top_p is not None:
        p = check_real(
            top_p, f"{owner}: top_p", fix=" Use top_p=None to turn nucleus sampling off."
        )
        if not 0.0 < p <= 1.0:
            raise ValueError(
                f"{owner}: top_p must be in (0, 1]; got {p}. Use a probability mass such as "
                "top_p=0.9, or top_p=None (the same as 1.0) to keep every token."
            )
    if key is not None:
        _check_key(key, owner)
    elif t > 0:
        raise ValueError(
            f"{owner}: sampling with temperature={t} needs a key; got key=None.{_KEY_FIX} "
            "Or use temperature=0.0 for greedy decoding, which needs no key."
        )


@no_type_check  # validated eagerly, with errors that say what to fix
def sample_tokens(
    logits: ArrayLike,
    key: PRNGKeyArray | None = None,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Int[Array, " batch"]:
    """Choose one token per row from next-token logits.

    `temperature=0` is greedy (the argmax; ties go to the lowest token id). Otherwise the
    logits are divided by `temperature`, restricted to the `top_k` largest, then to the
    nucleus: the smallest set of the most probable remaining tokens whose probability
    (renormalised over the remaining ones) reaches `top_p`. The most probable token is always
    kept; tokens tied with the last kept one are kept too. One token is then drawn from the
    softmax of what is left. Rows sample independently: row `i` draws with the `i`-th key of
    `jax.random.split(key, batch)`, so its token depends only on its logits and that key.

    **Arguments:**

    - `logits`: `[batch, vocab]` floating-point logits (computed in float32).
    - `key`: one JAX PRNG key (`jax.random.key(seed)`, or a legacy `jax.random.PRNGKey`);
      needed when `temperature > 0`, ignored when greedy.
    - `temperature`: `>= 0`; `0` is greedy, `1` samples from `softmax(logits)`.
    - `top_k`: keep only the `top_k` largest logits (`None`: all of them). Values above
      `vocab` keep all of them.
    - `top_p`: nucleus mass in `(0, 1]` (`None` or `1.0`: no nucleus restriction).

    **Returns:**

    `[batch]` int32 token ids.

    **Raises:**

    - `TypeError`: when `logits` is not a floating-point array, or an argument has the wrong
      type (see `check_sampling`).
    - `ValueError`: when `logits` is not `[batch, vocab]` with both non-empty,
      `temperature < 0` or not finite, `top_k < 1`, `top_p` outside `(0, 1]`, or
      `temperature > 0` comes without a `key`.
    """
    dtype = getattr(logits, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            "sample_tokens: logits must be a floating-point array [batch, vocab]; got "
            f"{seen(logits) if dtype is None else f'an array of dtype {dtype}'}."
        )
    shape = tuple(np.shape(logits))
    if len(shape) != 2 or 0 in shape:
        raise ValueError(
            "sample_tokens: logits must have shape [batch, vocab] with both non-empty; got "
            f"shape {shape}. For one sequence, pass logits[None]."
        )
    check_sampling(temperature, top_k, top_p, key)
    greedy = float(temperature) == 0.0
    filtered = not greedy and (top_k is not None or (top_p is not None and float(top_p) < 1.0))
    return _sample_jit(
        jnp.asarray(logits, jnp.float32),
        None if greedy else jnp.asarray(key),
        float(temperature),
        0 if top_k is None else min(int(top_k), shape[1]),
        1.0 if top_p is None else float(top_p),
        filtered=filtered,
    )


def _filter(
    scaled: Float[Array, "batch vocab"],
    top_k: Int[Array, ""] | int,
    top_p: Float[Array, ""] | float,
) -> Float[Array, "batch vocab"]:
    """`scaled` with every token outside the top-k and then the nucleus set to `-inf`.

    `top_k` 0 and `top_p` 1.0 turn each restriction off; both may be traced.
    """
    vocab = scaled.shape[-1]
    k = jnp.asarray(top_k, jnp.int32)
    k = jnp.where(k > 0, jnp.minimum(k, vocab), vocab)
    p = jnp.asarray(top_p, jnp.float32)
    ordered = -jnp.sort(-scaled, axis=-1)  # descending
    rank = jnp.arange(vocab)
    in_top_k = rank < k
    probs = jax.nn.softmax(jnp.where(in_top_k, ordered, -jnp.inf), axis=-1)
    # A token joins the nucleus while the mass of the more probable ones is below top_p, so
    # the most probable token is always in it; top_p = 1.0 keeps every token (rounding of the
    # cumulative sum could otherwise drop the least probable ones).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_top_k & ((mass_before < p) | (p >= 1.0))
    kept = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    threshold = jnp.take_along_axis(ordered, (kept - 1)[:, None], axis=-1)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def _sample(
    logits: Float[Array, "batch vocab"],
    key: PRNGKeyArray | None,
    temperature: Float[Array, ""] | float,
    top_k: Int[Array, ""] | int,
    top_p: Float[Array, ""] | float,
    *,
    filtered: bool,
) -> Int[Array, " batch"]:
    """The jit-friendly core of `sample_tokens`; arguments are trusted, not checked.

    `temperature` (0 = greedy), `top_k` (0 = off) and `top_p` (1.0 = off) may be traced.
    `key=None` (static) and `filtered=False` (static: no top-k and no top-p, so no sort)
    compile smaller functions.
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if key is None:
        return greedy
    t = jnp.asarray(temperature, jnp.float32)
    scaled = logits / jnp.where(t > 0, t, 1.0)
    if filtered:
        scaled = _filter(scaled, top_k, top_p)
    keys = jax.random.split(key, logits.shape[0])
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(t > 0, drawn, greedy)


# One compiled function per logits shape and `filtered`: the settings are traced.
_sample_jit = jax.jit(_sample, static_argnames="filtered")


__all__ = ["check_sampling", "sample_tokens"]
