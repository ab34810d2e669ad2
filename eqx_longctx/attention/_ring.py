"""Ring context parallelism: K/V blocks travel around the ring, queries stay put.

Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers" (arXiv:2310.01889).
Each of the `N` devices holds one query shard and one K/V shard. For `N` steps it attends its
queries to the K/V shard it currently holds and passes that shard (with its token positions
and segment ids) to the next device with `lax.ppermute`; the next shard's transfer is issued
before the current shard's compute so the two can overlap; K, V and their ids travel as one
array per dtype (`_pack.together`). Partial results merge by online
softmax in float32 (`merge_partials`: a log-add-exp that never forms `inf - inf`, so rows that see
no key stay exactly zero). Hops that the causal mask or disjoint segments leave empty are
skipped with `lax.switch`, not computed and zeroed. Under a causal zig-zag layout of short
chunks the queries are two groups, the early and the late half, and each hop makes the
calls its kind needs (`_halves.RING_PLANS`): 3/4 of the pairs on the own hop, 1/2 on every
other one (on a plain ring; 3/4 each where a device holds several shards, as under USP).

The backward (`jax.custom_vjp`) runs the ring again: each device recomputes its block's
probabilities from the saved global logsumexp, keeps its query gradient, and sends float32
dK/dV accumulators around the ring with the K/V shard. The own shard's gradient stays home
and the accumulator starts on the next device, so it is home after `N-1` hops.
Communication: `N-1` K/V hops forward; `N-1` K/V hops and `N-1` dK/dV hops backward, the
theoretical minimum of a ring.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .._types import AxisName
from ._block import (
    AbstractBlockImpl,
    BlockOptions,
    custom_vjps,
    merge_partials,
    pairs_are_empty,
    per_platform,
)
from ._halves import ALL, EARLY, NOTHING, OWN, RING_PLANS, half, join, ring_hop_kind
from ._pack import together


class _RingConfig(NamedTuple):
    axis: AxisName
    impl: AbstractBlockImpl  # the block function; which implementation, the ring cannot tell
    options: BlockOptions
    # expand(params, source) -> (k, v): how a travelling K/V source becomes keys and values.
    expand: Callable
    # Hops that can see anything (the own shard first); fewer than the ring's length when a
    # sliding window hides the shards further back (`_tiling_policy.ring_hops`). None: every hop.
    hops: int | None = None
    # Zig-zag's causal halves (`_halves.py`): queries in two groups, each hop's calls by its
    # kind (`_halves.RING_PLANS`), where the implementation splits them (`_on`).
    halves: bool = False
    # Whole zig-zag shards each device holds (USP: the Ulysses degree, after its all-to-all).
    shards: int = 1


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
    impl: AbstractBlockImpl,
    options: BlockOptions,
    hops: int | None = None,
    halves: bool = False,
    shards: int = 1,
):
    """Local shard of ring attention over mesh axis `axis` (call inside `shard_map`).

    **Arguments:**

    - `q`, `k`, `v`: this device's `[batch, seq/N, heads, dim]` shards.
    - `positions`: `[batch, seq/N]` original token indices of this shard's tokens.
    - `segment_ids`: `[batch, seq/N]` ints or `None`.
    - `impl`, `options`: the block implementation and the mask and scale.
    - `hops`: how many hops can see anything (`None`: all `N`).
    - `halves`: the shards are zig-zag's under a causal mask: split every hop into its causal
      halves (`_halves.RING_PLANS`) where `impl` splits them.
    - `shards`: how many whole zig-zag shards each device's tokens are, in order (USP: its
      Ulysses degree); with `halves` only.

    **Returns:** this shard's attention output, `q`'s dtype.
    """
    return ring_latent_attention(
        q, (k, v), _kv_identity, (), positions, segment_ids, axis=axis, impl=impl,
        options=options, hops=hops, halves=halves, shards=shards,
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
    impl: AbstractBlockImpl,
    options: BlockOptions,
    hops: int | None = None,
    halves: bool = False,
    shards: int = 1,
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
    - `positions`, `segment_ids`, `impl`, `options`, `hops`, `halves`, `shards`: as in
      `ring_attention`.

    **Returns:** this shard's attention output, `q`'s dtype.
    """
    config = _RingConfig(axis, impl, options, expand, hops, halves, shards)
    fn = _ring if config.impl.pure_forward else _ring_effects
    return fn(config, q, params, source, positions, segment_ids)


def _on(impl: AbstractBlockImpl, config: _RingConfig) -> _RingConfig:
    """The configuration of the side `per_platform` runs: its implementation, and the
    halves only where that implementation splits them."""
    return config._replace(impl=impl, halves=config.halves and impl.splits_zigzag_halves)


