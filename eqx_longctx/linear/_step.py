"""One token of the gated delta rule and of the short convolution: what a linear-attention
layer runs per decoded token, against the fixed-size state its cache keeps.

Both take any leading axes (`...`: the rows, and whatever else the caller keeps apart, such
as the copies of a token on the devices of a sequence split) and compute in float32. They
share no arithmetic with the chunked form (`_chunked.py`); the tests compare them with
`reference_gated_delta_rule` and `short_conv` token by token.

Einsum letters: `c` key channels (`dk`), `v` value channels (`dv`).
"""

from typing import no_type_check

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from ._conv import ACTIVATIONS

_HIGHEST = lax.Precision.HIGHEST


def _float(x, where: str, name: str):
    x = x if isinstance(x, jax.Array) else jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{where} needs floating-point {name}; got dtype {x.dtype}. Cast with "
            ".astype(jnp.float32)."
        )
    return x


@no_type_check  # validated eagerly, with errors that say what to fix
def gated_delta_step(
    state: ArrayLike,
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    g: ArrayLike,
    beta: ArrayLike,
    *,
    scale: float | None = None,
):
    """One token of the gated delta rule: the recurrence of
    [`gated_delta_rule`][eqx_longctx.linear.gated_delta_rule] for a single step, from the
    state before the token.

    Per head: `S <- diag(exp(g)) S`, `S <- S + k (beta (v - S^T k))^T`, `o = S^T (scale q)`
    (transformers' `torch_recurrent_gated_delta_rule` and `recurrent_kimi_delta_attention`
    for one token). A token with `g = 0` and `beta = 0` leaves the state unchanged.

    **Arguments:**

    - `state`: `[..., heads, dk, dv]`, the state before the token.
    - `q`, `k`: `[..., heads, dk]`.
    - `v`: `[..., heads, dv]`.
    - `g`: the log decay, `<= 0`: `[..., heads]` (GDN) or `[..., heads, dk]` (KDA).
    - `beta`: `[..., heads]`, the write strength.
    - `scale`: the factor on `q`, default `dk ** -0.5`.

    `...` are any leading axes, the same for every argument.

    **Returns:** `(out, new_state)`: `out` `[..., heads, dv]` in the promoted dtype of `q`,
    `k` and `v`; `new_state` `[..., heads, dk, dv]` float32.

    **Raises:** `TypeError` for a non-float argument; `ValueError` for shapes that
    disagree (naming each argument's shape and the one expected).
    """
    where = "gated_delta_step"
    names = ("state", "q", "k", "v", "g", "beta")
    arrays = (state, q, k, v, g, beta)
    state, q, k, v, g, beta = (_float(x, where, n) for x, n in zip(arrays, names, strict=True))
    if state.ndim < 3:
        raise ValueError(
            f"{where} needs state [..., heads, dk, dv]; got state{tuple(state.shape)}."
        )
    *lead, h, dk, dv = state.shape
    lead = tuple(lead)
    want = {
        "q": (q, (*lead, h, dk)),
        "k": (k, (*lead, h, dk)),
        "v": (v, (*lead, h, dv)),
        "beta": (beta, (*lead, h)),
    }
    for name, (x, shape) in want.items():
        if tuple(x.shape) != shape:
            raise ValueError(
                f"{where}: {name} must be {list(shape)} for state{tuple(state.shape)} "
                f"([..., heads, dk, dv]); got {name}{tuple(x.shape)}."
            )
    if tuple(g.shape) not in ((*lead, h), (*lead, h, dk)):
        raise ValueError(
            f"{where}: g must be [..., heads] = {[*lead, h]} (a decay per head) or "
            f"[..., heads, dk] = {[*lead, h, dk]} (per key channel); got g{tuple(g.shape)}."
        )
    scale = dk**-0.5 if scale is None else float(scale)
    return _step(state, q, k, v, g, beta, scale)


def _step(state, q, k, v, g, beta, scale):
    out_dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    state, q, k, v, g, beta = (x.astype(jnp.float32) for x in (state, q, k, v, g, beta))
    decay = jnp.exp(g)
    decay = decay[..., None, None] if decay.ndim == q.ndim - 1 else decay[..., None]
    state = decay * state
    read = jnp.einsum("...c,...cv->...v", k, state, precision=_HIGHEST)
    delta = beta[..., None] * (v - read)
    state = state + k[..., :, None] * delta[..., None, :]
    out = jnp.einsum("...c,...cv->...v", q * scale, state, precision=_HIGHEST)
    return out.astype(out_dtype), state


@no_type_check  # validated eagerly, with errors that say what to fix
def short_conv_step(
    window: ArrayLike,
    x: ArrayLike,
    weight: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    activation: str | None = None,
):
    """One token of [`short_conv`][eqx_longctx.linear.short_conv]: the new input `x` against
    the window of the `K - 1` inputs before it.

    `out[..., c] = act(bias[c] + sum_i w[c, i] [window | x][..., c, i])`; the window then
    drops its oldest input and takes `x`. A window of zeros is the start of a row (or of a
    packed document).

    **Arguments:**

    - `window`: `[..., channels, K-1]`, the last `K - 1` inputs, oldest first.
    - `x`: `[..., channels]`, the new input.
    - `weight`: `[channels, K]` (`weight[:, K-1]` weighs the new input), as `short_conv`'s.
    - `bias`: `[channels]` or `None`.
    - `activation`: `None` or `"silu"`.

    **Returns:** `(out, new_window)`: `out` `[..., channels]` in the promoted dtype of
    `x`, `weight` and `bias`; `new_window` `[..., channels, K-1]` in the window's dtype.

    **Raises:** `TypeError` for a non-float argument; `ValueError` for shapes that
    disagree or an unknown `activation`.
    """
    where = "short_conv_step"
    window, x, weight = (_float(window, where, "window"), _float(x, where, "x"),
                         _float(weight, where, "weight"))  # fmt: skip
    if bias is not None:
        bias = _float(bias, where, "bias")
    if weight.ndim != 2 or weight.shape[1] < 1:
        raise ValueError(f"{where} needs weight [channels, K]; got weight{tuple(weight.shape)}.")
    c, kernel = weight.shape
    if tuple(window.shape) != (*x.shape, kernel - 1) or x.shape[-1:] != (c,):
        raise ValueError(
            f"{where} needs x [..., channels={c}] and window [..., channels, K-1={kernel - 1}] "
            f"for weight{tuple(weight.shape)}; got x{tuple(x.shape)}, window"
            f"{tuple(window.shape)}."
        )
    if bias is not None and tuple(bias.shape) != (c,):
        raise ValueError(f"{where} needs bias [channels] = [{c}]; got bias{tuple(bias.shape)}.")
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"{where}: activation must be one of {ACTIVATIONS}; got {activation!r}. "
            "Apply another activation to the output yourself."
        )
    dtype = jnp.result_type(x.dtype, weight.dtype, *(() if bias is None else (bias,)))
    w = weight.astype(jnp.float32)
    # The order of short_conv's sum: the token itself, then its predecessors nearest first.
    out = x.astype(jnp.float32) * w[:, kernel - 1]
    for j in range(1, kernel):
        out = out + window[..., kernel - 1 - j].astype(jnp.float32) * w[:, kernel - 1 - j]
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    if activation == "silu":
        out = jax.nn.silu(out)
    new_window = jnp.concatenate([window[..., 1:], x[..., None].astype(window.dtype)], axis=-1)
    return out.astype(dtype), new_window
