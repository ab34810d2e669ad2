"""Hugging Face datasets as a corpus source: `hf:<name>[:<split>]`, read where installed.

`<name>` is a dataset on the Hub (streamed, so only the bytes the budget asks for are
fetched) or a folder written by `datasets.Dataset.save_to_disk` /
`DatasetDict.save_to_disk` (read with no network; the split picks one of a
`DatasetDict`'s, a saved `Dataset` is read whole). Documents are the rows' `"text"` column
(or the only string column).
"""

import codecs
from pathlib import Path
from typing import Any

PREFIX = "hf:"
DEFAULT_SPLIT = "train"


def parse_source(source: str) -> tuple[str, str]:
    """`(name, split)` of `"hf:<name>[:<split>]"`."""
    rest = source[len(PREFIX) :]
    name, sep, split = rest.rpartition(":")
    if not sep or Path(rest).expanduser().is_dir():
        name, split = rest, DEFAULT_SPLIT
    if not name or not split:
        raise ValueError(
            f"a Hugging Face source is 'hf:<dataset>[:<split>]'; got {source!r}, which has an "
            "empty dataset name or split. Write e.g. 'hf:roneneldan/TinyStories:train' or "
            "'hf:/path/saved_with_save_to_disk'."
        )
    return name, split


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as err:
        raise ValueError(
            "a corpus path 'hf:...' reads a Hugging Face dataset, which needs the `datasets` "
            "package; it is not installed. Install it (pip install datasets, or pip install "
            "'eqx_longctx[datasets]'), or point at a text file or folder instead."
        ) from err
    return datasets


def _text_column(row: dict[str, Any], name: str) -> str:
    """The column holding the documents: `"text"`, else the only string one."""
    if "text" in row:
        return "text"
    strings = [c for c, v in row.items() if isinstance(v, str)]
    if len(strings) == 1:
        return strings[0]
    raise ValueError(
        f"the Hugging Face dataset {name!r} has no 'text' column and not exactly one string "
        f"column to use instead; its columns are {list(row)}. Rename the text column to "
        "'text' (dataset.rename_column) and save_to_disk, then pass hf:<that folder>."
    )


def _open(source: str) -> tuple[Any, str]:
    """The rows (a `Dataset` or streaming `IterableDataset`) and the dataset's name."""
    name, split = parse_source(source)
    datasets = _import_datasets()
    folder = Path(name).expanduser()
    if folder.is_dir():
        data = datasets.load_from_disk(str(folder))
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise ValueError(
                    f"the saved dataset {str(folder)!r} has splits {sorted(data)}, not "
                    f"{split!r}. Pass hf:{name}:<one of those>."
                )
            data = data[split]
    else:
        try:
            data = datasets.load_dataset(name, split=split, streaming=True)
        except Exception as err:
            raise ValueError(
                f"could not load the Hugging Face dataset {name!r} (split {split!r}): "
                f"{type(err).__name__}: {err}. Check the name, split and network, or save the "
                "dataset with save_to_disk and pass hf:<that folder>."
            ) from err
    return data, name


def read_hf(source: str, budget: int) -> list[str]:
    """The texts of `source`'s rows, in order, until `budget` UTF-8 bytes are read (the
    last one cut short, never inside a character)."""
    data, name = _open(source)
    texts, column = [], None
    for row in data:
        if budget <= 0:
            break
        column = _text_column(row, name) if column is None else column
        value = row[column]
        if value is not None and not isinstance(value, str):
            raise ValueError(
                f"the Hugging Face dataset {name!r} has a {column!r} column of "
                f"{type(value).__name__}, not text (row {len(texts)}). Point at a dataset "
                "whose 'text' column holds strings, or rename the text column to 'text'."
            )
        raw = (value or "").encode("utf-8")[:budget]
        texts.append(codecs.getincrementaldecoder("utf-8")().decode(raw, final=False))
        budget -= len(raw)
    return texts
