"""Eager input checks for the gated delta rule: clear errors instead of XLA shape failures.

Every check reads shapes and dtypes only, before anything is traced, except the sign of a
concrete `g` (a decay above 1 makes the state grow without bound), which is read from its
values when they are known (not under `jax.jit`).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from .._checks import as_int32_ids, check_bool, check_int, check_real, check_spec

_LAYOUT = "[batch, seq, heads, dk] (v: [batch, seq, heads, dv])"


def _as_array(x):
    return x if isinstance(x, jax.Array | jax.ShapeDtypeStruct) else jnp.asarray(x)


def _check_float(where: str, name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{where} needs floating-point {name}; got dtype {x.dtype}. Cast with "
            ".astype(jnp.float32) (or bfloat16): the rule would silently truncate integers."
        )


def check_inputs(where: str, q, k, v, g, beta, segment_ids, initial_state, scale):
    """Check the arrays of `gated_delta_rule` (and of its reference) against each other.

    **Returns:** `(q, k, v, g, beta, segment_ids, initial_state, scale)`: the arrays as JAX
    arrays (NumPy and lists accepted; `segment_ids` and `initial_state` may be `None`) and
    `scale` as a Python float (`dk ** -0.5` for `None`).

    **Raises:** `TypeError` for a non-float `q`, `k`, `v`, `g`, `beta` or `initial_state`,
    or non-integer `segment_ids`; `ValueError` for shapes that disagree, an empty
    dimension, `g` neither `[batch, seq, heads]` nor `[batch, seq, heads, dk]`, or a
    concrete `g` with a positive entry.
    """
    arrays = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    q, k, v, g, beta = (_as_array(x) for x in arrays.values())
    for name, x in zip(arrays, (q, k, v, g, beta), strict=True):
        _check_float(where, name, x)
    if not (q.ndim == k.ndim == v.ndim == 4):
        raise ValueError(
            f"{where} needs q, k and v of rank 4 laid out {_LAYOUT}; got q{tuple(q.shape)}, "
            f"k{tuple(k.shape)}, v{tuple(v.shape)}. Add a batch axis (x[None]) or split heads "
            "(einops.rearrange(x, 'b s (h d) -> b s h d', h=...))."
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if 0 in x.shape:
            raise ValueError(
                f"{where} needs non-empty dimensions; got {name} of shape {tuple(x.shape)}. "
                "Drop the call for empty inputs."
            )
    b, s, h, dk = q.shape
    if tuple(k.shape) != tuple(q.shape) or tuple(v.shape[:3]) != (b, s, h):
        raise ValueError(
            f"{where} needs q and k of one shape [batch, seq, heads, dk] and v "
            f"[batch, seq, heads, dv] with the same batch, seq and heads; got "
            f"q{tuple(q.shape)}, k{tuple(k.shape)}, v{tuple(v.shape)}. Repeat grouped heads "
            "first (jnp.repeat(x, n, axis=2)) if q/k and v have different head counts."
        )
    if tuple(g.shape) not in ((b, s, h), (b, s, h, dk)):
        raise ValueError(
            f"{where}: g must be [batch, seq, heads] = {(b, s, h)} (GDN: one decay per head) "
            f"or [batch, seq, heads, dk] = {(b, s, h, dk)} (KDA: one per key channel); got "
            f"g{tuple(g.shape)}."
        )
    if tuple(beta.shape) != (b, s, h):
        raise ValueError(
            f"{where}: beta must be [batch, seq, heads] = {(b, s, h)} (one write strength per "
            f"token and head); got beta{tuple(beta.shape)}."
        )
    concrete = not isinstance(g, Tracer | jax.ShapeDtypeStruct)
    if concrete and getattr(g, "is_fully_addressable", True):
        top = float(np.max(np.asarray(g, np.float32)))
        if top > 0:
            raise ValueError(
                f"{where}: g is the log of the decay and must be <= 0 (the state is multiplied "
                f"by exp(g) at each token); got max(g) = {top:.4g}. Pass a log decay such as "
                "-exp(A_log) * softplus(a + dt_bias), or jnp.log of a decay in (0, 1]."
            )
    if segment_ids is not None:
        if not isinstance(segment_ids, jax.Array | jax.ShapeDtypeStruct):
            segment_ids = jnp.asarray(as_int32_ids(segment_ids, f"{where}: segment_ids"))
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise TypeError(
                f"{where}: segment_ids must be integers (one id per packed document); got "
                f"dtype {segment_ids.dtype}. Cast with .astype(jnp.int32)."
            )
        if tuple(segment_ids.shape) != (b, s):
            raise ValueError(
                f"{where}: segment_ids must be [batch, seq] = {(b, s)}; got "
                f"{tuple(segment_ids.shape)}."
            )
    if initial_state is not None:
        initial_state = _as_array(initial_state)
        _check_float(where, "initial_state", initial_state)
        dv = v.shape[-1]
        if tuple(initial_state.shape) != (b, h, dk, dv):
            raise ValueError(
                f"{where}: initial_state must be [batch, heads, dk, dv] = {(b, h, dk, dv)} "
                f"(the state before token 0); got {tuple(initial_state.shape)}. Pass the "
                "final_state of a previous call (return_state=True), or None for zeros."
            )
    scale = dk**-0.5 if scale is None else check_real(scale, f"{where}: scale")
    return q, k, v, g, beta, segment_ids, initial_state, scale


def check_options(where: str, spec, return_state, chunk) -> int:
    """Check the keyword options of `gated_delta_rule`. **Returns:** `chunk` as an int.

    **Raises:** `TypeError` for a `spec` that is not a `ShardingSpec` or `None`, a
    non-bool `return_state` or a non-int `chunk`; `ValueError` for `chunk < 1`.
    """
    check_spec(spec, where)
    check_bool(return_state, f"{where}: return_state")
    fix = " Pass the tokens per chunk of the chunked form, e.g. 64."
    return check_int(chunk, f"{where}: chunk", fix=fix)
