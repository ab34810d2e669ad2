"""A Hugging Face checkpoint's `tokenizer.json`, read by the `tokenizers` package (extra:
hf), as a tokenizer of the data pipeline: the same `encode`, `decode`, `pad_id`, `bos_id`,
`eos_id` and `vocab_size` as `ByteTokenizer`, so packing works unchanged.

Bits per byte need the bytes of text each token stands for: `token_bytes` counts them per
id from the vocabulary (see `token_bytes_of`), so the loss of any batch can be reported per
byte without keeping the text.
"""

import json
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any, final

import jax
import numpy as np
from jaxtyping import Int

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_FILES = (
    TOKENIZER_FILE,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
"""The files of a Hugging Face tokenizer that a checkpoint directory may hold."""

_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_SPACE = "\u2581"  # SentencePiece's word boundary


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as err:
        raise ValueError(
            "reading a tokenizer.json needs the `tokenizers` package, which is not installed. "
            "Install it (pip install tokenizers, or pip install 'eqx_longctx[hf]')."
        ) from err
    return tokenizers


def _types(node: Any) -> set[str]:
    """Every `"type"` in a (nested) component of `tokenizer.json`, e.g. its decoder."""
    if isinstance(node, dict):
        found = {node["type"]} if isinstance(node.get("type"), str) else set()
        return found.union(*(_types(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_types(v) for v in node))
    return set()


def token_bytes_of(spec: dict[str, Any], tokens: Sequence[str | None]) -> np.ndarray:
    """The bytes of text each id stands for, from the vocabulary of a `tokenizer.json`.

    A byte-level vocabulary (GPT-2, Llama 3: decoder `ByteLevel`) spells each byte as one
    character, so a token counts its characters. Otherwise (SentencePiece, WordPiece) a
    token counts the UTF-8 bytes of its string with `\u2581` read as a space, a byte-fallback
    token `<0xNN>` one byte, and WordPiece's `##` continuation prefix none; SentencePiece's
    `\u2581` before a document's first word then counts one byte the text does not have.
    Special tokens (BOS, EOS, padding) count 0.

    **Arguments:**

    - `spec`: the parsed `tokenizer.json`.
    - `tokens`: the token string of each id (`None` for an unused id).

    **Returns:** a float32 array of one count per id.
    """
    special = {t["id"] for t in spec.get("added_tokens") or () if t.get("special")}
    byte_level = "ByteLevel" in _types(spec.get("decoder"))
    wordpiece = "WordPiece" in _types(spec.get("decoder"))
    out = np.zeros(len(tokens), np.float32)
    for i, token in enumerate(tokens):
        if token is None or i in special:
            continue
        if byte_level:
            out[i] = len(token)
        elif _BYTE_FALLBACK.fullmatch(token):
            out[i] = 1
        else:
            if wordpiece and token.startswith("##"):
                token = token[2:]
            out[i] = len(token.replace(_SPACE, " ").encode("utf-8"))
    return out


@final
class HFTokenizer:
    """A `tokenizer.json` (Hugging Face `tokenizers`) with the interface of `ByteTokenizer`.

    **Arguments:**

    - `file`: the `tokenizer.json`.
    - `bos_id`, `eos_id`, `pad_id`: the special ids the packer uses (documents open with
      BOS and close with EOS; padding is never a loss-bearing target); `None` where the
      tokenizer is only used to encode prompts and decode. Usually from the checkpoint's
      `config.json`: see `HFTokenizer.from_checkpoint`.

    **Attributes:** `vocab_size` (ids the tokenizer can produce, added tokens included),
    `token_bytes` (see `token_bytes_of`), `file`.

    **Raises:** `ValueError` when `tokenizers` is not installed or `file` cannot be read.
    """

    def __init__(
        self,
        file: str | os.PathLike,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
    ):
        tokenizers = _import_tokenizers()
        self.file = os.fspath(file)
        try:
            self._tok = tokenizers.Tokenizer.from_file(self.file)
            spec = json.loads(self._tok.to_str())
        except Exception as e:  # tokenizers raises its own Exception type
            raise ValueError(
                f"cannot read the tokenizer {self.file}: {e}. The file is damaged, or was "
                "written by a newer tokenizers version; write or download it again."
            ) from e
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        ids = [i for i in (bos_id, eos_id, pad_id) if i is not None]
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise ValueError(
                f"the special ids bos={bos_id}, eos={eos_id}, pad={pad_id} must lie in the "
                f"tokenizer's vocabulary [0, {self.vocab_size}) of {self.file}; fix "
                "bos_token_id / eos_token_id / pad_token_id in config.json."
            )
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        tokens = [self._tok.id_to_token(i) for i in range(self.vocab_size)]
        self.token_bytes = token_bytes_of(spec, tokens)

    @classmethod
    def from_checkpoint(cls, directory: str | os.PathLike) -> "HFTokenizer":
        """The tokenizer of a Hugging Face checkpoint directory, for training: its
        `tokenizer.json`, with BOS, EOS and padding ids from its `config.json`
        (`bos_token_id`, else the EOS id; `eos_token_id`, the first if a list;
        `pad_token_id`, else the EOS id).

        **Raises:** `ValueError` when the directory has no `tokenizer.json`, `config.json`
        names no `eos_token_id`, and as the constructor.
        """
        path = os.fspath(directory)
        file = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(file):
            raise ValueError(
                f"{path!r} has no {TOKENIZER_FILE}, which tokenizes the training data. Save "
                "the tokenizer next to the weights (tokenizer.save_pretrained(DIR)), or copy "
                "the checkpoint's tokenizer.json there."
            )
        try:
            with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            config = None
        config = config if isinstance(config, dict) else {}

        def first(key: str) -> int | None:
            value = config.get(key)
            value = value[0] if isinstance(value, list) and value else value
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        eos = first("eos_token_id")
        if eos is None:
            raise ValueError(
                f"{os.path.join(path, 'config.json')} names no eos_token_id (got "
                f"{config.get('eos_token_id')!r}); packing closes every document with EOS. "
                "Add the tokenizer's end-of-text id as eos_token_id to config.json."
            )
        bos, pad = first("bos_token_id"), first("pad_token_id")
        return cls(file, bos_id=eos if bos is None else bos, eos_id=eos,
                   pad_id=eos if pad is None else pad)  # fmt: skip

    def encode(self, text: str | bytes, *, bos: bool = False, eos: bool = False
               ) -> Int[np.ndarray, " n"]:  # fmt: skip
        """Token ids of `text`, without the tokenizer's own special tokens.

        **Arguments:**

        - `text`: a string (bytes are decoded as UTF-8).
        - `bos`, `eos`: prepend `bos_id` / append `eos_id`.

        **Returns:** a 1-D `int32` numpy array.

        **Raises:** `ValueError` naming the start of the text when the tokenizer cannot
        encode it (e.g. a character outside a vocabulary without an unknown token).
        """
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        try:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        except Exception as e:  # tokenizers raises its own Exception type
            raise ValueError(
                f"the tokenizer {self.file} cannot encode the text starting {text[:40]!r}: "
                f"{e}. Its vocabulary does not cover this text; use data it covers, or a "
                "checkpoint whose tokenizer does."
            ) from e
        specials = [[self.bos_id] * bos, ids, [self.eos_id] * eos]
        return np.concatenate(specials).astype(np.int32)

    def encode_batch(self, texts: Iterable[str | bytes]) -> list[Int[np.ndarray, " n"]]:
        """`[encode(t) for t in texts]`, encoded in parallel by the `tokenizers` library.

        **Raises:** `ValueError` as `encode`.
        """
        texts = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
        try:
            encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        except Exception:  # find the text to name in the message
            return [self.encode(t) for t in texts]
        return [np.asarray(e.ids, np.int32) for e in encodings]

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt with the tokenizer's own template (e.g. a leading BOS)."""
        return list(self._tok.encode(text).ids)

    def decode(self, ids: Sequence[int | np.integer] | np.ndarray | jax.Array) -> str:
        """Text of a 1-D sequence of ids; special tokens are dropped."""
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                                skip_special_tokens=True)  # fmt: skip

    def __repr__(self) -> str:
        return f"HFTokenizer({self.file!r}, vocab_size={self.vocab_size})"
