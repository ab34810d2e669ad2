"""The block-attention contract every strategy calls, and its one differentiable wrapper.

A *block implementation* (`AbstractBlockImpl`) attends tiled queries to one K/V block given
token positions and segment ids, and returns `(out, logsumexp)` partials that merge by
online softmax; its backward recomputes from a given (global) logsumexp. Strategies only
ever call these methods, so swapping the implementation (the XLA loop in `_local.py`, the
Pallas TPU kernels in `eqx_longctx/kernels/`, or a third one) never touches a strategy:

- `tile_queries(q, positions, segment_ids, kv_like, options) -> qt`: the query side, tiled
  once in the implementation's native layout (`qt.split_q`, `qt.split_rows`, `qt.merge_q`,
  `qt.merge_rows`, `qt.rows`, `qt.zeros_dq()`, `qt.dq(acc)` convert to and from it);
- `attend(qt, k, v, kv_positions, kv_segment_ids) -> (out, lse)`: native layout, float32 lse
  (`-inf` for rows that see no key of the block); `attend_heads_major` is the same with K/V
  `[batch, kv_heads, kv_seq, dim]` (how decoding reads the KV cache);
- `attend_backward(qt, k, v, kv_positions, kv_segment_ids, dout, lse, delta, dq) ->
  (dq, dk, dv)`: `lse` is the row's logsumexp over *all* keys it sees and `delta =
  rowsum(dout * out) - dlse`, so `dk`, `dv` (float32, `[batch, kv_seq, kv_heads, dim]`) are
  this block's whole contribution and the query gradient is added to the accumulator `dq`.

`block_attention` is the differentiable single-block call built on those methods (what
all-gather, Ulysses and the public `flash_attention` run); the ring drives the methods hop
by hop under its own `custom_vjp`.
"""

import abc
import functools
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._sharding import IMPLS


class BlockOptions(NamedTuple):
    """The mask and scale of an attention call (static)."""

    causal: bool
    window: int | None
    scale: float

    @staticmethod
    def make(causal, window, scale, head_dim: int) -> "BlockOptions":
        scale = 1.0 / float(np.sqrt(head_dim)) if scale is None else float(scale)
        return BlockOptions(bool(causal), None if window is None else int(window), scale)


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
    if q_seg is not None and kv_seg is not None:
        one = q_seg.min(-1) == q_seg.max(-1)
        same = (kv_seg.min(-1) == q_seg.min(-1)) & (kv_seg.max(-1) == q_seg.min(-1))
        full = full & one & same
    return jnp.all(full)


class PerPlatform(AbstractBlockImpl):
    """Two implementations, the one for the platform the program is lowered for chosen then
    (`jax.lax.platform_dependent`): `tpu` on a TPU, `default` anywhere else. What
    `impl="auto"` is on a host that is not a TPU, so that a TPU program exported from it
    carries the Pallas kernels.

    The choice is made inside the custom VJPs (`block_attention`'s and the ring's), around
    a whole forward or backward, so autodiff never traces through it; the per-block methods
    themselves are not for calling (a caller that drives them, like decoding, resolves
    `"auto"` by the host instead).
    """

    tpu: AbstractBlockImpl = eqx.field(static=True)
    default: AbstractBlockImpl = eqx.field(static=True)

    @property
    def pure_forward(self) -> bool:
        return self.tpu.pure_forward and self.default.pure_forward

    def _no(self, *args):
        raise NotImplementedError(
            "PerPlatform chooses its implementation around a whole forward or backward "
            "(per_platform); call the methods of .tpu or .default."
        )

    tile_queries = attend = attend_backward = _no  # pyright: ignore[reportAssignmentType]


def per_platform(impl: AbstractBlockImpl, fn, static, *args):
    """`fn(impl, static, *args)`; for a `PerPlatform` impl, `fn` of each of its two
    implementations staged out with `jax.lax.platform_dependent`, which keeps the one the
    program is lowered for.

    `fn` is a module-level function and `static` a hashable value (the options, the ring's
    configuration): each side is a `jax.jit` of them, made once per `(fn, impl, static)`,
    so JAX traces it once per input shapes and reuses the trace wherever they recur (every
    layer of a planner's pass, remat, the next program of the same shapes). The TPU side
    is only ever dropped at lowering on another host, yet tracing its kernels afresh was
    half of what an attention call cost to trace on a CPU. The nested `jit` is inlined
    when compiled: the program is the same.
    """
    if not isinstance(impl, PerPlatform):
        return fn(impl, static, *args)
    return jax.lax.platform_dependent(
        *args, tpu=_staged(fn, impl.tpu, static), default=_staged(fn, impl.default, static)
    )


def _staged(fn, impl: AbstractBlockImpl, static):
    """`jax.jit` of `fn(impl, static, *args)`, one per key; `fn` itself when the key cannot
    be hashed (a configuration holding a list, say), which costs a trace per call, never a
    wrong result."""
    try:
        return _jitted(fn, impl, static)
    except TypeError:  # unhashable: lru_cache refuses the key
        return functools.partial(fn, impl, static)


