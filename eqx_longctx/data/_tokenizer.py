"""Byte-level tokenizer: one token per UTF-8 byte, plus PAD, BOS and EOS."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, final

import jax
import numpy as np
from jaxtyping import Int


@final
@dataclass(frozen=True)
class ByteTokenizer:
    """Byte-level tokenizer: ids 0-255 are the bytes of the UTF-8 text, then three specials.

    There is no vocabulary file and no unknown token: any text round-trips exactly.

    - `pad_id` (256) fills the unused end of a packed row.
    - `bos_id` (257) opens every document chunk, so its first byte gets a prediction.
    - `eos_id` (258) closes every document and is predicted like any byte.
    - `vocab_size` (259) is the size of the embedding table a model needs.
    - `byte_ids` (256): ids below it are one byte of text each, so a loss over them can be
      reported in bits per byte (a tokenizer without `byte_ids` gets bits per token).
    """

    byte_ids: ClassVar[int] = 256
    pad_id: ClassVar[int] = 256
    bos_id: ClassVar[int] = 257
    eos_id: ClassVar[int] = 258
    vocab_size: ClassVar[int] = 259

    def encode(
        self, text: str | bytes, *, bos: bool = False, eos: bool = False
    ) -> Int[np.ndarray, " n"]:
        """Token ids of `text`: its UTF-8 bytes.

        **Arguments:**

        - `text`: a string (encoded as UTF-8) or raw bytes.
        - `bos`, `eos`: prepend `bos_id` / append `eos_id`.

        **Returns:**

        A 1-D `int32` numpy array.
        """
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids = np.frombuffer(data, np.uint8).astype(np.int32)
        return np.concatenate([[self.bos_id] * bos, ids, [self.eos_id] * eos]).astype(np.int32)

    def decode(self, ids: Sequence[int | np.integer] | np.ndarray | jax.Array) -> str:
        """Text of a 1-D sequence of token ids; special (and out-of-range) ids are dropped.

        **Arguments:**

        - `ids`: a 1-D sequence of ints (list, numpy or jax array).

        **Returns:**

        The string; bytes that are not valid UTF-8 (a model's sample, a cut character)
        become U+FFFD.

        **Raises:** `ValueError` when `ids` is not 1-D.
        """
        ids = np.asarray(ids)
        if ids.ndim != 1:
            raise ValueError(
                f"ByteTokenizer.decode takes one 1-D sequence of ids; got shape {ids.shape}. "
                "Decode one row at a time: [tokenizer.decode(row) for row in ids]."
            )
        data = ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")
