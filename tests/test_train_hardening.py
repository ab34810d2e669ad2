"""Hardening of the training CLI: every flag rule raises an error naming the flag, the
value and the fix, and the CLI prints it as one line."""

import pathlib
import re

import pytest
from test_train import SMALL_MODEL, small_config

from eqx_longctx.train._cli import main
from eqx_longctx.train._config import check_train_config
from eqx_longctx.train._parallel import Placement
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
        ({"steps": 0}, ValueError, r"--steps .* at least 1; got --steps 0\. Pass e\.g\. --steps"),
        ({"warmup_steps": -1}, ValueError, r"--warmup-steps .* at least 0; got --warmup-steps -1"),
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
        ({"lr": NAN}, ValueError, r"--lr must be finite and > 0; got --lr nan\. Pass e\.g\. --lr"),
        ({"lr": INF}, ValueError, r"--lr must be finite and > 0; got --lr inf"),
        ({"lr": 0.0}, ValueError, r"--lr must be finite and > 0; got --lr 0\.0"),
        (
            {"weight_decay": -0.1},
            ValueError,
            r"--weight-decay must be finite and >= 0; got .* -0\.1",
        ),
        ({"weight_decay": NAN}, ValueError, r"--weight-decay must be finite and >= 0; got .* nan"),
        (
            {"clip_norm": 0.0},
            ValueError,
            r"--clip-norm must be finite and > 0 .*got --clip-norm 0.0",
        ),
        ({"clip_norm": INF}, ValueError, r"--clip-norm must be finite"),
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
            r"axes from \('data', 'ulysses', .*bad part 'pipeline=4'",
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
        ("model_overrides", [1], r"--override \(model_overrides\) must map LlamaConfig"),
        ("model_overrides", {1: 2}, r"must map LlamaConfig field names to values; got \{1: 2\}"),
    ],
)
def test_config_type_rule(tmp_path, field, value, match):
    """A plainly wrong type is a `TypeError`. (Under pytest jaxtyping already rejects it
    at `__init__`; the check itself is what runs for users, so it is called directly.)"""
    config = small_config(tmp_path)
    object.__setattr__(config, field, value)
    with pytest.raises(TypeError, match=match):
        check_train_config(config)


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


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (
            ["--mesh", "context=4,context=2", "--devices", "8"],
            "--mesh names each axis at most once",
        ),
        (["--lr", "nan"], r"--lr must be finite and > 0; got --lr nan"),
        (["--steps", "abc"], r"argument --steps: invalid int value: 'abc' \(see --help\)"),
        (["--strategy", "rings"], r"argument --strategy: invalid choice: 'rings'"),
        (["--override", "n_layers"], r"--override takes FIELD=VALUE"),
        (
            ["--batch-size", "6", "--devices", "8", "--mesh", "data=4,context=2"],
            r"--batch-size 6 must be divisible by 4",
        ),
        (["--override", "depth=3"], r"--override must name LlamaConfig fields; .*\['depth'\]"),
    ],
)
def test_cli_bad_flag_is_one_line(tmp_path, capsys, flags, match):
    status = main([*flags, "--run-dir", str(tmp_path / "run"), "--no-progress"])
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert err.startswith("eqx-longctx-train: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert re.search(match, err), err
    assert not (tmp_path / "run").exists()  # nothing was written
