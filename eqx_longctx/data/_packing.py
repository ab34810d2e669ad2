"""Packing documents into fixed-length rows, and the batches the trainer reads.

A document's tokens followed by EOS form a stream. The stream is cut into pieces; each
piece, preceded by BOS, is one segment of a row. Rows are filled greedily in document
order: a piece takes all the room left in the row (a document too long for the room
continues as a new segment in the next row), so only the last row and rows with exactly
one free slot (too small for BOS plus a token) carry padding. Every byte of every document
appears exactly once as a token and once as a target.
"""

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, final, no_type_check

import jax
import numpy as np
from jaxtyping import Float, Int

from ._hf_tokenizer import HFTokenizer
from ._tokenizer import ByteTokenizer

Tokenizer = ByteTokenizer | HFTokenizer
"""The tokenizers packing takes: `ByteTokenizer`, or a checkpoint's `HFTokenizer`."""


class Batch(NamedTuple):
    """One batch of packed rows; every field is a numpy or jax array of shape `[batch, seq]`.

    - `tokens`: `int32` input ids.
    - `targets`: `int32` id of the token after `tokens[b, t]` in the same segment; `pad_id`
      at the last token of a segment and on padding.
    - `positions`: `int32` position within the segment, restarting at 0 at its BOS.
    - `segment_ids`: `int32` 1, 2, 3, ... per segment within a row; padding is 0. Attention
      stays within a segment.
    - `loss_mask`: `float32` 1.0 where `targets[b, t]` is a real next token of the same
      segment, else 0.0 (last token of a segment, padding).
    """

    tokens: Int[np.ndarray | jax.Array, "batch seq"]
    targets: Int[np.ndarray | jax.Array, "batch seq"]
    positions: Int[np.ndarray | jax.Array, "batch seq"]
    segment_ids: Int[np.ndarray | jax.Array, "batch seq"]
    loss_mask: Float[np.ndarray | jax.Array, "batch seq"]


def _check_seq_len(seq_len: int) -> None:
    if seq_len < 2:
        raise ValueError(
            f"seq_len must be at least 2 (a BOS and one token to predict); got seq_len={seq_len}. "
            "Pass seq_len >= 2, typically a power of two such as 1024."
        )


def _with_targets(
    tokens: Int[np.ndarray, "batch seq"],
    positions: Int[np.ndarray, "batch seq"],
    segment_ids: Int[np.ndarray, "batch seq"],
    pad_id: int,
) -> Batch:
    """Complete rows into a `Batch`: a token's target is the next token of its segment."""
    same = np.zeros(tokens.shape, bool)
    same[:, :-1] = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, :-1] != 0)
    targets = np.full_like(tokens, pad_id)
    targets[:, :-1] = np.where(same[:, :-1], tokens[:, 1:], pad_id)
    return Batch(tokens, targets, positions, segment_ids, same.astype(np.float32))


class _Plan(NamedTuple):
    """Where every piece of every document stream goes: piece `k` is
    `stream(doc[k])[start[k]:stop[k]]`, preceded by BOS at flat slot `offset[k]`; pieces are
    sorted by `offset`, and row `r` holds pieces `row_start[r] ... row_start[r + 1] - 1`."""

    offset: np.ndarray
    doc: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    row_start: np.ndarray
    seq_len: int

    @property
    def num_rows(self) -> int:
        return len(self.row_start) - 1


