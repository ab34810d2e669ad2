"""The gated delta rule in its chunked parallel form (WY / UT transform): the XLA path.

Per batch row and head the rule updates a state `S` `[dk, dv]` token by token (decay
`a_t = exp(g_t)`, a scalar for GDN or one per key channel for KDA):

    S_t = (I - beta_t k_t k_t^T) diag(a_t) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t

(`q` arrives already scaled). Over a chunk of `C` tokens that starts from the state `S`,
with `G_t` the log decay summed from the chunk's start through token `t`, unrolling gives
`S_t = exp(G_t) S + sum_{j <= t} exp(G_t - G_j) k_j u_j^T` for the corrections
`u_j = beta_j (v_j - (diag(a_j) S_{j-1})^T k_j)`. Written for all `j` of the chunk at once
they solve one unit-lower-triangular system (the UT transform of Gated DeltaNet,
arXiv:2412.06464, Sec. 3; per channel for Kimi Linear, arXiv:2510.26692):

    (I + A) W = diag(beta) [k * exp(G) | v],   A_tj = beta_t <k_t, exp(G_t - G_j) k_j>, j < t
    u = W_v - W_k S
    o = (q * exp(G)) S + P u,                  P_tj = <q_t, exp(G_t - G_j) k_j>, j <= t
    S' = exp(G_C) S + sum_j (exp(G_C - G_j) k_j) u_j^T

so a chunk costs a few `C x C` matmuls, and only the state passes from chunk to chunk
(`lax.scan`). The system is solved by an explicit inverse of `I + A`, built by doubling
blocks (`_unit_lower_inverse`): batched matmuls where XLA:CPU's batched
`triangular_solve` is a loop over rows (1-2 s against 0.03 s for 256 tokens forward and
backward at `dk = dv = 128`, 4 heads).

**Stability.** Decays enter only as `exp(G_t - G_j)` with `t >= j` and as `exp(G_t)`,
exponents that are never positive, masked to `-inf` before the `exp` where a pair does not
count. Never as `exp(G_t) * exp(-G_j)`: at `g = -20` over 64 tokens `exp(-G_j)` is
`exp(1280)`, infinite in float32. Nor is `G_t - G_j` computed as a difference of prefix
sums: each `g_{j+1} + ... + g_t` is summed from its own terms (a reverse cumulative sum per
row), so weak decays after strong ones keep their precision, and so do the gradients of
strong decays (tiny, and swamped by rounding when they come out of a difference of large
opposite terms). For KDA the factors are per channel, `[C, C, dk]` per chunk.

**Documents.** `starts[t]` drops the state before token `t`'s update. Inside a chunk the
pairs `(t, j)` of different documents are masked out of `A` and `P`; the incoming state
reaches token `t` only if no document starts in `[chunk start, t]`, and only the tokens of
the chunk's last document write into the outgoing state. So every sum of log decays that
is used runs within one document (a reset is never a huge negative `g` inside a sum).

**Memory.** The chunk step is `jax.checkpoint`ed: the backward keeps the inputs and one
state per chunk (the scan's carry) and recomputes a chunk's `C x C` work when it needs it;
no per-token state `[seq, heads, dk, dv]` ever exists.

Einsum letters: `b` batch, `h` heads, `t` the token of the chunk that reads, `j` the token
that writes, `c` key channel (`dk`, or 1 for a GDN decay), `v` value channel (`dv`).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float

# Full float32 products on every backend (TPU's default multiplies in bfloat16, GPU's in
# TF32): the state is a long sum of small corrections.
_HIGHEST = lax.Precision.HIGHEST


def document_starts(segment_ids: Array | None, batch: int, seq: int) -> Bool[Array, "batch seq"]:
    """The `starts` flags of `chunk_gated_delta` from `[batch, seq]` segment ids (`None`:
    one document per row): token `t > 0` starts a document where its id differs from token
    `t - 1`'s. Token 0 never does: the state before it is the initial state."""
    if segment_ids is None:
        return jnp.zeros((batch, seq), bool)
    changed = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.concatenate([jnp.zeros((batch, 1), bool), changed], axis=1)


