"""Synthetic long-context tasks, generated from a seed: pass key retrieval, RULER's
needle-in-a-haystack variants and variable tracking (Hsieh et al. 2024, "RULER: What's the
Real Context Size of Your Long-Context Language Models?"), and multi-query associative
recall (Arora et al. 2023, "Zoology").

Each sample is a prompt of filler units (`FILLER`) with one or more needles at unit
boundaries, a question at the end and the answer the model should continue with;
`len(prompt_ids) + len(answer_ids)` is the requested length exactly, in the tokens of the
tokenizer given. Nothing is downloaded; pure Python and numpy.
"""

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from ._needles import WORDS, Draw, Piece, Place, Text, Var, assemble, assemble_drill, coder

TASKS: tuple[str, ...] = (
    "passkey",
    "niah_single",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "variable_tracking",
    "mqar",
)
"""The synthetic tasks, in a fixed order (the order seeds `make_samples`)."""

GENERATION_TASKS: tuple[str, ...] = TASKS
"""The tasks scored by generating the answer (all of `TASKS`)."""

_TRIES = 20  # draws before giving up on a tokenizer whose pieces outgrow their bound


@dataclasses.dataclass(frozen=True)
class Sample:
    """One prompt of a task and the answer the model should continue it with.

    - `task`: one of `TASKS`.
    - `length`: the requested length: `len(prompt_ids) + len(answer_ids) == length`.
    - `depth`: the requested depth in `[0, 1]` of the queried needle in the filler.
    - `prompt_ids`: the `start` ids, then the prompt's tokens.
    - `answer_ids`: the tokens of the expected continuation (e.g. `encode(" 71432")`).
    - `prompt`: the text of the prompt's tokens (without the `start` ids).
    - `answer`: the expected answer, stripped (e.g. `"71432"`, `"4812763, 1293847"`).
    - `needle_at`: the index in `prompt_ids` where the (first) queried needle starts.
    """

    task: str
    length: int
    depth: float
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]
    prompt: str
    answer: str
    needle_at: int


def check_task(task: str) -> str:
    """**Returns:** `task` when it is one of `TASKS`.

    **Raises:** `ValueError` naming the task and listing `TASKS` otherwise.
    """
    if task not in TASKS:
        raise ValueError(
            f"unknown eval task {task!r}; the tasks are {', '.join(TASKS)}. Pick one of them."
        )
    return task


def _numbers(rng: np.random.Generator, count: int, digits: int) -> list[str]:
    """`count` distinct random numbers of `digits` digits (no leading zero)."""
    while True:
        values = rng.integers(10 ** (digits - 1), 10**digits, size=count).tolist()
        if len(set(values)) == count:
            return [str(v) for v in values]


def _words(rng: np.random.Generator, count: int) -> list[str]:
    """`count` distinct random words of `WORDS`."""
    while True:
        picked = rng.integers(0, len(WORDS), size=count).tolist()
        if len(set(picked)) == count:
            return [WORDS[i] for i in picked]


def _names(rng: np.random.Generator, count: int) -> list[str]:
    """`count` distinct names of 5 random uppercase letters."""
    while True:
        names = ["".join(chr(65 + c) for c in row) for row in rng.integers(0, 26, (count, 5))]
        if len(set(names)) == count:
            return names


def _num(value: str) -> Var:
    return Var("number", " " + value)


def _word(word: str) -> Var:
    return Var("word", " " + word)


def _name(name: str) -> Var:
    return Var("name", " " + name)


def _listing(values: Sequence[Piece]) -> list[Piece]:
    """`values` separated by commas: `" a, b, c"`."""
    out: list[Piece] = []
    for i, value in enumerate(values):
        out += [",", value] if i else [value]
    return out


def _series(words: Sequence[str]) -> list[Piece]:
    """`words` as `" a, b and c"`."""
    return _listing([_word(w) for w in words[:-1]]) + [" and", _word(words[-1])]


def _at_depth(boundaries: int, at: int, rng: np.random.Generator) -> list[int]:
    return [at]


def _and_anywhere(count: int) -> Place:
    """Needle 0 at the depth, `count` more at random boundaries."""

    def place(boundaries: int, at: int, rng: np.random.Generator) -> list[int]:
        return [at] + rng.integers(0, boundaries, count).tolist()

    return place


def _and_after(count: int) -> Place:
    """Needle 0 at the depth, `count` more at random boundaries at or after it, in order."""

    def place(boundaries: int, at: int, rng: np.random.Generator) -> list[int]:
        return [at] + sorted(rng.integers(at, boundaries, count).tolist())

    return place


