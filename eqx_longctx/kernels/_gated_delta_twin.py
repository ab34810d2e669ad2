"""The XLA twin of the gated delta kernels' chunk work (`_gated_delta_pallas.py`, its
backward `_gated_delta_pallas_bwd.py`), and the state scan that finishes each chunk.

Per chunk of `C` tokens the state-independent work is (see `eqx_longctx/linear/_chunked.py`
for the derivation; this is its math, split where the state enters):

    (I + A) [W_k | W_v] = diag(beta) [k * exp(G) | v]   (the UT transform; rows past a
                                                         document start keep no exp(G) part)
    P_tj = <q_t, exp(G_t - G_j) k_j>, j <= t, one document
    q_in = q * exp(G) (tokens the incoming state reaches), k_out = k * exp(G_C - G_j) (the
    chunk's last document)

and the scan (`scan_chunks`) finishes each chunk from the state `S` it receives:

    u = W_v - W_k S,   out = q_in S + P u,   S' = kept * S + k_out^T u.

`intra_chunk_reference` computes the first part with the same formulas as the XLA path's
`_chunk_step` (reverse cumulative sums of the log decays, `triangular_solve`); the kernel
must agree with it, and the backward kernel with its VJP (`tests/test_gated_delta_kernel.py`).

Einsum letters: `b` batch, `h` heads, `t` the token that reads, `j` the token that writes,
`c` key channel (`dk`, or 1 for a GDN decay), `v` value channel.
"""

import jax
import jax.numpy as jnp
from jax import lax

_HIGHEST = lax.Precision.HIGHEST


def intra_chunk_reference(q, k, v, g, beta, starts):
    """The state-independent work of a chunk, in XLA.

    **Arguments:** heads-major chunks: `q`, `k` `[b, h, C, dk]` (`q` scaled), `v`
    `[b, h, C, dv]`, `g` `[b, h, C, c]` (`c` 1 or `dk`), `beta` `[b, h, C, 1]`, `starts`
    `[b, 1, C, 1]` (1.0 where a token starts a document, shared by the heads).

    **Returns:** `(w_k [.., C, dk], w_v [.., C, dv], p [.., C, C], q_in [.., C, dk],
    k_out [.., C, dk])`, float32.
    """
    size, dk = q.shape[-2], q.shape[-1]
    doc = jnp.cumsum(starts[..., 0] > 0, axis=-1, dtype=jnp.int32)  # [b, 1, C]
    causal = jnp.tril(jnp.ones((size, size), bool))
    same = (doc[..., :, None] == doc[..., None, :]) & causal  # [b, 1, t, j]
    # span[t, j] = g_{j+1} + ... + g_t from the g's themselves (no difference of prefix sums)
    upto = jnp.where(causal[:, :, None], g[..., None, :, :], 0.0)  # [b, h, t, i, c]
    span = lax.cumsum(upto, axis=upto.ndim - 2, reverse=True)
    span = jnp.concatenate([span[..., 1:, :], jnp.zeros_like(span[..., :1, :])], axis=-2)
    decay = jnp.exp(jnp.where(same[..., None], span, -jnp.inf))  # [b, h, t, j, c]
    earlier = jnp.tril(jnp.ones((size, size), bool), -1)
    a = jnp.where(earlier, _decayed_dots(k, k, decay), 0.0) * beta
    p = _decayed_dots(q, k, decay)
    reached = (doc == 0)[..., None]  # [b, 1, C, 1]
    from_start = jnp.exp(lax.cumsum(g, axis=g.ndim - 2))
    rhs = jnp.concatenate([jnp.where(reached, k * from_start, 0.0), v], axis=-1) * beta
    w = lax.linalg.triangular_solve(a, rhs, left_side=True, lower=True, unit_diagonal=True)
    q_in = jnp.where(reached, q * from_start, 0.0)
    k_out = k * decay[..., -1, :, :]
    return w[..., :dk], w[..., dk:], p, q_in, k_out


def _decayed_dots(x, y, decay):
    """`[.., t, j]`: `sum_c x_tc y_jc decay_tjc` (`c = 1`: one decay for all channels)."""
    if decay.shape[-1] == 1:
        return jnp.einsum("bhtc,bhjc->bhtj", x, y, precision=_HIGHEST) * decay[..., 0]
    return jnp.einsum("bhtc,bhjc,bhtjc->bhtj", x, y, decay, precision=_HIGHEST)


def by_chunk(x, size: int):
    """`[b, h, n * C, ...]` -> `[n, b, h, C, ...]`."""
    b, h, s = x.shape[:3]
    return jnp.moveaxis(x.reshape(b, h, s // size, size, *x.shape[3:]), 2, 0)


def from_chunks(x):
    """`[n, b, h, C, ...]` -> `[b, h, n * C, ...]`."""
    n, b, h, size = x.shape[:4]
    return jnp.moveaxis(x, 0, 2).reshape(b, h, n * size, *x.shape[4:])


def scan_chunks(parts, kept, initial_state, size: int):
    """Each chunk finished from the state it receives, in order (`lax.scan`).

    **Arguments:** `parts` `(w_k, w_v, p, q_in, k_out)` heads-major over the padded
    sequence; `kept` `[n, b, h, c]` the decay of the whole chunk where no document starts
    in it (else 0); `initial_state` `[b, h, dk, dv]`.

    **Returns:** `(out [b, h, S, dv], final_state [b, h, dk, dv])`, float32.
    """

    def step(state, xs):
        w_k, w_v, p, q_in, k_out, keep = xs
        u = w_v - jnp.einsum("bhtc,bhcv->bhtv", w_k, state, precision=_HIGHEST)
        out = jnp.einsum("bhtc,bhcv->bhtv", q_in, state, precision=_HIGHEST)
        out = out + jnp.einsum("bhtj,bhjv->bhtv", p, u, precision=_HIGHEST)
        new = keep[..., :, None] * state
        new = new + jnp.einsum("bhjc,bhjv->bhcv", k_out, u, precision=_HIGHEST)
        return new, out

    xs = (*(by_chunk(x, size) for x in parts), kept)
    step = jax.checkpoint(step, prevent_cse=False)
    final_state, out = lax.scan(step, initial_state, xs)
    return from_chunks(out), final_state
