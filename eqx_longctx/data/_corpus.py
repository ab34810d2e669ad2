"""Corpus readers: the interpreter's standard library by default, or the user's text files.

The default corpus is real, sizeable (about 12 MB of Python) and already on disk: the
`*.py` files of the running interpreter's standard library, tests and site-packages left
out. Paths are sorted, so the same interpreter always yields the same documents.
"""

import codecs
import os
import sysconfig
from pathlib import Path

import numpy as np

from .._checks import check_int
from ._hf import PREFIX as HF_PREFIX
from ._hf import read_hf
from ._packing import PackedDataset, Tokenizer, _check_seq_len

DEFAULT_MAX_BYTES = 8 * 2**20
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.rglob("*.py"))
    return [f for f in files if not _STDLIB_SKIP.intersection(f.relative_to(root).parts)]


def _folder_files(folder: Path, suffixes: tuple[str, ...] | None) -> list[Path]:
    """Regular files under `folder`, sorted; hidden files and folders are left out."""
    files = []
    for f in sorted(folder.rglob("*")):
        hidden = any(part.startswith(".") for part in f.relative_to(folder).parts)
        if f.is_file() and not hidden and (suffixes is None or f.suffix in suffixes):
            files.append(f)
    return files


def _read_text(path: Path, budget: int) -> tuple[str, int] | None:
    """The first `budget` bytes of `path` as text and the bytes used; None if not text."""
    try:
        with open(path, "rb") as f:
            data = f.read(budget)
        # final=False drops a multibyte character that the budget cut in half.
        text = codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
    except (OSError, UnicodeDecodeError):
        return None
    return None if "\0" in text else (text, len(data))


def load_corpus(
    path: str | os.PathLike | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    suffixes: str | tuple[str, ...] | None = None,
    separator: str | None = None,
) -> list[str]:
    """Read a corpus of text documents.

    **Arguments:**

    - `path`: `None` for the Python standard library (`*.py`); a text file; a folder,
      read recursively in sorted order (hidden entries skipped); or
      `"hf:<dataset>[:<split>]"` (default split `train`), a Hugging Face dataset on the Hub
      (streamed) or a folder saved with `save_to_disk`, one document per row of its
      `"text"` column; this needs the `datasets` package.
    - `max_bytes`: stop once this many bytes are read (the last file is cut short).
    - `suffixes`: in a folder, read only files ending in one of these (e.g.
      `(".txt", ".md")`, or one as a string); `None` tries every file. Binary and
      non-UTF-8 files are skipped.
    - `separator`: split every file into documents at this string (`"\\n\\n"` for
      paragraphs, `"\\n"` for lines); `None` keeps one document per file.

    **Returns:**

    The documents as strings; blank documents are dropped.

    **Raises:** `ValueError` when `max_bytes < 1`, `path` is empty or does not exist,
    `separator` is empty, or no non-blank
    UTF-8 text is found; for `"hf:..."` also when the source has an empty name or split, the
    `datasets` package is not installed, a saved `DatasetDict` lacks the split, the Hub
    dataset cannot be loaded, or the rows have no `"text"` column and not exactly one string
    column.
    """
    if max_bytes <= 0:
        raise ValueError(
            f"load_corpus needs max_bytes >= 1; got max_bytes={max_bytes}. "
            f"Pass a positive byte budget (default {DEFAULT_MAX_BYTES})."
        )
    if isinstance(suffixes, str):  # one suffix: ".txt" would match ".t" and "" by substring
        suffixes = (suffixes,)
    if path is not None and not os.fspath(path):
        raise ValueError(
            "load_corpus needs a path; got path='' (which would read the current folder). "
            "Pass a file or folder, or path=None for the Python standard library."
        )
    if separator is not None and (not isinstance(separator, str) or not separator):
        raise ValueError(
            f"load_corpus needs a non-empty separator string or None; got separator="
            f"{separator!r}. Pass e.g. separator='\\n\\n' for paragraphs."
        )
    if isinstance(path, str) and path.startswith(HF_PREFIX):
        texts = read_hf(path, max_bytes)
        return _documents(
            texts,
            separator,
            f"{path!r}: the rows of its text column are empty or blank. Check the dataset "
            "and split",
        )
    if path is None:
        files = _stdlib_files()
    else:
        path = Path(path).expanduser()
        if not path.exists():
            raise ValueError(
                f"load_corpus needs an existing file or folder; got path='{path}', which "
                "does not exist. Fix the path, or pass path=None for the Python standard library."
            )
        files = [path] if path.is_file() else _folder_files(path, suffixes)
    texts, budget = [], max_bytes
    for f in files:
        read = _read_text(f, budget) if budget > 0 else None
        if read is not None:
            texts.append(read[0])
            budget -= read[1]
    what = "file" if path is not None and path.is_file() else f"folder ({len(files)} files)"
    return _documents(
        texts,
        separator,
        f"path='{path}': the {what} is empty or holds no non-blank UTF-8 text files "
        f"(suffixes={suffixes}). Point at a non-empty UTF-8 text file or a folder of them, or "
        "widen suffixes",
    )


