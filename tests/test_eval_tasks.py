"""The synthetic long-context tasks: exact lengths in tokens (byte and BPE tokenizers), the
queried needle at its depth, answers that a solver reading only the prompt's text finds,
determinism, training documents, scoring and every documented error."""

import math
import re

import numpy as np
import pytest

from eqx_longctx.data import ByteTokenizer, HFTokenizer
from eqx_longctx.evals._needles import FILLER, WORDS
from eqx_longctx.evals._score import score
from eqx_longctx.evals._tasks import (
    GENERATION_TASKS,
    TASKS,
    check_task,
    make_drill,
    make_sample,
    make_samples,
    min_drill_length,
    min_length,
    training_document,
)

BYTES = ByteTokenizer()
BOS = ByteTokenizer.bos_id
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
_NIAH = r" One of the special magic numbers for [a-z]+ is: \d+\."
_NIAH_INTRO = "Special magic numbers are hidden in the text below. Memorize them."
FORMATS = {  # task: (intro, a regex matching each needle)
    "passkey": (
        "There is a pass key hidden in the text below. Find it and remember it.",
        r" The pass key is \d+\. Remember it\.",
    ),
    "niah_single": (_NIAH_INTRO, _NIAH),
    "niah_multikey": (_NIAH_INTRO, _NIAH),
    "niah_multivalue": (_NIAH_INTRO, _NIAH),
    "niah_multiquery": (_NIAH_INTRO, _NIAH),
    "variable_tracking": (
        "Track the chains of variable assignments hidden in the text below.",
        r" VAR [A-Z]{5} = (?:VAR [A-Z]{5}|\d+)\.",
    ),
    "mqar": (
        "A list of words and their numbers is hidden in the text below. Memorize it.",
        r"(?: [a-z]+: \d+\.){8}",
    ),
}


def _magic(prompt: str, word: str) -> list[re.Match]:
    return list(re.finditer(rf" One of the special magic numbers for {word} is: (\d+)\.", prompt))


def solve(task: str, prompt: str) -> tuple[str, int]:
    """The answer to `prompt` and where its (first) queried needle starts, read from the
    text alone."""
    question = prompt[prompt.rindex("\n") :]
    if task == "passkey":
        found = re.search(r" The pass key is (\d+)\.", prompt)
        assert found
        return found[1], found.start()
    if task in ("niah_single", "niah_multikey", "niah_multivalue"):
        found = re.search(r"magic numbers? for ([a-z]+)[ ?]", question)
        assert found
        needles = _magic(prompt, found[1])
        if task != "niah_multivalue":
            assert len(needles) == 1
        return ", ".join(m[1] for m in needles), needles[0].start()
    if task == "niah_multiquery":
        found = re.search(r"numbers for (.*)\? They are$", question)
        assert found
        words = re.split(r", | and ", found[1])
        needles = [_magic(prompt, w) for w in words]
        assert all(len(n) == 1 for n in needles)
        return ", ".join(n[0][1] for n in needles), needles[0][0].start()
    if task == "variable_tracking":
        found = re.search(r"hold the value (\d+)\?", question)
        assert found
        holds, first, names = {found[1]}, None, []
        for m in re.finditer(r" VAR ([A-Z]{5}) = (?:VAR )?(\w+)\.", prompt):
            if m[2] in holds:
                holds.add(m[1])
                names.append(m[1])
                first = m.start() if first is None else first
        assert first is not None
        return " ".join(names), first
    assert task == "mqar"
    found = re.search(r"numbers of ([a-z]+), ([a-z]+) and ([a-z]+)\?", question)
    block = re.search(FORMATS["mqar"][1], prompt)
    assert found and block
    pairs = dict(re.findall(r" ([a-z]+): (\d+)\.", block[0]))
    return ", ".join(pairs[w] for w in found.groups()), block.start()


def check_sample(sample, task: str, length: int, text, start: list[int]) -> None:
    """Length, start ids, text, answer (each value once), queried needle: for any tokenizer."""
    assert sample.task == task and sample.length == length
    assert len(sample.prompt_ids) + len(sample.answer_ids) == length
    assert list(sample.prompt_ids[: len(start)]) == start
    assert sample.prompt == text.decode(np.asarray(sample.prompt_ids[len(start) :]))
    assert text.decode(np.asarray(sample.answer_ids)).strip() == sample.answer
    answer, queried = solve(task, sample.prompt)
    assert answer == sample.answer
    haystack = sample.prompt[: sample.prompt.rindex("\n")]
    numbers = re.findall(r"\d+", haystack)
    assert len(numbers) == len(set(numbers)), "every number of the needles is distinct"
    if task == "variable_tracking":
        for name in sample.answer.split():
            assert sample.prompt.count(f"VAR {name} =") == 1
    else:
        for value in sample.answer.split(", "):
            assert sample.prompt.count(value) == 1
    needle = re.compile(FORMATS[task][1]).match(sample.prompt, queried)
    assert needle
    assert text.decode(np.asarray(sample.prompt_ids[sample.needle_at :])).startswith(needle[0])