@functools.lru_cache(maxsize=256)
def _jitted(fn, impl: AbstractBlockImpl, static):
    return jax.jit(functools.partial(fn, impl, static))


def merge_partials(out, lse, block_out, block_lse):
    """Combine two softmax partials `(out, lse)` over disjoint key sets into one (float32,
    -inf safe): the online-softmax merge the ring, USP and decoding share."""
    new = jnp.logaddexp(lse, block_lse)
    # Only rows that have seen no key yet (-inf) are special; NaN and +inf propagate.
    empty = new == -jnp.inf
    safe = jnp.where(empty, 0.0, new)
    w_old = jnp.where(empty, 0.0, jnp.exp(lse - safe))[..., None]
    w_new = jnp.where(empty, 0.0, jnp.exp(block_lse - safe))[..., None]
    return w_old * out + w_new * block_out.astype(jnp.float32), new


def block_attention(
    impl: AbstractBlockImpl, q, k, v, q_pos, kv_pos, q_seg, kv_seg, options
) -> tuple[jax.Array, jax.Array]:
    """Differentiable attention of `q` over one K/V block through `impl`; **returns**
    `(out, lse)` in the usual layouts (`[batch, seq, heads, v_head_dim]` in `q`'s dtype and
    float32 `[batch, seq, heads]`). The backward honours the cotangent of `lse`."""
    fn = _block_attention if impl.pure_forward else _block_attention_effects
    out = fn(impl, options, q, k, v, q_pos, kv_pos, q_seg, kv_seg)
    return out  # pyright: ignore[reportReturnType]  (custom_vjp typing)


def _primal(impl, options, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    return _forward(impl, options, q, k, v, q_pos, kv_pos, q_seg, kv_seg)


def _forward(impl, options, *args):
    return per_platform(impl, _forward_one, options, *args)


def _forward_one(impl, options, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    qt = impl.tile_queries(q, q_pos, q_seg, k, options)
    out, lse = impl.attend(qt, k, v, kv_pos, kv_seg)
    return qt.merge_q(out).astype(q.dtype), qt.merge_rows(lse)


def _fwd(impl, options, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    out, lse = _forward(impl, options, q, k, v, q_pos, kv_pos, q_seg, kv_seg)
    return (out, lse), (q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse)


def _bwd(impl, options, residuals, cotangents):
    return per_platform(impl, _bwd_one, options, residuals, cotangents)


def _bwd_one(impl, options, residuals, cotangents):
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse = residuals
    dout, dlse = cotangents
    # d(loss)/d(score) = p * (dp - delta) with delta = rowsum(dout * out) - dlse.
    delta = jnp.einsum("bshv,bshv->bsh", dout.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - dlse.astype(jnp.float32)
    qt = impl.tile_queries(q, q_pos, q_seg, k, options)
    dq, dk, dv = impl.attend_backward(
        qt, k, v, kv_pos, kv_seg, qt.split_q(dout.astype(q.dtype)), qt.split_rows(lse),
        qt.split_rows(delta), qt.zeros_dq(),
    )  # fmt: skip
    cast = lambda g, x: g.astype(x.dtype)  # noqa: E731
    return cast(qt.dq(dq), q), cast(dk, k), cast(dv, v), None, None, None, None


def custom_vjps(primal, fwd, bwd, nondiff_argnums: tuple[int, ...]):
    """**Returns:** `(pure, effects)`: `primal` with the custom VJP `(fwd, bwd)` twice.

    `pure` sets `optimize_remat`: under `jax.checkpoint` (LayerStack remat dots/full/offload)
    JAX would otherwise partially evaluate the forward's loops over head tiles and blocks
    and store every block's scores, O(seq^2) (4 heads in 4 tiles at 8K tokens: 413 MiB of
    temporaries against 59 MiB); with it the forward rule is recomputed whole in the
    backward pass. JAX refuses that for a forward with side effects: `effects` is the plain
    rule, for an impl whose `pure_forward` is `False`.
    """
    pure = jax.custom_vjp(primal, nondiff_argnums=nondiff_argnums)
    pure.defvjp(fwd, bwd, optimize_remat=True)
    effects = jax.custom_vjp(primal, nondiff_argnums=nondiff_argnums)
    effects.defvjp(fwd, bwd)
    return pure, effects


_block_attention, _block_attention_effects = custom_vjps(_primal, _fwd, _bwd, (0, 1))


def resolve_impl(impl, platform: str):
    """`"auto"` is `"pallas"` on TPU and `"xla"` elsewhere; **returns** the name to run, or
    `impl` itself when it is an `AbstractBlockImpl` (a third implementation plugs in so)."""
    if isinstance(impl, AbstractBlockImpl):
        return impl
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(
            f"impl must be one of {IMPLS} or an AbstractBlockImpl; got impl={impl!r}. 'auto' "
            "runs the Pallas kernels on TPU and the XLA path elsewhere."
        )
    if impl == "auto":
        return "pallas" if platform == "tpu" else "xla"
    return impl