def chunk_gated_delta(
    q: Float[Array, "batch seq heads dk"],
    k: Float[Array, "batch seq heads dk"],
    v: Float[Array, "batch seq heads dv"],
    g: Float[Array, "batch seq heads"] | Float[Array, "batch seq heads dk"],
    beta: Float[Array, "batch seq heads"],
    starts: Bool[Array, "batch seq"],
    initial_state: Float[Array, "batch heads dk dv"],
    *,
    scale: float,
    chunk: int,
) -> tuple[Float[Array, "batch seq heads dv"], Float[Array, "batch heads dk dv"]]:
    """The gated delta rule over a sequence, chunk by chunk, from a given state.

    The internal interface of the room: the one-device op calls it once, the
    context-parallel path once per piece of the sequence. Inputs are trusted (validated and
    float32 already). The result is linear in `initial_state` and `v` jointly (nothing is
    normalised inside), which is what lets a piece be summarised as an affine map of the
    state it receives.

    **Arguments:**

    - `q`, `k`: `[batch, seq, heads, dk]`, float32; `q` is multiplied by `scale` here.
    - `v`: `[batch, seq, heads, dv]`, float32, any `dv`.
    - `g`: the log decay (`<= 0`), `[batch, seq, heads]` (GDN) or `[batch, seq, heads, dk]`
      (KDA).
    - `beta`: `[batch, seq, heads]`.
    - `starts`: `[batch, seq]` bool: `True` at a token whose document does not continue the
      state before it; that state is dropped (zero) before the token's own update. A row's
      first token is `False` unless the state passed in must be dropped too.
    - `initial_state`: `[batch, heads, dk, dv]` float32, the state before token 0 (zeros
      for none).
    - `scale`: the factor on `q`.
    - `chunk`: tokens per chunk (at most `seq` are used); the sequence is padded to a
      multiple of it with tokens that change nothing (`beta = 0`, `g = 0`).

    **Returns:** `(out, final_state)`: `out` `[batch, seq, heads, dv]` and the state after
    the last token `[batch, heads, dk, dv]`, both float32.
    """
    b, s, h, _ = q.shape
    size = min(chunk, s)
    n = -(-s // size)
    pad = n * size - s
    if g.ndim == 3:
        g = g[..., None]  # one decay for every key channel

    def split(x):  # [b, s, h, ...] -> [n, b, h, size, ...], zero-padded
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, n, size, *x.shape[2:])
        return jnp.moveaxis(x, (1, 2), (0, 3))

    flags = jnp.pad(starts, [(0, 0), (0, pad)]).reshape(b, n, size).swapaxes(0, 1)
    xs = (split(q * scale), split(k), split(v), split(g), split(beta), flags)
    step = jax.checkpoint(_chunk_step, prevent_cse=False)
    final_state, out = lax.scan(step, initial_state, xs)
    out = jnp.moveaxis(out, (0, 3), (1, 2)).reshape(b, n * size, h, -1)
    return out[:, :s], final_state