def _documents(texts: list[str], separator: str | None, where: str) -> list[str]:
    """The non-blank documents of `texts`, each split at `separator` when given."""
    docs = [d for t in texts for d in ([t] if separator is None else t.split(separator))]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"load_corpus found no text in {where}.")
    return docs


def split_documents(
    docs: list[str], *, val_fraction: float = 0.05, seed: int = 0
) -> tuple[list[str], list[str]]:
    """Hold out whole documents for validation, chosen from `seed`, kept in corpus order.

    **Arguments:**

    - `docs`: the documents, at least 2.
    - `val_fraction`: share of documents held out, in `(0, 1)`; at least one document
      goes to each side.
    - `seed`: picks which documents are held out.

    **Returns:**

    `(train_docs, val_docs)`, disjoint, together `docs`.

    **Raises:** `ValueError` unless `0 < val_fraction < 1` and `docs` holds at least 2
    documents.
    """
    check_int(seed, "split_documents' seed", minimum=0, fix=" Pass e.g. seed=0.")
    if not 0 < val_fraction < 1:
        raise ValueError(
            f"val_fraction must lie strictly between 0 and 1; got val_fraction={val_fraction}. "
            "Pass e.g. val_fraction=0.05."
        )
    if len(docs) < 2:
        raise ValueError(
            "A validation split holds out whole documents, so it needs at least 2 documents; "
            f"got {len(docs)} (val_fraction={val_fraction}). Point at a folder with more files, "
            "or at a file of paragraphs separated by blank lines (load_datasets and "
            "load_corpus split at another string with separator=...)."
        )
    num_val = min(max(1, round(val_fraction * len(docs))), len(docs) - 1)
    # A second word no epoch reaches keeps this stream apart from the epoch permutations.
    held = np.random.default_rng((seed, 2**32 - 1)).permutation(len(docs))[:num_val]
    is_val = np.zeros(len(docs), bool)
    is_val[held] = True
    train = [d for d, v in zip(docs, is_val, strict=True) if not v]
    return train, [d for d, v in zip(docs, is_val, strict=True) if v]


def load_datasets(
    path: str | os.PathLike | None = None,
    *,
    seq_len: int,
    seed: int = 0,
    val_fraction: float = 0.05,
    max_bytes: int = DEFAULT_MAX_BYTES,
    tokenizer: Tokenizer | None = None,
    suffixes: str | tuple[str, ...] | None = None,
    separator: str | None = None,
) -> tuple[PackedDataset, PackedDataset]:
    """Read a corpus, hold out validation documents and pack both splits.

    **Arguments:**

    - `path`, `max_bytes`, `suffixes`, `separator`: as in `load_corpus` (`None` reads the
      Python standard library, `"hf:<dataset>[:<split>]"` a Hugging Face dataset). A
      corpus of one document (a single file, no `separator`) is split at blank lines
      (`"\n\n"`), so that whole documents can be held out for validation.
    - `seq_len`: tokens per row, at least 2.
    - `seed`: picks the validation documents and the training row order.
    - `val_fraction`: share of documents held out (see `split_documents`).
    - `tokenizer`: default `ByteTokenizer()`; or a checkpoint's `HFTokenizer`.

    **Returns:**

    `(train, val)` `PackedDataset`s.

    **Raises:** `ValueError` when `seq_len < 2`, and as `load_corpus` and `split_documents`.
    """
    _check_seq_len(seq_len)
    docs = load_corpus(path, max_bytes=max_bytes, suffixes=suffixes, separator=separator)
    if separator is None and len(docs) == 1:  # one file: its paragraphs are the documents
        docs = _documents(docs, "\n\n", str(path))
    train_docs, val_docs = split_documents(docs, val_fraction=val_fraction, seed=seed)
    train = PackedDataset.from_documents(train_docs, seq_len, tokenizer, seed=seed)
    val = PackedDataset.from_documents(val_docs, seq_len, tokenizer, seed=seed)
    return train, val
