"""A Pallas TPU kernel for the gated delta rule's chunk work (Gated DeltaNet, Kimi Delta
Attention), beside its XLA twin (`_gated_delta_twin.py`).

**What is in the kernel.** One grid step is one chunk of one head of one batch row, grid
`(batch, heads, chunks)`, every axis "parallel": the work that does not depend on the state.
From the chunk's `q` (scaled), `k`, `v`, log decays `g`, `beta` and document starts it
writes the UT transform's solution `W_k`, `W_v` (the inverse of the unit lower-triangular
`C x C` matrix by forward substitution, then one MXU product per right-hand side), the
decayed `q`-`k` scores `P`, and the decayed `q_in`, `k_out` (see the twin's docstring for
the formulas). The prefix sums of the decays and the pair masks are products with `C x C`
triangles of ones on the MXU: the span `g_{j+1} + ... + g_t` of a GDN decay is
`tril(1) @ (g * (i > j))`, a sum of the g's themselves, never a difference of prefix sums.
A KDA decay is per key channel, so its `[C, C, dk]` spans are never held: the kernel walks
the key tokens `j` from the last to the first, each step adding one row of `g` to the
running spans `[C, dk]` (the same one-signed sums) and filling column `j` of `A` and `P`.

**What stays XLA.** The state scan (`_gated_delta_twin.scan_chunks`): per chunk three
`[C, dk] x [dk, dv]` products and one `[C, C] x [C, dv]` with the state, sequential over chunks
(differentiated by XLA; the chunk work's backward is a second kernel,
`_gated_delta_pallas_bwd.py`). The scan's residuals are the kernel's outputs (about 1.5x the
inputs at `dk = dv = 128`, `C = 64`) and one state per chunk.

**Blocks.** `q`, `k`, `q_in`, `k_out`, `W_k`: `(C, dk)`; `v`, `W_v`: `(C, dv)`; `P`:
`(C, C)`; `g`: `(C, dk)` or `(C, 1)`; `beta` `(C, 1)` and the starts `(C, 1)` (shared by
the heads). Every block's second-minor dim is the chunk (a multiple of 8) and its minor dim
the whole array's (a multiple of 128 at `dk = dv = 128`), as Mosaic asks. VMEM per grid
step (`gated_delta_vmem`) does not depend on the heads, the batch or the sequence.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._blocks import call_kernel
from ._operands import NUM_LANES, NUM_SUBLANES, out_struct
from ._vmem import VMEM_HEADROOM, MiB, VmemEstimate, vmem_budget

_NN = (((1,), (0,)), ((), ()))
NT = (((1,), (1,)), ((), ()))


def dot(a, b, dims=_NN):
    """A float32 matmul at `HIGHEST` precision (`dims`: `a @ b`, or `NT` for `a @ b^T`)."""
    return lax.dot_general(
        a, b, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


class Terms(NamedTuple):
    """What both kernels recompute of a chunk from its decays and document starts."""

    rows: jax.Array  # [C, C] int32 row index t
    cols: jax.Array  # [C, C] int32 column index j
    lower: jax.Array  # [C, C] float32, t >= j
    upper: jax.Array  # [C, C] float32, j > t
    strict: jax.Array  # [C, C] bool, t > j
    same: jax.Array  # [C, C] bool, j <= t in one document
    reached: jax.Array  # [C, 1] bool: no start in [0, t], the incoming state reaches t
    last: jax.Array  # [C, 1] bool: no start in (t, C-1], t writes the outgoing state
    from_start: jax.Array  # [C, dk] exp(g_0 + ... + g_t)
    to_end: jax.Array  # [C, dk] exp(g_{t+1} + ... + g_{C-1})


def chunk_terms(g, starts, dk: int) -> Terms:
    """The triangles, masks and decays of a chunk from `g` `[C, dk]` or `[C, 1]` and the
    starts `[C, 1]`: prefix sums and document counts are products with triangles of ones."""
    size = starts.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (size, size), 0)
    cols = lax.broadcasted_iota(jnp.int32, (size, size), 1)
    causal, strict = rows >= cols, rows > cols
    lower, upper = causal.astype(jnp.float32), (cols > rows).astype(jnp.float32)
    g = jnp.broadcast_to(g, (size, dk))
    wide = jnp.broadcast_to(starts, (size, NUM_LANES))
    return Terms(
        rows, cols, lower, upper, strict,
        same=causal & (dot(lower, starts * strict.astype(jnp.float32)) == 0.0),
        reached=dot(lower, wide)[:, :1] == 0.0,
        last=dot(upper, wide)[:, :1] == 0.0,
        from_start=jnp.exp(dot(lower, g)),
        to_end=jnp.exp(dot(upper, g)),
    )  # fmt: skip


def gdn_decay(g, t: Terms):
    """`exp(g_{j+1} + ... + g_t)` on pairs of one document (else 0) for a GDN `g` `[C, 1]`:
    the span is `tril(1) @ (g * (i > j))`, a sum of the g's themselves."""
    span = dot(t.lower, g * t.strict.astype(jnp.float32))
    return jnp.exp(jnp.where(t.same, span, -jnp.inf))


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, starts_ref,
            wk_ref, wv_ref, p_ref, qin_ref, kout_ref, *, kda: bool):  # fmt: skip
    q, k, v, beta = q_ref[...], k_ref[...], v_ref[...], beta_ref[...]
    t = chunk_terms(g_ref[...], starts_ref[...], k.shape[1])
    qin_ref[...] = jnp.where(t.reached, q * t.from_start, 0.0)
    kout_ref[...] = jnp.where(t.last, k * t.to_end, 0.0)
    if kda:
        a, p = channel_scores(q, k, g_ref[...], t.same)
    else:
        decay = gdn_decay(g_ref[...], t)
        a, p = dot(k, k, NT) * decay, dot(q, k, NT) * decay
    p_ref[...] = p
    a = jnp.where(t.strict, a, 0.0) * beta
    inverse = unit_lower_inverse(a)
    wk_ref[...] = dot(inverse, jnp.where(t.reached, k * t.from_start, 0.0) * beta)
    wv_ref[...] = dot(inverse, v * beta)


