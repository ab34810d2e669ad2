"""Hardening of the training CLI and checkpoints: every flag rule raises a one-line error
naming the flag, the value and the fix; a damaged newest checkpoint falls back to the newest
readable one; `--resume` refuses flags that change the run and names each difference."""

import dataclasses
import json
import os
import pathlib
import re
import shutil

import numpy as np
import pytest
from test_train import SEQ, SMALL_MODEL, params_of, small_config

from eqx_longctx.data import load_datasets
from eqx_longctx.train import (
    Checkpointer,
    TrainConfig,
    Trainer,
    make_optimizer,
    make_schedule,
)
from eqx_longctx.train._cli import main
from eqx_longctx.train._config import check_train_config
from eqx_longctx.train._parallel import Placement
from eqx_longctx.train._record import FREE_FLAGS, RESHARDABLE_FLAGS, RUN_FLAGS
from models.llama import LlamaConfig

# ---- flag rules ----------------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        (
            {"seq_len": 0},
            ValueError,
            r"--seq-len \(tokens per row\) .* at least 1; got --seq-len 0",
        ),
        ({"batch_size": -2}, ValueError, r"--batch-size .* at least 1; got --batch-size -2"),
        (
            {"steps": 0},
            ValueError,
            r"total_steps \(--steps\) must be at least 1; got total_steps=0\. .*\(--steps 200\)",
        ),
        (
            {"warmup_steps": -1},
            ValueError,
            r"warmup_steps \(--warmup-steps\) must be at least 0; got warmup_steps=-1",
        ),
        ({"warmup_steps": 8}, ValueError, r"below --steps.*--warmup-steps 8 and --steps 8"),
        ({"checkpoint_every": 0}, ValueError, r"--checkpoint-every .* at least 1"),
        ({"eval_every": -1}, ValueError, r"--eval-every .* at least 1"),
        ({"log_every": 0}, ValueError, r"--log-every .* at least 1"),
        ({"eval_batches": 0}, ValueError, r"--eval-batches .* at least 1; got --eval-batches 0"),
        ({"final_eval_batches": -3}, ValueError, r"--final-eval-batches .* at least 1"),
        ({"max_bytes": 0}, ValueError, r"--max-bytes .* at least 1"),
        ({"keep_checkpoints": 0}, ValueError, r"keep_checkpoints .* at least 1"),
        ({"devices": 0}, ValueError, r"--devices .* at least 1; got --devices 0"),
        ({"seed": -1}, ValueError, r"--seed .* at least 0; got --seed -1"),
        ({"seed": 2**32}, ValueError, r"--seed must be below 2\*\*32 .*got --seed 4294967296"),
        (
            {"lr": NAN},
            ValueError,
            r"lr \(--lr\) must be finite and > 0; got lr=nan\. Pass e\.g\. lr=3e-3 \(--lr 3e-3\)",
        ),
        ({"lr": INF}, ValueError, r"lr \(--lr\) must be finite and > 0; got lr=inf"),
        ({"lr": 0.0}, ValueError, r"lr \(--lr\) must be finite and > 0; got lr=0\.0"),
        (
            {"weight_decay": -0.1},
            ValueError,
            r"weight_decay \(--weight-decay\) must be finite and >= 0; got weight_decay=-0\.1",
        ),
        ({"weight_decay": NAN}, ValueError, r"\(--weight-decay\) must be .*; got weight_decay=nan"),
        (
            {"clip_norm": 0.0},
            ValueError,
            r"clip_norm \(--clip-norm\) must be finite and > 0 .*got clip_norm=0\.0",
        ),
        ({"clip_norm": INF}, ValueError, r"clip_norm \(--clip-norm\) must be finite"),
        ({"val_fraction": 1.0}, ValueError, r"val_fraction must be .* between 0 and 1"),
        ({"strategy": "rings"}, ValueError, r"--strategy must be one of .*got --strategy 'rings'"),
        ({"load_balance": "zag"}, ValueError, r"--load-balance must be one of .* 'zag'"),
        ({"on_nonfinite": "explode"}, ValueError, r"--on-nonfinite must be one of .*'explode'"),
        ({"remat": "some"}, ValueError, r"--remat must be one of .*got --remat 'some'"),
        (
            {"devices": 8, "mesh": "context=4,context=2"},
            ValueError,
            r"at most once; .*'context' appears twice \(context=4 and context=2\)",
        ),
        (
            {"devices": 8, "mesh": "data=2,pipeline=4"},
            ValueError,
            r"axes from \('data', 'fsdp', .*bad part 'pipeline=4'",
        ),
        (
            {"devices": 8, "mesh": "data=2;context=4"},
            ValueError,
            r"positive integers; .*axis 'data' has size '2;context=4'",
        ),
        (
            {"devices": 1, "mesh": "context=0"},
            ValueError,
            r"positive integers; .*'context' has size '0'",
        ),
        ({"devices": 4, "mesh": "context=-4"}, ValueError, r"sizes must be positive integers"),
        ({"devices": 4, "mesh": "data=2,context=two"}, ValueError, r"'context' has size 'two'"),
        ({"devices": 2, "mesh": "data=2"}, ValueError, r"--mesh needs a 'context' axis"),
        (
            {"devices": 8, "mesh": "data=2,context=2"},
            ValueError,
            r"'data=2,context=2' \(4 devices\) and --devices 8\. Pass --devices 4",
        ),
        ({"resume": True, "overwrite": True}, ValueError, r"got both\. Pass only one of --resume"),
    ],
)
def test_config_rule(tmp_path, changes, error, match):
    with pytest.raises(error, match=match):
        small_config(tmp_path, **changes)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("steps", 2.5, r"--steps \(optimizer steps\) must be an integer; got float 2\.5"),
        ("batch_size", True, r"--batch-size .* must be an integer; got bool True"),
        ("max_bytes", "4MB", r"--max-bytes .* must be an integer; got str '4MB'"),
        ("lr", "3e-3", r"--lr must be a number; got str '3e-3'\. Pass e\.g\. --lr 3e-3"),
        ("preset", 3, r"--preset must be a str; got int 3\. Pass a string"),
        ("mesh", 4, r"--mesh must be a str; got int 4\. Pass a string or None"),
        ("resume", "yes", r"--resume must be a bool; got str 'yes'\. Pass True or False"),
        ("model_overrides", [1], r"--override \(model_overrides\) must map field names of"),
        ("model_overrides", {1: 2}, r"config \(e\.g\. LlamaConfig\) to values; got \{1: 2\}"),
        ("model", None, r"--model must be a str; got NoneType None\. Pass a string\."),
        ("fsdp_axes", 3, r"--fsdp-axes must be a str; got int 3\. Pass a string or None"),
    ],
)
def test_config_type_rule(tmp_path, field, value, match):
    """A plainly wrong type is a `TypeError`. (Under pytest jaxtyping already rejects it
    at `__init__`; the check itself is what runs for users, so it is called directly.)"""
    config = small_config(tmp_path)
    object.__setattr__(config, field, value)
    with pytest.raises(TypeError, match=match):
        check_train_config(config)