_NIAH_INTRO = "Special magic numbers are hidden in the text below. Memorize them."


def _magic(word: str, number: str) -> list[Piece]:
    return [" One of the special magic numbers for", _word(word), " is:", _num(number), "."]


def _passkey(rng: np.random.Generator) -> Draw:
    (key,) = _numbers(rng, 1, 5)
    return Draw(
        intro=["There is a pass key hidden in the text below. Find it and remember it."],
        needles=[[" The pass key is", _num(key), ". Remember it."]],
        question=["\nWhat is the pass key? The pass key is"],
        answer=[_num(key)],
        answer_text=key,
        place=_at_depth,
    )


def _niah(rng: np.random.Generator, distractors: int) -> Draw:
    words, numbers = _words(rng, 1 + distractors), _numbers(rng, 1 + distractors, 7)
    word = _word(words[0])
    return Draw(
        intro=[_NIAH_INTRO],
        needles=[_magic(w, n) for w, n in zip(words, numbers, strict=True)],
        question=[
            "\nWhat is the special magic number for",
            word,
            " mentioned in the text? The special magic number for",
            word,
            " is",
        ],  # fmt: skip
        answer=[_num(numbers[0])],
        answer_text=numbers[0],
        place=_and_anywhere(distractors),
    )


def _niah_multivalue(rng: np.random.Generator) -> Draw:
    (word,), numbers = _words(rng, 1), _numbers(rng, 4, 7)
    return Draw(
        intro=[_NIAH_INTRO],
        needles=[_magic(word, n) for n in numbers],
        question=["\nWhat are all the special magic numbers for", _word(word), "? They are"],
        answer=_listing([_num(n) for n in numbers]),
        answer_text=", ".join(numbers),
        place=_and_after(3),
    )


def _niah_multiquery(rng: np.random.Generator) -> Draw:
    words, numbers = _words(rng, 4), _numbers(rng, 4, 7)
    return Draw(
        intro=[_NIAH_INTRO],
        needles=[_magic(w, n) for w, n in zip(words, numbers, strict=True)],
        question=["\nWhat are the special magic numbers for", *_series(words), "? They are"],
        answer=_listing([_num(n) for n in numbers]),
        answer_text=", ".join(numbers),
        place=_and_anywhere(3),
    )


def _chain(names: Sequence[str], value: str) -> list[list[Piece]]:
    first: list[Piece] = [" VAR", _name(names[0]), " =", _num(value), "."]
    hops = [
        [" VAR", _name(b), " = VAR", _name(a), "."]
        for a, b in zip(names[:-1], names[1:], strict=True)
    ]
    return [first, *hops]


def _chains(boundaries: int, at: int, rng: np.random.Generator) -> list[int]:
    """The queried chain from the depth on, its hops evenly spaced between its first
    assignment and the end of the filler; the distractor chain at random boundaries."""
    room = boundaries - 1 - at
    chain = [at + round(room * k / 4) for k in range(4)]
    return chain + sorted(rng.integers(0, boundaries, 4).tolist())


def _variable_tracking(rng: np.random.Generator) -> Draw:
    names, (value, other) = _names(rng, 8), _numbers(rng, 2, 5)
    return Draw(
        intro=["Track the chains of variable assignments hidden in the text below."],
        needles=_chain(names[:4], value) + _chain(names[4:], other),
        question=["\nQuestion: which variables hold the value", _num(value), "? Answer:"],
        answer=[_name(n) for n in names[:4]],
        answer_text=" ".join(names[:4]),
        place=_chains,
    )


def _mqar(rng: np.random.Generator) -> Draw:
    words, values = _words(rng, 8), _numbers(rng, 8, 3)
    block: list[Piece] = []
    for word, value in zip(words, values, strict=True):
        block += [_word(word), ":", _num(value), "."]
    asked = rng.choice(8, size=3, replace=False).tolist()
    return Draw(
        intro=["A list of words and their numbers is hidden in the text below. Memorize it."],
        needles=[block],
        question=["\nWhat are the numbers of", *_series([words[i] for i in asked]), "? They are"],
        answer=_listing([_num(values[i]) for i in asked]),
        answer_text=", ".join(values[i] for i in asked),
        place=_at_depth,
    )


_DRAWS = {
    "passkey": _passkey,
    "niah_single": lambda rng: _niah(rng, 0),
    "niah_multikey": lambda rng: _niah(rng, 3),
    "niah_multivalue": _niah_multivalue,
    "niah_multiquery": _niah_multiquery,
    "variable_tracking": _variable_tracking,
    "mqar": _mqar,
}


