"""Data pipeline: tokenizer round trip, packing invariants, determinism, splits, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_longctx.data import (
    Batch,
    ByteTokenizer,
    PackedDataset,
    load_corpus,
    load_datasets,
    pack_documents,
    split_documents,
)

TOK = ByteTokenizer()


def random_docs(seed: int, num: int, max_len: int) -> list[str]:
    rng = np.random.default_rng(seed)
    alphabet = list("abcdefgh \n") + ["é", "€", "😀"]
    return ["".join(rng.choice(alphabet, rng.integers(0, max_len))) for _ in range(num)]


def check_packed(batch: Batch, docs: list[str]) -> None:
    """Every packing invariant, checked token by token with plain Python loops."""
    tokens, targets, positions, segment_ids, loss_mask = (np.asarray(a) for a in batch)
    assert {a.dtype for a in (tokens, targets, positions, segment_ids)} == {np.dtype(np.int32)}
    assert loss_mask.dtype == np.float32
    assert len({a.shape for a in batch}) == 1
    num_rows, seq_len = tokens.shape
    streams = []  # each segment's tokens after its BOS
    for b in range(num_rows):
        for t in range(seq_len):
            seg, pos = segment_ids[b, t], positions[b, t]
            if seg == 0:  # padding only at the end of a row
                assert (segment_ids[b, t:] == 0).all() and tokens[b, t] == TOK.pad_id and pos == 0
                assert loss_mask[b, t] == 0 and targets[b, t] == TOK.pad_id
                continue
            starts = t == 0 or segment_ids[b, t - 1] != seg
            if starts:
                assert seg == (1 if t == 0 else segment_ids[b, t - 1] + 1)
                assert pos == 0 and tokens[b, t] == TOK.bos_id
                streams.append([])
            else:
                assert pos == positions[b, t - 1] + 1
                streams[-1].append(int(tokens[b, t]))
            ends = t == seq_len - 1 or segment_ids[b, t + 1] != seg
            if ends:
                assert loss_mask[b, t] == 0 and targets[b, t] == TOK.pad_id
            else:
                assert loss_mask[b, t] == 1 and targets[b, t] == tokens[b, t + 1]
        if b < num_rows - 1:  # greedy fill: only a single slot too small for BOS + token
            assert (segment_ids[b] == 0).sum() <= 1
    assert all(len(s) >= 1 for s in streams)
    expected = np.concatenate([TOK.encode(d, eos=True) for d in docs])
    np.testing.assert_array_equal(np.concatenate(streams), expected)


def test_tokenizer_round_trip():
    for text in ["", "hello, world\n", "naïve café € 😀 日本語", "\x00\xff"]:
        ids = TOK.encode(text)
        assert ids.dtype == np.int32 and ids.ndim == 1
        assert ((ids >= 0) & (ids < 256)).all()
        assert TOK.decode(ids) == text
        assert TOK.decode(jnp.asarray(ids)) == text
    assert TOK.encode(b"\x00\xffab").tolist() == [0, 255, 97, 98]
    ids = TOK.encode("hi", bos=True, eos=True)
    assert ids.tolist() == [TOK.bos_id, 104, 105, TOK.eos_id]
    assert TOK.decode([TOK.pad_id, *ids, TOK.pad_id]) == "hi"
    assert TOK.decode([0xE2, 0x82]) == "\ufffd"  # a cut character decodes, replaced
    specials = {TOK.pad_id, TOK.bos_id, TOK.eos_id}
    assert len(specials) == 3 and min(specials) >= 256 and max(specials) < TOK.vocab_size


@pytest.mark.parametrize("seq_len", [2, 3, 8, 37])
def test_packing_invariants(seq_len):
    docs = random_docs(seq_len, num=12, max_len=3 * seq_len)  # some longer than a row
    batch = pack_documents(docs, seq_len)
    check_packed(batch, docs)


def test_dataset_rows_are_the_packed_rows():
    docs = random_docs(1, num=20, max_len=50)
    ds = PackedDataset.from_documents(docs, 16, seed=3)
    packed = pack_documents(docs, 16)
    assert ds.num_rows == packed.tokens.shape[0] and ds.seq_len == 16
    assert ds.num_documents == 20 and 0 <= ds.padding_fraction < 1 / 16
    for got, want in zip(ds.rows(np.arange(ds.num_rows)), packed, strict=True):
        np.testing.assert_array_equal(got, want)
    check_packed(ds.rows(np.arange(ds.num_rows)), docs)
    # A Batch is a pytree: it moves to device in one call, as the trainer does.
    on_device = jax.tree.map(jnp.asarray, ds.batch(0, 4))
    assert isinstance(on_device, Batch) and on_device.loss_mask.dtype == jnp.float32


def test_batches_are_a_pure_function_of_seed_and_step():
    docs = random_docs(2, num=30, max_len=60)
    ds = PackedDataset.from_documents(docs, 16, seed=0)
    again = PackedDataset.from_documents(docs, 16, seed=0)
    other = PackedDataset.from_documents(docs, 16, seed=1)
    steps = [5, 0, 7, 2, 7]
    first = {s: ds.batch(s, 4) for s in steps}
    for s in reversed(steps):  # call order does not matter; a fresh object agrees
        for a, b, c in zip(first[s], ds.batch(s, 4), again.batch(s, 4), strict=True):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(a, c)
    ours = np.concatenate([ds.batch(s, 4).tokens for s in range(8)])
    theirs = np.concatenate([other.batch(s, 4).tokens for s in range(8)])
    assert not np.array_equal(ours, theirs)


def test_each_epoch_visits_every_row_once():
    ds = PackedDataset.from_documents(random_docs(3, num=25, max_len=40), 8, seed=4)
    n, batch_size = ds.num_rows, 3
    seen = np.concatenate([ds.batch(s, batch_size).tokens for s in range(-(-2 * n // 3) + 1)])
    all_rows = ds.rows(np.arange(n)).tokens
    for epoch in range(2):  # batches straddle epochs; each epoch is still a permutation
        block = seen[epoch * n : (epoch + 1) * n]
        assert sorted(map(bytes, block)) == sorted(map(bytes, all_rows))
    assert not np.array_equal(seen[:n], seen[n : 2 * n])
    big = ds.batch(0, 2 * n + 1)  # a batch larger than the dataset repeats rows
    assert big.tokens.shape == (2 * n + 1, 8)


def test_eval_batches_cover_all_rows_in_order():
    ds = PackedDataset.from_documents(random_docs(4, num=10, max_len=40), 8)
    batches = list(ds.eval_batches(4))
    assert len(batches) == -(-ds.num_rows // 4)
    tokens = np.concatenate([b.tokens for b in batches])
    np.testing.assert_array_equal(tokens[: ds.num_rows], ds.tokens)
    extra = slice(ds.num_rows, None)
    assert (np.concatenate([b.loss_mask for b in batches])[extra] == 0).all()
    assert (np.concatenate([b.segment_ids for b in batches])[extra] == 0).all()
    assert (tokens[extra] == TOK.pad_id).all()


def test_validation_split_is_disjoint_and_seeded():
    docs = [f"document {i}\n" for i in range(100)]
    train, val = split_documents(docs, val_fraction=0.1, seed=0)
    assert len(val) == 10 and sorted(train + val) == sorted(docs) and not set(train) & set(val)
    assert train == sorted(train, key=docs.index)  # corpus order kept
    assert split_documents(docs, val_fraction=0.1, seed=0) == (train, val)
    assert split_documents(docs, val_fraction=0.1, seed=1)[1] != val
    assert len(split_documents(docs[:2], val_fraction=0.01)[1]) == 1


def test_default_corpus_is_the_stdlib():
    docs = load_corpus(max_bytes=3 * 2**20)
    size = sum(len(d.encode()) for d in docs)
    assert 2.5 * 2**20 < size <= 3 * 2**20 and len(docs) > 100
    assert sum("def " in d for d in docs) > len(docs) / 2
    train, val = load_datasets(seq_len=512, max_bytes=3 * 2**20, seed=0)
    assert train.num_documents + val.num_documents == len(docs)
    assert val.num_documents == round(0.05 * len(docs))
    assert train.padding_fraction < 0.01 and val.padding_fraction < 0.01
    train_text = {TOK.decode(r) for r in train.tokens[:, :64]}
    assert not train_text & {TOK.decode(r) for r in val.tokens[:, :64]}


def test_user_files(tmp_path):
    (tmp_path / "a.txt").write_text("alpha\n\nbeta\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("gamma 😀")
    (tmp_path / "c.bin").write_bytes(b"\x00\x01\x02\xff")  # binary: skipped
    (tmp_path / "d.txt").write_bytes(b"\xff\xfe bad utf-8")  # not UTF-8: skipped
    (tmp_path / ".hidden.txt").write_text("secret")
    (tmp_path / "e.txt").write_text("  \n")  # blank: dropped
    assert load_corpus(tmp_path) == ["alpha\n\nbeta\n", "gamma 😀"]
    assert load_corpus(tmp_path, suffixes=(".md",)) == ["gamma 😀"]
    assert load_corpus(tmp_path, suffixes=".md") == ["gamma 😀"]  # one suffix, not a substring
    assert load_corpus(tmp_path, separator="\n\n") == ["alpha", "beta\n", "gamma 😀"]
    assert load_corpus(tmp_path / "a.txt") == ["alpha\n\nbeta\n"]
    # The budget (a.txt, e.txt, 8 bytes of b.md) cuts mid-emoji: the partial character goes.
    assert load_corpus(tmp_path, max_bytes=12 + 3 + 8) == ["alpha\n\nbeta\n", "gamma "]
    train, val = load_datasets(tmp_path / "a.txt", seq_len=8, separator="\n\n")
    assert {train.num_documents, val.num_documents} == {1}
    # One file and no separator: its paragraphs are the documents (the CLI's --data FILE).
    alone = load_datasets(tmp_path / "a.txt", seq_len=8)
    assert [d.num_documents for d in alone] == [train.num_documents, val.num_documents]
    np.testing.assert_array_equal(alone[0].tokens, train.tokens)


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no text .* folder \(0 files\)"):
        load_corpus(tmp_path / "empty")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "x.dat").write_bytes(b"\x00\x01")
    with pytest.raises(ValueError, match=r"folder \(1 files\).*UTF-8"):
        load_corpus(tmp_path / "bin")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="the file is empty"):
        load_datasets(tmp_path / "empty.txt", seq_len=8)
    with pytest.raises(ValueError, match="max_bytes >= 1; got max_bytes=0"):
        load_corpus(max_bytes=0)
    (tmp_path / "one.txt").write_text("a single document")
    with pytest.raises(ValueError, match=r"at least 2 documents; got 1.*separator"):
        load_datasets(tmp_path / "one.txt", seq_len=8)
    with pytest.raises(ValueError, match=r"needs a path; got path=''"):
        load_corpus("")
    with pytest.raises(ValueError, match="non-empty separator"):
        load_corpus(tmp_path / "one.txt", separator="")
    with pytest.raises(TypeError, match=r"docs\[1\] of type int"):
        pack_documents(["abc", 5], 8)
    with pytest.raises(TypeError, match="got one str"):
        pack_documents("hello", 8)
    with pytest.raises(ValueError, match="seed must be >= 0; got -1"):
        split_documents(["a", "b"], seed=-1)
    with pytest.raises(ValueError, match="strictly between 0 and 1; got val_fraction=1"):
        split_documents(["a", "b"], val_fraction=1.0)
    for make in (
        lambda: pack_documents(["abc"], 1),
        lambda: PackedDataset.from_documents(["abc"], 0),
        lambda: load_datasets(seq_len=1),
    ):
        with pytest.raises(
            ValueError, match=r"seq_len must be at least 2 .*; got seq_len=[01]\. Pass"
        ):
            make()
    with pytest.raises(ValueError, match="at least one document; got an empty list"):
        PackedDataset.from_documents([], 8)
    ds = PackedDataset.from_documents(["abc", "defgh"], 4)
    with pytest.raises(ValueError, match="batch_size must be at least 1; got batch_size=0"):
        ds.batch(0, 0)
    with pytest.raises(ValueError, match="batch_size must be at least 1; got batch_size=-2"):
        ds.eval_batches(-2)
    with pytest.raises(ValueError, match="step >= 0; got step=-1"):
        ds.batch(-1, 2)
    with pytest.raises(ValueError, match=r"1-D sequence of ids; got shape \(2, 2\)"):
        TOK.decode(np.zeros((2, 2), np.int32))
