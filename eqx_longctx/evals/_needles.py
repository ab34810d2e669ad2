"""The haystack of the synthetic tasks: pieces of text encoded one by one, filler units
and needles placed at unit boundaries, a prompt of an exact token count.

A prompt is built from separately encoded pieces (intro, filler unit, needle parts,
question, answer) whose ids are concatenated, so its length is exact in the tokens of any
tokenizer and its text is the decode of exactly what the model sees. Every piece a draw
varies (a word, a number, a variable name) opens with a space and every constant piece
ends where a word ends, so the pieces split where a byte-level BPE splits words anyway.
"""

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

FILLER = (
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
"""One filler unit (the classic pass key haystack): the haystack repeats it, the last copy
cut in tokens so the prompt's length is exact. It holds no digit."""

WORDS = tuple(
    """anchor animal apple arrow bag ball banana barn basket beach bean bear bed bee bell belt
    bench berry bird blanket boat bone book boot bottle box brain branch bread brick bridge
    brush bucket butter button cabin cake camera candle candy carpet carrot castle cat cave
    chain chair chalk cheese cherry chicken circle clock cloud coat coffee coin comb corn
    cotton cow crab crown cup curtain desert desk diamond dinner dog doll door dragon dress
    drum duck eagle egg engine farm feather fence field finger fish flag flower forest fork
    fountain fox frog fruit garden gate glove goat gold guitar hammer hand hat heart helmet
    hill horse house island jacket jar jewel kettle king kitchen kite knife ladder lake lamp
    leaf lemon letter lion lock map mirror monkey moon mountain mouse nail nest ocean onion
    orange owl paint palace paper parrot pencil piano pillow pirate planet plate pocket
    potato queen rabbit radio rain ribbon river robot rocket roof rope rose salt sand sheep
    shell ship shirt shoe silver snake snow soap sock spoon star stone storm street sugar
    table tiger tooth tower town train tree truck turtle umbrella valley village violin
    wagon wall watch water whale wheel window wolf wood zebra""".split()
)
"""The keys of the needles: 200 common lowercase English nouns, none of them a word of
`FILLER`."""

_DIGITS = "0123456789"
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@runtime_checkable
class Text(Protocol):
    """What the generators need of a tokenizer: `ByteTokenizer` and `HFTokenizer` both are.

    - `encode(text)`: the token ids of `text`, without special tokens.
    - `decode(ids)`: the text of `ids`, a 1-D numpy array of ints.
    """

    def encode(self, text: str) -> Sequence[int] | np.ndarray: ...

    def decode(self, ids: np.ndarray) -> str: ...


class Var(NamedTuple):
    """A piece a draw varies: `kind` is `"word"` (`" " +` one of `WORDS`), `"number"`
    (`" "` and digits) or `"name"` (`" "` and uppercase letters); `text` its text."""

    kind: str
    text: str


Piece = str | Var
"""A piece of a prompt: a constant string or a drawn `Var`."""


def _array(encoded: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.asarray(encoded, dtype=np.int64).reshape(-1)


class Coder:
    """A tokenizer's encodings of the pieces: constants and words cached, and the most
    tokens a drawn piece can take (for `min_length`)."""

    def __init__(self, text: Text):
        self.text = text
        self._cache: dict[str, np.ndarray] = {}
        self.unit = self.encode(FILLER)
        self.minimum: dict[str, int] = {}  # task -> tokens of its pieces at their largest
        space = len(self.encode(" "))
        self._per = {
            "number": (space, max(len(self.encode(d)) for d in _DIGITS)),
            "name": (space, max(len(self.encode(c)) for c in _LETTERS)),
        }
        self._word = max(len(self.encode(" " + w)) for w in WORDS)

    def encode(self, piece: Piece) -> np.ndarray:
        """The ids of one piece (constants and words from the cache)."""
        if isinstance(piece, Var):
            if piece.kind != "word":
                return _array(self.text.encode(piece.text))
            piece = piece.text
        ids = self._cache.get(piece)
        if ids is None:
            ids = self._cache[piece] = _array(self.text.encode(piece))
        return ids

    def ids(self, pieces: Sequence[Piece]) -> np.ndarray:
        """The concatenated ids of `pieces`."""
        return np.concatenate([self.encode(piece) for piece in pieces])

    def bound(self, pieces: Sequence[Piece]) -> int:
        """The most tokens `pieces` can take whatever a draw puts in its `Var`s: a
        number or name at most the tokens of its space plus, per character, the most any
        one digit or letter takes alone (BPE merges only shorten), a word the longest."""
        total = 0
        for piece in pieces:
            if isinstance(piece, str):
                total += len(self.encode(piece))
            elif piece.kind == "word":
                total += self._word
            else:
                space, per = self._per[piece.kind]
                total += space + per * (len(piece.text) - 1)
        return total


_CODERS: "weakref.WeakKeyDictionary[Text, Coder]" = weakref.WeakKeyDictionary()


def coder(text: Text) -> Coder:
    """The (cached) `Coder` of a tokenizer; a fresh one for a tokenizer that cannot be a
    weak dictionary key."""
    try:
        found = _CODERS.get(text)
        if found is None:
            found = _CODERS[text] = Coder(text)
        return found
    except TypeError:  # unhashable or not weakly referenceable
        return Coder(text)


Place = Callable[[int, int, np.random.Generator], list[int]]
"""`place(boundaries, at_depth, rng)`: the boundary of each needle, given how many
boundaries the haystack has and the one nearest the depth."""


@dataclass(frozen=True)
class Draw:
    """One task's drawn pieces: needle 0 is the queried one (placed at the depth)."""

    intro: list[Piece]
    needles: list[list[Piece]]
    question: list[Piece]
    answer: list[Piece]
    answer_text: str
    place: Place

    def pieces(self) -> list[Piece]:
        """Every piece but the filler."""
        out = list(self.intro) + list(self.question) + list(self.answer)
        for needle in self.needles:
            out += needle
        return out


def assemble(
    code: Coder, draw: Draw, *, start: Sequence[int], length: int, depth: float,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, int] | None:  # fmt: skip
    """The prompt ids (`start` first), answer ids and the queried needle's index for a
    prompt + answer of `length` tokens; `None` when the drawn pieces leave no room.

    The filler units fill what the pieces leave; boundary `b` lies `b` units into the
    filler (the last one at its end, after a cut unit). The queried needle goes to the
    boundary nearest `depth * filler`, the others where `draw.place` says; needles at one
    boundary keep their order in `draw.needles`.
    """
    intro, question = code.ids(draw.intro), code.ids(draw.question)
    needles = [code.ids(n) for n in draw.needles]
    answer = code.ids(draw.answer)
    fixed = len(start) + intro.size + sum(n.size for n in needles) + question.size + answer.size
    filler = length - fixed
    if filler < 0:
        return None
    unit = code.unit.size
    boundaries = -(-filler // unit) + 1

    def offset(b: int) -> int:
        return min(b * unit, filler)

    target = depth * filler
    at = min(int(target // unit), boundaries - 1)
    if at + 1 < boundaries and abs(offset(at + 1) - target) < abs(offset(at) - target):
        at += 1
    places = [offset(b) for b in draw.place(boundaries, at, rng)]
    hay = np.resize(code.unit, filler)  # the units repeated, the last one cut
    head = [np.asarray(start, dtype=np.int64), intro]
    parts, needle_at = _weave(head, hay, needles, places)
    return np.concatenate([*parts, question]), answer, needle_at


def assemble_drill(
    code: Coder, draw: Draw, *, start: Sequence[int], filler: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, int, float]:
    """A drill of `draw`: its needles and question without the intro, in `filler` tokens
    of the filler units read from a random token of a unit on. Every token is a boundary:
    the queried needle goes to a uniformly random one, the others where `draw.place` says,
    so neither the needle nor the question sits at an offset a model could learn instead of
    reading the needle. Returns the prompt ids (`start` first), the answer ids, the queried
    needle's index and its depth in the filler (0 without filler).
    """
    needles = [code.ids(n) for n in draw.needles]
    phase = int(rng.integers(code.unit.size))
    hay = np.resize(np.roll(code.unit, -phase), filler)
    places = draw.place(filler + 1, int(rng.integers(filler + 1)), rng)
    parts, needle_at = _weave([np.asarray(start, dtype=np.int64)], hay, needles, places)
    prompt = np.concatenate([*parts, code.ids(draw.question)])
    return prompt, code.ids(draw.answer), needle_at, places[0] / max(filler, 1)


def _weave(
    head: list[np.ndarray], hay: np.ndarray, needles: list[np.ndarray], places: Sequence[int]
) -> tuple[list[np.ndarray], int]:
    """`head`, then `hay` with needle `i` put in before its token `places[i]` (needles at
    one place in their order), and the index of needle 0 in the concatenation."""
    parts = list(head)
    size, done, needle_at = sum(p.size for p in head), 0, 0
    for i in sorted(range(len(needles)), key=places.__getitem__):
        upto = places[i]
        parts += [hay[done:upto], needles[i]]
        size, done = size + upto - done, upto
        if i == 0:
            needle_at = size
        size += needles[i].size
    return [*parts, hay[done:]], needle_at
