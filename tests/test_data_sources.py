"""Hugging Face datasets as a corpus (`hf:<name>[:<split>]`), built locally: no network."""

import sys

import pytest

from eqx_longctx.data import load_corpus, load_datasets

TEXTS = ["alpha beta\n\ngamma", "  ", "delta 😀 epsilon", "zeta"]


def test_missing_datasets_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ValueError, match=r"needs the `datasets` package.*pip install datasets"):
        load_corpus("hf:someone/corpus")


def test_source_syntax_errors():
    for bad in ("hf:", "hf::train", "hf:name:"):
        with pytest.raises(ValueError, match=r"'hf:<dataset>\[:<split>\]'; got .*empty"):
            load_corpus(bad)


def test_saved_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    one = tmp_path / "one"
    datasets.Dataset.from_dict({"text": TEXTS, "id": [1, 2, 3, 4]}).save_to_disk(str(one))
    assert load_corpus(f"hf:{one}") == [TEXTS[0], TEXTS[2], TEXTS[3]]  # blank dropped
    assert load_corpus(f"hf:{one}:anything") == load_corpus(f"hf:{one}")  # one split: whole
    assert load_corpus(f"hf:{one}", separator="\n\n")[:2] == ["alpha beta", "gamma"]
    # The budget counts UTF-8 bytes and never cuts a character: 8 bytes of the third
    # text end inside the 4-byte emoji, which goes.
    assert load_corpus(f"hf:{one}", max_bytes=17 + 2 + 8) == [TEXTS[0], "delta "]
    train, val = load_datasets(f"hf:{one}", seq_len=8, val_fraction=0.3)
    assert train.num_documents + val.num_documents == 3

    splits = tmp_path / "splits"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"body": ["first"], "n": [0]}),
            "test": datasets.Dataset.from_dict({"body": ["second"], "n": [1]}),
        }
    ).save_to_disk(str(splits))
    assert load_corpus(f"hf:{splits}") == ["first"]  # the only string column, split train
    assert load_corpus(f"hf:{splits}:test") == ["second"]
    with pytest.raises(ValueError, match=r"has splits \['test', 'train'\], not 'dev'"):
        load_corpus(f"hf:{splits}:dev")

    two = tmp_path / "two"
    datasets.Dataset.from_dict({"a": ["x"], "b": ["y"]}).save_to_disk(str(two))
    with pytest.raises(ValueError, match=r"no 'text' column .* columns are \['a', 'b'\]"):
        load_corpus(f"hf:{two}")
    blank = tmp_path / "blank"
    datasets.Dataset.from_dict({"text": [" ", "\n"]}).save_to_disk(str(blank))
    with pytest.raises(ValueError, match="found no text in 'hf:.*blank'.*empty or blank"):
        load_corpus(f"hf:{blank}")


def test_hub_load_failure_is_a_clear_error(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(name, split, streaming):
        raise ConnectionError(f"no network for {name}")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError, match=r"could not load .* 'nobody/none' \(split 'val'\).*"):
        load_corpus("hf:nobody/none:val")


def test_a_text_column_that_is_not_text_is_a_clear_error(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    ints = tmp_path / "ints"
    datasets.Dataset.from_dict({"text": [1, 2]}).save_to_disk(str(ints))
    with pytest.raises(ValueError, match=r"'text' column of int, not text \(row 0\)"):
        load_corpus(f"hf:{ints}")
