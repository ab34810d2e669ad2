"""The KV cache: slots split over the spec's sequence axes, each slot carrying its token's
position, so the order of slots never matters.

Geometry. With `N` sequence shards, each device holds `per` slots of every layer.

- **Full layers**: the prefill's `P` tokens (the prompt padded to the layout's multiple, in
  layout order) are written where the layout put them: device `d` keeps its own `P / N`
  tokens in its first `P / N` slots, with no reshuffle. Decode step `t` (0-based) writes
  the new token on device `t mod N` at local slot `P / N + t // N`, so the devices stay
  balanced: each holds at most `ceil(t / N)` more.
- **Sliding layers** with a window `W` shorter than the cache keep a ring buffer of `R =
  W` rounded up to a multiple of `N` slots (`R / N` per device), whatever `max_len` is.
  Row `b` with `L_b` prompt tokens keeps position `p` in ring slot `(p - L_b) mod R`; decode
  step `t` (position `L_b + t`) writes slot `t mod R` in every row, overwriting position
  `L_b + t - R`, which no later query can see. The prefill fills the ring with one
  reduce-scatter of `R` slots over the sequence axes. **Chunked layers** (chunk `C`) keep
  the same ring with `R = C` rounded up: a query sees only its own chunk, at most the last
  `C` positions.

Empty slots have position `-1`; the decoding attention never sees them.

- **Fixed-size states** (linear attention: Gated DeltaNet, Kimi Delta Attention): a layer
  that keeps a recurrent state `[heads, dk, dv]` and its convolution's window `[heads,
  dim, K-1]` per row, instead of per-token slots, has no slots at all. Its states are
  float32, their rows split over the batch axes and their heads over the tensor axis like
  the layer's heads, and **replicated over the sequence axes**: every device holds the
  whole state of its rows and heads and runs the one-token recurrence itself in the decode
  step, on its own copy of the new token. The state is `heads x dk x dv` numbers per row
  and layer, whatever the context: splitting it over the sequence would save nothing
  worth a collective per layer and token. The prefill leaves each row's state after its
  last real token (the op's final state, replicated); the decode step replaces it (no
  slot is written).
"""

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec
from jaxtyping import Array, Int

from .._layout import layout_multiple
from .._sharding import ShardingSpec


def slots_per_device(spec: ShardingSpec | None, max_len: int) -> int:
    """Full-cache slots per device for `max_len` tokens: any prompt padded to the layout's
    multiple, plus the decoded tokens spread round-robin, fits."""
    n = 1 if spec is None else spec.context_parallel_size
    return (max_len + layout_multiple(spec) + n - 2) // n


class StackCache(eqx.Module):
    """The cache of one `LayerStack`: its layers' entries and the slots' token positions.

    - `entries`: per cached array of the attention layer (K and V, or MLA's latent),
      heads-major `[layers, batch, heads, slots, dim]` (what decoding reads in place).
    - `positions`: `[batch, slots]` int32 token position of each slot; `-1` when empty
      (no slots, `[batch, 0]`, for a layer that keeps fixed-size states only).
    - `states`: each fixed-size state of the layers (`cache_state_shapes`), float32
      `[layers, batch, heads, ...]`, replicated over the sequence axes (linear attention's
      recurrent state and convolution windows; empty for softmax attention).
    - `ring`: the ring-buffer length (a sliding layer's slots), or `None` for a full cache.
    - `window`: the layers' sliding window, or `None`.
    - `split_heads`: whether the heads split over the spec's tensor axis.
    """

    entries: tuple[Array, ...]
    positions: Int[Array, "batch slots"]
    states: tuple[Array, ...]
    ring: int | None = eqx.field(static=True)
    window: int | None = eqx.field(static=True)
    split_heads: bool = eqx.field(static=True)


class KVCache(eqx.Module):
    """An immutable KV cache for one model and spec (build it with `init_cache`).

    - `stacks`: one `StackCache` per layer stack of the model.
    - `lengths`: `[batch]` int32 tokens of each row so far (the next token's position).
    - `step`: decode steps since the prefill.
    - `offset`: the slots per device the prefill filled (`P / N`).
    - `max_len`, `config`, `spec`: the capacity in tokens, and the model's config and spec
      the cache was built for (static).
    """

    stacks: tuple[StackCache, ...]
    lengths: Int[Array, " batch"]
    step: Int[Array, ""]
    offset: Int[Array, ""]
    max_len: int = eqx.field(static=True)
    config: Any = eqx.field(static=True)
    spec: ShardingSpec | None = eqx.field(static=True)

    @property
    def batch(self) -> int:
        """Rows of the cache."""
        return self.lengths.shape[0]

    def nbytes_per_device(self) -> int:
        """Bytes of this cache on the most loaded device, read from the arrays' shards
        (abstract arrays: computed from their shardings)."""
        total = 0
        for leaf in jax.tree.leaves(self):
            shards = getattr(leaf, "addressable_shards", None)
            sharding = getattr(leaf, "sharding", None)
            if shards:
                total += max(s.data.nbytes for s in shards)
            elif sharding is not None:
                total += math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
            else:
                total += leaf.size * leaf.dtype.itemsize
        return total


