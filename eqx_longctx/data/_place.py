"""The one batch placement: host `[batch, seq]` fields onto the mesh, in the sharding
spec's token layout, from any number of processes.

Each process holds some of the mesh's devices; a `[batch, seq]` field sharded
`spec.token_pspec()` puts a block of rows and laid-out sequence slots on each of them.
[`process_slice`][] says which rows and slots a process feeds, [`place_local`][] assembles
the global arrays from every process's block (`jax.make_array_from_process_local_data`),
and [`place_batch`][] takes a whole host batch (every process holding all of it), cuts this
process's block and places it. The trainer's Grain feed reads only its own block and
calls `place_local`; everything else (evaluation, benchmarks, tests, a batch hook's host
arrays) calls `place_batch`. The global arrays are the same for every process count and
mesh.
"""

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from .._layout import check_sequence_length, layout_order
from .._sharding import ShardingSpec


@dataclasses.dataclass(frozen=True)
class ProcessSlice:
    """What one process feeds of a `[batch, seq]` global array.

    - `rows`: global batch rows, in the order of the process-local block.
    - `slots`: laid-out sequence slots, in the order of the process-local block.
    - `tokens`: natural-order token index at each of those slots (the layout applied).
    - `global_shape`: `(batch, seq)`.
    - `sharding`: the arrays' `NamedSharding`, or `None` without a spec.
    - `is_this_process`: whether it is this process's part (else a simulated one).
    """

    rows: np.ndarray
    slots: np.ndarray
    tokens: np.ndarray
    global_shape: tuple[int, int]
    sharding: NamedSharding | None
    is_this_process: bool


def _process_devices(mesh, process_index: int, process_count: int) -> list:
    """The mesh devices of process `process_index` out of `process_count`: the real ones
    when `process_count` is the real count, else (one real process, as in tests) the
    `process_count` equal groups of the mesh's devices in id order."""
    devices = sorted(mesh.devices.flat, key=lambda d: d.id)
    real = jax.process_count()
    if process_count == real:
        return [d for d in devices if d.process_index == process_index]
    if real != 1:
        raise ValueError(
            f"process_count={process_count} differs from the {real} processes of this run; "
            "simulating other process counts works only in a single-process run. Leave "
            "process_index and process_count unset."
        )
    if len(devices) % process_count:
        raise ValueError(
            f"simulating {process_count} processes splits the mesh's {len(devices)} devices "
            f"into equal groups, so process_count must divide {len(devices)}; got "
            f"process_count={process_count}. Use a divisor of {len(devices)}."
        )
    k = len(devices) // process_count
    return devices[process_index * k : (process_index + 1) * k]


def _held(indices: list[Any], dim: int, shard: int) -> np.ndarray:
    """Global indices along `dim` held by some of these shards, in the order
    `make_array_from_process_local_data` expects: shards sorted by start, concatenated."""
    starts = sorted({s[dim].start or 0 for s in indices})
    return np.concatenate([np.arange(s, s + shard) for s in starts])


def process_slice(
    spec: ShardingSpec | None,
    global_shape: tuple[int, int],
    process_index: int | None = None,
    process_count: int | None = None,
) -> ProcessSlice:
    """The rows and sequence slots of a `[batch, seq]` global array that a process feeds.

    **Arguments:**

    - `spec`: the `ShardingSpec` (sharding `spec.token_pspec()`, layout
      `spec.load_balance`), or `None` for one device.
    - `global_shape`: `(batch, seq)`.
    - `process_index`, `process_count`: default `jax.process_index()` /
      `jax.process_count()`. In a single-process run another count may be given to see what
      each process of such a run would feed (its devices: equal groups in id order).

    **Returns:** a [`ProcessSlice`][].

    **Raises:** `ValueError` when only one of `process_index` and `process_count` is given,
    `process_index` is not in `[0, process_count)`, `spec=None` with more than one process,
    `batch` does not split over the spec's batch axes or `seq` over its layout, a simulated
    `process_count` is not the real one in a multi-process run or does not divide the
    mesh's device count, or the process holds none of the mesh's devices.
    """
    batch, seq = global_shape
    real_index, real_count = jax.process_index(), jax.process_count()
    if (process_index is None) != (process_count is None):
        raise ValueError(
            f"pass process_index and process_count together, or neither; got "
            f"process_index={process_index}, process_count={process_count}. Leave both unset "
            "to use jax.process_index() and jax.process_count()."
        )
    index = real_index if process_index is None else process_index
    count = real_count if process_count is None else process_count
    mine = (index, count) == (real_index, real_count)
    if count < 1 or not 0 <= index < count:
        raise ValueError(
            f"process_index must lie in [0, process_count); got process_index={index}, "
            f"process_count={count}. Leave both unset to use jax.process_index() and "
            "jax.process_count()."
        )
    if spec is None:
        if count > 1:
            raise ValueError(
                f"spec=None places the whole batch on one device, which needs one process; got "
                f"process_count={count}. Pass the run's ShardingSpec."
            )
        everything = (np.arange(batch), np.arange(seq))
        return ProcessSlice(*everything, everything[1], (batch, seq), None, mine)
    spec.check_batch(batch, "batch_size")
    check_sequence_length(spec, seq)
    sharding = spec.sharding(spec.token_pspec())
    if mine:
        held = sharding.addressable_devices_indices_map(global_shape)
    else:
        every = sharding.devices_indices_map(global_shape)
        held = {d: every[d] for d in _process_devices(spec.mesh, index, count)}
    if not held:
        raise ValueError(
            f"process {index} of {count} holds none of the mesh's {spec.mesh.devices.size} "
            "devices, so it has nothing to feed. Build the mesh from every process's devices "
            "(jax.make_mesh over jax.devices())."
        )
    indices = list(held.values())
    shard = sharding.shard_shape(global_shape)
    rows, slots = _held(indices, 0, shard[0]), _held(indices, 1, shard[1])
    tokens = layout_order(spec, seq)[slots]
    return ProcessSlice(rows, slots, tokens, (batch, seq), sharding, mine)