def row_of(x, pick):
    """Row `pick` (`[C, 1]` bool, one true) of `x` as `[1, d]`: a masked sum, exact."""
    return jnp.sum(jnp.where(pick, x, 0.0), axis=0, keepdims=True)


def channel_scores(q, k, g, same, decays_ref=None):
    """`A` (before the strict mask and `beta`) and `P` of a per-channel (KDA) decay, column
    by column from the last key token: `span[t] = g_{j+1} + ... + g_t` grows by one row of
    `g` per step. With `decays_ref` (`[C, C, dk]` VMEM) step `j` keeps its decays
    `exp(span)` `[C, dk]` at `decays_ref[j]`, for the backward."""
    size, dk = k.shape
    row = lax.broadcasted_iota(jnp.int32, (size, 1), 0)
    col = lax.broadcasted_iota(jnp.int32, (1, size), 1)
    same = same.astype(jnp.float32)

    def step(i, carry):
        a, p, span = carry
        j = size - 1 - i
        span = jnp.where(row > j, span + row_of(g, row == j + 1), 0.0)
        pick_col = col == j
        ok = jnp.sum(jnp.where(pick_col, same, 0.0), axis=1, keepdims=True) > 0.0  # [C, 1]
        decays = jnp.exp(jnp.where(ok, span, -jnp.inf))
        if decays_ref is not None:
            decays_ref[j] = decays
        kd = row_of(k, row == j) * decays
        a = jnp.where(pick_col, jnp.sum(k * kd, axis=1, keepdims=True), a)
        p = jnp.where(pick_col, jnp.sum(q * kd, axis=1, keepdims=True), p)
        return a, p, span

    zeros = jnp.zeros((size, size), jnp.float32)
    a, p, _ = lax.fori_loop(0, size, step, (zeros, zeros, jnp.zeros((size, dk), jnp.float32)))
    return a, p


def unit_lower_inverse(a):
    """`(I + a)^{-1}` for a strictly lower `a` `[C, C]`, by forward substitution on the
    identity: column `j` of `a` times the finished row `j` is taken off every later row
    (rows `<= j` get `a_tj = 0`). `[C, C]` per step, not `[C, dk + dv]`: the right-hand
    sides then take one MXU product each."""
    size = a.shape[0]
    row = lax.broadcasted_iota(jnp.int32, (size, 1), 0)
    col = lax.broadcasted_iota(jnp.int32, (1, size), 1)

    def step(j, inverse):
        a_j = jnp.sum(jnp.where(col == j, a, 0.0), axis=1, keepdims=True)  # [C, 1]
        return inverse - a_j * row_of(inverse, row == j)

    return lax.fori_loop(0, size, step, (row == col).astype(jnp.float32))