def filler_around(task: str, prompt: str, at: int) -> tuple[int, int, list[int]]:
    """Filler characters before `at` and in all, and before each needle, after checking
    the haystack is the intro, then `FILLER` repeated with needles between."""
    intro, needle = FORMATS[task]
    assert prompt.startswith(intro)
    body = prompt[len(intro) : prompt.rindex("\n")]
    filler = re.sub(needle, "", body)
    assert filler == (FILLER * (len(filler) // len(FILLER) + 1))[: len(filler)]
    before = len(re.sub(needle, "", body[: at - len(intro)]))
    each = [len(re.sub(needle, "", body[: m.start()])) for m in re.finditer(needle, body)]
    return before, len(filler), each


@pytest.mark.parametrize("task", TASKS)
def test_lengths_and_depths_bytes(task):
    shortest = min_length(task, BYTES, start=[BOS])
    assert min_length(task, BYTES) == shortest - 1
    unit = len(FILLER)
    for length in sorted({shortest, max(shortest, 300), 1024, 4096}):
        for depth in DEPTHS:
            rng = np.random.default_rng(int(length + 10 * depth))
            sample = make_sample(task, BYTES, length=length, depth=depth, rng=rng, start=[BOS])
            check_sample(sample, task, length, BYTES, [BOS])
            _, queried = solve(task, sample.prompt)
            assert sample.needle_at == 1 + queried  # one token per character, after BOS
            before, total, each = filler_around(task, sample.prompt, queried)
            assert abs(before - depth * total) <= unit / 2, (before, depth, total)
            assert all(b % unit == 0 or b == total for b in each), "needles at unit ends"
            if depth == 0.0:
                assert before == 0
            if depth == 1.0:
                assert before == total
            if length == shortest:
                assert total < unit, "min_length leaves no filler for the longest pieces"


def test_start_counts_and_comes_first():
    for task in TASKS:
        length = min_length(task, BYTES) + 50
        with_bos = make_sample(task, BYTES, length=length, depth=0.5,
                               rng=np.random.default_rng(1), start=[BOS])  # fmt: skip
        without = make_sample(task, BYTES, length=length, depth=0.5, rng=np.random.default_rng(1))
        assert with_bos.prompt_ids[0] == BOS and BOS not in with_bos.prompt_ids[1:]
        assert len(with_bos.prompt_ids) == len(without.prompt_ids)
        assert len(with_bos.prompt) == len(without.prompt) - 1  # one filler token fewer


def test_same_seed_same_samples():
    def draw(task, seed):
        return make_samples(task, BYTES, length=700, depth=0.3, samples=4, seed=seed,
                            start=[BOS])  # fmt: skip

    for task in GENERATION_TASKS:
        first = draw(task, 3)
        assert first == draw(task, 3)
        assert [s.answer for s in first] != [s.answer for s in draw(task, 4)]
        assert len({s.answer for s in first}) > 1, "the samples of one call differ"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE `tokenizer.json` (as tests/test_init_hf.py writes them) trained
    on the tasks' own texts, so pieces merge into multi-byte tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, pre_tokenizers, trainers

    texts = [FILLER * 4, " ".join(WORDS), " ".join(str(i) for i in range(0, 1000, 7))]
    for task in TASKS:
        texts.append(
            make_sample(task, BYTES, length=600, depth=0.5, rng=np.random.default_rng(0)).prompt
        )
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return HFTokenizer(path, bos_id=1, eos_id=2, pad_id=0)


@pytest.mark.parametrize("task", TASKS)
def test_lengths_bpe(bpe, task):
    unit = len(bpe.encode(FILLER))
    assert unit < len(FILLER), "the filler merges into fewer tokens than bytes"
    shortest = min_length(task, bpe, start=[1])
    for length in (shortest, shortest + 1, 700, 2000):
        for depth in (0.0, 0.5, 1.0):
            rng = np.random.default_rng(length)
            sample = make_sample(task, bpe, length=length, depth=depth, rng=rng, start=[1])
            check_sample(sample, task, length, bpe, [1])
            _, queried = solve(task, sample.prompt)
            before, total, _ = filler_around(task, sample.prompt, queried)
            assert abs(before - depth * total) <= len(FILLER), (before, depth, total)


@pytest.mark.parametrize("task", TASKS)
def test_training_document(task):
    rng = np.random.default_rng(5)
    for length in (min_length(task, BYTES), 500, 2048):
        doc = training_document(task, BYTES, length=length, rng=rng)
        assert len(BYTES.encode(doc)) == length
        assert doc.startswith(FORMATS[task][0])
        question = doc.rindex("\n")
        tail = re.search(r"(?:is|are|Answer:)( [^?]*)$", doc[question:])
        assert tail
        answer, _ = solve(task, doc[: question + tail.start(1)])
        assert tail[1] == " " + answer


@pytest.mark.parametrize("task", TASKS)
def test_drill(task):
    """A drill: no intro, the filler asked for (read from any token of the unit on), the
    queried needle where `needle_at` says, and the answer a text-only solver finds."""
    rng = np.random.default_rng(6)
    pieces = min_drill_length(task, BYTES, start=[BOS])
    assert pieces < min_length(task, BYTES, start=[BOS])
    openings = set()
    for filler in (0, 1, 37, 300):
        for _ in range(3):
            s = make_drill(task, BYTES, filler=filler, rng=rng, start=[BOS])
            assert s.prompt_ids[0] == BOS and FORMATS[task][0] not in s.prompt
            assert filler <= s.length <= pieces + filler and 0 <= s.depth <= 1
            answer, at = solve(task, s.prompt)
            assert answer == s.answer and s.answer_ids == tuple(BYTES.encode(" " + answer))
            assert s.needle_at == 1 + at  # bytes: one token per character, after the BOS
            haystack = re.sub(FORMATS[task][1], "", s.prompt[: s.prompt.rindex("\n")])
            assert not re.search(r"\d", haystack)  # digits only in the needles
            openings.add(s.prompt[:3])
    assert len(openings) > 4  # the filler starts anywhere in its unit
    with pytest.raises(ValueError, match="filler must be an int >= 0"):
        make_drill(task, BYTES, filler=-1, rng=rng)


@pytest.mark.parametrize(
    "output, answer, right",
    [
        ("71432", "71432", True),
        ("71432.", "71432", True),
        ("71432 is the key", "71432", True),
        (" 71432\n", "71432", True),
        ("\n  71432", "71432", True),
        ("71433", "71432", False),
        ("", "71432", False),
        ("7143", "71432", False),
        ("714329", "71432", False),
        ("71432a", "71432", False),
        ("The pass key is 71432", "71432", False),
        ("4812763, 1293847.", "4812763, 1293847", True),
        ("4812763, 129384", "4812763, 1293847", False),
        ("4812763, 12938475", "4812763, 1293847", False),
        ("QPWJZ MBKXE", "QPWJZ MBKXE", True),
        ("QPWJZ MBKXEF", "QPWJZ MBKXE", False),
    ],
)
def test_score(output, answer, right):
    assert score(output, answer) is right


def test_errors():
    with pytest.raises(ValueError, match=r"unknown eval task 'nope'; the tasks are passkey, "):
        check_task("nope")
    with pytest.raises(ValueError, match=r"'nope'"):
        make_sample("nope", BYTES, length=500, depth=0.5, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"'nope'"):
        min_length("nope", BYTES)
    for depth in (-0.1, 1.5, math.nan, math.inf):
        with pytest.raises(ValueError, match=rf"depth .* in \[0, 1\].*got {depth!r}"):
            make_sample("passkey", BYTES, length=500, depth=depth, rng=np.random.default_rng(0))
    shortest = min_length("mqar", BYTES, start=[BOS])
    with pytest.raises(ValueError, match=rf"length={shortest - 1} .*min_length={shortest}"):
        make_samples("mqar", BYTES, length=shortest - 1, depth=0.5, samples=1, seed=0, start=[BOS])
    with pytest.raises(ValueError, match=r"length=10 .*min_length="):
        training_document("passkey", BYTES, length=10, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"samples must be an int >= 1; got 0"):
        make_samples("passkey", BYTES, length=500, depth=0.5, samples=0, seed=0)
    with pytest.raises(ValueError, match=r"seed must be an int >= 0; got -1"):
        make_samples("passkey", BYTES, length=500, depth=0.5, samples=1, seed=-1)
    # a float length is refused by the type check under pytest (beartype), by the
    # function's own check otherwise; a bool passes the type check
    with pytest.raises(ValueError, match=r"length must be an int .*got True"):
        make_sample("passkey", BYTES, length=True, depth=0.5, rng=np.random.default_rng(0))
    with pytest.raises((ValueError, TypeError), match=r"300\.5"):
        make_sample("passkey", BYTES, length=300.5, depth=0.5, rng=np.random.default_rng(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"answer must be a non-empty text .*got ' '"):
        score("71432", " ")


def test_words_and_filler():
    assert len(WORDS) == len(set(WORDS)) == 200
    assert all(w.isalpha() and w.islower() for w in WORDS)
    filler_words = set(re.findall(r"[a-z]+", FILLER.lower()))
    assert not filler_words & set(WORDS)
    assert not re.search(r"\d", FILLER)
