"""Running the generation tasks on a model: batches of prompts through `generate` (greedy,
under the model's sharding spec), each continuation scored by exact match."""

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ._score import score
from ._tasks import Sample, check_task, make_samples, min_length

EXTRA_TOKENS = 4
"""Tokens generated past the longest answer, so that an answer the model continues (a
longer number: wrong) is told from one it ends (right)."""


@dataclasses.dataclass(frozen=True)
class EvalModel:
    """A model as the evals use it.

    **Arguments:**

    - `model`: a decoder of the zoo (any family), on one device or under its spec.
    - `text`: its tokenizer as the tasks use it: `encode(text) -> ids` (no special
      tokens) and `decode(ids) -> text`.
    - `start`: the ids every prompt opens with (e.g. `(BOS,)`, as every training document
      of a run of `python -m eqx_longctx.train` did).
    - `eos`: ids that end a continuation.
    - `name`: what the plots call it.
    """

    model: Any
    text: Any
    start: tuple[int, ...] = ()
    eos: frozenset[int] = frozenset()
    name: str = "model"

    @property
    def max_seq_len(self) -> int:
        return int(self.model.config.max_seq_len)


def check_lengths(em: EvalModel, tasks: Sequence[str], lengths: Sequence[int]) -> None:
    """**Raises:** `ValueError` for a length above the model's `max_seq_len` or below a
    task's shortest sample."""
    for length in lengths:
        if length > em.max_seq_len:
            raise ValueError(
                f"--lengths must be at most the model's max_seq_len={em.max_seq_len} (prompt "
                f"and answer together); got {length}. Pass shorter lengths, or extend the "
                "model with --override max_seq_len=N (and a rope_scaling)."
            )
        for task in tasks:
            if task == "position_loss":
                continue
            shortest = min_length(task, em.text, start=em.start)
            if length < shortest:
                raise ValueError(
                    f"--lengths must be at least {shortest} tokens for task {task!r} (its "
                    f"intro, needles, question and answer); got {length}. Pass longer lengths."
                )


def _batch_multiple(model: Any) -> int:
    spec = getattr(model, "spec", None)
    if spec is None:
        return 1
    sizes = dict(spec.mesh.shape)
    return math.prod(sizes[a] for a in spec.batch_axes if a is not None)


def generate_answers(
    em: EvalModel, samples: Sequence[Sample], *, batch_size: int = 16, impl: Any = None
) -> list[tuple[list[int], str]]:
    """The greedy continuation of each sample's prompt, as `(token ids, text)`.

    Samples of one length run as batches of `batch_size` rows (rounded up to the spec's
    batch shards; a short last batch is filled with copies of its first row), each with a
    cache of `length + EXTRA_TOKENS` tokens (at most `max_seq_len`), so the prefill and
    the decode step compile once per length.

    **Arguments:**

    - `em`: the model.
    - `samples`: samples from `make_samples` (any lengths).
    - `batch_size`: rows per `generate` call.
    - `impl`: the block implementation (`generate`'s).

    **Returns:** one `(ids up to the first EOS, decoded text)` per sample, in order.
    """
    from ..inference import generate

    multiple = _batch_multiple(em.model)
    rows = max(multiple, -(-batch_size // multiple) * multiple)
    out: list[tuple[list[int], str] | None] = [None] * len(samples)
    by_length: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        by_length.setdefault(s.length, []).append(i)
    for length, index in by_length.items():
        longest_answer = max(len(samples[i].answer_ids) for i in index)
        width = max(len(samples[i].prompt_ids) for i in index)
        new = min(longest_answer + EXTRA_TOKENS, em.max_seq_len - width)
        new = max(new, 1)
        max_len = width + new
        for lo in range(0, len(index), rows):
            chunk = index[lo : lo + rows]
            picked = chunk + [chunk[0]] * (rows - len(chunk))
            tokens = np.zeros((rows, width), np.int32)
            lengths = np.zeros((rows,), np.int32)
            for r, i in enumerate(picked):
                ids = samples[i].prompt_ids
                tokens[r, : len(ids)] = ids
                lengths[r] = len(ids)
            result = np.asarray(
                generate(
                    em.model, tokens, lengths=lengths, max_new_tokens=new, max_len=max_len,
                    eos_id=sorted(em.eos) or None, impl=impl,
                )
            )  # fmt: skip
            for r, i in enumerate(chunk):
                ids = [int(t) for t in result[r]]
                for k, t in enumerate(ids):
                    if t in em.eos:
                        ids = ids[:k]
                        break
                out[i] = (ids, em.text.decode(ids))
        del length
    return [o for o in out if o is not None]


def task_samples(
    em: EvalModel,
    tasks: Sequence[str],
    lengths: Sequence[int],
    depths: Sequence[float],
    samples: int,
    seed: int,
) -> list[Sample]:
    """Every sample of every (task, length, depth), in that order (the generation tasks
    only: `position_loss` is a curve, see `position_loss`)."""
    out = []
    for task in tasks:
        if task == "position_loss":
            continue
        check_task(task)
        for length in lengths:
            for depth in depths:
                out.extend(
                    make_samples(
                        task, em.text, length=length, depth=depth, samples=samples, seed=seed,
                        start=em.start,
                    )
                )  # fmt: skip
    return out


def run_samples(
    em: EvalModel,
    samples: Sequence[Sample],
    *,
    batch_size: int = 16,
    impl: Any = None,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
) -> list[dict[str, Any]]:
    """Generate and score `samples`; **returns** one record per sample: `task`, `length`,
    `depth`, `prompt` (the text the model saw), `answer`, `output` (the decoded greedy
    continuation), `correct`, and `output_ids`.

    **Arguments:** as [`generate_answers`][]; `progress` wraps the groups of samples run
    together (e.g. `tqdm`).
    """
    groups: dict[tuple[str, int], list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault((s.task, s.length), []).append(i)
    records: list[dict[str, Any] | None] = [None] * len(samples)
    keys = list(groups)
    for key in progress(keys) if progress is not None else keys:
        index = groups[key]
        answers = generate_answers(
            em, [samples[i] for i in index], batch_size=batch_size, impl=impl
        )
        for i, (ids, text) in zip(index, answers, strict=True):
            s = samples[i]
            records[i] = {
                "task": s.task, "length": s.length, "depth": s.depth, "prompt": s.prompt,
                "answer": s.answer, "output": text, "correct": score(text, s.answer),
                "output_ids": ids,
            }  # fmt: skip
    return [r for r in records if r is not None]


def accuracy_table(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """`{task: {"lengths": [...], "depths": [...], "accuracy": [[depth x length]],
    "samples": [[...]], "overall": float}}` from scored records."""
    table: dict[str, Any] = {}
    for task in dict.fromkeys(r["task"] for r in records):
        mine = [r for r in records if r["task"] == task]
        lengths = sorted({r["length"] for r in mine})
        depths = sorted({r["depth"] for r in mine})
        acc, count = [], []
        for d in depths:
            acc_row, count_row = [], []
            for n in lengths:
                cell = [r["correct"] for r in mine if r["depth"] == d and r["length"] == n]
                acc_row.append(float(np.mean(cell)) if cell else None)
                count_row.append(len(cell))
            acc.append(acc_row)
            count.append(count_row)
        table[task] = {
            "lengths": lengths, "depths": depths, "accuracy": acc, "samples": count,
            "overall": float(np.mean([r["correct"] for r in mine])),
        }  # fmt: skip
    return table