def test_optimizer_functions_share_the_rules():
    """`make_schedule` / `make_optimizer` run the same checks as the flags (NaN included)."""
    with pytest.raises(ValueError, match=r"lr \(--lr\) must be finite and > 0; got lr=nan"):
        make_schedule(NAN, 2, 8)
    with pytest.raises(ValueError, match=r"total_steps \(--steps\) must be at least 1"):
        make_schedule(1e-3, 0, 0)
    with pytest.raises(ValueError, match=r"clip_norm \(--clip-norm\) must be finite and > 0"):
        make_optimizer(1e-3, 2, 8, clip_norm=INF)
    with pytest.raises(ValueError, match=r"weight_decay \(--weight-decay\) must be finite"):
        make_optimizer(1e-3, 2, 8, weight_decay=-1.0)


def test_config_accepts_edges(tmp_path):
    """The limits are inclusive where the rule says so, and paths are recorded as strings."""
    config = small_config(
        tmp_path, warmup_steps=7, weight_decay=0.0, seed=2**32 - 1, lr=1.0, eval_batches=None
    )
    assert config.run_dir == str(tmp_path)
    assert small_config(pathlib.Path(tmp_path), steps=1, warmup_steps=0).steps == 1
    # The default mesh of each device count is valid.
    for devices in (1, 2, 3, 4, 6, 8):
        small_config(tmp_path, devices=devices)


TINY = LlamaConfig.from_preset("tiny", vocab_size=259, **SMALL_MODEL)  # 4 query, 2 kv heads


@pytest.mark.parametrize(
    ("mesh", "strategy", "batch", "seq", "match"),
    [
        ("data=4,context=2", "ring", 6, 64, r"--batch-size 6 must be divisible by 4; .*batch of 8"),
        ("context=8", "ring", 8, 24, r"--seq-len 24: .* divisible by 16; got seq=24\. Use seq=32"),
        (
            "context=8",
            "ulysses",
            8,
            64,
            r"'ulysses' on mesh \{'context': 8\}.* 4 query / 2 key-value",
        ),
        (
            "data=2,tensor=4,context=1",
            "ring",
            8,
            64,
            r"tensor_axis 'tensor' has 4 devices.*kv_heads=2",
        ),
        (
            "ulysses=2,context=4",
            "ring",
            8,
            64,
            r"'ulysses=2,context=4' with --strategy 'ring': Sh.*ulysses_axis",
        ),
        (
            "context=8",
            "usp",
            8,
            64,
            r"'context=8' with --strategy 'usp': .*'usp' needs ulysses_axis",
        ),
    ],
)
def test_placement_rule(mesh, strategy, batch, seq, match):
    """Mesh-dependent rules are the ShardingSpec's own, run on the shapes before any tracing."""
    with pytest.raises(ValueError, match=match):
        Placement(8, mesh, strategy).check_run(batch, seq, TINY)


