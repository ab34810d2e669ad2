"""Neighbour exchange for local layers: each device fetches only the keys its queries reach.

A layer whose queries see a bounded reach back (a sliding `window`, Llama 4's `chunk`)
needs, for each contiguous piece of queries a device holds, the keys of the `reach` tokens
before that piece: a *halo*. On the contiguous layout that is the tail of the previous
device's shard; on zig-zag each of a device's two pieces takes its tail from its own
neighbour in sequence order (the next device's second piece for the late one). When the
reach is longer than a piece, the halo spans as many neighbours as it takes. The halo
arrives by `ppermute`s of exactly the tokens it needs (with their positions and segment
ids, one collective per dtype), so a window-`W` layer moves `W - 1` tokens of K/V per
piece instead of the whole shards a ring sends; its backward is autodiff's transpose, the
halo's gradients going back the same way.

Which tokens go where is worked out once, from the layout's token order
(`halo_plan`): a list of *rounds*, each one `ppermute` by a fixed shift of a fixed-length
slice into a fixed place of the receiver's halo buffer, with per-device tables (read at
`lax.axis_index`) saying where each sender's slice starts and who receives. Halo slots no
token fills get a position no query sees (`_UNSEEN`), so the causal rule hides them.
Layouts whose shards are not one or two runs of consecutive tokens (striped) get `None`
and keep their ring.

Each piece then attends its own keys and its halo in one `block_attention` call (the
pieces of a zig-zag shard stacked on the batch axis), so block skipping, soft-caps, chunks
and segment ids work as in any other strategy.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._collectives import ppermute
from .._types import AxisName
from ._block import BlockImpl, BlockOptions, block_attention
from ._pack import together

_UNSEEN = 2**30  # the position of a halo slot no token fills: no query sees it (causal)
# The strategies a local layer's exchange replaces: those that would send whole shards.
# Ulysses and USP keep their all-to-all (the spec asked to split heads). Read at every
# call: a benchmark sets it to `()` to time the ring it replaces.
HALO_REPLACES: tuple[str, ...] = ("ring", "all_gather")
# A halo buffer is a whole number of these slots when the pieces are: a window of W keeps
# W - 1 keys, and a key sequence one short of whole blocks would be padded, which makes the
# blockwise kernels mask every block (measured: the exchange 13% slower than the one-hop
# ring it replaces at 32K tokens, window 1024, on 8 fake devices). The slots no token fills
# stay unseen.
HALO_ALIGN = 128
# Layouts whose shards are more runs of consecutive tokens than this keep their ring.
MAX_PIECES = 2


class Round(NamedTuple):
    """One transfer pattern: every sender `src` sends `length` tokens from its local index
    `starts[src]` to device `(src + shift) % n`, which writes them at `offset` of its halo
    buffer for `piece`. `shift == 0` is a copy within the device."""

    shift: int
    piece: int
    offset: int
    length: int
    starts: tuple[int, ...]  # per device: where its slice starts (0 if it sends nothing)
    receives: tuple[bool, ...]  # per device: whether it receives in this round
    pairs: tuple[tuple[int, int], ...]  # (sender, receiver)


class HaloPlan(NamedTuple):
    """The static plan of a neighbour exchange (see `halo_plan`)."""

    devices: int
    pieces: int  # runs of consecutive tokens per shard: 1 contiguous, 2 zig-zag
    piece_len: int
    halo_len: int  # the halo buffer of each piece (the longest halo any piece needs)
    rounds: tuple[Round, ...]

    def tokens_received(self) -> int:
        """The most tokens one device receives from other devices (the exchange's bytes
        per token width)."""
        got = np.zeros(self.devices, int)
        for r in self.rounds:
            if r.shift:
                got += np.asarray(r.receives, int) * r.length
        return int(got.max(initial=0))


def earliest_key(a: int, options: BlockOptions) -> int:
    """The earliest key position a query at position `a` can see under `options`."""
    lo = 0
    if options.window is not None:
        lo = max(lo, a - (options.window - 1))
    if options.chunk is not None:
        lo = max(lo, a // options.chunk * options.chunk)
    return lo


def halo_plan(order: np.ndarray, devices: int, options: BlockOptions) -> HaloPlan | None:
    """The neighbour exchange for a layout, or `None` where it does not apply.

    **Arguments:**

    - `order`: the token position held at each slot of the layout (`layout_order`), the
      shards of `devices` devices one after another.
    - `devices`: the sequence-parallel degree.
    - `options`: the call's mask; without a causal `window` or `chunk` there is no halo.

    **Returns:** a `HaloPlan`, or `None` when the reach is unbounded, a shard is not one or
    two runs of consecutive tokens of one length (striped), or the halo would be every
    other shard (then a gather or ring is no worse).
    """
    if not options.causal or options.reach is None or devices < 2:
        return None
    order = np.asarray(order).reshape(devices, -1)
    shard = order.shape[1]
    pieces = next((n for n in range(1, MAX_PIECES + 1) if _runs(order, n)), None)
    if pieces is None:
        return None
    piece_len = shard // pieces
    owner = np.empty(order.size, int)
    index = np.empty(order.size, int)
    for d, row in enumerate(order):
        owner[row] = d
        index[row] = np.arange(shard)
    starts = order[:, ::piece_len]  # [devices, pieces]: each piece's first position
    halo_len = int(max(a - earliest_key(int(a), options) for a in starts.reshape(-1)))
    if halo_len >= (devices - 1) * shard:
        return None
    if piece_len % HALO_ALIGN == 0:  # whole key blocks: no padded keys, so no masked blocks
        halo_len = -(-halo_len // HALO_ALIGN) * HALO_ALIGN
    rounds: dict[tuple[int, int, int, int], dict] = {}
    for d in range(devices):
        for p in range(pieces):
            a = int(starts[d, p])
            t = earliest_key(a, options)
            while t < a:  # maximal runs of the halo held by one device, consecutively
                src, i0 = int(owner[t]), int(index[t])
                n = 1
                while t + n < a and owner[t + n] == src and index[t + n] == i0 + n:
                    n += 1
                key = ((d - src) % devices, p, halo_len - (a - t), n)
                entry = rounds.setdefault(key, {"starts": {}, "receives": set()})
                entry["starts"][src] = i0
                entry["receives"].add(d)
                t += n
    plan_rounds = []
    for (shift, p, offset, length), entry in sorted(rounds.items()):
        plan_rounds.append(
            Round(
                shift,
                p,
                offset,
                length,
                tuple(entry["starts"].get(d, 0) for d in range(devices)),
                tuple(d in entry["receives"] for d in range(devices)),
                tuple((s, (s + shift) % devices) for s in sorted(entry["starts"])),
            )  # fmt: skip
        )
    return HaloPlan(devices, pieces, piece_len, halo_len, tuple(plan_rounds))


def _runs(order: np.ndarray, pieces: int) -> bool:
    """Whether every shard (row of `order`) is `pieces` equal runs of consecutive tokens
    (zig-zag's middle device holds two runs that happen to meet: still two pieces)."""
    if order.shape[1] % pieces:
        return False
    parts = order.reshape(order.shape[0], pieces, -1)
    return bool(np.all(np.diff(parts, axis=-1) == 1))


def _exchange(plan: HaloPlan, tree, axis: AxisName):
    """Each piece's halo buffer (`[batch, halo_len, ...]` per leaf of `tree`, which holds
    the source, positions and segment ids of this device's shard), filled round by round."""
    me = lax.axis_index(axis)
    source, positions, segment_ids = tree
    b = positions.shape[0]

    def empty():
        buf = jax.tree.map(lambda x: jnp.zeros((b, plan.halo_len, *x.shape[2:]), x.dtype), source)
        pos = jnp.full((b, plan.halo_len), _UNSEEN, positions.dtype)
        seg = None if segment_ids is None else jnp.zeros((b, plan.halo_len), segment_ids.dtype)
        return buf, pos, seg

    halos = [empty() for _ in range(plan.pieces)]
    for r in plan.rounds:
        start = jnp.asarray(r.starts, jnp.int32)[me]
        cut = lambda x, start=start, n=r.length: lax.dynamic_slice_in_dim(x, start, n, 1)  # noqa: E731
        part = jax.tree.map(cut, tree)
        if r.shift:
            part = together(part, lambda x, r=r: ppermute(x, axis, r.pairs))
        take = jnp.asarray(r.receives)[me]
        at = slice(r.offset, r.offset + r.length)

        def put(buf, x, take=take, at=at):
            if buf is None:
                return None
            return buf.at[:, at].set(jnp.where(take, x, buf[:, at]))

        halos[r.piece] = jax.tree.map(put, halos[r.piece], part, is_leaf=lambda x: x is None)
    return halos


def halo_latent_attention(
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
    plan: HaloPlan,
):
    """Local attention of this device's pieces over their halos and themselves (call inside
    `shard_map`).

    **Arguments:**

    - `q`: this device's `[batch, seq/N, heads, dim]` queries.
    - `source`: the K/V source of this device's tokens (K/V themselves, or MLA's latent),
      `[batch, seq/N, ...]` arrays; `expand(params, source) -> (k, v)` builds K/V.
    - `positions`, `segment_ids`: this device's `[batch, seq/N]` ids.
    - `impl`, `options`: the block implementation and the mask.
    - `plan`: the exchange (`halo_plan` of the layout).

    **Returns:** `(out, lse)` of this device's queries.
    """
    halos = _exchange(plan, (source, positions, segment_ids), axis)
    length, b = plan.piece_len, q.shape[0]

    def own(x, p):
        return None if x is None else x[:, p * length : (p + 1) * length]

    def cat(parts):
        if parts[0] is None:
            return None
        return jnp.concatenate(parts, axis=0)  # the pieces on the batch axis

    def keys(p):
        buf, pos, seg = halos[p]

        def join(h, x):
            return jnp.concatenate([h, x[:, p * length : (p + 1) * length]], axis=1)

        src = jax.tree.map(join, buf, source)
        return src, join(pos, positions), None if seg is None else join(seg, segment_ids)

    parts = [keys(p) for p in range(plan.pieces)]
    src = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *[s for s, _, _ in parts])
    kv_pos = cat([pos for _, pos, _ in parts])
    kv_seg = cat([seg for _, _, seg in parts])
    qs = cat([own(q, p) for p in range(plan.pieces)])
    q_pos = cat([own(positions, p) for p in range(plan.pieces)])
    q_seg = cat([own(segment_ids, p) for p in range(plan.pieces)])
    k, v = expand(params, src)
    out, lse = block_attention(impl, qs, k, v, q_pos, kv_pos, q_seg, kv_seg, options)
    split = (
        lambda x: jnp.concatenate(  # noqa: E731
            [x[p * b : (p + 1) * b] for p in range(plan.pieces)], axis=1
        )
    )
    return split(out), split(lse)