def _chunk_step(state, xs):
    """One chunk: `state` `[b, h, dk, dv]` in, `(state out, outputs [b, h, C, dv])`."""
    q, k, v, g, beta, starts = xs  # [b, h, C, dk|dv|c], beta [b, h, C], starts [b, C]
    size = q.shape[2]
    dk = k.shape[-1]
    doc = jnp.cumsum(starts, axis=-1, dtype=jnp.int32)  # the document's index in the chunk
    causal = jnp.tril(jnp.ones((size, size), bool))
    same = (doc[:, :, None] == doc[:, None, :]) & causal  # [b, t, j]: j <= t, one document

    # span[t, j] = g_{j+1} + ... + g_t, summed from the g's themselves (one sign, so no
    # cancellation), not as G_t - G_j: the difference of two long prefix sums loses the
    # small decays that follow strong ones, and its gradient cancels large opposite terms.
    # The diagonal and the pairs left out are sums of nothing: exactly 0, with no gradient.
    upto = jnp.where(causal[:, :, None], g[:, :, None, :, :], 0.0)  # [b, h, t, i, c], i <= t
    span = lax.cumsum(upto, axis=3, reverse=True)
    span = jnp.concatenate([span[:, :, :, 1:], jnp.zeros_like(span[:, :, :, :1])], axis=3)
    decay = jnp.exp(jnp.where(same[:, None, :, :, None], span, -jnp.inf))  # [b, h, t, j, c]
    earlier = jnp.tril(jnp.ones((size, size), bool), -1)
    a = jnp.where(earlier, _decayed_dots(k, k, decay), 0.0) * beta[..., None]
    p = _decayed_dots(q, k, decay)

    # From the chunk's start: the incoming state reaches the tokens before any start.
    reached = (doc == 0)[:, None, :, None]
    from_start = jnp.exp(lax.cumsum(g, axis=2))  # [b, h, C, c]
    rhs = jnp.concatenate([jnp.where(reached, k * from_start, 0.0), v], axis=-1)
    w = jnp.einsum("bhtj,bhjc->bhtc", _unit_lower_inverse(a), rhs * beta[..., None],
                   precision=_HIGHEST)  # fmt: skip
    u = w[..., dk:] - jnp.einsum("bhtc,bhcv->bhtv", w[..., :dk], state, precision=_HIGHEST)
    q_in = jnp.where(reached, q * from_start, 0.0)
    out = jnp.einsum("bhtc,bhcv->bhtv", q_in, state, precision=_HIGHEST)
    out = out + jnp.einsum("bhtj,bhjv->bhtv", p, u, precision=_HIGHEST)

    # The last row of `decay` is the decay from each token of the last document to the end.
    kept = jnp.where(reached[:, :, -1:], from_start[:, :, -1:], 0.0)  # [b, h, 1, c]
    new_state = jnp.swapaxes(kept, -1, -2) * state
    k_out = k * decay[:, :, -1]
    new_state = new_state + jnp.einsum("bhjc,bhjv->bhcv", k_out, u, precision=_HIGHEST)
    return new_state, out


def _decayed_dots(x, y, decay):
    """`[b, h, t, j]`: `sum_c x_tc y_jc decay_tjc`, with `decay` `[b, h, t, j, c]` (`c = 1`
    for a decay shared by all channels)."""
    if decay.shape[-1] == 1:
        dots = jnp.einsum("bhtc,bhjc->bhtj", x, y, precision=_HIGHEST)
        return dots * decay[..., 0]
    return jnp.einsum("bhtc,bhjc,bhtjc->bhtj", x, y, decay, precision=_HIGHEST)


def _unit_lower_inverse(a):
    """`(I + a)^-1` for `a` `[..., C, C]` strictly lower triangular, by doubling blocks: if
    the inverse `X` of the diagonal blocks of size `m` is known, the blocks of size `2 m`
    invert as `X - X E X`, with `E` the part of `a` between the two halves of each (exact:
    `(X E)^2 = 0`). Batched `C x C` matmuls, `ceil(log2 C)` rounds: XLA:CPU lowers a
    batched `triangular_solve` to a loop over rows that costs milliseconds a chunk."""
    size = a.shape[-1]
    row = jnp.arange(size)
    inv = jnp.broadcast_to(jnp.eye(size, dtype=a.dtype), a.shape)
    m = 1
    while m < size:
        between = (row[:, None] // (2 * m) == row[None, :] // (2 * m)) & (
            row[:, None] // m != row[None, :] // m
        )
        e = jnp.where(between, a, 0.0)
        xe = jnp.einsum("...tj,...ji->...ti", inv, e, precision=_HIGHEST)
        inv = inv - jnp.einsum("...ti,...ij->...tj", xe, inv, precision=_HIGHEST)
        m *= 2
    return inv
