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


@pytest.mark.parametrize("power", [None, 1.0])
def test_whole_row_needles_lean_towards_the_start(power, monkeypatch):
    """A whole-row document's needle is drawn at depth u ** 2 (the farthest distances, the
    rarest, trained more often); at power 1, uniformly."""
    from eqx_longctx.evals import _mix

    if power is not None:
        monkeypatch.setattr(_mix, "FAR_DEPTH_POWER", power)
    data = retrieval_dataset(["passkey"], TOK, 512, 150, seed=4)
    whole = []
    for r in range(data.num_rows):
        spans = _segments(data.segment_ids[r])
        start, stop = spans[0]
        if len(spans) == 1 and stop - start > 0.75 * 512:
            text = TOK.decode(data.tokens[r, start + 1 : stop - 1].tolist())
            intro, question = text.find("remember it.") + 12, text.rfind("\n")
            whole.append((text.find("The pass key is") - intro) / (question - intro))
    assert 0.5 < len(whole) / data.num_rows < 0.7  # FULL_ROW_SHARE
    near = np.mean(np.asarray(whole) < 0.1)
    if power is None:
        assert np.mean(whole) < 0.4 and near > 0.25, (np.mean(whole), near)
    else:
        assert 0.4 < np.mean(whole) < 0.6 and near < 0.2, (np.mean(whole), near)


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


def test_drills_pack_short_needles_at_random_offsets():
    """`max_filler`: each document is a task's needles and question without the intro, in
    at most that many filler tokens, several to a row; the needle's and the question's
    offsets vary, and the answers loss counts the answer read back from its needle."""
    seq, rows, most = 512, 30, 40
    data = retrieval_dataset(["passkey"], TOK, seq, rows, seed=4, loss="answers",
                             max_filler=most)  # fmt: skip
    batch = data.rows(np.arange(rows))
    needle = " The pass key is"
    gaps, distances, count = [], [], 0
    for r in range(rows):
        used = int((data.segment_ids[r] > 0).sum())
        assert (data.segment_ids[r, :used] > 0).all()
        assert (data.tokens[r, used:] == TOK.pad_id).all()
        for start, stop in _segments(data.segment_ids[r]):
            ids = data.tokens[r, start:stop]
            assert ids[0] == TOK.bos_id and ids[-1] == TOK.eos_id
            np.testing.assert_array_equal(data.positions[r, start:stop], np.arange(stop - start))
            text = TOK.decode(ids[1:-1].tolist())
            m = re.fullmatch(r"(.*)" + needle + r" (\d{5})\. Remember it\.(.*)\nWhat is the pass "
                             r"key\? The pass key is (\d{5})", text, re.S)  # fmt: skip
            assert m is not None and m.group(2) == m.group(4), text
            assert "There is a pass key" not in text  # no intro
            gap = len(m.group(1)) + len(m.group(3))  # bytes: tokens of the byte tokenizer
            assert 0 <= gap <= most and not re.search(r"\d", m.group(1) + m.group(3))
            gaps.append(gap)
            distances.append(len(m.group(3)))  # needle end to question
            mask = batch.loss_mask[r, start:stop]
            counted = batch.targets[r, start:stop][mask > 0].tolist()
            assert TOK.decode(counted[:-1]) == " " + m.group(2) and counted[-1] == TOK.eos_id
            count += 1
    assert count == data.num_documents >= 4 * rows  # several to a row
    assert len(set(gaps)) > 30 and len(set(distances)) > 30 and min(gaps) < 5


def test_drills_refuse_a_row_they_do_not_fit():
    with pytest.raises(ValueError, match=r"--seq-len must be at least \d+ tokens for drills"):
        retrieval_dataset(["passkey"], TOK, 256, 1, max_filler=300)
    with pytest.raises(ValueError, match="--synthetic-filler is the most filler tokens"):
        retrieval_dataset(["passkey"], TOK, 256, 1, max_filler=-1)
    with pytest.raises(ValueError, match="--synthetic-filler"):
        TrainConfig(synthetic="passkey", synthetic_filler=-1)
    assert parse_flags(["--synthetic-filler", "32"]).synthetic_filler == 32