def _shard_map(spec: ShardingSpec, fn: Callable, in_specs, out_specs):
    return jax.shard_map(
        fn, mesh=spec.compute_mesh(), in_specs=in_specs, out_specs=out_specs, check_vma=False
    )


def _seq_axes(spec: ShardingSpec):
    axes = spec.sequence_axes
    return axes[0] if len(axes) == 1 else axes


def _ring_slots(positions, lengths, ring: int):
    """Ring slot of each prompt token (`ring` = dropped: outside the last `ring` tokens)."""
    rel = positions - lengths[:, None]
    keep = (rel < 0) & (rel >= -ring)
    return jnp.where(keep, jnp.mod(rel, ring), ring)


def store_fn(
    spec: ShardingSpec | None, stack: StackCache, per: int, positions, lengths
) -> Callable:
    """`store(entry) -> stored`: one layer's prefill entry (`[batch, P, heads, dim]` arrays
    in layout order) as that layer's cache slots (`[batch, heads, slots, dim]`), cast to
    the cache's dtype."""
    dtypes = tuple(x.dtype for x in stack.entries)

    def local(entry, positions, lengths):
        out = []
        for x, dtype in zip(entry, dtypes, strict=True):
            x = x.astype(dtype)
            if stack.ring is None:  # where the layout put them, in the first P/N slots
                pad = [(0, 0)] * x.ndim
                pad[1] = (0, per - x.shape[1])
                out.append(jnp.swapaxes(jnp.pad(x, pad), 1, 2))
                continue
            slots = _ring_slots(positions, lengths, stack.ring)
            rows = jnp.arange(x.shape[0])[:, None]
            ring = jnp.zeros((x.shape[0], stack.ring, *x.shape[2:]), dtype)
            ring = ring.at[rows, slots].set(x, mode="drop")
            if spec is not None and spec.context_parallel_size > 1:
                ring = lax.psum_scatter(ring, _seq_axes(spec), scatter_dimension=1, tiled=True)
            out.append(jnp.swapaxes(ring, 1, 2))
        return tuple(out)

    return _stack_map(spec, stack, local, positions, lengths)


def _stack_map(spec, stack: StackCache, local: Callable, positions, lengths) -> Callable:
    """`fn(entry)` running `local(entry, positions, lengths)` per device."""
    if spec is None:
        return lambda entry: local(entry, positions, lengths)
    heads = spec.tensor_axis if stack.split_heads else None
    entry_spec = PartitionSpec(spec.batch_entry(), spec.sequence_axes, heads, None)
    stored = PartitionSpec(spec.batch_entry(), heads, spec.sequence_axes, None)
    tokens = spec.token_pspec()
    specs = tuple(entry_spec for _ in stack.entries)
    outs = tuple(stored for _ in stack.entries)
    mapped = _shard_map(spec, local, (specs, tokens, PartitionSpec(spec.batch_entry())), outs)

    def fn(entry):
        entry = tuple(spec.place(x, entry_spec) for x in entry)
        return mapped(entry, positions, lengths)

    return fn


def slot_positions(spec: ShardingSpec | None, stack: StackCache, per: int, positions, lengths):
    """The `[batch, slots]` positions the prefill leaves in a stack's cache (`-1`: empty):
    prompt positions `>= lengths` (padding) are empty."""

    def local(positions, lengths):
        valid = positions < lengths[:, None]
        if stack.ring is None:
            pos = jnp.where(valid, positions, -1)
            return jnp.pad(pos, ((0, 0), (0, per - pos.shape[1])), constant_values=-1)
        slots = _ring_slots(positions, lengths, stack.ring)
        rows = jnp.arange(positions.shape[0])[:, None]
        ring = jnp.zeros((positions.shape[0], stack.ring), jnp.int32)
        ring = ring.at[rows, slots].set(positions + 1, mode="drop")
        if spec is not None and spec.context_parallel_size > 1:
            ring = lax.psum_scatter(ring, _seq_axes(spec), scatter_dimension=1, tiled=True)
        return ring - 1

    if spec is None:
        return local(positions, lengths)
    tokens = spec.token_pspec()
    mapped = _shard_map(spec, local, (tokens, PartitionSpec(spec.batch_entry())), tokens)
    return mapped(spec.place(positions, tokens), lengths)