def place_local(local: Any, part: ProcessSlice) -> Any:
    """Global `jax.Array`s from this process's block of each field (every process calls it).

    **Arguments:**

    - `local`: a `Batch` (or any tuple type of fields) of host arrays
      `[len(part.rows), len(part.slots)]`: this process's rows and slots, in layout order.
    - `part`: this process's [`ProcessSlice`][] of the batch.

    **Returns:** the same type of tuple of global arrays sharded `part.sharding` (on one
    device without a spec: the default device).

    **Raises:** `ValueError` when `part` simulates another process (`process_slice` with
    a `process_index` / `process_count` other than this run's).
    """
    if not part.is_this_process:
        raise ValueError(
            "this slice simulates another process (process_index/process_count given), so "
            "its block can be computed (a feed's local()) but not placed on that process's "
            "devices. Build it without process_index and process_count to place batches."
        )
    if part.sharding is None:
        return _like(local, (jax.device_put(np.asarray(x)) for x in local))
    return _like(
        local,
        (
            jax.make_array_from_process_local_data(part.sharding, np.asarray(x), part.global_shape)
            for x in local
        ),
    )


def _like(fields: Any, values: Any) -> Any:
    """`values` in the container type of `fields`: a named tuple (`Batch`), tuple or list."""
    values = list(values)
    return type(fields)(*values) if hasattr(fields, "_fields") else type(fields)(values)


def place_batch(batch: Any, spec: ShardingSpec | None, *, laid_out: bool = False) -> Any:
    """Place a host batch on the mesh, split over the spec's batch and sequence axes in its
    token layout: on one process or many (each process fills only the shards its own
    devices hold, from the whole host batch it was given).

    Tokens, targets, positions, segment ids and the loss mask move together, so the loss (a
    sum over token slots) is unchanged by the layout. With `spec=None` the batch goes to the
    default device as is.

    **Arguments:**

    - `batch`: a `Batch` (or any tuple type of fields) of `[batch, seq]` host arrays. A
      field that is already a `jax.Array` is kept as it is.
    - `spec`: the `ShardingSpec`, or `None`.
    - `laid_out`: whether the host fields are already in the spec's layout (e.g. a batch
      hook's arrays, made from a placed batch); by default they are in natural order and
      are laid out here.

    **Returns:** the same type of tuple of global `jax.Array`s sharded `P(batch axes,
    sequence axes)`.

    **Raises:** `ValueError` (with a spec) when a field is not `[batch, seq]` or its batch
    and sequence do not split over the spec's batch axes and layout (see
    [`process_slice`][]), or the fields' shapes differ.
    """
    fields = list(batch)
    host = [x for x in fields if not isinstance(x, jax.Array)]
    if not host:
        return batch
    shapes = {np.shape(x) for x in host}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(
            f"place_batch places [batch, seq] fields of one shape; got shapes "
            f"{sorted(shapes)}. Pass a Batch of equal [batch, seq] arrays."
        )
    rows, seq = next(iter(shapes))
    part = process_slice(spec, (rows, seq))
    cols = part.slots if laid_out else part.tokens
    block = [x if isinstance(x, jax.Array) else np.asarray(x)[part.rows][:, cols] for x in fields]
    placed = place_local([x for x in block if not isinstance(x, jax.Array)], part)
    it = iter(placed)
    return _like(batch, (x if isinstance(x, jax.Array) else next(it) for x in block))
