"""Hardening of the trainer's checkpoints: a damaged newest checkpoint falls back to the
newest readable one; `--resume` refuses flags that change the run and names each difference;
`--overwrite` keeps the earlier run when the new flags fail. (The flag rules:
`test_train_flags.py`.)"""

import json
import pathlib
import re
import shutil

import numpy as np
import pytest
from test_train import SEQ, SMALL_MODEL, params_of, small_config

from eqx_longctx.data import load_datasets
from eqx_longctx.train import Checkpointer, Trainer

# ---- damaged checkpoints -------------------------------------------------------------------


@pytest.fixture(scope="module")
def datasets():
    return load_datasets(None, seq_len=SEQ, max_bytes=300_000, val_fraction=0.1)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, datasets):
    """A run of 8 steps with checkpoints at 4 and 8, and its final model."""
    run_dir = tmp_path_factory.mktemp("finished")
    trainer = Trainer(small_config(run_dir), datasets=datasets)
    result = trainer.run()
    trainer.close()
    assert result.checkpoint_steps == [4, 8]
    return run_dir, result


@pytest.fixture
def run_copy(tmp_path, finished_run):
    shutil.copytree(finished_run[0], tmp_path / "run")
    return tmp_path / "run"


def truncate_data(step_dir: pathlib.Path) -> str:
    files = list((step_dir / "state" / "ocdbt.process_0" / "d").iterdir())
    largest = max(files, key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    return "OUT_OF_RANGE"


def delete_meta(step_dir: pathlib.Path) -> str:
    (step_dir / "meta" / "metadata").unlink()
    return r"meta/metadata not found"


def delete_state(step_dir: pathlib.Path) -> str:
    shutil.rmtree(step_dir / "state")
    return "state"


@pytest.mark.parametrize("damage", [truncate_data, delete_meta, delete_state])
def test_damaged_newest_checkpoint_falls_back(run_copy, finished_run, datasets, capsys, damage):
    why = damage(run_copy / "checkpoints" / "8")
    trainer = Trainer(small_config(run_copy, resume=True), datasets=datasets)
    err = capsys.readouterr().err
    assert trainer.step == 4 and trainer.nothing_to_do is None
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("checkpoint step 8 in ") and "cannot be read" in lines[0]
    assert re.search(why, lines[0]), lines[0]
    assert "resuming from step 4 instead (step 8 moved to " in lines[0]
    assert (run_copy / "checkpoints-unreadable" / "8").is_dir()
    assert trainer.checkpointer.steps() == [4]
    # The metrics continue from the checkpoint resumed.
    steps = [json.loads(x)["step"] for x in (run_copy / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 4
    if damage is truncate_data:  # continuing from step 4 saves step 8 again, exactly
        result = trainer.run()
        for a, b in zip(params_of(result.model), params_of(finished_run[1].model), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7)
        assert result.checkpoint_steps == [4, 8]
    trainer.close()


def test_all_checkpoints_unreadable_stop(run_copy, datasets):
    for step in ("4", "8"):
        delete_meta(run_copy / "checkpoints" / step)
    before = sorted(p.name for p in (run_copy / "checkpoints").iterdir())
    with pytest.raises(ValueError, match=r"none in .*checkpoints can be read") as info:
        Trainer(small_config(run_copy, resume=True), datasets=datasets)
    message = str(info.value)
    assert "\n" not in message
    assert re.search(
        r"\(step 8: FileNotFoundError: .*8/meta/metadata not found.*; step 4: ", message
    )
    assert "Start a new --run-dir, or pass --overwrite instead of --resume" in message
    assert sorted(p.name for p in (run_copy / "checkpoints").iterdir()) == before


def test_damaged_newest_and_refused_flags_say_both(run_copy, datasets, capsys):
    delete_meta(run_copy / "checkpoints" / "8")
    with pytest.raises(ValueError, match=r"--seed: recorded 0, given 1.*cannot be read: step 8"):
        Trainer(small_config(run_copy, resume=True, seed=1), datasets=datasets)
    assert capsys.readouterr().err == ""  # the one error line says it all
    assert (run_copy / "checkpoints" / "8").is_dir()  # nothing moved when refusing


def test_set_aside_needs_a_step_folder(tmp_path):
    checkpointer = Checkpointer(tmp_path / "checkpoints", async_save=False)
    with pytest.raises(ValueError, match=r"checkpoints holds no step folders, not step 3\."):
        checkpointer.set_aside(3)
    checkpointer.save(2, np.zeros(3, np.float32), {"count": np.int32(0)}, {})
    checkpointer.save(4, np.ones(3, np.float32), {"count": np.int32(1)}, {})
    with pytest.raises(
        ValueError,
        match=r"set_aside moves a saved step's folder; .*checkpoints holds step folders "
        r"\[2, 4\], not step 3\. Pass one of the steps there",
    ):
        checkpointer.set_aside(3)
    assert checkpointer.steps() == [2, 4]  # nothing moved
    moved = checkpointer.set_aside(4)
    assert moved == tmp_path / "checkpoints-unreadable" / "4" and moved.is_dir()
    assert checkpointer.steps() == [2]
    checkpointer.close()


# ---- resume refuses flags that change the run ------------------------------------------------


def test_resume_refuses_changed_flags(run_copy):
    metrics = (run_copy / "metrics.jsonl").read_bytes()
    short = load_datasets(None, seq_len=32, max_bytes=300_000, val_fraction=0.1)
    changed = small_config(run_copy, resume=True, seed=1, lr=1e-3, seq_len=32)
    with pytest.raises(ValueError) as info:
        Trainer(changed, datasets=short)
    message = str(info.value)
    assert message.startswith("--resume must continue a run with the flags it was started with")
    assert (
        "differs in 3: --seq-len: recorded 64, given 32; --lr: recorded 0.003, given 0.001; "
        "--seed: recorded 0, given 1." in message
    )
    assert "Pass the recorded values (--seq-len 64 --lr 0.003 --seed 0)" in message
    assert "or start a new --run-dir" in message
    assert (run_copy / "metrics.jsonl").read_bytes() == metrics
    assert Checkpointer(run_copy / "checkpoints").steps() == [4, 8]


def test_resume_refuses_changed_model_and_optimizer(run_copy, datasets):
    changed = small_config(
        run_copy,
        resume=True,
        steps=12,
        warmup_steps=3,
        weight_decay=0.0,
        clip_norm=0.5,
        model_overrides={**SMALL_MODEL, "n_layers": 1},
    )
    with pytest.raises(ValueError, match="differs in 5: --override: recorded") as info:
        Trainer(changed, datasets=datasets)
    for part in (
        "'n_layers': 2",
        "--steps: recorded 8, given 12 (the cosine schedule spans --steps)",
        "--warmup-steps: recorded 2, given 3",
        "--weight-decay: recorded 0.1, given 0.0",
        "--clip-norm: recorded 1.0, given 0.5",
    ):
        assert part in str(info.value)


def test_resume_without_flags_file_checks_the_checkpoint_record(run_copy, datasets):
    (run_copy / "flags.json").unlink()
    with pytest.raises(ValueError, match=r"8 \(no flags.json\) differs in 1: --seed: recorded 0"):
        Trainer(small_config(run_copy, resume=True, seed=1), datasets=datasets)


def test_resume_may_reshard(run_copy, finished_run, datasets):
    """Placement flags and strides may change on resume: the same run continues."""
    shutil.rmtree(run_copy / "checkpoints" / "8")  # killed before the last save
    changed = small_config(
        run_copy,
        resume=True,
        devices=2,
        mesh="context=2",
        strategy="all_gather",
        load_balance="striped",
        remat="full",
        eval_every=8,
        log_every=2,
        on_nonfinite="skip",
    )
    trainer = Trainer(changed, datasets=datasets)
    assert trainer.step == 4
    result = trainer.run()
    trainer.close()
    assert result.status == "completed" and result.step == 8
    for a, b in zip(params_of(result.model), params_of(finished_run[1].model), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("steps", [4, 8])
def test_resume_with_nothing_left_to_do(run_copy, datasets, steps):
    metrics = (run_copy / "metrics.jsonl").read_bytes()
    trainer = Trainer(small_config(run_copy, resume=True, steps=steps), datasets=datasets)
    message = trainer.nothing_to_do
    assert message is not None and message.startswith("nothing left to do: ")
    assert f"is step 8 and --steps {steps} asks for no more; nothing was trained" in message
    result = trainer.run()
    trainer.close()
    assert result.status == "nothing_to_do" and result.step == 8
    assert result.checkpoint_steps == [4, 8]
    assert (run_copy / "metrics.jsonl").read_bytes() == metrics


def test_overwrite_keeps_the_earlier_run_when_the_new_flags_fail(run_copy, datasets):
    metrics = (run_copy / "metrics.jsonl").read_bytes()
    for override in ({"max_seq_len": 16}, {"vocab_size": 3}):
        bad = small_config(run_copy, overwrite=True, model_overrides=override)
        with pytest.raises(ValueError, match="max_seq_len=16|vocab_size=3"):
            Trainer(bad, datasets=datasets)
    assert (run_copy / "metrics.jsonl").read_bytes() == metrics
    assert Checkpointer(run_copy / "checkpoints").steps() == [4, 8]


def test_a_run_dir_under_a_file_is_one_error(tmp_path, datasets):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        Trainer(small_config(tmp_path / "afile" / "run"), datasets=datasets)
