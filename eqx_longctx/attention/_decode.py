"""Decoding attention over a sequence-sharded KV cache: each device attends its own slots.

One new token per batch row attends every cached token plus itself. The cache's slots are
split over the spec's sequence axes; each device runs the block contract
(`AbstractBlockImpl.attend`) on the slots it holds, which gives an `(out, lse)` partial,
and one all-gather of those small partials over the sequence axes lets every device merge
them by online softmax (`merge_partials`), as Flash-Decoding and Tree Attention do. The
cache itself never moves. The new token's own key and value join the merge as one more
partial, so the cache is only written after the layer ran (a donated in-place update by
the caller).

The query heads of one K/V head are the query *rows* the implementation tiles (`[batch,
group, kv_heads, dim]`, all at the new token's position), so GQA never repeats K/V and a
kernel that tiles 128 query rows sees `group` rows instead of one. Latent attention (MLA,
absorbed) is the case of one K/V head whose values are the first `value_dim` features of
its keys.

The cache is heads-major, `[layers, batch, kv_heads, slots, dim]` (a `LayerCache` hands a
layer a stack's arrays and its index), the layout the Pallas kernels and the XLA path's
products read without a transpose (`AbstractBlockImpl.attend_heads_major`). Each device
reads its slots a chunk of about `CHUNK_BYTES` at a time (chunks that no query can see
skipped): only a chunk is ever sliced out, never a layer's whole slice.

Slots carry their token positions (`-1`: empty), so the order of slots does not matter:
the causal and window rules are evaluated on positions, and empty slots get a position no
query can see.

The new token arrives as `n` identical rows (`n` = the number of sequence shards), laid out
like a sequence over the sequence axes, so that every layer outside the attention runs
under the spec's usual activation sharding, each device computing its own copy.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from .._sharding import ShardingSpec
from ._block import AbstractBlockImpl, BlockOptions, merge_partials, pairs_are_empty

_UNSEEN = 2**30  # the position of an empty slot: later than any query, so never visible
CHUNK_BYTES = 2 * 2**20  # bytes of one cached array a device reads at a time (a multiple
# of 128 slots): L2-sized on a CPU, a few key blocks of a TPU kernel


class LayerCache(NamedTuple):
    """One layer's view of a layer stack's cache: the stack's `entries`, each `[layers, batch,
    kv_heads, slots, dim]` (heads-major), and the `layer` index (an int32 scalar, traced in a
    scan). Decoding reads it chunk by chunk, so the layer's slice is never copied out whole."""

    entries: tuple
    layer: Any

    def arrays(self) -> tuple:
        """This layer's entries, `[batch, kv_heads, slots, dim]` each (a copy)."""
        return tuple(x[self.layer] for x in self.entries)


def _as_view(cache) -> LayerCache:
    if isinstance(cache, LayerCache):
        return cache
    return LayerCache(tuple(x[None] for x in cache), jnp.zeros((), jnp.int32))


def _split(kv: tuple, value_dim: int | None):
    """`(k, v)` from a cache entry: the pair itself, or one latent array whose first
    `value_dim` features are the values."""
    if len(kv) == 2:
        return kv
    (k,) = kv
    return k, k[..., :value_dim]


def _self_partial(q_rows, k_new, v_new, options: BlockOptions):
    """The new token against its own key: `(out, lse)` in rows layout (`[b, g, kvh, dv]`,
    `[b, g, kvh]`). A single visible key: its value, weighted one."""
    s = jnp.einsum("bgkd,bkd->bgk", q_rows.astype(jnp.float32), k_new.astype(jnp.float32))
    out = jnp.broadcast_to(v_new[:, None].astype(jnp.float32), (*s.shape, v_new.shape[-1]))
    s = s * options.scale
    if options.softcap is not None:
        s = options.softcap * jnp.tanh(s / options.softcap)
    return out, s


def _chunk_slots(entries, slots: int) -> int:
    """Slots per chunk: about `CHUNK_BYTES` of the widest cached array, a multiple of 128."""
    _, b, h, _, d = max((x.shape for x in entries), key=lambda shape: shape[-1])
    per_slot = b * h * d * entries[0].dtype.itemsize
    return min(slots, max(128, CHUNK_BYTES // per_slot // 128 * 128))


def _attend_slots(impl: AbstractBlockImpl, options, value_dim, rows, rows_pos, view, kv_pos):
    """`(out, lse)` of the query rows over this device's slots, in rows layout, a chunk of
    slots at a time (the last chunk is moved back to end at the last slot; the slots it
    repeats are hidden)."""
    entries, layer = view
    _, b, h, slots, _ = entries[0].shape
    size = _chunk_slots(entries, slots)
    chunks = -(-slots // size)
    k_dim = entries[0].shape[-1]
    like = jax.ShapeDtypeStruct((b, size, h, k_dim), entries[0].dtype)
    qt: Any = impl.tile_queries(rows, rows_pos, None, like, options)
    dv = entries[-1].shape[-1] if len(entries) == 2 else value_dim

    def chunk(i, carry):
        start = jnp.minimum(i * size, slots - size)
        pos = lax.dynamic_slice_in_dim(kv_pos, start, size, 1)
        pos = jnp.where(start + jnp.arange(size) >= i * size, pos, _UNSEEN)

        def attend(carry):
            # One index dtype, int32: under jax_enable_x64 the literal zeros and `start`
            # would be int64 beside the int32 `layer`, which dynamic_slice refuses.
            at = tuple(jnp.asarray(a, jnp.int32) for a in (layer, 0, 0, start, 0))
            kv = tuple(lax.dynamic_slice(x, at, (1, b, h, size, x.shape[-1]))[0] for x in entries)
            k, v = _split(kv, value_dim)
            out, lse = impl.attend_heads_major(qt, k, v, pos, None)  # pyright: ignore[reportGeneralTypeIssues]
            acc, acc_lse = carry
            return merge_partials(acc, acc_lse, qt.merge_q(out), qt.merge_rows(lse))

        empty = pairs_are_empty(options, rows_pos, pos, None, None)
        return lax.cond(empty, lambda c: c, attend, carry)

    init = (
        jnp.zeros((*rows.shape[:-1], dv), jnp.float32),
        jnp.full(rows.shape[:-1], -jnp.inf, jnp.float32),
    )
    if chunks == 1:
        return chunk(0, init)
    return lax.fori_loop(0, chunks, chunk, init)


def _local(
    impl: AbstractBlockImpl, options: BlockOptions, value_dim, axes, q, new, view, cache_pos, q_pos,
    sinks=None,
):  # fmt: skip
    """One device's decode attention (inside `shard_map`, or the whole of it on one device);
    `sinks`: this device's heads' sinks, or `None`."""
    with jax.named_scope("decode_attention"):
        return _local_scoped(impl, options, value_dim, axes, q, new, view, cache_pos, q_pos, sinks)


def _local_scoped(impl, options, value_dim, axes, q, new, view, cache_pos, q_pos, sinks):
    b, _, h, dk = q.shape
    k_new, v_new = _split(tuple(x[:, 0] for x in new), value_dim)
    kvh = view.entries[0].shape[2]
    g = h // kvh
    rows = q[:, 0].reshape(b, kvh, g, dk).transpose(0, 2, 1, 3)  # [b, g, kvh, dk]
    rows_pos = jnp.broadcast_to(q_pos[:, :1], (b, g)).astype(jnp.int32)
    kv_pos = jnp.where(cache_pos >= 0, cache_pos, _UNSEEN).astype(jnp.int32)
    out, lse = _attend_slots(impl, options, value_dim, rows, rows_pos, view, kv_pos)
    if axes is not None:  # every device's partial, merged in the same order everywhere
        outs = lax.all_gather(jnp.concatenate([out, lse[..., None]], -1), axes, axis=0)
        out, lse = outs[0, ..., :-1], outs[0, ..., -1]
        for i in range(1, outs.shape[0]):
            out, lse = merge_partials(out, lse, outs[i, ..., :-1], outs[i, ..., -1])
    out, lse = merge_partials(out, lse, *_self_partial(rows, k_new, v_new, options))
    if sinks is not None:  # after the merge, as `apply_sinks`; rows are [b, g, kvh]
        rows_sinks = sinks.astype(jnp.float32).reshape(kvh, g).T
        out = out * jax.nn.sigmoid(lse - rows_sinks)[..., None]
    out = out.transpose(0, 2, 1, 3).reshape(b, 1, h, out.shape[-1])
    return out.astype(q.dtype)


def decode_attention(
    q,
    new: tuple,
    cache: tuple,
    cache_positions,
    positions,
    *,
    spec: ShardingSpec | None,
    impl: AbstractBlockImpl,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks=None,
    scale: float | None = None,
    split_heads: bool = True,
    value_dim: int | None = None,
):
    """Attention of one new token per row over a KV cache (and the token itself).

    **Arguments:**

    - `q`: `[batch, n, q_heads, head_dim]`: the new token's queries, repeated on `n`
      rows (`n` = the spec's sequence shards, 1 without a spec).
    - `new`: the new token's cache entry, `(k, v)` each `[batch, n, kv_heads, dim]`, or
      `(kv,)` for a latent whose first `value_dim` features are the values.
    - `cache`: the cache's entry for this layer: a `LayerCache` (the stack's heads-major
      arrays `[layers, batch, kv_heads, slots, dim]` and this layer's index), or a tuple of
      the same structure as `new` with `[batch, kv_heads, slots, dim]` arrays; slots split
      over the spec's sequence axes.
    - `cache_positions`: `[batch, slots]` token position of each slot, `-1` for empty.
    - `positions`: `[batch, n]` the new token's position (equal along `n`).
    - `spec`: the sharding spec, or `None` for one device.
    - `impl`: the block implementation that attends each device's slots.
    - `window`: sliding window `W` (keys `j` with `0 <= i - j < W`), or `None`.
    - `chunk`, `softcap`, `sinks`: as in `eqx_longctx.attention` (`sinks` `[q_heads]`,
      joined after the merge; under a tensor axis each shard takes its own heads').
    - `scale`: the score scale (default `1/sqrt(head_dim)`).
    - `split_heads`: whether the cache's heads split over the spec's tensor axis (K/V
      heads), or stay whole on every tensor shard (one shared latent).
    - `value_dim`: with a one-array latent entry, the width of its value part.

    **Returns:** `[batch, n, q_heads, v_dim]` in `q`'s dtype (equal along `n`).
    """
    options = BlockOptions.make(True, window, scale, q.shape[-1], softcap, chunk)
    view = _as_view(cache)
    if spec is None:
        return _local(
            impl, options, value_dim, None, q, new, view, cache_positions, positions, sinks
        )
    batch, seq, tensor = spec.batch_entry(), spec.sequence_axes, spec.tensor_axis
    kv_heads = tensor if split_heads else None
    q_spec = PartitionSpec(batch, seq, tensor, None)
    kv_spec = PartitionSpec(batch, seq, kv_heads, None)
    stacked = PartitionSpec(None, batch, kv_heads, seq, None)
    tokens = spec.token_pspec()
    axes = seq[0] if len(seq) == 1 else seq

    def local(q, new, view, cache_pos, q_pos, *sinks):
        sinks = sinks[0] if sinks else None
        return _local(impl, options, value_dim, axes, q, new, view, cache_pos, q_pos, sinks)

    view_spec = LayerCache(tuple(stacked for _ in view.entries), PartitionSpec())
    in_specs = (q_spec, tuple(kv_spec for _ in new), view_spec, tokens, tokens)
    place = spec.place
    view = LayerCache(tuple(place(x, stacked) for x in view.entries), view.layer)
    args = (
        place(q, q_spec),
        tuple(place(x, kv_spec) for x in new),
        view,
        place(cache_positions, tokens),
        place(positions, tokens),
    )
    if sinks is not None:
        in_specs = (*in_specs, PartitionSpec(tensor))
        args = (*args, place(sinks, PartitionSpec(tensor)))
    mapped = jax.shard_map(
        local, mesh=spec.compute_mesh(), in_specs=in_specs, out_specs=q_spec, check_vma=False
    )
    return mapped(*args)
