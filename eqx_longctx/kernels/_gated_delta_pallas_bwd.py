"""The backward of the gated delta kernel's chunk work, as a Pallas TPU kernel: Gated
DeltaNet (a decay per head) and Kimi Delta Attention (per key channel).

One grid step is one chunk of one head, grid `(batch, heads, chunks)`, all "parallel"
(chunks are independent here: the state's gradient flows through the XLA scan). It
recomputes the chunk's forward (`chunk_terms`, the decays `D`, `A = strict(beta K K^T D)`,
`T = (I + A)^{-1}`) and takes the cotangents of `W_k = T r_k`, `W_v = T r_v`, `P = Q K^T D`,
`q_in`, `k_out` back to `q`, `k`, `v`, `g`, `beta`:

    dT = dW_k r_k^T + dW_v r_v^T,  dr = T^T dW,  dA = -strict(T^T dT T^T)
    dK K^T = beta dA D,  dQ K^T = dP D,  dD = beta dA (K K^T) + dP (Q K^T)
    dspan = dD D  ->  dg_i = sum_j (i > j) (tril(1)^T dspan)_ij     (GDN)

(for KDA the pairs' scores are per channel: see `_channel_backward`), plus the elementwise
paths through `exp(G)` (`q_in`, `r_k`) and `exp(G_C - G_t)` (`k_out`), whose prefix sums go
back through the transposed triangles. Transposes are products with the identity
(`x^T = I x^T`, one MXU pass that is exact at `HIGHEST`), so every product is a plain or
`a @ b^T` one, as Mosaic lowers them.
"""

import functools
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._blocks import call_kernel
from ._gated_delta_pallas import (
    NT,
    channel_scores,
    chunk_terms,
    dot,
    gdn_decay,
    row_of,
    unit_lower_inverse,
)
from ._operands import out_struct


def _bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, starts_ref,
                dwk_ref, dwv_ref, dp_ref, dqin_ref, dkout_ref,
                dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, *scratch, kda: bool):  # fmt: skip
    q, k, v, g, beta = q_ref[...], k_ref[...], v_ref[...], g_ref[...], beta_ref[...]
    dwk, dwv, dp = dwk_ref[...], dwv_ref[...], dp_ref[...]
    dqin, dkout = dqin_ref[...], dkout_ref[...]
    t = chunk_terms(g, starts_ref[...], k.shape[1])
    eye = (t.rows == t.cols).astype(jnp.float32)

    def transpose(x):  # [C, C]
        return dot(eye, x, NT)

    # The forward, again: `scores` is A before the strict mask and beta.
    if kda:
        scores, _ = channel_scores(q, k, g, t.same, scratch[0])
    else:
        decay = gdn_decay(g, t)
        kk, qk = dot(k, k, NT), dot(q, k, NT)
        scores = kk * decay
    inverse = unit_lower_inverse(jnp.where(t.strict, scores, 0.0) * beta)
    inverse_t = transpose(inverse)
    k_start = jnp.where(t.reached, k * t.from_start, 0.0)
    r_k, r_v = k_start * beta, v * beta

    # Through the solve, then A = strict(beta scores).
    d_inverse = dot(dwk, r_k, NT) + dot(dwv, r_v, NT)
    dr_k, dr_v = dot(inverse_t, dwk), dot(inverse_t, dwv)
    da = jnp.where(t.strict, -dot(dot(inverse_t, d_inverse), inverse, NT), 0.0)
    d_scores = da * beta
    dbeta = jnp.sum(da * scores, axis=1, keepdims=True)
    dbeta += jnp.sum(dr_k * k_start, axis=1, keepdims=True)
    dbeta += jnp.sum(dr_v * v, axis=1, keepdims=True)
    dq = jnp.where(t.reached, dqin * t.from_start, 0.0)
    dk = jnp.where(t.reached, dr_k * t.from_start * beta, 0.0)
    dk += jnp.where(t.last, dkout * t.to_end, 0.0)
    # The decays from the chunk's start and to its end: G = tril(1) @ g,
    # G_C - G = triu(1, 1) @ g.
    lower_t = transpose(t.lower)
    d_start = jnp.where(t.reached, (dr_k * k * beta + dqin * q) * t.from_start, 0.0)
    d_end = jnp.where(t.last, dkout * k * t.to_end, 0.0)
    dg = dot(lower_t, d_start) + dot(t.strict.astype(jnp.float32), d_end)
    if kda:  # the pairs' decays, per channel
        dq_pairs, dk_pairs, dg_pairs = _channel_backward(q, k, d_scores, dp, scratch[0])
        dq, dk, dg = dq + dq_pairs, dk + dk_pairs, dg + dg_pairs
    else:  # through scores = K K^T D, P = Q K^T D and span = tril(1) @ (g * strict)
        dkk, dqk = d_scores * decay, dp * decay
        dq += dot(dqk, k)
        dk += dot(transpose(dqk), q) + dot(dkk + transpose(dkk), k)
        d_span = dot(lower_t, (d_scores * kk + dp * qk) * decay)
        dg = jnp.sum(dg, axis=1, keepdims=True)
        dg += jnp.sum(jnp.where(t.strict, d_span, 0.0), axis=1, keepdims=True)
    dq_ref[...] = dq
    dk_ref[...] = dk
    dv_ref[...] = dr_v * beta
    dg_ref[...] = dg
    dbeta_ref[...] = dbeta