def _plans(config: _RingConfig):
    """The (query group, keys) calls of each kind of hop (`_halves.RING_PLANS`); without
    the halves one group, every query, and two kinds: nothing visible, or the whole shard.
    A device holding several zig-zag shards (USP) knows no more than that early queries
    never see late keys: every hop it attends is `OWN`'s pair of calls."""
    if not config.halves:
        return ((), ((0, ALL),))
    return RING_PLANS if config.shards == 1 else RING_PLANS[: OWN + 1]


def _hop_kind(config: _RingConfig, q_pos, kv_pos, q_seg, kv_seg):
    """Index of a hop's plan in `_plans(config)`: 0 (`NOTHING`) when no query sees a key."""
    empty = pairs_are_empty(config.options, q_pos, kv_pos, q_seg, kv_seg)
    kind = ring_hop_kind(q_pos, kv_pos) if config.halves and config.shards == 1 else 1
    return jnp.where(empty, NOTHING, kind)


def _groups(config: _RingConfig, *xs) -> list[tuple[Any, ...]]:
    """Per query group, `xs` (`[batch, seq/N, ...]` arrays or None): their early and late
    halves, or themselves whole."""
    if not config.halves:
        return [xs]
    return [tuple(half(x, config.shards, i) for x in xs) for i in (0, 1)]


def _ungroup(config: _RingConfig, parts):
    return join(parts[0], parts[1], config.shards) if config.halves else parts[0]


def _keys(config: _RingConfig, k, v, pos, seg) -> dict[int | None, tuple[Any, Any, Any, Any]]:
    """The keys of a plan's calls: `ALL` the shard, `EARLY` its early half."""
    early = functools.partial(half, shards=config.shards, which=0)
    return {ALL: (k, v, pos, seg), EARLY: (early(k), early(v), early(pos), early(seg))}


def _whole_shard(config: _RingConfig, dkv):
    """`(dk, dv)` of a whole shard from a plan's gradients, listed by keys (`ALL`, `EARLY`)."""
    add = lambda a, b: (a[0] + b[0], a[1] + b[1])  # noqa: E731
    sums = {part: functools.reduce(add, grads) for part, grads in dkv.items()}
    if EARLY in sums:  # the early half's gradient, zero over the late half
        pad = lambda x: join(x, jnp.zeros_like(x), config.shards)  # noqa: E731
        sums[EARLY] = (pad(sums[EARLY][0]), pad(sums[EARLY][1]))
    return functools.reduce(add, sums.values())


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
    out, _ = _ring_forward(config, q, params, source, positions, segment_ids)
    return out


def _query_tiles(config, q, positions, segment_ids, k_shape):
    return config.impl.tile_queries(q, positions, segment_ids, k_shape, config.options)


def _ring_forward(config, *args):
    return per_platform(config.impl, _ring_forward_one, config, *args)


def _ring_forward_one(impl, config, q, params, source, positions, segment_ids):
    config = _on(impl, config)
    # Queries are tiled once (per half); the merged output and logsumexp stay block-major
    # until the end.
    k0, v0 = jax.eval_shape(config.expand, params, source)
    qts = [
        _query_tiles(config, q_g, pos_g, seg_g, k0)
        for q_g, pos_g, seg_g in _groups(config, q, positions, segment_ids)
    ]

    def attend(accs, shard):
        src_j, pos_j, seg_j = shard

        def branch(plan):
            def run(accs):
                if not plan:
                    return accs
                k_j, v_j = config.expand(params, src_j)
                keys = _keys(config, k_j, v_j, pos_j, seg_j)
                accs = list(accs)
                for g, part in plan:
                    block_out, block_lse = config.impl.attend(qts[g], *keys[part])
                    out, lse = accs[g]
                    accs[g] = merge_partials(out, lse, block_out, block_lse)
                return tuple(accs)

            return run

        kind = _hop_kind(config, positions, pos_j, segment_ids, seg_j)
        return lax.switch(kind, [branch(plan) for plan in _plans(config)], accs)

    def step(carry, _):
        accs, shard = carry
        incoming = _shift(shard, config.axis)  # issued before this hop's compute
        return (attend(accs, shard), incoming), None

    accs0 = tuple(
        (jnp.zeros((*qt.rows, v0.shape[-1]), jnp.float32), jnp.full(qt.rows, -jnp.inf, jnp.float32))
        for qt in qts
    )
    shard0 = (source, positions, segment_ids)
    (accs, last), _ = lax.scan(step, (accs0, shard0), None, length=_hops(config) - 1)
    accs = attend(accs, last)
    out = _ungroup(
        config, [qt.merge_q(a[0]).astype(q.dtype) for qt, a in zip(qts, accs, strict=True)]
    )
    lse = _ungroup(config, [qt.merge_rows(acc[1]) for qt, acc in zip(qts, accs, strict=True)])
    return out, lse