def _start_ids(start: Sequence[int | np.integer] | np.ndarray) -> list[int]:
    return [int(i) for i in start] if len(start) else []


def min_length(
    task: str, text: Text, *, start: Sequence[int | np.integer] | np.ndarray = ()
) -> int:
    """The shortest length a sample of `task` can have with the tokenizer `text`: the
    `start` ids and every piece but the filler at their largest (longest word, most tokens
    a number or name can take); `make_sample` refuses shorter lengths.

    **Arguments:**

    - `task`: one of `TASKS`.
    - `text`: the tokenizer (see `Text`).
    - `start`: ids every prompt opens with (e.g. `[bos_id]`); they count.

    **Returns:** the length in tokens.

    **Raises:** `ValueError` for an unknown task.
    """
    check_task(task)
    code = coder(text)
    if task not in code.minimum:
        draw = _DRAWS[task](np.random.default_rng(0))  # every draw has the same pieces
        code.minimum[task] = code.bound(draw.pieces())
    return len(_start_ids(start)) + code.minimum[task]


def _check_length(task: str, text: Text, length: object, start: list[int]) -> int:
    if not isinstance(length, int | np.integer) or isinstance(length, bool):
        raise ValueError(
            f"length must be an int number of tokens; got {length!r} "
            f"({type(length).__name__}). Pass e.g. length=1024."
        )
    shortest = min_length(task, text, start=start)
    if length < shortest:
        raise ValueError(
            f"length={length} is below the shortest {task!r} sample for this tokenizer "
            f"(min_length={shortest} tokens, start ids included); pass length >= {shortest}."
        )
    return int(length)


def _check_depth(depth: object) -> float:
    if isinstance(depth, int | float | np.floating | np.integer) and not isinstance(depth, bool):
        value = float(depth)
        if math.isfinite(value) and 0 <= value <= 1:
            return value
    raise ValueError(
        f"depth is where the needle sits in the filler, a number in [0, 1] (0: right after "
        f"the intro, 1: right before the question); got {depth!r}. Pass e.g. depth=0.5."
    )


def _build(
    task: str, text: Text, length: int, depth: float, rng: np.random.Generator,
    start: list[int],
) -> tuple[np.ndarray, np.ndarray, int, str]:  # fmt: skip
    """Prompt ids, answer ids, needle index and answer text; arguments checked."""
    code = coder(text)
    for _ in range(_TRIES):
        draw = _DRAWS[task](rng)
        built = assemble(code, draw, start=start, length=length, depth=depth, rng=rng)
        if built is not None:
            return *built, draw.answer_text
    raise ValueError(
        f"the tokenizer encodes the pieces of {task!r} into more tokens than min_length "
        f"({min_length(task, text, start=start)}) assumed, in {_TRIES} draws at "
        f"length={length}; pass a larger length."
    )


def make_sample(
    task: str, text: Text, *, length: int, depth: float | int, rng: np.random.Generator,
    start: Sequence[int | np.integer] | np.ndarray = (),
) -> Sample:  # fmt: skip
    """One sample of `task`: a prompt of exactly `length - len(answer_ids)` tokens whose
    queried needle sits at the filler-unit boundary nearest `depth` of the filler.

    **Arguments:**

    - `task`: one of `TASKS`.
    - `text`: the tokenizer (see `Text`).
    - `length`: prompt plus answer, in tokens, `start` included; at least `min_length`.
    - `depth`: in `[0, 1]`: 0 puts the needle right after the intro, 1 right before the
      question.
    - `rng`: draws the keys, values and the other needles' places.
    - `start`: ids every prompt opens with (e.g. `[bos_id]`); they count toward `length`.

    **Returns:** a `Sample`.

    **Raises:** `ValueError` for an unknown task, a `length` that is not an int or is
    below `min_length`, or a `depth` outside `[0, 1]` or not finite.
    """
    check_task(task)
    begin = _start_ids(start)
    length = _check_length(task, text, length, begin)
    depth = _check_depth(depth)
    ids, answer_ids, needle_at, answer = _build(task, text, length, depth, rng, begin)
    return Sample(
        task=task,
        length=length,
        depth=depth,
        prompt_ids=tuple(ids.tolist()),
        answer_ids=tuple(answer_ids.tolist()),
        prompt=text.decode(ids[len(begin) :]),
        answer=answer,
        needle_at=needle_at,
    )


