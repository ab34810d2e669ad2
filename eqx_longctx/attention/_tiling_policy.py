"""The tiling policy: which flash tiles and how many ring hops the dispatcher uses.

Shared by the dispatcher (`attention/__init__.py`, at run time) and the cost model
(`_cost.py`), so the model prices the tiles that actually run.
"""

import numpy as np

from .._layout import layout_order
from .._sharding import ShardingSpec
from ._tiles import DEFAULT_BLOCK_Q, TILE_BYTES, Tiling

MIN_ALIGNED_BLOCK = 128


def block_size(spec: ShardingSpec, seq: int) -> int:
    """Flash tile size for a spec: aligned with zig-zag's chunks (when they are at least
    `MIN_ALIGNED_BLOCK` long), so that chunks the causal mask hides are skipped whole rather
    than computed under a mask. Smaller tiles would cost more in loop overhead than they
    save."""
    if spec.load_balance != "zigzag":
        return DEFAULT_BLOCK_Q
    chunk = seq // (2 * spec.context_parallel_size)
    if chunk < MIN_ALIGNED_BLOCK or chunk % DEFAULT_BLOCK_Q and chunk > DEFAULT_BLOCK_Q:
        return DEFAULT_BLOCK_Q
    return min(chunk, DEFAULT_BLOCK_Q)


def zigzag_halves(spec: ShardingSpec, seq: int, causal: bool) -> bool:
    """Whether all-gather and Ulysses split their attention into zig-zag's causal halves
    (`_halves.py`): a causal zig-zag layout whose chunks are too short for `block_size` to
    align tiles with them (aligned tiles skip the same pairs). The XLA path splits; the
    Pallas kernels decline (`AbstractBlockImpl.splits_zigzag_halves`)."""
    if spec.load_balance != "zigzag" or not causal:
        return False
    return seq // (2 * spec.context_parallel_size) < MIN_ALIGNED_BLOCK


def tile_bytes(spec: ShardingSpec) -> int:
    """Bytes one block of float32 scores may take on each device of the spec's mesh.

    Devices of one process on the CPU platform (fake devices) share one cache hierarchy,
    and all of them compute at once, so each gets `TILE_BYTES / count`. Measured here with
    8 fake devices on two cores, seq 8K, 8 heads: the ring's forward took 0.36 s with
    one-head tiles (1 MiB of scores) against 0.51 s with 8-head tiles (8 MiB), while one
    device was fastest with 8-head tiles. Accelerators have a device each: `TILE_BYTES`.
    """
    devices = np.asarray(spec.mesh.devices).reshape(-1)
    shared = [
        d for d in devices if d.platform == "cpu" and d.process_index == devices[0].process_index
    ]
    return max(1, TILE_BYTES // max(1, len(shared)))


def ring_hops(spec: ShardingSpec, seq: int, causal: bool, window: int | None) -> int | None:
    """How many ring hops (the own shard first) can see anything, or None for all of them.

    A hop is needed when some device's queries see some key of the shard it receives on
    that hop (the same shard-level test the ring skips hops by). With a sliding window and
    the contiguous layout, only the shards within the window travel: `ceil((W - 1) / L) + 1`
    hops for shards of `L` tokens, so communication and compute are O(W), not O(seq).
    """
    if window is None or not causal:
        return None
    nu, nr = spec.axis_size(spec.ulysses_axis), spec.axis_size(spec.context_axis)
    if spec.strategy != "usp":  # a strategy other than USP rings over every sequence axis
        nu, nr = 1, spec.context_parallel_size
    return cut_ring_hops(token_positions(spec, seq), nu, nr, window)


def cut_ring_hops(order: np.ndarray, nu: int, nr: int, window: int | None) -> int:
    """`ring_hops` for a token order, `nu` Ulysses x `nr` ring positions: every hop (`nr`)
    without a window."""
    if window is None:
        return nr
    shards = order.reshape(nu * nr, -1)
    # Ring position c holds (after USP's all-to-all) the shards u * nr + c of every u.
    held = [shards[[u * nr + c for u in range(nu)]].reshape(-1) for c in range(nr)]
    lo, hi = [h.min() for h in held], [h.max() for h in held]
    for hop in range(nr - 1, 0, -1):
        for c in range(nr):
            j = (c - hop) % nr
            if hi[c] >= lo[j] and lo[c] - hi[j] < window:
                return hop + 1
    return 1


def tiling(spec: ShardingSpec, seq: int) -> Tiling:
    """The flash tiles the dispatcher uses for `spec` at length `seq`."""
    return Tiling(block_size(spec, seq), tile_bytes(spec))


def token_positions(spec: ShardingSpec, seq: int) -> np.ndarray:
    """The original token index held at each slot of the spec's layout."""
    return layout_order(spec, seq)
