"""Packed rows as Grain `MapDataset`s: the packing transform, and the sample order.

`PackDocuments` is our packing (see `_packing`) as a Grain transform over a `MapDataset`
of documents: random access to any row, built from the documents that row holds. Grain's
own packers (`ConcatThenSplitIterDataset`, `FirstFitPackIterDataset`) are not used: they are
`IterDataset`s (no random access by step, so no shuffle of packed rows and no resume
without replay), and their segments differ from ours (a piece continued from the previous
row keeps counting positions and has no BOS, or loses its first token to one).
"""

import functools
import sys
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from ._packing import (
    Batch,
    PackedDataset,
    Tokenizer,
    _check_seq_len,
    _fill,
    _pad_id,
    _plan,
    _stream,
    _with_targets,
)
from ._tokenizer import ByteTokenizer


def _squeeze(batch: Batch) -> Batch:
    return Batch(*(x[0] for x in batch))


class _Rows(grain.MapDataset):
    """A Grain dataset of packed rows: element `r` is a `Batch` of 1-D arrays `[seq_len]`."""

    seq_len: int
    pad_id: int

    def row(self, index: int) -> Batch:
        """Row `index`."""
        raise NotImplementedError

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        return self.row(int(index))


class PackDocuments(_Rows):
    """Grain transform: documents in, packed rows out, as `pack_documents` packs them.

    Element `r` is row `r` as a `Batch` of 1-D numpy arrays `[seq_len]` (tokens, targets,
    positions, segment ids, loss mask), equal to row `r` of `pack_documents(docs, seq_len)`.
    Building it reads every document once (the layout of rows depends on all lengths
    before them); a row is then made from the documents it holds, on demand.

    **Arguments:**

    - `docs`: a Grain `MapDataset` of documents (`str` or `bytes`), or a sequence of them.
    - `seq_len`: tokens per row, at least 2.
    - `tokenizer`: default `ByteTokenizer()`; or a checkpoint's `HFTokenizer`.

    **Raises:** `ValueError` when `seq_len < 2`, `docs` is empty, or a document is `None`
    (as a Grain filter leaves a dropped one).
    """

    def __init__(
        self,
        docs: "grain.MapDataset | Sequence[str | bytes]",
        seq_len: int,
        tokenizer: Tokenizer | None = None,
    ):
        _check_seq_len(seq_len)
        if not isinstance(docs, grain.MapDataset):
            docs = grain.MapDataset.source(docs)
        if len(docs) == 0:
            raise ValueError(
                "PackDocuments needs at least one document; got an empty dataset. "
                "Check the corpus (load_corpus) or the split that produced it."
            )
        self.tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
        encoded = docs.map(self.tokenizer.encode)
        super().__init__(encoded)
        self.num_documents, self.seq_len = len(encoded), seq_len
        self.pad_id = _pad_id(self.tokenizer)
        self._plan = _plan([len(self._ids(i)) + 1 for i in range(len(encoded))], seq_len)
        # Neighbouring rows share documents: keep the last few streams.
        self._stream = functools.lru_cache(maxsize=16)(self._read_stream)

    def _ids(self, doc: int) -> np.ndarray:
        ids = self._parent[doc]
        if ids is None:
            raise ValueError(
                f"PackDocuments needs every document of its dataset; document {doc} is None "
                "(how a Grain filter drops an element). Filter the documents into a list "
                "first, then wrap it with grain.MapDataset.source."
            )
        return ids

    def _read_stream(self, doc: int) -> np.ndarray:
        return _stream(self._ids(doc), self.tokenizer)

    def __len__(self) -> int:
        return self._plan.num_rows

    def row(self, index: int) -> Batch:
        """Row `index` (modulo the number of rows, as Grain's `MapDataset`s wrap), as a
        `Batch` of 1-D arrays `[seq_len]`."""
        row = index % len(self)  # past the end wraps, as Grain's MapDatasets do
        rows = _fill(self._plan, range(row, row + 1), self._stream, self.tokenizer)
        return _squeeze(_with_targets(*rows, self.pad_id))

    def __str__(self) -> str:
        return f"PackDocuments(seq_len={self.seq_len}, num_rows={len(self)})"


class _PackedRows(_Rows):
    """The rows of a `PackedDataset` as a Grain source; an index past the end (the padding
    of the last evaluation batch) is an empty row."""

    def __init__(self, dataset: PackedDataset, length: int | None = None):
        super().__init__()
        self._dataset = dataset
        self._length = dataset.num_rows if length is None else length
        self.seq_len, self.pad_id = dataset.seq_len, dataset.pad_id

    def __len__(self) -> int:
        return self._length

    def row(self, index: int) -> Batch:
        return _squeeze(self._dataset.rows(np.array([index])))

    def __str__(self) -> str:
        return f"_PackedRows(num_rows={self._dataset.num_rows})"


class _PaddedRows(_Rows):
    """`PackDocuments` rows, then empty rows up to `length`."""

    def __init__(self, rows: PackDocuments, length: int):
        super().__init__(rows)
        self._rows, self._length = rows, length
        self.seq_len, self.pad_id = rows.seq_len, rows.pad_id

    def __len__(self) -> int:
        return self._length

    def row(self, index: int) -> Batch:
        if index < len(self._rows):
            return self._rows.row(index)
        empty = np.zeros((1, self.seq_len), np.int32)
        return _squeeze(_with_targets(empty + self.pad_id, empty, empty, self.pad_id))

    def __str__(self) -> str:
        return f"_PaddedRows(length={self._length})"


def rows_dataset(dataset: Any, length: int | None = None) -> _Rows:
    """The packed rows of `dataset` (a `PackedDataset` or `PackDocuments`) as a Grain
    `MapDataset` of 1-D `Batch`es, padded with empty rows to `length` when given."""
    if isinstance(dataset, PackedDataset):
        return _PackedRows(dataset, length)
    if isinstance(dataset, PackDocuments):
        return dataset if length is None else _PaddedRows(dataset, length)
    raise ValueError(
        "the batches are read from packed rows: a PackedDataset (from load_datasets or "
        "PackedDataset.from_documents) or a PackDocuments Grain dataset; got "
        f"{type(dataset).__name__}. Pack the documents first."
    )


class EpochShuffle(grain.MapDataset):
    """Grain transform: the endless sample stream of `PackedDataset.batch`.

    Sample `i` is row `permutation_e[i % num_rows]` of the parent, with epoch
    `e = i // num_rows` and `permutation_e = np.random.default_rng((seed, e))
    .permutation(num_rows)`: the order `PackedDataset.batch` reads, so both paths give the
    same batches. Random access: any sample costs one permutation per epoch (cached).
    """

    def __init__(self, parent: grain.MapDataset, seed: int):
        super().__init__(parent)
        self._num_rows, self._seed, self._rows = len(parent), seed, parent
        self._permutation = functools.lru_cache(maxsize=4)(self._draw)

    def _draw(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self._seed, epoch)).permutation(self._num_rows)

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        return self._rows[self.row_of(int(index))]

    def row_of(self, sample: int) -> int:
        """The parent row of sample `sample`."""
        epoch, slot = divmod(sample, self._num_rows)
        return int(self._permutation(epoch)[slot])

    def __str__(self) -> str:
        return f"EpochShuffle(seed={self._seed}, num_rows={self._num_rows})"
