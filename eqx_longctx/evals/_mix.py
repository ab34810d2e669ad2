"""Training rows of synthetic retrieval documents, to mix into a text corpus: what the
`passkey` recipe trains on besides the standard library."""

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._tasks import check_task, make_sample, min_length

SYNTHETIC_LOSSES = ("all", "answers")
"""What the training loss counts in a retrieval document: every token, or the answer's."""

FULL_ROW_SHARE = 0.3
"""The share of retrieval rows that hold one document of three quarters to all of the row
(the others hold several shorter ones), so that every depth of the longest context is
trained."""


def _row_pieces(rng: np.random.Generator, seq_len: int, shortest: int) -> list[int]:
    """Token counts of the documents of one row (each with its BOS and EOS), each at least
    `shortest`; the rest of the row is padding. One long document (`FULL_ROW_SHARE`), or
    log-uniform pieces while at least `shortest` tokens are left.

    Lengths vary from row to row on purpose: with every document as long as the row, the
    question always sits at the same position, and a model learns to answer there from
    the position rather than from the needle (measured: 10% of pass keys at the training
    length, none 1 to 5 tokens shorter).
    """
    if rng.random() < FULL_ROW_SHARE:
        return [int(rng.integers(max(shortest, seq_len - seq_len // 4), seq_len + 1))]
    pieces, left = [], seq_len
    while left >= shortest:
        size = int(np.exp(rng.uniform(np.log(shortest), np.log(left + 1))))
        pieces.append(min(max(size, shortest), left))
        left -= pieces[-1]
    return pieces


def retrieval_dataset(
    tasks: Sequence[str],
    tokenizer: Any,
    seq_len: int,
    rows: int,
    *,
    seed: int = 0,
    loss: str = "all",
) -> Any:
    """`rows` packed rows of retrieval documents (`make_sample`'s prompt and answer, at a
    uniform random depth, task by task in turn at random): one document of three quarters
    to all of the row, or several shorter ones, each opened by BOS and closed by EOS, with
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

    **Returns:** an `eqx_longctx.data.PackedDataset`.

    **Raises:** `ValueError` for an unknown task or `loss`, or a `seq_len` too short for
    the longest task's shortest document.
    """
    from ..data import PackedDataset

    tasks = [check_task(t) for t in tasks]
    if loss not in SYNTHETIC_LOSSES:
        raise ValueError(
            f"the retrieval documents' loss must be one of {SYNTHETIC_LOSSES}; got {loss!r}. "
            "Pass 'answers' to train on the answers alone, or 'all'."
        )
    shortest = max(min_length(t, tokenizer) for t in tasks) + 2
    if seq_len < shortest:
        raise ValueError(
            f"--seq-len must be at least {shortest} tokens for retrieval documents of "
            f"{', '.join(tasks)}; got {seq_len}. Raise --seq-len or drop --synthetic."
        )
    rng = np.random.default_rng([seed, 48])
    tokens = np.full((rows, seq_len), tokenizer.pad_id, np.int32)
    positions = np.zeros((rows, seq_len), np.int32)
    segments = np.zeros((rows, seq_len), np.int32)
    weights = np.zeros((rows, seq_len), np.float32) if loss == "answers" else None
    documents = 0
    for r in range(rows):
        at = 0
        for seg, size in enumerate(_row_pieces(rng, seq_len, shortest), start=1):
            task = tasks[int(rng.integers(len(tasks)))]
            s = make_sample(task, tokenizer, length=size - 2, depth=float(rng.random()), rng=rng)
            ids = [tokenizer.bos_id, *s.prompt_ids, *s.answer_ids, tokenizer.eos_id]
            tokens[r, at : at + size] = ids
            positions[r, at : at + size] = np.arange(size)
            segments[r, at : at + size] = seg
            if weights is not None:  # the targets that are the answer's tokens and the EOS
                first = at + len(s.prompt_ids)  # BOS, then the prompt: its last token's slot
                weights[r, first : first + len(s.answer_ids) + 1] = 1.0
            at += size
            documents += 1
    return PackedDataset(tokens, positions, segments, pad_id=tokenizer.pad_id,
                         num_documents=documents, seed=seed, loss_weights=weights)  # fmt: skip


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