def _ring_fwd(config, q, params, source, positions, segment_ids):
    out, lse = _ring_forward(config, q, params, source, positions, segment_ids)
    return out, (q, params, source, positions, segment_ids, out, lse)


def _ring_bwd(config, residuals, dout):
    return per_platform(config.impl, _ring_bwd_one, config, residuals, dout)


def _ring_bwd_one(impl, config, residuals, dout):
    config = _on(impl, config)
    q, params, source, positions, segment_ids, out, lse = residuals
    delta = jnp.einsum("bshv,bshv->bsh", dout.astype(jnp.float32), out.astype(jnp.float32))
    # The query side is tiled once (per half); the query gradient accumulates block-major
    # over the hops.
    k0, _ = jax.eval_shape(config.expand, params, source)
    qts, douts, lses, deltas = [], [], [], []
    for q_g, pos_g, seg_g, dout_g, lse_g, delta_g in _groups(
        config, q, positions, segment_ids, dout, lse, delta
    ):
        qt = _query_tiles(config, q_g, pos_g, seg_g, k0)
        qts.append(qt)
        douts.append(qt.split_q(dout_g.astype(q.dtype)))
        lses.append(qt.split_rows(lse_g))
        deltas.append(qt.split_rows(delta_g))

    def grads(dqs, dparams, shard, acc):
        src_j, pos_j, seg_j = shard

        def branch(plan):
            def run(operands):
                if not plan:
                    return operands
                dqs, dparams, acc = operands
                (k_j, v_j), expand_vjp = jax.vjp(config.expand, params, src_j)
                keys = _keys(config, k_j, v_j, pos_j, seg_j)
                dqs, dkv = list(dqs), {}
                for g, part in plan:
                    dqs[g], dk, dv = config.impl.attend_backward(
                        qts[g], *keys[part], douts[g], lses[g], deltas[g], dqs[g]
                    )
                    dkv.setdefault(part, []).append((dk, dv))
                dk_j, dv_j = _whole_shard(config, dkv)
                dparams_j, dsrc_j = expand_vjp((dk_j.astype(k_j.dtype), dv_j.astype(v_j.dtype)))
                add = lambda a, b: a + b.astype(jnp.float32)  # noqa: E731
                return (
                    tuple(dqs),
                    jax.tree.map(add, dparams, dparams_j),
                    jax.tree.map(add, acc, dsrc_j),
                )

            return run

        kind = _hop_kind(config, positions, pos_j, segment_ids, seg_j)
        branches = [branch(plan) for plan in _plans(config)]
        return lax.switch(kind, branches, (dqs, dparams, acc))

    def step(carry, _):
        dqs, dparams, shard, acc = carry
        incoming = _shift(shard, config.axis)
        dqs, dparams, acc = grads(dqs, dparams, shard, acc)
        return (dqs, dparams, incoming, _shift(acc, config.axis)), None

    hops = _hops(config)
    own = (source, positions, segment_ids)
    if hops > 1:
        incoming = _shift(own, config.axis)  # in flight while the own shard is computed
    # The own shard's dK/dV stay home; the travelling accumulator starts one device to the
    # right, so on a full ring it is home again after N-1 hops, not N. A ring cut short by
    # a window sends it home in one jump back.
    dqs0 = tuple(qt.zeros_dq() for qt in qts)
    dqs, dparams, home = grads(dqs0, _zeros_f32(params), own, _zeros_f32(source))
    dsource = home
    if hops > 1:
        carry0 = (dqs, dparams, incoming, _zeros_f32(source))
        (dqs, dparams, last, acc), _ = lax.scan(step, carry0, None, length=hops - 2)
        dqs, dparams, acc = grads(dqs, dparams, last, acc)
        dsource = jax.tree.map(jnp.add, home, _shift(acc, config.axis, by=1 - hops))
    cast = lambda g, x: g.astype(x.dtype)  # noqa: E731
    dq = _ungroup(config, [qt.dq(d) for qt, d in zip(qts, dqs, strict=True)])
    return (
        dq.astype(q.dtype),
        jax.tree.map(cast, dparams, params),
        jax.tree.map(cast, dsource, source),
        None,
        None,
    )


_ring, _ring_effects = custom_vjps(_ring_primal, _ring_fwd, _ring_bwd, (0,))