def write_token(spec: ShardingSpec | None, stack: StackCache, new: tuple, positions, step, offset):
    """The stack's cache with one decoded token written: `new` its entries `[layers, batch,
    n, heads, dim]` (equal along `n`), `positions` `[batch]` its positions. A dynamic
    update of one slot on the device that owns it (in place when the cache is donated)."""
    n = 1 if spec is None else spec.context_parallel_size
    if stack.ring is None:
        owner, slot = step % n, offset + step // n
    else:
        per = stack.ring // n
        owner, slot = (step % stack.ring) // per, step % per

    def local(entries, new, cache_pos, positions):
        me = 0 if spec is None or n == 1 else lax.axis_index(_seq_axes(spec))
        mine = me == owner
        # One index dtype, int32: under jax_enable_x64 the literal zeros would be int64
        # beside the int32 `slot`, which dynamic_slice refuses.
        zero, at = jnp.int32(0), jnp.asarray(slot, jnp.int32)
        out = []
        for x, y in zip(entries, new, strict=True):
            start = (zero, zero, zero, at, zero)
            old = lax.dynamic_slice(x, start, (*x.shape[:3], 1, x.shape[4]))
            y = jnp.swapaxes(y[:, :, :1], 2, 3)  # [layers, batch, heads, 1, dim]
            y = jnp.where(mine, y.astype(x.dtype), old)
            out.append(lax.dynamic_update_slice(x, y, start))
        old = lax.dynamic_slice(cache_pos, (zero, at), (cache_pos.shape[0], 1))
        pos = jnp.where(mine, positions[:, None].astype(cache_pos.dtype), old)
        return tuple(out), lax.dynamic_update_slice(cache_pos, pos, (zero, at))

    if spec is None:
        entries, cache_pos = local(stack.entries, new, stack.positions, positions)
    else:
        heads = spec.tensor_axis if stack.split_heads else None
        entry = PartitionSpec(None, spec.batch_entry(), heads, spec.sequence_axes, None)
        new_spec = PartitionSpec(None, spec.batch_entry(), spec.sequence_axes, heads, None)
        entries = tuple(entry for _ in new)
        news = tuple(new_spec for _ in new)
        tokens = spec.token_pspec()
        in_specs = (entries, news, tokens, PartitionSpec(spec.batch_entry()))
        mapped = _shard_map(spec, local, in_specs, (entries, tokens))
        new = tuple(spec.place(y, new_spec) for y in new)
        entries, cache_pos = mapped(stack.entries, new, stack.positions, positions)
    return eqx.tree_at(lambda c: (c.entries, c.positions), stack, (entries, cache_pos))


def state_pspec(spec: ShardingSpec, split_heads: bool, layers: bool = True) -> PartitionSpec:
    """The `PartitionSpec` of a fixed-size state `[layers, batch, heads, ...]` (without
    `layers`: one layer's): rows over the batch axes, heads over the tensor axis when
    `split_heads`, replicated over the sequence axes."""
    heads = spec.tensor_axis if split_heads else None
    lead = (None,) if layers else ()
    return PartitionSpec(*lead, spec.batch_entry(), heads, None, None)


def store_states(spec: ShardingSpec | None, stack: StackCache, states: tuple) -> tuple:
    """One layer's prefill states (`[batch, heads, ...]` each, the same on every device of
    the sequence axes) as the cache keeps them: float32, placed."""
    states = tuple(x.astype(jnp.float32) for x in states)
    if spec is None:
        return states
    pspec = state_pspec(spec, stack.split_heads, layers=False)
    return tuple(spec.place(x, pspec) for x in states)


def write_states(spec: ShardingSpec | None, stack: StackCache, new: tuple) -> tuple:
    """The stack's states after a decode step: `new` the layers' new states `[layers, batch,
    n, heads, ...]`, one copy per sequence shard (equal along `n`: each device ran the
    step on its own copy). Each device keeps its own copy; nothing moves."""
    if spec is None:
        return tuple(y[:, :, 0].astype(jnp.float32) for y in new)
    heads = spec.tensor_axis if stack.split_heads else None
    copies = tuple(
        PartitionSpec(None, spec.batch_entry(), spec.sequence_axes, heads, None, None) for _ in new
    )
    kept = tuple(state_pspec(spec, stack.split_heads) for _ in new)

    def local(new):
        return tuple(y[:, :, 0].astype(jnp.float32) for y in new)

    mapped = _shard_map(spec, local, (copies,), kept)
    return mapped(tuple(spec.place(y, c) for y, c in zip(new, copies, strict=True)))