def make_samples(
    task: str, text: Text, *, length: int, depth: float | int, samples: int, seed: int,
    start: Sequence[int | np.integer] | np.ndarray = (),
) -> list[Sample]:  # fmt: skip
    """`samples` samples of `task` at one length and depth, the same for the same seed:
    drawn from `np.random.default_rng([seed, TASKS.index(task), length,
    round(depth * 10**6)])`.

    **Arguments:** as `make_sample`, and

    - `samples`: how many, at least 1.
    - `seed`: a non-negative int.

    **Returns:** a list of `Sample`s.

    **Raises:** `ValueError` for `samples < 1`, a negative `seed`, and as `make_sample`.
    """
    check_task(task)
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise ValueError(f"samples must be an int >= 1; got {samples!r}. Pass e.g. samples=8.")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be an int >= 0; got {seed!r}. Pass e.g. seed=0.")
    begin = _start_ids(start)
    length = _check_length(task, text, length, begin)
    depth = _check_depth(depth)
    rng = np.random.default_rng([seed, TASKS.index(task), length, round(depth * 10**6)])
    return [
        make_sample(task, text, length=length, depth=depth, rng=rng, start=begin)
        for _ in range(samples)
    ]


def min_drill_length(
    task: str, text: Text, *, start: Sequence[int | np.integer] | np.ndarray = ()
) -> int:
    """The most tokens a drill of `task` without filler can take with the tokenizer
    `text` (`make_drill`): the `start` ids and every piece but the intro and the filler
    at their largest.

    **Raises:** `ValueError` for an unknown task.
    """
    check_task(task)
    code, key = coder(text), "drill " + task
    if key not in code.minimum:
        draw = _DRAWS[task](np.random.default_rng(0))  # every draw has the same pieces
        code.minimum[key] = code.bound(draw.pieces()) - code.bound(draw.intro)
    return len(_start_ids(start)) + code.minimum[key]


def make_drill(
    task: str, text: Text, *, filler: int, rng: np.random.Generator,
    start: Sequence[int | np.integer] | np.ndarray = (),
) -> Sample:  # fmt: skip
    """One drill of `task`, a training document rather than an eval: the task's needles
    and question without its intro, in `filler` tokens of filler read from a random token
    of its unit on, the queried needle before a uniformly random one of them (the others
    where the task puts them). Short drills are how a small model first learns to read a
    needle by its content (docs/recipes.md).

    **Arguments:**

    - `task`: one of `TASKS`.
    - `text`: the tokenizer (see `Text`).
    - `filler`: the filler's tokens, at least 0.
    - `rng`: draws the sample, the filler's phase and the needles' places.
    - `start`: ids the prompt opens with (e.g. `[bos_id]`).

    **Returns:** a `Sample` whose `length` is what the drill came to and whose `depth` is
    where its queried needle sits in the filler.

    **Raises:** `ValueError` for an unknown task or a negative `filler`.
    """
    check_task(task)
    if not isinstance(filler, int | np.integer) or isinstance(filler, bool) or filler < 0:
        raise ValueError(f"filler must be an int >= 0 tokens; got {filler!r}. Pass e.g. 32.")
    begin, code = _start_ids(start), coder(text)
    draw = _DRAWS[task](rng)
    ids, answer_ids, needle_at, depth = assemble_drill(
        code, draw, start=begin, filler=int(filler), rng=rng
    )
    return Sample(
        task=task,
        length=int(ids.size + answer_ids.size),
        depth=depth,
        prompt_ids=tuple(ids.tolist()),
        answer_ids=tuple(answer_ids.tolist()),
        prompt=text.decode(ids[len(begin) :]),
        answer=draw.answer_text,
        needle_at=needle_at,
    )


def training_document(task: str, text: Text, *, length: int, rng: np.random.Generator) -> str:
    """One training document of `task`: the prompt's text followed by the answer's, at a
    depth drawn uniformly from `[0, 1]`; `length` tokens (the decode of prompt tokens and
    answer tokens, no start ids).

    **Arguments:**

    - `task`: one of `TASKS`.
    - `text`: the tokenizer (see `Text`).
    - `length`: tokens of prompt and answer, at least `min_length(task, text)`.
    - `rng`: draws the depth and the sample.

    **Returns:** the document's text.

    **Raises:** `ValueError` as `make_sample`.
    """
    check_task(task)
    length = _check_length(task, text, length, [])
    depth = float(rng.uniform(0.0, 1.0))
    ids, answer_ids, _, _ = _build(task, text, length, depth, rng, [])
    return text.decode(np.concatenate([ids, answer_ids]))
