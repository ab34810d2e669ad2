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

import functools

import jax
import jax.numpy as jnp

from .._block_contract import AbstractBlockImpl as AbstractBlockImpl
from .._block_contract import BlockImpl as BlockImpl
from .._block_contract import BlockOptions as BlockOptions
from .._block_contract import PlatformChoice as PlatformChoice
from .._block_contract import pairs_are_empty as pairs_are_empty
from .._block_contract import pairs_are_full as pairs_are_full
from .._caches import on_clear_caches


def per_platform(impl: BlockImpl, fn, static, *args):
    """`fn(impl, static, *args)`; for a `PlatformChoice`, `fn` of each of its two
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
    if not isinstance(impl, PlatformChoice):
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


on_clear_caches(_jitted.cache_clear)


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


def apply_sinks(out, lse, sinks):
    """Attention sinks joined to merged partials: one learned logit per head (`sinks`,
    `[heads]`) added to every row's softmax denominator, with no value (GPT-OSS).

    With `lse' = logaddexp(lse, sink)` the output is `out * exp(lse - lse')`, that is
    `out * sigmoid(lse - sink)`, applied once after every partial result is merged, so
    every strategy and layout supports sinks unchanged. Differentiable: the gradient of
    `lse` reaches the block backward (`delta = rowsum(dout * out) - dlse`) and the sinks
    get theirs, summed over rows (and, under a mesh, over the devices holding them).

    **Returns:** `out` `[batch, seq, heads, v_head_dim]` in its dtype; rows that see no key
    stay 0.
    """
    weight = jax.nn.sigmoid(lse - sinks.astype(jnp.float32))
    return (out.astype(jnp.float32) * weight[..., None]).astype(out.dtype)


def block_attention(
    impl: BlockImpl, q, k, v, q_pos, kv_pos, q_seg, kv_seg, options
) -> tuple[jax.Array, jax.Array]:
    """Differentiable attention of `q` over one K/V block through `impl` (a block
    implementation, or a `PlatformChoice` of two); **returns**
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