def _padded(rows: int, cols: int) -> int:
    """Bytes of a float32 `[rows, cols]` VMEM tile, padded to whole `(8, 128)` tiles."""
    return (-(-rows // NUM_SUBLANES) * NUM_SUBLANES) * (-(-cols // NUM_LANES) * NUM_LANES) * 4


def gated_delta_vmem(*, chunk: int, dk: int, dv: int, kda: bool, backward: bool = False
                     ) -> VmemEstimate:  # fmt: skip
    """VMEM of one grid step of the gated delta kernels (float32 throughout).

    **Arguments:** `chunk` the tokens per chunk; `dk`, `dv` the key and value head dims;
    `kda` whether the decay is per key channel; `backward` the backward kernel's instead
    of the forward's.

    **Returns:** a `VmemEstimate`: the blocks read and written, twice (Pallas
    double-buffers them), exact; the scratch (a KDA backward keeps every key token's
    decays, `[C, C, dk]`), exact; temporaries an estimate (Mosaic decides what
    stays live): the `[C, C]` triangles, masks, spans, scores and inverse (and their
    cotangents in the backward), and the `[C, dk]`, `[C, dv]` decayed rows and right-hand
    sides (KDA: the running spans and one decayed key per step, besides).
    """
    c = chunk
    ins = [_padded(c, dk)] * 2 + [_padded(c, dv), _padded(c, dk if kda else 1)]
    ins += [_padded(c, 1)] * 2
    outs = [_padded(c, dk)] * 3 + [_padded(c, dv), _padded(c, c)]
    square, key_rows, value_rows = 12, 6 + (4 if kda else 0), 3
    scratch = 0
    if backward:  # the outputs' cotangents come in, the inputs' go out
        ins, outs = ins + outs, [_padded(c, dk)] * 2 + [_padded(c, dv), ins[3], _padded(c, 1)]
        square, key_rows, value_rows = 22, 12 + (6 if kda else 0), 5
        scratch = c * _padded(c, dk) if kda else 0  # every key token's decays
    temporaries = square * _padded(c, c) + key_rows * _padded(c, dk) + value_rows * _padded(c, dv)
    return VmemEstimate(2 * (sum(ins) + sum(outs)), scratch, temporaries)


def check_gated_delta_kernel(chunk: int, dk: int, dv: int, kda: bool, budget=None) -> int:
    """**Returns:** the VMEM limit the kernel asks Mosaic for (`vmem_budget()`).

    **Raises:** `ValueError` when `chunk` is not a multiple of 8 (the TPU's sublane tile)
    or the estimate of one grid step passes `VMEM_HEADROOM` of the budget.
    """
    if chunk % NUM_SUBLANES:
        raise ValueError(
            f"impl='pallas' needs a chunk that is a multiple of {NUM_SUBLANES} (the TPU's "
            f"sublane tile: a chunk is the second-minor dim of every block); got chunk={chunk}. "
            "Use chunk=64 (the default), or impl='xla' for this chunk."
        )
    budget = vmem_budget() if budget is None else budget
    need = max(
        gated_delta_vmem(chunk=chunk, dk=dk, dv=dv, kda=kda, backward=backward).total
        for backward in (False, True)
    )
    if need > VMEM_HEADROOM * budget:
        raise ValueError(
            f"the gated delta kernel needs about {need / MiB:.1f} MiB of VMEM per grid step "
            f"at chunk={chunk}, dk={dk}, dv={dv} ({'KDA' if kda else 'GDN'}); "
            f"{VMEM_HEADROOM:.0%} of the budget is {VMEM_HEADROOM * budget / MiB:.1f} MiB "
            "(vmem_budget()). Use a smaller chunk (64), or impl='xla'."
        )
    return budget


def intra_chunk_kernel(q, k, v, g, beta, starts, *, size: int, interpret: Any):
    """The kernel over every chunk: heads-major inputs over a sequence padded to a multiple
    of `size` (`q`, `k` `[b, h, S, dk]`, `v` `[b, h, S, dv]`, `g` `[b, h, S, c]`, `beta`
    `[b, h, S, 1]`, `starts` `[b, 1, S, 1]` float32).

    **Returns:** `(w_k, w_v, p, q_in, k_out)`, heads-major, `p` `[b, h, S, size]`.
    """
    b, h, s, dk = q.shape
    dv, c = v.shape[-1], g.shape[-1]
    kda = c != 1
    vmem = check_gated_delta_kernel(size, dk, dv, kda)

    def spec(width):
        return pl.BlockSpec((None, None, size, width), lambda bi, hi, ci: (bi, hi, ci, 0))

    starts_spec = pl.BlockSpec((None, None, size, 1), lambda bi, hi, ci: (bi, 0, ci, 0))
    operands = (q, k, v, g, beta, starts)
    in_specs = [spec(dk), spec(dk), spec(dv), spec(c), spec(1), starts_spec]
    widths = (dk, dv, size, dk, dk)
    out_shape = [out_struct((b, h, s, w), jnp.float32, *operands) for w in widths]
    n = s // size
    flops = 2 * size * size * (3 * dk + dv + 4 * size) + (8 * size * size * dk if kda else 0)
    cost = pl.CostEstimate(
        flops=b * h * n * flops,
        transcendentals=b * h * s * (3 * dk + (size * dk if kda else size)),
        bytes_accessed=4 * b * h * s * (6 * dk + 2 * dv + size + c + 1),
    )
    build = lambda interpret: pl.pallas_call(  # noqa: E731
        functools.partial(_kernel, kda=kda),
        grid=(b, h, n),
        in_specs=in_specs,
        out_specs=[spec(w) for w in widths],
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel"), vmem_limit_bytes=vmem
        ),
        interpret=interpret,
        cost_estimate=cost,
        name="eqx_longctx_gated_delta_chunks",
    )
    return tuple(call_kernel(interpret, build, *operands))
