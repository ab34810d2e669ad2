"""The training rows of retrieval documents (`eqx_longctx.evals.retrieval_dataset`) and
their mix with text: documents whole and of varied lengths, padding only at a row's end,
and with `loss="answers"` a loss mask that counts exactly the answer's tokens, read back
from the rows themselves."""

import re

import numpy as np
import pytest

from eqx_longctx.data import ByteTokenizer, PackedDataset
from eqx_longctx.evals import min_length, mix_datasets, retrieval_dataset
from eqx_longctx.train import TrainConfig
from eqx_longctx.train._cli import parse_flags

TOK = ByteTokenizer()
SEQ, ROWS = 1024, 12


def _segments(row_segments):
    """`[(start, stop)]` of each document (segment id > 0) of a row."""
    cuts = np.flatnonzero(np.diff(row_segments)) + 1
    bounds = [0, *cuts.tolist(), len(row_segments)]
    pairs = zip(bounds[:-1], bounds[1:], strict=True)
    return [(a, b) for a, b in pairs if row_segments[a] > 0]


def test_rows_hold_whole_documents_of_varied_lengths():
    rows = 40
    data = retrieval_dataset(["passkey", "niah_multikey"], TOK, SEQ, rows, seed=3)
    assert data.tokens.shape == (rows, SEQ) and data.loss_weights is None
    shortest = min_length("niah_multikey", TOK) + 2
    count, lengths, questions = 0, [], []
    for r in range(rows):
        used = int((data.segment_ids[r] > 0).sum())
        assert (data.segment_ids[r, :used] > 0).all() and (
            data.tokens[r, used:] == TOK.pad_id
        ).all()
        assert SEQ - used < shortest  # padding only where no document fits
        for start, stop in _segments(data.segment_ids[r]):
            ids = data.tokens[r, start:stop]
            assert ids[0] == TOK.bos_id and ids[-1] == TOK.eos_id
            np.testing.assert_array_equal(data.positions[r, start:stop], np.arange(stop - start))
            assert stop - start >= shortest
            lengths.append(stop - start)
            questions.append(TOK.decode(ids.tolist()).rfind("\n"))  # where the question opens
            count += 1
    assert count == data.num_documents > rows  # some rows hold several documents
    assert max(lengths) > 0.75 * SEQ  # the longest contexts are trained
    # No position a model could answer from: the question opens at many places.
    assert len(set(questions)) > 0.8 * len(questions), sorted(questions)


def test_answers_loss_counts_exactly_the_answer_tokens():
    data = retrieval_dataset(["passkey"], TOK, SEQ, ROWS, seed=5, loss="answers")
    batch = data.rows(np.arange(ROWS))
    for r in range(ROWS):
        for start, stop in _segments(data.segment_ids[r]):
            mask = batch.loss_mask[r, start:stop]
            counted = batch.targets[r, start:stop][mask > 0].tolist()
            assert counted[-1] == TOK.eos_id  # where the answer stops counts too
            answer = TOK.decode(counted[:-1])
            prompt = TOK.decode(data.tokens[r, start + 1 : stop - 1].tolist())
            assert re.fullmatch(r" \d{5}", answer), answer
            assert prompt.count(answer.strip()) == 2  # in the needle, and as the answer
            assert prompt.endswith("What is the pass key? The pass key is" + answer)


def test_a_mix_keeps_the_text_loss_whole():
    text = PackedDataset.from_documents(["some text " * 300, "more text " * 200], SEQ, TOK)
    retrieval = retrieval_dataset(["passkey"], TOK, SEQ, 4, loss="answers")
    mixed = mix_datasets(text, retrieval)
    n = text.num_rows
    assert mixed.num_documents == text.num_documents + retrieval.num_documents
    batch = mixed.rows(np.arange(mixed.num_rows))
    np.testing.assert_array_equal(batch.loss_mask[:n], text.rows(np.arange(n)).loss_mask)
    answer_tokens = batch.loss_mask[n:].sum(-1)
    assert (answer_tokens >= 7).all() and (answer_tokens % 7 == 0).all()  # " 12345", EOS
    plain = mix_datasets(text, retrieval_dataset(["passkey"], TOK, SEQ, 4))
    assert plain.loss_weights is None
    empty = mixed.rows(np.array([mixed.num_rows]))  # past the end: an empty row
    assert empty.loss_mask.sum() == 0


def test_bad_loss_and_weights_raise():
    with pytest.raises(ValueError, match=r"loss must be one of \('all', 'answers'\)"):
        retrieval_dataset(["passkey"], TOK, SEQ, 1, loss="needles")
    t = np.zeros((2, 8), np.int32)
    with pytest.raises(ValueError, match="loss_weights must be finite and shaped like tokens"):
        PackedDataset(t, t, t, pad_id=0, num_documents=1, loss_weights=np.ones((2, 7)))
    with pytest.raises(ValueError, match="--synthetic-loss must be one of"):
        TrainConfig(synthetic="passkey", synthetic_loss="some")


def test_the_recipes_train_on_answers_and_a_flag_wins():
    assert parse_flags(["--recipe", "passkey"]).synthetic_loss == "answers"
    flags = parse_flags(["--recipe", "passkey", "--synthetic-loss", "all"])
    assert flags.synthetic_loss == "all"
    assert parse_flags([]).synthetic_loss == "all"