def _channel_backward(q, k, d_scores, dp, decays_ref):
    """The cotangents of `q`, `k`, `g` `[C, dk]` through a KDA chunk's pair scores
    (`scores_tj = sum_c k_tc k_jc e_jtc`, `P_tj = sum_c q_tc k_jc e_jtc`, `e_j = exp(span_j)`
    kept by the forward walk), walking the key tokens `j` from the first: the spans' own
    recursion (`span_{j-1} = span_j + g_j` on rows `t >= j`) run backward, so each `g_j`
    gets the cotangents of every span it is in, summed as they arrive, with no difference
    of large terms."""
    size, dk = k.shape
    row = lax.broadcasted_iota(jnp.int32, (size, 1), 0)
    col = lax.broadcasted_iota(jnp.int32, (1, size), 1)

    def step(j, carry):
        dq, dk_, dg, adjoint = carry  # adjoint: the cotangent of span_{j-1}
        decays = decays_ref[j]
        pick, pick_col = row == j, col == j
        col_a = jnp.sum(jnp.where(pick_col, d_scores, 0.0), axis=1, keepdims=True)  # [C, 1]
        col_p = jnp.sum(jnp.where(pick_col, dp, 0.0), axis=1, keepdims=True)
        kd = row_of(k, pick) * decays
        d_kd = col_a * k + col_p * q
        dq = dq + col_p * kd
        dk_ = dk_ + col_a * kd + jnp.where(pick, jnp.sum(d_kd * decays, axis=0, keepdims=True), 0.0)
        carried = jnp.where(row >= j, adjoint, 0.0)  # span_{j-1} = span_j + g_j there
        dg = dg + jnp.where(pick, jnp.sum(carried, axis=0, keepdims=True), 0.0)
        return dq, dk_, dg, d_kd * kd + carried

    zeros = jnp.zeros((size, dk), jnp.float32)
    dq, dk_, dg, _ = lax.fori_loop(0, size, step, (zeros, zeros, zeros, zeros))
    return dq, dk_, dg


def intra_chunk_backward_kernel(size: int, interpret: Any, vmem: int, inputs, cotangents):
    """The backward kernel over every chunk.

    **Arguments:** `size` the chunk; `interpret` as the forward's; `vmem` the scoped VMEM
    limit; `inputs` `(q, k, v, g, beta, starts)` and `cotangents` of `(w_k, w_v, p, q_in,
    k_out)`, heads-major over the padded sequence, as `intra_chunk_kernel` takes and gives
    them.

    **Returns:** the cotangents of `q, k, v, g, beta`, float32, their layouts.
    """
    q, k, v, g, beta, starts = inputs
    b, h, s, dk = q.shape
    dv = v.shape[-1]

    def spec(width):
        return pl.BlockSpec((None, None, size, width), lambda bi, hi, ci: (bi, hi, ci, 0))

    starts_spec = pl.BlockSpec((None, None, size, 1), lambda bi, hi, ci: (bi, 0, ci, 0))
    operands = (*inputs, *cotangents)
    c = g.shape[-1]
    kda = c != 1
    in_specs = [spec(dk), spec(dk), spec(dv), spec(c), spec(1), starts_spec]
    in_specs += [spec(dk), spec(dv), spec(size), spec(dk), spec(dk)]
    widths = (dk, dk, dv, c, 1)
    n = s // size
    cost = pl.CostEstimate(
        flops=b * h * n * 2 * size * size * (8 * size + 9 * dk + 3 * dv + (8 * dk if kda else 0)),
        transcendentals=b * h * s * (size * (dk if kda else 1) + 2 * dk),
        bytes_accessed=4 * b * h * s * (8 * dk + 3 * dv + size + 5),
    )
    build = lambda interpret: pl.pallas_call(  # noqa: E731
        functools.partial(_bwd_kernel, kda=kda),
        grid=(b, h, n),
        in_specs=in_specs,
        out_specs=[spec(w) for w in widths],
        out_shape=[out_struct((b, h, s, w), jnp.float32, *operands) for w in widths],
        scratch_shapes=[pltpu.VMEM((size, size, dk), jnp.float32)] if kda else [],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel"), vmem_limit_bytes=vmem
        ),
        interpret=interpret,
        cost_estimate=cost,
        name="eqx_longctx_gated_delta_chunks_bwd",
    )
    return tuple(call_kernel(interpret, build, *operands))
