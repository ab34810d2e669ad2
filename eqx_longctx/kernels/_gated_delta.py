"""The gated delta rule with its chunk work in Pallas TPU kernels: the op that ties the
forward kernel (`_gated_delta_pallas.py`), the backward kernel (`_gated_delta_pallas_bwd.py`) and
the state scan in XLA (`_gated_delta_twin.py`) together under one custom VJP of the chunk
work.
"""

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ._gated_delta_pallas import check_gated_delta_kernel, intra_chunk_kernel
from ._gated_delta_pallas_bwd import intra_chunk_backward_kernel
from ._gated_delta_twin import by_chunk, scan_chunks
from ._operands import NUM_SUBLANES


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _intra(size, interpret, q, k, v, g, beta, starts):
    return intra_chunk_kernel(q, k, v, g, beta, starts, size=size, interpret=interpret)


def _intra_fwd(size, interpret, *inputs):
    return _intra(size, interpret, *inputs), inputs


def _intra_bwd(size, interpret, inputs, cotangents):
    q, v, g = inputs[0], inputs[2], inputs[3]
    vmem = check_gated_delta_kernel(size, q.shape[-1], v.shape[-1], g.shape[-1] != 1)
    return (*intra_chunk_backward_kernel(size, interpret, vmem, inputs, cotangents), None)


_intra.defvjp(_intra_fwd, _intra_bwd)


def pallas_chunk_gated_delta(
    q, k, v, g, beta, starts, initial_state, *, scale: float, chunk: int, interpret: Any = None
):  # fmt: skip
    """The gated delta rule over a sequence with the chunk work in the Pallas kernel: the
    contract of the XLA path's `chunk_gated_delta` (`eqx_longctx/linear/_chunked.py`).

    **Arguments:**

    - `q`, `k` `[batch, seq, heads, dk]`, `v` `[batch, seq, heads, dv]`, `g`
      `[batch, seq, heads]` (GDN) or `[batch, seq, heads, dk]` (KDA), `beta`
      `[batch, seq, heads]`, `initial_state` `[batch, heads, dk, dv]`: float32, trusted.
    - `starts`: `[batch, seq]` bool, `True` where the state before the token is dropped.
    - `scale`: the factor on `q`.
    - `chunk`: tokens per chunk, a multiple of 8 (a sequence shorter than it runs one
      chunk of its length rounded up to 8); the sequence is padded with tokens that
      change nothing.
    - `interpret`: `None` compiles the kernel for a TPU and interprets it on any other
      platform, chosen for the platform the program is lowered for; `True`, `False` or a
      `pltpu.InterpretParams` as for `pallas_call`.

    **Returns:** `(out [batch, seq, heads, dv], final_state [batch, heads, dk, dv])`,
    float32. Differentiable: the chunk work's backward is the backward kernel, the scan's
    XLA's autodiff.

    **Raises:** `ValueError` as `check_gated_delta_kernel`.
    """
    b, s, h, dk = q.shape
    check_gated_delta_kernel(chunk, dk, v.shape[-1], g.ndim == 4)
    size = min(chunk, -(-s // NUM_SUBLANES) * NUM_SUBLANES)
    n = -(-s // size)
    pad = n * size - s
    if g.ndim == 3:
        g = g[..., None]

    def heads_major(x):  # [b, s, h, ...] -> [b, h, n * size, ...], zero-padded
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.swapaxes(x, 1, 2)

    flags = jnp.pad(starts, [(0, 0), (0, pad)])
    starts_f = flags.astype(jnp.float32)[:, None, :, None]  # [b, 1, S, 1], shared by heads
    inputs = (heads_major(q * scale), heads_major(k), heads_major(v), heads_major(g),
              heads_major(beta[..., None]), starts_f)  # fmt: skip
    parts = _intra(size, interpret, *inputs)
    # The decay of a whole chunk, where no document starts in it (else the state is dropped).
    whole = jnp.exp(jnp.sum(by_chunk(inputs[3], size), axis=3))  # [n, b, h, c]
    fresh = jnp.any(flags.reshape(b, n, size), axis=-1).T[:, :, None, None]  # [n, b, 1, 1]
    kept = jnp.where(fresh, 0.0, whole)
    out, final_state = scan_chunks(parts, kept, initial_state, size)
    return jnp.swapaxes(out, 1, 2)[:, :s], final_state


class PallasGatedDeltaImpl(eqx.Module):
    """The gated delta rule's chunk work on the Pallas TPU kernel: what
    `eqx_longctx.gated_delta_rule(..., impl="pallas")` runs (`impl=PallasGatedDeltaImpl(...)`
    sets the interpreter).

    **Arguments:**

    - `interpret`: `None` (the default) compiles the kernel for a TPU and runs Pallas'
      interpreter on any other platform, chosen for the platform the program is lowered
      for; `False` always compiles; `True` or a `pltpu.InterpretParams` interprets (see
      `race_detecting_interpret`).
    """

    interpret: Any = eqx.field(static=True, default=None)

    def check(self, *, chunk: int, dk: int, dv: int, kda: bool) -> None:
        """Eager validation of a call: `check_gated_delta_kernel`.

        **Raises:** `ValueError` naming the rule, the values and the fix."""
        check_gated_delta_kernel(chunk, dk, dv, kda)

    def __call__(self, q, k, v, g, beta, starts, initial_state, *, scale: float, chunk: int):
        """`pallas_chunk_gated_delta` with this `interpret`."""
        return pallas_chunk_gated_delta(
            q, k, v, g, beta, starts, initial_state,
            scale=scale, chunk=chunk, interpret=self.interpret,
        )  # fmt: skip
