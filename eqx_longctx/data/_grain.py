"""Training and evaluation batches through Grain, each process feeding only its own part.

The global batch of step `s` is a pure function of (seed, step): samples
`s * batch_size ... (s + 1) * batch_size - 1` of `EpochShuffle` (the order of
`PackedDataset.batch`). Its `[batch, seq]` fields are sharded `spec.token_pspec()` in the
spec's token layout. A process reads only the rows its devices hold, lays them out, keeps
only the sequence slots its devices hold, and hands that block to
`jax.make_array_from_process_local_data`: the global array is the same for every process
count and mesh. Grain's `ShardByJaxProcess` is not used: it splits records over processes,
whereas here a row may also be split along the sequence over devices of several processes.
"""

import sys
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np

from .._sharding import ShardingSpec
from ._grain_rows import EpochShuffle, _Rows, rows_dataset
from ._packing import Batch, _check_batch_size
from ._place import ProcessSlice, place_local, process_slice


class _LocalBatches(grain.MapDataset):
    """Grain transform: element `s` is this process's block of global batch `s`, a host
    `Batch` of `[len(rows), len(slots)]` arrays, reading only samples
    `s * batch_size + part.rows`: rows in stored order, or in the order of `order`."""

    def __init__(
        self, rows: _Rows, order: EpochShuffle | None, batch_size: int, part: ProcessSlice, n: int
    ):
        super().__init__(rows if order is None else order)
        self._rows, self._order = rows, order
        self._batch_size, self._part, self._length = batch_size, part, n

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        return self.block(int(index))

    def block(self, step: int) -> Batch:
        """This process's block of batch `step`."""
        ids = [step * self._batch_size + int(r) for r in self._part.rows]
        if self._order is not None:
            ids = [self._order.row_of(i) for i in ids]
        rows = [self._rows.row(i) for i in ids]
        cols = self._part.tokens
        return Batch(*(np.stack([getattr(r, f)[cols] for r in rows]) for f in Batch._fields))

    def __str__(self) -> str:
        return f"_LocalBatches(batch_size={self._batch_size})"


class _Feed:
    """Shared by `GrainBatches` and `GrainEvalBatches`: local blocks and their placement."""

    def __init__(
        self,
        rows: _Rows,
        order: EpochShuffle | None,
        batch_size: int,
        spec: ShardingSpec | None,
        process_index: int | None,
        process_count: int | None,
        num_steps: int,
    ):
        self.batch_size, self.spec = batch_size, spec
        shape = (batch_size, rows.seq_len)
        self.part = process_slice(spec, shape, process_index, process_count)
        self.dataset = _LocalBatches(rows, order, batch_size, self.part, num_steps)

    def _check_step(self, step: int | np.integer, what: str, stop: int | None = None) -> None:
        """**Raises:** `ValueError` unless `step` is an int `>= 0` (and `< stop` if given)."""
        if not isinstance(step, int | np.integer) or step < 0 or (stop and step >= stop):
            bound = f"0 <= {what} < {stop}" if stop else f"{what} >= 0"
            raise ValueError(f"{bound} needed; got {what}={step}. Count {what}s from 0.")

    def local(self, step: int | np.integer) -> Batch:
        """This process's block of batch `step`: host arrays `[len(rows), len(slots)]` (see
        `part`), in the layout; what it hands to `jax.make_array_from_process_local_data`.

        **Raises:** `ValueError` when `step` is not an int `>= 0`.
        """
        self._check_step(step, "step")
        return self.dataset.block(int(step))

    def place(self, local: Batch) -> Batch:
        """Global `jax.Array`s from this process's block (every process calls it):
        `place_local(local, self.part)`.

        **Raises:** `ValueError` when the feed simulates another process (built with a
        `process_index` / `process_count` other than this run's).
        """
        return place_local(local, self.part)


