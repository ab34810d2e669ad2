"""Ring context parallelism: K/V blocks travel around the ring, queries stay put.

Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers" (arXiv:2310.01889).
Each of the `N` devices holds one query shard and one K/V shard. For `N` steps it attends its
queries to the K/V shard it currently holds and passes that shard (with its token positions
and segment ids) to the next device with `lax.ppermute`; the next shard's transfer is issued
before the current shard's compute so the two can overlap; K, V and their ids travel as one
array per dtype (`_pack.together`). Partial results merge by online
softmax in float32 (`merge_partials`: a log-add-exp that never forms `inf - inf`, so rows that see
no key stay exactly zero). Hops that the causal mask or disjoint segments leave empty are
skipped with `lax.cond`, not computed and zeroed.

The backward (`jax.custom_vjp`) runs the ring again: each device recomputes its block's
probabilities from the saved global logsumexp, keeps its query gradient, and sends float32
dK/dV accumulators around the ring with the K/V shard. The own shard's gradient stays home
and the accumulator starts on the next device, so it is home after `N-1` hops.
Communication: `N-1` K/V hops forward; `N-1` K/V hops and `N-1` dK/dV hops backward, the
theoretical minimum of a ring.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .._after import after
from .._types import AxisName
from ._block import (
    BlockImpl,
    BlockOptions,
    custom_vjps,
    merge_partials,
    pairs_are_empty,
    per_platform,
)
from ._pack import together


class _RingConfig(NamedTuple):
    axis: AxisName
    impl: BlockImpl  # the block function; which implementation, the ring cannot tell
    options: BlockOptions
    # expand(params, source) -> (k, v): how a travelling K/V source becomes keys and values.
    expand: Callable
    # Hops that can see anything (the own shard first); fewer than the ring's length when a
    # sliding window hides the shards further back (`_tiling_policy.ring_hops`). None: every hop.
    hops: int | None = None


def _kv_identity(params, source):
    return source


def ring_attention(
    q,
    k,
    v,
    positions,
    segment_ids,
    *,
    axis: AxisName,
    impl: BlockImpl,
    options: BlockOptions,
    hops: int | None = None,
):
    """Local shard of ring attention over mesh axis `axis` (call inside `shard_map`).

    **Arguments:**

    - `q`, `k`, `v`: this device's `[batch, seq/N, heads, dim]` shards.
    - `positions`: `[batch, seq/N]` original token indices of this shard's tokens.
    - `segment_ids`: `[batch, seq/N]` ints or `None`.
    - `impl`, `options`: the block implementation and the mask and scale.
    - `hops`: how many hops can see anything (`None`: all `N`).

    **Returns:** `(out, lse)`: this shard's attention output (`q`'s dtype) and float32
    logsumexp.
    """
    return ring_latent_attention(
        q, (k, v), _kv_identity, (), positions, segment_ids, axis=axis, impl=impl,
        options=options, hops=hops,
    )  # fmt: skip


def ring_latent_attention(
    q,
    source,
    expand,
    params,
    positions,
    segment_ids,
    *,
    axis: AxisName,
    impl: BlockImpl,
    options: BlockOptions,
    hops: int | None = None,
):
    """Ring attention where what travels is a K/V *source* (e.g. MLA's compressed latent).

    Each hop rebuilds its keys and values locally with `expand(params, source)`; the
    backward pulls their gradients back through `expand`, so the float32 accumulators that
    travel home are source-sized too, and the gradient of `params` stays on the device.

    **Arguments:**

    - `q`: this device's `[batch, seq/N, heads, dim]` queries.
    - `source`: a pytree of `[batch, seq/N, ...]` arrays (this device's tokens).
    - `expand`: `expand(params, source) -> (k, v)`, differentiable.
    - `params`: a pytree of arrays `expand` uses (replicated).
    - `positions`, `segment_ids`, `impl`, `options`, `hops`: as in `ring_attention`.

    **Returns:** `(out, lse)`: this shard's attention output (`q`'s dtype) and float32
    logsumexp (differentiable: its cotangent reaches the backward's `delta`).
    """
    config = _RingConfig(axis, impl, options, expand, hops)
    fn = _ring if config.impl.pure_forward else _ring_effects
    return fn(config, q, params, source, positions, segment_ids)


def _hop_is_empty(config: _RingConfig, q_pos, kv_pos, q_seg, kv_seg):
    return pairs_are_empty(config.options, q_pos, kv_pos, q_seg, kv_seg)


def _shift(tree, axis: AxisName, by: int = 1):
    n = lax.axis_size(axis)
    perm = [(i, (i + by) % n) for i in range(n)]
    return together(tree, lambda x: lax.ppermute(x, axis, perm))


def _hops(config: _RingConfig) -> int:
    n = lax.axis_size(config.axis)
    return n if config.hops is None else min(config.hops, n)


def _zeros_f32(tree):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)


def _ring_primal(config, q, params, source, positions, segment_ids):
    return _ring_forward(config, q, params, source, positions, segment_ids)


def _query_tiles(config, q, positions, segment_ids, k_shape):
    return config.impl.tile_queries(q, positions, segment_ids, k_shape, config.options)


def _ring_forward(config, *args):
    return per_platform(config.impl, _ring_forward_one, config, *args)


def _ring_forward_one(impl, config, q, params, source, positions, segment_ids):
    config = config._replace(impl=impl)  # the side `per_platform` runs
    # Queries are tiled once; the merged output and logsumexp stay block-major until the end.
    k0, v0 = jax.eval_shape(config.expand, params, source)
    qt = _query_tiles(config, q, positions, segment_ids, k0)

    def attend(acc, shard):
        out, lse = acc
        src_j, pos_j, seg_j = shard

        def compute(acc):
            k_j, v_j = config.expand(params, src_j)
            block_out, block_lse = config.impl.attend(qt, k_j, v_j, pos_j, seg_j)
            return merge_partials(out, lse, block_out, block_lse)

        empty = _hop_is_empty(config, positions, pos_j, segment_ids, seg_j)
        return lax.cond(empty, lambda acc: acc, compute, acc)

    def step(carry, _):
        acc, shard = carry
        incoming = _shift(shard, config.axis)  # issued before this hop's compute
        return (attend(acc, shard), incoming), None

    rows = qt.rows
    acc0 = (
        jnp.zeros((*rows, v0.shape[-1]), jnp.float32),
        jnp.full(rows, -jnp.inf, jnp.float32),
    )
    shard0 = (source, positions, segment_ids)
    (acc, last), _ = lax.scan(step, (acc0, shard0), None, length=_hops(config) - 1)
    out, lse = attend(acc, last)
    return qt.merge_q(out).astype(q.dtype), qt.merge_rows(lse)


def _ring_fwd(config, q, params, source, positions, segment_ids):
    out, lse = _ring_forward(config, q, params, source, positions, segment_ids)
    return (out, lse), (q, params, source, positions, segment_ids, out, lse)


def _ring_bwd(config, residuals, cotangents):
    return per_platform(config.impl, _ring_bwd_one, config, residuals, cotangents)


def _ring_bwd_one(impl, config, residuals, cotangents):
    config = config._replace(impl=impl)  # the side `per_platform` runs
    q, params, source, positions, segment_ids, out, lse = residuals
    dout, dlse = cotangents
    delta = jnp.einsum("bshv,bshv->bsh", dout.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - dlse.astype(jnp.float32)
    # The query side is tiled once; the query gradient accumulates block-major over the hops.
    k0, _ = jax.eval_shape(config.expand, params, source)
    qt = _query_tiles(config, q, positions, segment_ids, k0)
    dout = qt.split_q(dout.astype(q.dtype))
    lse, delta = qt.split_rows(lse), qt.split_rows(delta)

    def grads(dq, dparams, shard, acc):
        src_j, pos_j, seg_j = shard

        def compute(operands):
            dq, dparams, acc = operands
            (k_j, v_j), expand_vjp = jax.vjp(config.expand, params, src_j)
            dq, dk_j, dv_j = config.impl.attend_backward(
                qt, k_j, v_j, pos_j, seg_j, dout, lse, delta, dq
            )
            dparams_j, dsrc_j = expand_vjp((dk_j.astype(k_j.dtype), dv_j.astype(v_j.dtype)))
            add = lambda a, b: a + b.astype(jnp.float32)  # noqa: E731
            return (
                dq,
                jax.tree.map(add, dparams, dparams_j),
                jax.tree.map(add, acc, dsrc_j),
            )

        empty = _hop_is_empty(config, positions, pos_j, segment_ids, seg_j)
        return lax.cond(empty, lambda x: x, compute, (dq, dparams, acc))

    def step(carry, _):
        dq, dparams, shard, acc = carry
        incoming = _shift(shard, config.axis)
        dq, dparams, acc = grads(dq, dparams, shard, acc)
        return (dq, dparams, incoming, _shift(acc, config.axis)), None

    hops = _hops(config)
    # Under remat the forward is recomputed just before this, and its loop of hops could run
    # beside this first hop (`eqx_longctx._after`), so the hop waits for its logsumexp. With
    # 2 hops the forward has no loop, and XLA merges its one shift with this one.
    own = (source, after(positions, lse) if hops > 2 else positions, segment_ids)
    if hops > 1:
        incoming = _shift(own, config.axis)  # in flight while the own shard is computed
    # The own shard's dK/dV stay home; the travelling accumulator starts one device to the
    # right, so on a full ring it is home again after N-1 hops, not N. A ring cut short by
    # a window sends it home in one jump back.
    dq, dparams, home = grads(qt.zeros_dq(), _zeros_f32(params), own, _zeros_f32(source))
    dsource = home
    if hops > 1:
        carry0 = (dq, dparams, incoming, _zeros_f32(source))
        (dq, dparams, last, acc), _ = lax.scan(step, carry0, None, length=hops - 2)
        dq, dparams, acc = grads(dq, dparams, last, acc)
        dsource = jax.tree.map(jnp.add, home, _shift(acc, config.axis, by=1 - hops))
    cast = lambda g, x: g.astype(x.dtype)  # noqa: E731
    return (
        qt.dq(dq).astype(q.dtype),
        jax.tree.map(cast, dparams, params),
        jax.tree.map(cast, dsource, source),
        None,
        None,
    )


_ring, _ring_effects = custom_vjps(_ring_primal, _ring_fwd, _ring_bwd, (0,))
