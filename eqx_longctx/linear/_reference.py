"""The plain gated delta rule, one token at a time, in float32: the room's oracle.

Shares no arithmetic with the chunked form (`_chunked.py`); tests and notebooks compare
against it, as they compare softmax attention against `reference_attention`.
"""

from typing import no_type_check

import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from ._validate import check_inputs

_HIGHEST = lax.Precision.HIGHEST


@no_type_check  # validated eagerly, with errors that say what to fix
def reference_gated_delta_rule(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    g: ArrayLike,
    beta: ArrayLike,
    *,
    segment_ids: ArrayLike | None = None,
    initial_state: ArrayLike | None = None,
    scale: float | None = None,
    return_state: bool = False,
):
    """The gated delta rule computed token by token (`lax.scan` over the sequence), in
    float32.

    The same rule, arguments and checks as [`gated_delta_rule`][eqx_longctx.linear.gated_delta_rule]
    (without `spec` and `chunk`); each step is the recurrence of transformers'
    `torch_recurrent_gated_delta_rule` and `recurrent_kimi_delta_attention`. Its backward
    keeps every per-token state: an oracle for short sequences, not a layer.

    **Arguments:**

    - `q`, `k`: `[batch, seq, heads, dk]`.
    - `v`: `[batch, seq, heads, dv]`.
    - `g`: the log decay, `<= 0`: `[batch, seq, heads]` or `[batch, seq, heads, dk]`.
    - `beta`: `[batch, seq, heads]`.
    - `segment_ids`: `[batch, seq]` ints; the state restarts from zero where the id changes.
    - `initial_state`: `[batch, heads, dk, dv]`, the state before token 0 (first document
      only), or `None` for zeros.
    - `scale`: the factor on `q`, default `dk ** -0.5`.
    - `return_state`: also return the state after the last token.

    **Returns:** `out` `[batch, seq, heads, dv]` in float32, or `(out, final_state)` with
    `final_state` `[batch, heads, dk, dv]` float32 when `return_state`.

    **Raises:** `TypeError` and `ValueError` as `gated_delta_rule` does.
    """
    where = "reference_gated_delta_rule"
    q, k, v, g, beta, segment_ids, initial_state, scale = check_inputs(
        where, q, k, v, g, beta, segment_ids, initial_state, scale
    )
    b, s, h, dk = q.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta))
    if g.ndim == 3:
        g = jnp.broadcast_to(g[..., None], (b, s, h, dk))
    if segment_ids is None:
        segment_ids = jnp.zeros((b, s), jnp.int32)
    # The id of the token before each one (token 0 is compared with itself: it keeps the
    # initial state).
    previous = jnp.concatenate([segment_ids[:, :1], segment_ids[:, :-1]], axis=1)
    new_doc = segment_ids != previous
    if initial_state is None:
        state = jnp.zeros((b, h, dk, dv), jnp.float32)
    else:
        state = jnp.asarray(initial_state, jnp.float32)

    def step(state, token):
        q_t, k_t, v_t, g_t, beta_t, new_t = token
        state = jnp.where(new_t[:, None, None, None], 0.0, state)
        state = jnp.exp(g_t)[..., None] * state
        read = jnp.einsum("bhc,bhcv->bhv", k_t, state, precision=_HIGHEST)
        delta = beta_t[..., None] * (v_t - read)
        state = state + k_t[..., :, None] * delta[..., None, :]
        out = jnp.einsum("bhc,bhcv->bhv", q_t * scale, state, precision=_HIGHEST)
        return state, out

    tokens = tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v, g, beta, new_doc))
    state, out = lax.scan(step, state, tokens)
    out = jnp.swapaxes(out, 0, 1)
    return (out, state) if return_state else out
