"""Starting from another run's weights (`--init-run`): the long stage of a short-then-long
schedule starts from exactly the short run's newest checkpoint, under another mesh,
sequence length and RoPE base, with a fresh optimizer; it resumes as its own run; and every
bad start is one clear error."""

import json

import jax
import numpy as np
import pytest

from eqx_longctx.data import load_datasets
from eqx_longctx.run import read_run_model
from eqx_longctx.train import TrainConfig, Trainer
from eqx_longctx.train._cli import main

SMALL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "hidden_dim": 128}
FLAGS = [f"--override={k}={v}" for k, v in SMALL.items()]
COMMON = ["--max-bytes", "200000", "--eval-every", "100", "--eval-batches", "1",
          "--final-eval-batches", "1", "--batch-size", "4", "--no-progress"]  # fmt: skip


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    """A 3-step run at 32 tokens on one device: the short stage."""
    run = tmp_path_factory.mktemp("short") / "run"
    flags = [*FLAGS, *COMMON, "--seq-len", "32", "--steps", "3", "--devices", "1"]
    assert main([*flags, "--checkpoint-every", "3", "--run-dir", str(run)]) == 0
    return run


def _leaves(model):
    return [np.asarray(x) for x in jax.tree.leaves(model) if isinstance(x, jax.Array)]


def _config(run_dir, short, **changes):
    base = dict(
        model_overrides=SMALL, seq_len=64, batch_size=4, steps=2, warmup_steps=1,
        run_dir=str(run_dir), eval_every=100, eval_batches=1, final_eval_batches=1,
        checkpoint_every=2, progress=False, devices=4, mesh="data=2,context=2",
        init_run=str(short), max_bytes=200_000,
    )  # fmt: skip
    return TrainConfig(**{**base, **changes})


def test_the_long_stage_starts_from_the_short_runs_weights(short, tmp_path):
    source = read_run_model(short, lambda c, f: _placement_of_one(), reader="test")
    data = load_datasets(None, seq_len=64, max_bytes=200_000, val_fraction=0.05)
    config = _config(tmp_path / "long", short, model_overrides={**SMALL, "rope_theta": 5e5})
    trainer = Trainer(config, datasets=data)
    try:
        assert trainer.step == 0 and trainer.model.config.rope_theta == 5e5
        assert trainer.model.config.max_seq_len >= 64
        for a, b in zip(_leaves(source.model), _leaves(trainer.model), strict=True):
            np.testing.assert_array_equal(a, b)  # exactly the short run's step-3 weights
        moments = [x for x in jax.tree.leaves(trainer.opt_state) if isinstance(x, jax.Array)]
        assert all(not np.asarray(m).any() for m in moments if m.ndim > 0)  # fresh AdamW
        result = trainer.run()
    finally:
        trainer.close()
    assert result.status == "completed"
    flags = json.loads((tmp_path / "long" / "flags.json").read_text())
    assert flags["init_run"] == str(short.resolve()) and flags["seq_len"] == 64
    # It resumes as its own run: the checkpoint wins, --init-run may be left out.
    again = _config(tmp_path / "long", short, init_run=None, resume=True, steps=2,
                    model_overrides={**SMALL, "rope_theta": 5e5})  # fmt: skip
    trainer = Trainer(again, datasets=data)
    try:
        assert trainer.nothing_to_do is not None
    finally:
        trainer.close()


def _placement_of_one():
    from eqx_longctx.run import placement_from_flags

    return placement_from_flags(1, None, "ring", "zigzag", None, vocab_size=259)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"model_overrides": {**SMALL, "dim": 32}},
         r"--init-run .* would change the model's weights: .* is \(259, 64\)"),
        ({"model": "deepseek", "model_overrides": {}},
         r"--init-run .* is a run of --model llama, this run trains --model deepseek"),
        ({"init_run": "/nonexistent/run"}, r"--init-run /nonexistent/run: .*needs its checkpoints"),
    ],
)  # fmt: skip
def test_a_start_that_cannot_be_made_is_one_error(short, tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        Trainer(_config(tmp_path / "bad", short, devices=1, mesh=None, **changes)).close()


def test_init_run_and_init_hf_together_are_refused(short, tmp_path):
    with pytest.raises(ValueError, match="got both --init-hf .* and --init-run"):
        _config(tmp_path, short, init_hf=str(tmp_path))
    with pytest.raises(ValueError, match="--init-run must not be empty"):
        _config(tmp_path, short, init_run="")


def test_a_recipe_trains_its_stages_in_order_then_the_run(tmp_path, monkeypatch):
    """A recipe's stages train into RUN_DIR/stage-1, stage-2, each from the one before,
    the run itself from the last; `--resume` finds all done; a user's `--init-run` replaces
    the stages."""
    from eqx_longctx.train import _recipes

    recipe = _recipes.Recipe(
        "staged", "a test recipe", {"seq_len": 64, "steps": 2, "devices": 1},
        stages=({"seq_len": 32, "batch_size": 2, "steps": 2},
                {"seq_len": 48, "steps": 4, "warmup_steps": 1}),
    )  # fmt: skip
    monkeypatch.setitem(_recipes.RECIPES, "staged", recipe)
    run = tmp_path / "run"
    flags = ["--recipe", "staged", *FLAGS, *COMMON, "--checkpoint-every", "2",
             "--run-dir", str(run)]  # fmt: skip
    assert main(flags) == 0
    read = lambda d: json.loads((d / "flags.json").read_text())  # noqa: E731
    one, two, last = read(run / "stage-1"), read(run / "stage-2"), read(run)
    assert (one["seq_len"], one["steps"], one["init_run"]) == (32, 2, None)
    assert (two["seq_len"], two["steps"], two["warmup_steps"]) == (48, 4, 1)
    assert one["batch_size"] == 2 and two["batch_size"] == last["batch_size"] == 4
    assert two["init_run"] == str((run / "stage-1").resolve())
    assert last["init_run"] == str((run / "stage-2").resolve()) and last["seq_len"] == 64
    for folder, step in ((run / "stage-1", 2), (run / "stage-2", 4), (run, 2)):
        assert (folder / "checkpoints" / str(step)).is_dir()
    assert main([*flags, "--resume"]) == 0  # every stage: nothing left to do

    config = TrainConfig(run_dir=str(tmp_path / "x"), init_run=str(run), progress=False)
    assert _recipes.recipe_stages(recipe, config) == [config]  # the user's start wins
