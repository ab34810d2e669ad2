"""Training rows of synthetic retrieval documents, to mix into a text corpus: what the
`passkey` recipe trains on besides the standard library."""

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._tasks import check_task, make_drill, make_sample, min_drill_length, min_length

SYNTHETIC_LOSSES = ("all", "answers")
"""What the training loss counts in a retrieval document: every token, or the answer's."""

RAMP_SHARE = 0.75
"""With a ramp (`retrieval_dataset`), the share of the rows over which the drills' most
filler grows to its end value."""

FULL_ROW_SHARE = 0.6
"""The share of retrieval rows that hold one document of three quarters to all of the row
(the others hold several shorter ones), so that every depth of the longest context is
trained."""

FAR_DEPTH_POWER = 2.0
"""A whole-row document's needle sits at depth `u ** FAR_DEPTH_POWER` (`u` uniform): more
often near the start, far from the question. The shorter documents already train short
distances many times over; at uniform depths a 2048-token passkey run saw its farthest
needles (depth 0) so rarely that it found 1 in 10 of them, and 9 in 10 with this draw
and `FULL_ROW_SHARE` raised from 0.3 to 0.6 (docs/recipes.md)."""


def _row_pieces(rng: np.random.Generator, seq_len: int, shortest: int) -> tuple[list[int], bool]:
    """Token counts of the documents of one row (each with its BOS and EOS), each at least
    `shortest`, and whether the row is one whole-row document; the rest of the row is
    padding. One long document (`FULL_ROW_SHARE`), or log-uniform pieces while at least
    `shortest` tokens are left.

    Lengths vary from row to row on purpose: with every document as long as the row, the
    question always sits at the same position, and a model learns to answer there from
    the position rather than from the needle (measured: 10% of pass keys at the training
    length, none 1 to 5 tokens shorter).
    """
    if rng.random() < FULL_ROW_SHARE:
        return [int(rng.integers(max(shortest, seq_len - seq_len // 4), seq_len + 1))], True
    pieces, left = [], seq_len
    while left >= shortest:
        size = int(np.exp(rng.uniform(np.log(shortest), np.log(left + 1))))
        pieces.append(min(max(size, shortest), left))
        left -= pieces[-1]
    return pieces, False


def retrieval_dataset(
    tasks: Sequence[str],
    tokenizer: Any,
    seq_len: int,
    rows: int,
    *,
    seed: int = 0,
    loss: str = "all",
    max_filler: int | None = None,
    ramp: bool = False,
) -> Any:
    """`rows` packed rows of retrieval documents (`make_sample`'s prompt and answer, task by
    task in turn at random): one document of three quarters to all of the row
    (`FULL_ROW_SHARE`, its needle drawn towards the start, `FAR_DEPTH_POWER`), or several
    shorter ones at uniform random depths, each opened by BOS and closed by EOS, with
    their own positions and segment ids, then padding (segment 0) shorter than the
    shortest document. Document lengths vary, so no answer sits at a fixed position.

    **Arguments:**

    - `tasks`: generation tasks (`eqx_longctx.evals.TASKS`).
    - `tokenizer`: the run's tokenizer (`bos_id`, `eos_id`, `pad_id`, `encode`, `decode`).
    - `seq_len`: tokens per row.
    - `rows`: how many rows.
    - `seed`: the documents' seed.
    - `loss`: which tokens the training loss counts (`SYNTHETIC_LOSSES`): `"all"` (the
      dataset has no `loss_weights`), or `"answers"`, only the answer's tokens and the EOS
      after them (the targets after the question: the answer, and where it stops), so the
      gradient is the retrieval's alone rather than mostly the filler's.
    - `max_filler`: `None`, or drills (`make_drill`) instead of prompts: each document
      the task's needles and question without the intro, in a uniform 0 to `max_filler`
      tokens of filler from a random token of its unit, the needle at a random token, as
      many to a row as fit. Short drills are where a small model first learns to read a
      needle by its content; prompts at full length teach it no such thing in minutes.
    - `ramp`: with `max_filler`, the most filler grows with the row: from 0 in row 0 to
      `max_filler` at `RAMP_SHARE` of the rows, then stays. Read the rows in order
      (`stream_mix`): a model that starts on needles right before their question learns to
      copy them, then to find them ever further back (a fixed spread from the start does
      not, in the same steps; docs/recipes.md).

    **Returns:** an `eqx_longctx.data.PackedDataset`.

    **Raises:** `ValueError` for an unknown task or `loss`, a negative `max_filler`, `ramp`
    without `max_filler`, or a
    `seq_len` too short for the longest task's shortest document (with `max_filler`, its
    drill at `max_filler` tokens of filler).
    """
    from ..data import PackedDataset

    tasks = [check_task(t) for t in tasks]
    if loss not in SYNTHETIC_LOSSES:
        raise ValueError(
            f"the retrieval documents' loss must be one of {SYNTHETIC_LOSSES}; got {loss!r}. "
            "Pass 'answers' to train on the answers alone, or 'all'."
        )
    if max_filler is not None and (isinstance(max_filler, bool) or max_filler < 0):
        raise ValueError(
            f"--synthetic-filler is the most filler tokens of a drill, an int >= 0; got "
            f"{max_filler!r}. Pass e.g. 32, or leave it out for whole prompts."
        )
    if ramp and max_filler is None:
        raise ValueError(
            "a ramp grows the drills' filler up to max_filler; got ramp=True and no max_filler. "
            "Pass max_filler (--synthetic-filler N)."
        )
    if max_filler is None:
        shortest = max(min_length(t, tokenizer) for t in tasks) + 2
    else:
        shortest = max(min_drill_length(t, tokenizer) for t in tasks) + 2 + max_filler
    if seq_len < shortest:
        what = "retrieval documents" if max_filler is None else f"drills of {max_filler} filler"
        raise ValueError(
            f"--seq-len must be at least {shortest} tokens for {what} of "
            f"{', '.join(tasks)}; got {seq_len}. Raise --seq-len or drop --synthetic"
            f"{'' if max_filler is None else ' or lower --synthetic-filler'}."
        )
    rng = np.random.default_rng([seed, 48])
    tokens = np.full((rows, seq_len), tokenizer.pad_id, np.int32)
    positions = np.zeros((rows, seq_len), np.int32)
    segments = np.zeros((rows, seq_len), np.int32)
    weights = np.zeros((rows, seq_len), np.float32) if loss == "answers" else None
    documents = 0
    for r in range(rows):
        at, seg = 0, 1
        most = max_filler
        if ramp and max_filler is not None:
            most = round(max_filler * min(1.0, r / max(1.0, RAMP_SHARE * rows)))
        for sample in _documents(tasks, tokenizer, rng, seq_len, shortest, most):
            size = sample.length + 2
            if at + size > seq_len:
                break
            ids = [tokenizer.bos_id, *sample.prompt_ids, *sample.answer_ids, tokenizer.eos_id]
            tokens[r, at : at + size] = ids
            positions[r, at : at + size] = np.arange(size)
            segments[r, at : at + size] = seg
            if weights is not None:  # the targets that are the answer's tokens and the EOS
                first = at + len(sample.prompt_ids)  # BOS, then the prompt: its last token's slot
                weights[r, first : first + len(sample.answer_ids) + 1] = 1.0
            at, seg, documents = at + size, seg + 1, documents + 1
    return PackedDataset(tokens, positions, segments, pad_id=tokenizer.pad_id,
                         num_documents=documents, seed=seed, loss_weights=weights)  # fmt: skip


def _documents(
    tasks: list[str], tokenizer: Any, rng: np.random.Generator, seq_len: int, shortest: int,
    max_filler: int | None,
) -> Iterator[Any]:  # fmt: skip
    """The samples of one row, task by task at random: prompts of `_row_pieces`' lengths
    (each with room for its BOS and EOS; a whole row's needle drawn towards the start,
    `FAR_DEPTH_POWER`), or drills until one does not fit."""
    if max_filler is None:
        sizes, whole = _row_pieces(rng, seq_len, shortest)
        for size in sizes:
            task = tasks[int(rng.integers(len(tasks)))]
            depth = float(rng.random()) ** (FAR_DEPTH_POWER if whole else 1.0)
            yield make_sample(task, tokenizer, length=size - 2, depth=depth, rng=rng)
        return
    while True:
        task = tasks[int(rng.integers(len(tasks)))]
        yield make_drill(task, tokenizer, filler=int(rng.integers(max_filler + 1)), rng=rng)


def mix_datasets(text: Any, retrieval: Any) -> Any:
    """The rows of both packed datasets in one (the training batches shuffle them by the
    text dataset's seed)."""
    from ..data import PackedDataset

    weights = None
    if text.loss_weights is not None or retrieval.loss_weights is not None:
        ones = lambda d: np.ones(d.tokens.shape, np.float32)  # noqa: E731
        weights = np.concatenate([ones(d) if d.loss_weights is None else d.loss_weights
                                  for d in (text, retrieval)])  # fmt: skip
    return PackedDataset(
        np.concatenate([text.tokens, retrieval.tokens]),
        np.concatenate([text.positions, retrieval.positions]),
        np.concatenate([text.segment_ids, retrieval.segment_ids]),
        pad_id=text.pad_id,
        num_documents=text.num_documents + retrieval.num_documents,
        seed=text.seed,
        loss_weights=weights,
    )


def retrieval_rows_for(text_rows: int, share: float) -> int:
    """How many retrieval rows make `share` of all rows beside `text_rows` of text."""
    return round(share / (1.0 - share) * text_rows)


def stream_mix(text: Any, retrieval: Any, samples: int) -> Any:
    """`samples` rows that `PackedDataset.batch` (and `GrainBatches`) read in their first
    epoch in this order: the `retrieval` rows in their own order (a ramp stays a ramp),
    the `text` rows in a shuffled cycle spread evenly between them. The rows are stored
    where the batches' first permutation (of `text.seed`) looks for them; later epochs
    shuffle as usual.

    **Arguments:**

    - `text`, `retrieval`: packed datasets of one row length.
    - `samples`: rows in all, the training run's `steps * batch_size`, at least as many as
      `retrieval` has.

    **Returns:** an `eqx_longctx.data.PackedDataset` of `samples` rows and `text.seed`.

    **Raises:** `ValueError` when `samples` is below the retrieval rows.
    """
    from ..data import PackedDataset

    extra = retrieval.num_rows
    if samples < extra:
        raise ValueError(
            f"stream_mix lays out the run's rows; got samples={samples} below the "
            f"{extra} retrieval rows. Pass steps * batch_size, or fewer retrieval rows."
        )
    t = np.arange(samples)
    is_extra = (t + 1) * extra // samples > t * extra // samples  # `extra` slots, evenly
    rng = np.random.default_rng([text.seed, 49])
    cycle = np.concatenate(
        [rng.permutation(text.num_rows) for _ in range(-(-(samples - extra) // text.num_rows))]
    ) if samples > extra else np.zeros(0, np.int64)  # fmt: skip
    source = np.zeros(samples, np.int64)
    source[~is_extra] = cycle[: samples - extra]
    source[is_extra] = text.num_rows + np.arange(extra)  # the retrieval rows, in order
    both = mix_datasets(text, retrieval)
    rows = both.rows(source)
    where = np.random.default_rng((text.seed, 0)).permutation(samples)  # `batch`'s epoch 0
    order = np.empty(samples, np.int64)
    order[where] = np.arange(samples)  # the row stored at `where[t]` is stream slot t
    weights = None if both.loss_weights is None else both.loss_weights[source][order]
    return PackedDataset(
        np.asarray(rows.tokens)[order], np.asarray(rows.positions)[order],
        np.asarray(rows.segment_ids)[order], pad_id=text.pad_id,
        num_documents=both.num_documents, seed=text.seed, loss_weights=weights,
    )  # fmt: skip


def with_retrieval(
    text: Any, tasks: Sequence[str], tokenizer: Any, *, share: float, loss: str, seed: int,
    max_filler: int | None, samples: int,
) -> Any:  # fmt: skip
    """The training rows of a run with `--synthetic` documents: `text` and
    `retrieval_dataset` rows of `tasks` at `share` of all rows.

    - Prompts (no `max_filler`): the rows are shuffled together (`mix_datasets`), with
      `share / (1 - share)` retrieval rows per text row; or, when the run reads fewer rows
      than that mix holds, only the `share` of its `samples` (`steps * batch_size`) that it
      reads, spread evenly among the text rows (`stream_mix`). Nothing is generated that
      no step reads (at share 0.98 the mix would hold 49 retrieval rows per text row).
    - Drills (`max_filler`): their filler ramps up to it over the run's `samples` rows,
      read in order (`stream_mix`).

    **Raises:** `ValueError` as `retrieval_dataset`.
    """
    seq_len = text.tokens.shape[1]
    rows = max(1, round(share * samples))
    whole = retrieval_rows_for(text.num_rows, share)
    if max_filler is None and whole <= rows:  # the run reads the whole mix: shuffle it
        extra = retrieval_dataset(tasks, tokenizer, seq_len, whole, seed=seed, loss=loss)
        return mix_datasets(text, extra)
    extra = retrieval_dataset(tasks, tokenizer, seq_len, rows, seed=seed, loss=loss,
                              max_filler=max_filler, ramp=max_filler is not None)  # fmt: skip
    return stream_mix(text, extra, max(samples, rows))