def test_placement_accepts_divisible_shapes():
    Placement(8, "data=2,context=4", "ring").check_run(8, 64, TINY)
    Placement(8, "ulysses=2,context=4", "usp").check_run(8, 64, TINY)
    Placement(1).check_run(3, 7, TINY)  # one device: nothing to split


def test_flag_groups_cover_every_field():
    groups = RUN_FLAGS + RESHARDABLE_FLAGS + FREE_FLAGS
    assert len(groups) == len(set(groups))
    assert set(groups) == {f.name for f in dataclasses.fields(TrainConfig)}


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (
            ["--mesh", "context=4,context=2", "--devices", "8"],
            "--mesh names each axis at most once",
        ),
        (["--lr", "nan"], r"lr \(--lr\) must be finite and > 0; got lr=nan"),
        (["--steps", "abc"], r"argument --steps: invalid int value: 'abc' \(see --help\)"),
        (["--strategy", "rings"], r"argument --strategy: invalid choice: 'rings'"),
        (["--override", "n_layers"], r"--override takes FIELD=VALUE"),
        (
            ["--batch-size", "6", "--devices", "8", "--mesh", "data=4,context=2"],
            r"--batch-size 6 must be divisible by 4",
        ),
        (["--override", "depth=3"], r"--override must name LlamaConfig fields; .*\['depth'\]"),
        (["--override", "sliding_window=abc"], r"--override sliding_window=abc: .*must be an int"),
        (["--run-dir", ""], r"--run-dir must not be empty"),
        (["--data", ""], r"--data must not be empty"),
        (["--mesh", ""], r"--mesh must not be empty"),
        (["--override", "max_seq_len=16"], r"max_seq_len=16 is shorter than --seq-len 64"),
        (["--override", "vocab_size=3"], r"vocab_size=3 is smaller than the tokenizer's 259"),
    ],
)
def test_cli_bad_flag_is_one_line(tmp_path, capsys, flags, match):
    run_dir = [] if "--run-dir" in flags else ["--run-dir", str(tmp_path / "run")]
    status = main([*flags, *run_dir, "--seq-len", "64", "--no-progress"])
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert err.startswith("eqx-longctx-train: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert re.search(match, err), err
    assert not (tmp_path / "run").exists()  # nothing was written


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


def test_override_of_a_field_the_preset_leaves_none_parses():
    from eqx_longctx.train._config import resolve_overrides

    parsed = resolve_overrides("tiny", {"sliding_window": "64", "layer_types": "none"})
    assert parsed == {"sliding_window": 64, "layer_types": None}


def test_override_parses_json_for_fields_the_preset_leaves_none():
    from eqx_longctx.train._config import resolve_overrides

    parsed = resolve_overrides(
        "tiny",
        {
            "layer_types": '["sliding_attention", "full_attention"]',
            "rope_scaling": '{"rope_type": "linear", "factor": 4.0}',
            "sliding_window": "none",
        },
    )
    assert parsed == {
        "layer_types": ("sliding_attention", "full_attention"),
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        "sliding_window": None,
    }


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


def test_resume_without_run_dir_takes_the_run_whose_checkpoints_changed_last(tmp_path, monkeypatch):
    from eqx_longctx.train._config import default_run_dir

    monkeypatch.chdir(tmp_path)
    for name, when in (("20990101-000000", 1_000), ("baseline", 2_000), ("aaa", 1_500)):
        (tmp_path / "runs" / name / "checkpoints").mkdir(parents=True)
        os.utime(tmp_path / "runs" / name / "checkpoints", (when, when))
    assert default_run_dir(resume=True).name == "baseline"


def test_help_states_each_default_once():
    from eqx_longctx.inference._cli import build_parser as generate_parser
    from eqx_longctx.train._cli import build_parser as train_parser

    for parser in (train_parser(), generate_parser()):
        text = " ".join(parser.format_help().split())
        assert not re.search(r"default[^()]*\)\s*\(default: ", text), text
        assert "(default: the preset's)" in text or parser.prog != "eqx-longctx-train"