def _plan(stream_lengths: Sequence[int], seq_len: int) -> _Plan:
    """The packing of streams of these lengths (a document's tokens plus EOS) into rows."""
    pieces = []  # (flat offset of the BOS, document, start, stop)
    cursor = 0
    for doc, length in enumerate(stream_lengths):
        start = 0
        while start < length:
            room = seq_len - cursor % seq_len
            if room < 2:  # no space for BOS plus a token: leave the slot as padding
                cursor += room
                continue
            stop = min(length, start + room - 1)
            pieces.append((cursor, doc, start, stop))
            cursor += stop - start + 1
            start = stop
    offset, doc, start, stop = np.array(pieces, np.int64).reshape(-1, 4).T
    row_start = np.searchsorted(offset // seq_len, np.arange(-(-cursor // seq_len) + 1))
    return _Plan(offset, doc, start, stop, row_start, seq_len)


def _fill(plan: _Plan, rows: range, stream: Callable[[int], np.ndarray], tokenizer):
    """`tokens`, `positions`, `segment_ids` of `rows` (consecutive), each `[len(rows), seq]`,
    reading each piece from `stream(doc)`."""
    seq_len, first = plan.seq_len, rows.start * plan.seq_len
    tokens = np.full(len(rows) * seq_len, tokenizer.pad_id, np.int32)
    positions = np.zeros(len(rows) * seq_len, np.int32)
    segment_ids = np.zeros(len(rows) * seq_len, np.int32)
    row, seg = -1, 0
    for k in range(plan.row_start[rows.start], plan.row_start[rows.stop]):
        offset = int(plan.offset[k]) - first
        piece = stream(int(plan.doc[k]))[plan.start[k] : plan.stop[k]]
        seg = seg + 1 if offset // seq_len == row else 1
        row = offset // seq_len
        end = offset + 1 + len(piece)
        tokens[offset] = tokenizer.bos_id
        tokens[offset + 1 : end] = piece
        positions[offset:end] = np.arange(end - offset)
        segment_ids[offset:end] = seg
    shape = (len(rows), seq_len)
    return tokens.reshape(shape), positions.reshape(shape), segment_ids.reshape(shape)


def _stream(ids: np.ndarray, tokenizer) -> np.ndarray:
    """A document's stream: its tokens, then EOS."""
    return np.append(ids, tokenizer.eos_id).astype(np.int32)


def _pack(docs: Sequence[np.ndarray], seq_len: int, tokenizer: Tokenizer):
    """Rows of `tokens`, `positions`, `segment_ids`, each `[num_rows, seq_len]`."""
    plan = _plan([len(ids) + 1 for ids in docs], seq_len)
    streams = [_stream(ids, tokenizer) for ids in docs]
    return _fill(plan, range(plan.num_rows), streams.__getitem__, tokenizer)


def _encode_all(docs: Any, tokenizer: Tokenizer | None):
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    if len(docs) == 0:
        raise ValueError(
            "Packing needs at least one document; got an empty list. "
            "Check the corpus (load_corpus) or the split that produced it."
        )
    if isinstance(docs, str | bytes):
        raise TypeError(
            "docs must be a sequence of documents (str or bytes); got one "
            f"{type(docs).__name__}, which would pack each character as a document. Pass "
            "[text]."
        )
    bad = next((i for i, d in enumerate(docs) if not isinstance(d, str | bytes)), None)
    if bad is not None:
        raise TypeError(
            f"every document must be str or bytes; got docs[{bad}] of type "
            f"{type(docs[bad]).__name__}. Convert it with str(...)."
        )
    _pad_id(tokenizer)  # an HFTokenizer without its special ids cannot pack
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.encode_batch(docs), tokenizer
    return [tokenizer.encode(d) for d in docs], tokenizer


def _pad_id(tokenizer: Tokenizer) -> int:
    """The padding id, after checking that the tokenizer has all three special ids."""
    bos, eos, pad = tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id
    if bos is None or eos is None or pad is None:
        raise ValueError(
            f"packing needs BOS, EOS and padding ids; {tokenizer!r} has bos_id={bos}, "
            f"eos_id={eos}, pad_id={pad}. Build it with HFTokenizer.from_checkpoint(DIR), or "
            "pass the three ids."
        )
    return pad


@no_type_check  # validated eagerly, with errors that say what to fix
def pack_documents(
    docs: Sequence[str | bytes], seq_len: int, tokenizer: Tokenizer | None = None
) -> Batch:
    """Pack documents, in order, into rows of `seq_len` tokens (see the module docstring).

    **Arguments:**

    - `docs`: the documents, as text or bytes.
    - `seq_len`: tokens per row, at least 2.
    - `tokenizer`: default `ByteTokenizer()`; or a checkpoint's `HFTokenizer`.

    **Returns:**

    A `Batch` of numpy arrays of shape `[num_rows, seq_len]` holding every row.

    **Raises:** `TypeError` when `docs` is one string or holds something other than str
    or bytes; `ValueError` when `seq_len < 2`, `docs` is empty, or an `HFTokenizer` lacks
    a BOS, EOS or padding id or cannot encode a document.
    """
    _check_seq_len(seq_len)
    encoded, tokenizer = _encode_all(docs, tokenizer)
    return _with_targets(*_pack(encoded, seq_len, tokenizer), _pad_id(tokenizer))


@final
@dataclass(frozen=True, eq=False, repr=False)
class PackedDataset:
    """Packed rows of a document set, served as `Batch`es that depend only on (seed, step).

    Build it with `PackedDataset.from_documents` (or `load_datasets`). Fields:
    `tokens`, `positions`, `segment_ids` (numpy `[num_rows, seq_len]`; targets and loss
    mask are derived per batch), `pad_id`, `num_documents`, `seed`, and `loss_weights`:
    `None`, or float32 `[num_rows, seq_len]` weights multiplied into each batch's derived
    loss mask (0 where a target should not count, e.g. everything but a retrieval
    document's answer).

    **Raises:** `ValueError` when `loss_weights` is not shaped like `tokens` or holds a
    non-finite value.
    """

    tokens: Int[np.ndarray, "rows seq"]
    positions: Int[np.ndarray, "rows seq"]
    segment_ids: Int[np.ndarray, "rows seq"]
    pad_id: int
    num_documents: int
    seed: int = 0
    loss_weights: np.ndarray | None = None  # checked in __post_init__, with its fix

    def __post_init__(self):
        w = self.loss_weights
        if w is not None and (w.shape != self.tokens.shape or not np.all(np.isfinite(w))):
            raise ValueError(
                f"PackedDataset: loss_weights must be finite and shaped like tokens "
                f"{self.tokens.shape}; got shape {w.shape}. Pass one weight per token slot, "
                "or None."
            )

    @classmethod
    def from_documents(
        cls,
        docs: Sequence[str | bytes],
        seq_len: int,
        tokenizer: Tokenizer | None = None,
        *,
        seed: int = 0,
    ) -> "PackedDataset":
        """Tokenize and pack `docs` (see `pack_documents`); `seed` fixes the row order.

            **Raises:** `ValueError` when `seq_len < 2`, `docs` is empty, or an `HFTokenizer` lacks
        a BOS, EOS or padding id or cannot encode a document.
        """
        _check_seq_len(seq_len)
        encoded, tokenizer = _encode_all(docs, tokenizer)
        rows = _pack(encoded, seq_len, tokenizer)
        return cls(*rows, pad_id=_pad_id(tokenizer), num_documents=len(docs), seed=seed)

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    @property
    def padding_fraction(self) -> float:
        """Fraction of all token slots that are padding (segment id 0)."""
        return float(np.mean(self.segment_ids == 0))

    def __repr__(self) -> str:
        return (
            f"PackedDataset(num_rows={self.num_rows}, seq_len={self.seq_len}, "
            f"num_documents={self.num_documents}, padding_fraction={self.padding_fraction:.4f}, "
            f"seed={self.seed})"
        )

    def rows(self, index: Int[np.ndarray, " batch"]) -> Batch:
        """The rows at `index` as a `Batch`; an index `>= num_rows` gives an empty row
        (PAD tokens, segment 0, loss mask 0)."""
        real = (index < self.num_rows)[:, None]
        take = np.minimum(index, self.num_rows - 1)
        batch = _with_targets(
            np.where(real, self.tokens[take], self.pad_id),
            np.where(real, self.positions[take], 0),
            np.where(real, self.segment_ids[take], 0),
            self.pad_id,
        )
        if self.loss_weights is None:
            return batch
        weights = np.where(real, self.loss_weights[take], 0.0).astype(np.float32)
        return batch._replace(loss_mask=batch.loss_mask * weights)

    def batch(self, step: int, batch_size: int) -> Batch:
        """The training batch of `step`: a pure function of (`seed`, `step`, `batch_size`).

        Sample `i` of the stream is row `permutation_e[i % num_rows]` with epoch
        `e = i // num_rows` and `permutation_e` drawn from
        `np.random.default_rng((seed, e))`; step `s` holds samples
        `s * batch_size ... (s + 1) * batch_size - 1`, so a batch may straddle two epochs
        and a resumed run sees exactly the same batches.

        **Arguments:**

        - `step`: the training step, `>= 0`.
        - `batch_size`: rows per batch, `>= 1` (may exceed `num_rows`: rows then repeat).

        **Returns:**

        A `Batch` of numpy arrays of shape `[batch_size, seq_len]`.

        **Raises:** `ValueError` when `step < 0` or `batch_size < 1`.
        """
        _check_batch_size(batch_size)
        if step < 0:
            raise ValueError(
                f"batch(step, batch_size) needs step >= 0; got step={step}. Count steps from 0."
            )
        epoch, slot = np.divmod(step * batch_size + np.arange(batch_size), self.num_rows)
        index = np.empty(batch_size, np.int64)
        for e in np.unique(epoch):
            order = np.random.default_rng((self.seed, int(e))).permutation(self.num_rows)
            index[epoch == e] = order[slot[epoch == e]]
        return self.rows(index)

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        """Every row once, in stored order, `batch_size` rows at a time.

        The last batch is padded with empty rows (loss mask 0), so every batch has the
        same shape (no recompilation) and a loss averaged over `loss_mask` is exact.

        **Returns:**

        An iterator of `ceil(num_rows / batch_size)` `Batch`es of shape
        `[batch_size, seq_len]`.

        **Raises:** `ValueError` when `batch_size < 1` (at the call, not at the first `next`).
        """
        _check_batch_size(batch_size)  # now, not at the first next()
        starts = range(0, self.num_rows, batch_size)
        return (self.rows(np.arange(s, s + batch_size)) for s in starts)


def _check_batch_size(batch_size: int) -> None:
    if batch_size <= 0:
        raise ValueError(
            f"batch_size must be at least 1; got batch_size={batch_size}. "
            "Pass a positive number of rows per batch."
        )