class GrainBatches(_Feed):
    """The training batches as a Grain pipeline: a pure function of (seed, step), each
    process reading and feeding only its own part.

    `get(step)` is the batch `place_batch(dataset.batch(step, batch_size), spec)` gives
    (the same values, layout and sharding) for any process count and mesh: samples in the
    order of `PackedDataset.batch` (`EpochShuffle`), this process's rows read, laid out
    (`to_layout`), cut to its sequence slots and assembled with
    `jax.make_array_from_process_local_data`. Iterating yields the batches of steps
    `0, 1, 2, ...` through a Grain iterator (prefetched on a thread) whose state,
    `get_state()`, is the next step (plus checks), the same on every process:
    save it with the checkpoint, `set_state` it on resume at any process count.

    **Arguments:**

    - `dataset`: a `PackedDataset` (from `load_datasets`) or `PackDocuments`.
    - `batch_size`: global rows per batch; divisible by `spec.batch_parallel_size`.
    - `seed`: the sample order; `dataset.seed` reproduces `dataset.batch`.
    - `spec`: the run's `ShardingSpec`, or `None` for one device.
    - `process_index`, `process_count`: default `jax.process_index()` /
      `jax.process_count()`; a single-process run may pass others to compute what such a
      process would feed (`local`, `part`), not to place it.
    - `prefetch`: batches Grain prepares ahead on a thread (0: none).

    **Raises:** `ValueError` when `batch_size < 1`, `prefetch < 0`, `dataset` is not a
    `PackedDataset` or `PackDocuments`, and as `process_slice` (e.g. a `batch_size` that
    does not split over the spec's batch axes). `local(step)` and `get(step)` raise
    `ValueError` for a step that is not an int `>= 0`; `get` and iteration also for a feed
    that simulates another process.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        seed: int,
        spec: ShardingSpec | None,
        process_index: int | None = None,
        process_count: int | None = None,
        prefetch: int = 2,
    ):
        _check_batch_size(batch_size)
        if prefetch < 0:
            raise ValueError(
                f"prefetch is a number of batches, at least 0; got prefetch={prefetch}. Pass 0 "
                "to read each batch when it is asked for."
            )
        rows = rows_dataset(dataset)
        self.seed, self.num_rows = seed, len(rows)
        order = EpochShuffle(rows, seed)
        steps = sys.maxsize // batch_size
        super().__init__(rows, order, batch_size, spec, process_index, process_count, steps)
        self._read = grain.ReadOptions(num_threads=min(prefetch, 1), prefetch_buffer_size=prefetch)
        self._iterator: Any = None

    def get(self, step: int | np.integer) -> Batch:
        """The global batch of `step` (random access; the iterator does not move).

        **Raises:** `ValueError` when `step` is not an int `>= 0` or the feed simulates
        another process.
        """
        return self.place(self.local(step))

    def _iter(self):
        if self._iterator is None:
            self._iterator = iter(self.dataset.to_iter_dataset(self._read))
        return self._iterator

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.place(next(self._iter()))

    @property
    def step(self) -> int:
        """The step the iterator yields next."""
        return int(self._iter().get_state()["next_index"])

    def get_state(self) -> dict[str, Any]:
        """The iterator state, JSON-serialisable: Grain's state (the next step) and what
        the stream depends on (checked by `set_state`). The same on every process."""
        return {
            "grain": self._iter().get_state(),
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_rows": self.num_rows,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from a `get_state()` (of any process count): the next batch is the one
        of the step it recorded.

        **Raises:** `ValueError` when `state` is not a dict holding a `"grain"` dict, or was
        recorded with another seed, batch size or number of rows.
        """
        if not isinstance(state, dict) or not isinstance(state.get("grain"), dict):
            raise ValueError(
                f"set_state needs a dict from GrainBatches.get_state(); got {state!r}. Pass "
                "the state saved with the checkpoint."
            )
        ours = {"seed": self.seed, "batch_size": self.batch_size, "num_rows": self.num_rows}
        theirs = {k: state.get(k) for k in ours}
        if theirs != ours:
            raise ValueError(
                f"the saved data state was recorded for {theirs}, but these batches have "
                f"{ours}; resuming would read another sample stream. Resume with the same "
                "seed, batch size and data as the saved run."
            )
        self._iter().set_state(state["grain"])

    def close(self) -> None:
        """Stop the prefetch thread (iterating again starts a new iterator at step 0)."""
        if self._iterator is not None:
            self._iterator.close()
            self._iterator = None


class GrainEvalBatches(_Feed):
    """The evaluation batches of a split, placed like `GrainBatches`: every row once, in
    stored order, the last batch padded with empty rows (loss mask 0), so batch `i` is
    `place_batch` of the `i`-th of `dataset.eval_batches(batch_size)`.

    **Arguments:** `dataset`, `batch_size`, `spec`, `process_index`, `process_count` as
    for [`GrainBatches`][].

    **Raises:** as `GrainBatches` for these arguments. `local(i)`, `get(i)` raise
    `ValueError` unless `0 <= i < len(...)`, and `get` for a feed that simulates another
    process.

    Use `len(...)`, `get(i)` (random access, e.g. an evenly spaced subset), iteration, or
    `eval_batches(batch_size)` (so it can stand in for the dataset in `evaluate` with
    `put=None`); `num_rows` is the split's row count.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        spec: ShardingSpec | None,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        _check_batch_size(batch_size)
        self.num_rows = len(rows_dataset(dataset))
        self.num_batches = -(-self.num_rows // batch_size)
        rows = rows_dataset(dataset, self.num_batches * batch_size)
        super().__init__(
            rows, None, batch_size, spec, process_index, process_count, self.num_batches
        )

    def __len__(self) -> int:
        return self.num_batches

    def local(self, step: int | np.integer) -> Batch:
        """This process's block of evaluation batch `step`: host arrays
        `[len(rows), len(slots)]` (see `part`), in the layout.

        **Raises:** `ValueError` unless `step` is an int with `0 <= step < len(self)`.
        """
        self._check_step(step, "batch", self.num_batches)
        return self.dataset.block(int(step))

    def get(self, i: int | np.integer) -> Batch:
        """Evaluation batch `i` as global `jax.Array`s.

        **Raises:** `ValueError` unless `0 <= i < len(self)`, or when the feed simulates
        another process.
        """
        return self.place(self.local(i))

    def __iter__(self) -> Iterator[Batch]:
        return (self.get(i) for i in range(self.num_batches))

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        """Every batch, placed (the `PackedDataset.eval_batches` interface).

        **Raises:** `ValueError` when `batch_size` differs from the one these batches were
        built with.
        """
        if batch_size != self.batch_size:
            raise ValueError(
                f"these evaluation batches hold {self.batch_size} rows; got "
                f"batch_size={batch_size}. Build GrainEvalBatches with batch_size={batch_size}."
            )
        return iter(self)