def test_a_ramp_reaches_the_batches_in_order():
    """`--synthetic-filler N`: drills whose filler grows from 0 to N over the run, at the
    share asked for, read by the training batches (numpy and Grain alike) in that order."""
    from eqx_longctx.data import GrainBatches
    from eqx_longctx.evals import with_retrieval

    seq, steps, batch, most = 256, 40, 4, 60
    text = PackedDataset.from_documents(["some text " * 300, "more text " * 200], seq, TOK, seed=3)
    data = with_retrieval(text, ["passkey"], TOK, share=0.75, loss="answers", seed=1,
                          max_filler=most, samples=steps * batch)  # fmt: skip
    assert data.num_rows == steps * batch and data.seed == text.seed
    grain = GrainBatches(data, batch_size=batch, seed=data.seed, spec=None)
    drills, fillers = 0, []
    for step in range(steps):
        b = data.batch(step, batch)
        np.testing.assert_array_equal(np.asarray(grain.get(step).tokens), b.tokens)
        gaps = []
        for r in range(batch):
            if "pass key" not in TOK.decode(b.tokens[r].tolist()):
                assert b.loss_mask[r].sum() > 100  # a text row: its whole loss
                continue
            drills += 1
            for start, stop in _segments(b.segment_ids[r]):
                doc = TOK.decode(b.tokens[r, start:stop].tolist())
                m = re.fullmatch(r"(.*) The pass key is \d{5}\. Remember it\.(.*)\nWhat is the "
                                 r"pass key\? The pass key is \d{5}", doc, re.S)  # fmt: skip
                assert m is not None, doc
                gaps.append(len(m.group(1)) + len(m.group(2)))
        fillers.append(max(gaps, default=-1))
    assert drills == round(0.75 * steps * batch)
    assert max(fillers[:4]) <= 6  # the first steps: needles right before their question
    assert max(fillers[-10:]) > 40 and max(fillers) <= most
    early, late = np.mean(fillers[: steps // 3]), np.mean(fillers[-steps // 3 :])
    assert late > early + 20, fillers


def test_a_run_of_prompts_generates_only_the_rows_it_reads():
    """Prompts at share 0.98 would mean 49 retrieval rows per text row; a run that reads
    fewer rows gets the share of its own rows, and every row it reads is one of them or
    text. A run that reads the whole mix gets the shuffled mix."""
    from eqx_longctx.evals import retrieval_rows_for, with_retrieval

    seq, steps, batch = 256, 10, 4
    text = PackedDataset.from_documents(["some text " * 300, "more text " * 200], seq, TOK, seed=3)
    assert retrieval_rows_for(text.num_rows, 0.98) > 2 * steps * batch
    data = with_retrieval(text, ["passkey"], TOK, share=0.98, loss="answers", seed=1,
                          max_filler=None, samples=steps * batch)  # fmt: skip
    assert data.num_rows == steps * batch
    read = np.concatenate([data.batch(step, batch).tokens for step in range(steps)])
    passkey = ["pass key" in TOK.decode(row.tolist()) for row in read]
    assert sum(passkey) == round(0.98 * steps * batch)
    texts = {tuple(row) for row in np.asarray(text.tokens)}
    assert all(p or tuple(row) in texts for p, row in zip(passkey, read, strict=True))
    whole = with_retrieval(text, ["passkey"], TOK, share=0.5, loss="all", seed=1,
                           max_filler=None, samples=10_000)  # fmt: skip
    assert whole.num_rows == 2 * text.num_rows


def test_the_passkey_recipe_drills_first_unless_told_not_to(tmp_path):
    """`--recipe passkey` trains its drill stage into RUN_DIR/stage-1, then the 2048-token
    run from it; `--no-stages` trains the last stage alone, and a start of one's own
    replaces the stages."""
    from eqx_longctx.train._cli import config_from_flags
    from eqx_longctx.train._recipes import RECIPES, recipe_stages

    def stages(*extra):
        args = parse_flags(["--recipe", "passkey", "--run-dir", str(tmp_path), *extra])
        return recipe_stages(RECIPES["passkey"], config_from_flags(args))

    drills, run = stages()
    assert (drills.seq_len, drills.synthetic_filler, drills.init_run) == (256, 60, None)
    assert drills.run_dir == str(tmp_path / "stage-1") and drills.synthetic == "passkey"
    assert (run.seq_len, run.synthetic_filler, run.init_run) == (2048, None, drills.run_dir)
    assert dict(run.model_overrides) == dict(drills.model_overrides) != {}
    (alone,) = stages("--init-run", str(tmp_path / "other"))
    assert alone.init_run == str(tmp_path / "other")
