"""The training CLI's flag rules: every rule raises a one-line error naming the flag, the
value and the fix, before anything is written; mesh-dependent rules are the ShardingSpec's
own; `--override` parses values for fields the preset leaves None. (Damaged checkpoints and
`--resume`'s refusals: `test_train_hardening.py`.)"""

import dataclasses
import os
import pathlib
import re

import pytest
from test_train import SMALL_MODEL, small_config

from eqx_longctx.run import Placement, placement_from_flags
from eqx_longctx.train import TrainConfig, make_optimizer, make_schedule
from eqx_longctx.train._cli import main
from eqx_longctx.train._config import check_train_config, flag_name
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
        ("data=4,context=2", "ring", 6, 64, r"batch_size=6 must be divisible by 4; .*batch of 8"),
        ("context=8", "ring", 8, 24, r"seq_len=24: .* divisible by 16; got seq=24\. Use seq=32"),
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
    """Mesh-dependent rules are the ShardingSpec's own, run on the shapes before any tracing;
    the placement names values as arguments (`batch_size=6`), the trainer as flags (below)."""
    with pytest.raises(ValueError, match=match):
        placement_from_flags(8, mesh, strategy).check_run(batch, seq, TINY)


def test_placement_words_values_as_the_caller_names_them():
    placement = placement_from_flags(8, "data=4,context=2", "ring")
    with pytest.raises(ValueError, match=r"so --batch-size 6 must be divisible by 4"):
        placement.check_run(6, 64, TINY, name=flag_name)
    with pytest.raises(ValueError, match=r"a micro-batch \(batch_size=8 / grad_accum=4 = 2"):
        placement.check_run(8, 64, TINY, grad_accum=4)
    with pytest.raises(ValueError, match=r"^mesh context=8 with strategy 'usp' .*: .*ulysses"):
        Placement(8, {"context": 8}, "usp")


def test_placement_accepts_divisible_shapes():
    placement_from_flags(8, "data=2,context=4", "ring").check_run(8, 64, TINY)
    placement_from_flags(8, "ulysses=2,context=4", "usp").check_run(8, 64, TINY)
    placement_from_flags(1).check_run(3, 7, TINY)  # one device: nothing to split


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


# ---- parsing: --override values, the default run dir, --help -------------------------------


def test_override_of_a_field_the_preset_leaves_none_parses():
    from eqx_longctx.run import resolve_overrides

    parsed = resolve_overrides("tiny", {"sliding_window": "64", "layer_types": "none"})
    assert parsed == {"sliding_window": 64, "layer_types": None}


def test_override_parses_json_for_fields_the_preset_leaves_none():
    from eqx_longctx.run import resolve_overrides

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


def test_resume_without_run_dir_takes_the_run_whose_checkpoints_changed_last(tmp_path, monkeypatch):
    from eqx_longctx.run import default_run_dir

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


def test_override_of_a_tuple_field_parses_a_json_list():
    """A hybrid preset's layer_types is a tuple: the override is a JSON list, not the
    string's characters."""
    from eqx_longctx.run import resolve_overrides

    text = '["full_attention", "linear_attention"]'
    parsed = resolve_overrides("tiny", {"layer_types": text}, model="qwen3_next")
    assert parsed == {"layer_types": ("full_attention", "linear_attention")}
    assert resolve_overrides("tiny", {"layer_types": "none"}, model="qwen3_next") == {
        "layer_types": None
    }
    with pytest.raises(ValueError, match=r"layer_types='full'.*must be a JSON list"):
        resolve_overrides("tiny", {"layer_types": "full"}, model="qwen3_next")
