"""The block-attention contract: what a block implementation (the XLA loop in
`eqx_longctx/attention/_local.py`, the Pallas kernels in `eqx_longctx/kernels/`, or a third
one) is, and the mask options every call carries.

It sits on the floor, below both `attention/` (the strategies that call the contract and
the differentiable wrapper around it, `attention/_block.py`) and `kernels/` (which
implement it), so neither imports the other's private modules. The contract itself is
described in `attention/_block.py`'s module docstring.
"""

import abc
from typing import NamedTuple

import equinox as eqx
import jax.numpy as jnp
import numpy as np


class BlockOptions(NamedTuple):
    """The mask, scale and score cap of an attention call (static).

    - `window`: query `i` sees key `j` only if `i - j < window` (with `causal`).
    - `softcap`: scaled scores `x` become `softcap * tanh(x / softcap)` before the softmax
      (Gemma 2), inside the block; the merge of partials is unchanged.
    - `chunk`: query `i` sees key `j` only if `i // chunk == j // chunk` (Llama 4's
      chunked attention, by token position; with `causal`).
    """

    causal: bool
    window: int | None
    scale: float
    softcap: float | None = None
    chunk: int | None = None

    @staticmethod
    def make(causal, window, scale, head_dim: int, softcap=None, chunk=None) -> "BlockOptions":
        scale = 1.0 / float(np.sqrt(head_dim)) if scale is None else float(scale)
        return BlockOptions(
            bool(causal),
            None if window is None else int(window),
            scale,
            None if softcap is None else float(softcap),
            None if chunk is None else int(chunk),
        )

    @property
    def reach(self) -> int | None:
        """How far back (in positions) a query can see, or `None` (unbounded): `window - 1`
        and `chunk - 1` bound it; what a neighbour exchange must bring."""
        bounds = [n - 1 for n in (self.window, self.chunk) if n is not None]
        return min(bounds) if bounds else None


class AbstractBlockImpl(eqx.Module):
    """A block-attention implementation (see the module docstring for the contract)."""

    @property
    def pure_forward(self) -> bool:
        """Whether `attend` has no side effects, so that under `jax.checkpoint` the custom
        VJPs may recompute it whole (`optimize_remat`). Override with `False` for a forward
        with callbacks (Pallas' TPU interpret mode with its race detector)."""
        return True

    @property
    def splits_zigzag_halves(self) -> bool:
        """Whether a strategy whose call is made of whole zig-zag shards splits it into its
        causal halves for this implementation (`_halves.py`: 3/4 of the score pairs, in two
        calls of half the queries each). `False` here: an implementation that pads queries to
        whole blocks (the Pallas kernels, to 128 rows) may lose more than the split saves."""
        return False

    @abc.abstractmethod
    def tile_queries(self, q, positions, segment_ids, kv_like, options: BlockOptions):
        """**Returns:** the tiled query side (`qt`)."""

    @abc.abstractmethod
    def attend(self, qt, k, v, kv_positions, kv_segment_ids):
        """**Returns:** `(out, lse)` of `qt` against this K/V block, native layout."""

    @abc.abstractmethod
    def attend_backward(self, qt, k, v, kv_positions, kv_segment_ids, dout, lse, delta, dq):
        """**Returns:** `(dq, dk, dv)`: the accumulator and this block's float32 dK, dV."""

    def attend_heads_major(self, qt, k, v, kv_positions, kv_segment_ids):
        """`attend` with K/V heads-major, `[batch, kv_heads, kv_seq, dim]` (the KV cache's
        layout). The default swaps them and calls `attend`; an implementation that reads
        heads-major K/V natively overrides it (both of ours do).

        **Returns:** `(out, lse)` as `attend`.
        """
        swap = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
        return self.attend(qt, swap(k), swap(v), kv_positions, kv_segment_ids)


def pairs_are_empty(options: BlockOptions, q_pos, kv_pos, q_seg, kv_seg):
    """True when no query sees any key, for every batch row, judged from `[batch, n]` ranges
    of positions and segment ids alone (the rule that skips blocks and ring hops)."""
    empty = jnp.zeros(q_pos.shape[:1], bool)
    if options.causal:
        empty = empty | (q_pos.max(-1) < kv_pos.min(-1))
    if options.window is not None:  # every key at least `window` before every query
        empty = empty | (q_pos.min(-1) - kv_pos.max(-1) >= options.window)
    if options.chunk is not None:  # every key in a chunk before every query's (or after)
        c = options.chunk
        empty = empty | (q_pos.min(-1) // c > kv_pos.max(-1) // c)
        empty = empty | (q_pos.max(-1) // c < kv_pos.min(-1) // c)
    if q_seg is not None and kv_seg is not None:
        disjoint = (q_seg.max(-1) < kv_seg.min(-1)) | (q_seg.min(-1) > kv_seg.max(-1))
        empty = empty | disjoint
    return jnp.all(empty)


def pairs_are_full(options: BlockOptions, q_pos, kv_pos, q_seg, kv_seg):
    """True when every query sees every key, for every batch row, judged from `[batch, n]`
    ranges alone (the rule that drops the mask); the twin of `pairs_are_empty`."""
    full = jnp.ones(q_pos.shape[:1], bool)
    if options.causal:
        full = full & (q_pos.min(-1) >= kv_pos.max(-1))
    if options.window is not None:
        full = full & (q_pos.max(-1) - kv_pos.min(-1) < options.window)
    if options.chunk is not None:  # every query and every key in one chunk
        c = options.chunk
        full = full & (q_pos.min(-1) // c == kv_pos.max(-1) // c)
        full = full & (q_pos.max(-1) // c == kv_pos.min(-1) // c)
    if q_seg is not None and kv_seg is not None:
        one = q_seg.min(-1) == q_seg.max(-1)
        same = (kv_seg.min(-1) == q_seg.min(-1)) & (kv_seg.max(-1) == q_seg.min(-1))
        full = full & one & same
    return jnp.all(full)


class PlatformChoice(eqx.Module):
    """Two block implementations, the one for the platform the program is lowered for
    chosen then (`jax.lax.platform_dependent`): `tpu` on a TPU, `default` anywhere else.
    What `impl="auto"` resolves to for a program traced on a host that is not a TPU (see
    `resolve_block_impl`), so that a TPU program exported from it carries the Pallas
    kernels while the host runs the XLA path.

    It is not itself a block implementation: the choice is made inside the custom VJPs
    (`block_attention`'s and the ring's, `attention/_block.py`) and around the zig-zag
    halves, about a whole forward or backward (`per_platform`), so autodiff never traces
    through it. A caller
    that drives the contract's methods block by block, like decoding, resolves `"auto"` by
    the host instead (`resolve_block_impl(..., lowering=False)`).
    """

    tpu: AbstractBlockImpl = eqx.field(static=True)
    default: AbstractBlockImpl = eqx.field(static=True)

    @property
    def pure_forward(self) -> bool:
        """Whether both sides' forwards are free of side effects (see
        `AbstractBlockImpl.pure_forward`)."""
        return self.tpu.pure_forward and self.default.pure_forward


BlockImpl = AbstractBlockImpl | PlatformChoice
"""What a strategy runs its blocks through: one block implementation, or a
`PlatformChoice` of two (see `eqx_longctx.attention.resolve_block_impl`)."""
