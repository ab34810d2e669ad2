"""Training: loss falls, checkpoints round-trip, resume is exact, non-finite steps never
reach a checkpoint, the CLI runs, and every documented error is raised."""

import dataclasses
import json
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_longctx.data import load_datasets
from eqx_longctx.run import check_meta_matches
from eqx_longctx.train import (
    Checkpointer,
    TrainConfig,
    Trainer,
    check_batch,
    decay_mask,
    make_optimizer,
    make_train_step,
)
from eqx_longctx.train._cli import main
from models.llama import Llama, LlamaConfig

SMALL_MODEL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "hidden_dim": 128}
SMALL_FLAGS = [f"--override={k}={v}" for k, v in SMALL_MODEL.items()]
SEQ, BATCH, STEPS = 64, 8, 8


@pytest.fixture(scope="module")
def datasets():
    return load_datasets(None, seq_len=SEQ, max_bytes=300_000, val_fraction=0.1)


def small_config(run_dir, **changes) -> TrainConfig:
    base = TrainConfig(
        model_overrides=SMALL_MODEL,
        seq_len=SEQ,
        batch_size=BATCH,
        steps=STEPS,
        lr=3e-3,
        warmup_steps=2,
        run_dir=str(run_dir),
        checkpoint_every=4,
        eval_every=4,
        eval_batches=2,
        progress=False,
        devices=1,
    )
    return dataclasses.replace(base, **changes)


def params_of(model):
    return jax.tree.leaves(eqx.filter(model, eqx.is_array))


def assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-7)


def train_lines(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = ("split", "step", "loss", "bpb", "lr", "grad_norm")
    return [tuple(r.get(k) for k in keys) for r in lines]


def poison_at(step):
    """A batch hook that makes the loss NaN at one step (a NaN in the loss mask)."""

    def hook(i, batch):
        if i != step:
            return batch
        return batch._replace(loss_mask=np.full_like(batch.loss_mask, np.nan))

    return hook


def test_loss_decreases(tmp_path, datasets):
    trainer = Trainer(small_config(tmp_path, steps=30, eval_every=30), datasets=datasets)
    result = trainer.run()
    trainer.close()
    losses = [r[2] for r in train_lines(tmp_path) if r[0] == "train"]
    assert result.status == "completed" and len(losses) == 30
    assert np.mean(losses[-5:]) < losses[0] - 1.0, losses
    assert result.val is not None and result.val["bpb"] < 6.5
    assert result.val["bits_per_token"] == pytest.approx(result.val["loss"] / np.log(2))
    bits = result.val["loss"] * result.val["tokens"] / np.log(2)
    assert result.val["bpb"] == pytest.approx(bits / result.val["bytes"])


def test_checkpoint_round_trip(tmp_path, datasets):
    trainer = Trainer(small_config(tmp_path, steps=STEPS), datasets=datasets)
    result = trainer.run(stop_at=4)
    trainer.close()
    assert result.checkpoint_steps == [4]
    ckpt = Checkpointer(tmp_path / "checkpoints")
    fresh = Trainer(small_config(tmp_path / "fresh"), datasets=datasets)
    model, opt_state, meta = ckpt.restore(fresh.model, fresh.opt_state)
    fresh.close()  # an open Trainer keeps its SIGTERM handler (test_preemption checks it)
    assert meta["step"] == 4 and meta["model_config"]["n_layers"] == 2
    assert_trees_equal(eqx.filter(model, eqx.is_array), eqx.filter(result.model, eqx.is_array))
    assert_trees_equal(opt_state, result.opt_state)
    assert int(opt_state.count) == 4


def test_exact_resume(tmp_path, datasets):
    full = Trainer(small_config(tmp_path / "full"), datasets=datasets)
    expected = full.run()
    full.close()
    # Killed at step 6, two steps after the checkpoint at 4; a fresh loop resumes from 4.
    part = Trainer(small_config(tmp_path / "part"), datasets=datasets)
    assert part.run(stop_at=6).status == "interrupted"
    part.close()
    (tmp_path / "part" / "checkpoints" / "8.orbax-checkpoint-tmp-1").mkdir()  # torn save
    resumed = Trainer(small_config(tmp_path / "part", resume=True), datasets=datasets)
    assert resumed.step == 4
    got = resumed.run()
    resumed.close()
    assert got.step == STEPS
    for a, b in zip(params_of(got.model), params_of(expected.model), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7)
    assert train_lines(tmp_path / "part") == train_lines(tmp_path / "full")
    steps = [r[1] for r in train_lines(tmp_path / "part") if r[0] == "train"]
    assert steps == list(range(1, STEPS + 1))
    assert (tmp_path / "part" / "loss.png").stat().st_size > 0


def test_nonfinite_step_leaves_state_unchanged(datasets):
    config = LlamaConfig.from_preset("tiny", **SMALL_MODEL)
    model = Llama(config, key=jax.random.key(0))
    optimizer = make_optimizer(1e-3, 2, STEPS, 0.1, 1.0)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    batch = poison_at(0)(0, datasets[0].batch(0, BATCH))
    new_model, new_opt_state, metrics = make_train_step(optimizer)(model, opt_state, batch)
    assert not bool(metrics["finite"])
    assert_trees_equal(eqx.filter(new_model, eqx.is_array), eqx.filter(model, eqx.is_array))
    assert_trees_equal(new_opt_state, opt_state)


def test_weight_decay_spares_norms_and_biases():
    config = LlamaConfig.from_preset("tiny", **SMALL_MODEL, attention_bias=True)
    params = eqx.filter(Llama(config, key=jax.random.key(0)), eqx.is_inexact_array)
    mask = decay_mask(params)
    layer = mask.layers.layers
    assert mask.embed and layer.attn.wq and layer.mlp.w_down
    assert not (mask.norm.weight or layer.attn_norm.weight or layer.mlp_norm.weight)
    assert not (layer.attn.bq or layer.attn.bk or layer.attn.bv)


def test_nonfinite_skip(tmp_path, datasets):
    trainer = Trainer(
        small_config(tmp_path, on_nonfinite="skip"), datasets=datasets, batch_hook=poison_at(5)
    )
    result = trainer.run()
    trainer.close()
    assert result.status == "completed" and result.step == STEPS and result.skipped_steps == 1
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in params_of(result.model))
    restored, _, meta = Checkpointer(tmp_path / "checkpoints").restore(
        trainer.model, trainer.opt_state
    )
    assert meta["skipped_steps"] == 1
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in params_of(restored))


def test_nonfinite_stop_keeps_last_good_checkpoint(tmp_path, datasets, capsys):
    trainer = Trainer(small_config(tmp_path), datasets=datasets, batch_hook=poison_at(5))
    result = trainer.run()
    trainer.close()
    assert result.status == "nonfinite" and result.step == 5
    assert "stopping because on_nonfinite='stop'" in capsys.readouterr().out
    ckpt = Checkpointer(tmp_path / "checkpoints")
    assert ckpt.steps() == [4]
    restored, _, meta = ckpt.restore(trainer.model, trainer.opt_state)
    assert meta["step"] == 4
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in params_of(restored))
    # Step 5 was finite and step 6 dropped: the final model is step 5's, not NaN.
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in params_of(result.model))


def test_cli_smoke(tmp_path, capsys):
    run_dir = tmp_path / "run"
    flags = [
        *SMALL_FLAGS,
        "--seq-len",
        "64",
        "--batch-size",
        "8",
        "--max-bytes",
        "300000",
        "--eval-every",
        "2",
        "--eval-batches",
        "1",
        "--checkpoint-every",
        "2",
        "--warmup-steps",
        "1",
        "--devices",
        "2",
        "--run-dir",
        str(run_dir),
        "--no-progress",
    ]
    assert main([*flags, "--steps", "4"]) == 0
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4]
    assert [r["step"] for r in records if r["split"] == "val"] == [2, 4]
    for key in ("loss", "bits_per_token", "bpb", "lr", "grad_norm", "tokens_per_s", "wall_time"):
        assert key in records[0]
    assert (run_dir / "loss.png").stat().st_size > 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2", "4"]
    recorded = json.loads((run_dir / "flags.json").read_text())
    assert recorded["model_overrides"] == SMALL_MODEL  # CLI strings parsed as the preset's ints
    assert recorded["steps"] == 4 and recorded["seq_len"] == 64 and "run_dir" not in recorded
    # A run killed before its last save resumes from the save before it.
    shutil.rmtree(run_dir / "checkpoints" / "4")
    capsys.readouterr()
    assert main([*flags, "--steps", "4", "--resume"]) == 0
    assert "resuming at step 2" in capsys.readouterr().out
    assert Checkpointer(run_dir / "checkpoints").latest_step() == 4
    assert main([*flags, "--steps", "4"]) == 2  # refuses to clobber the run
    assert main([*flags, "--steps", "6", "--overwrite"]) == 0
    assert Checkpointer(run_dir / "checkpoints").steps() == [4, 6]
    # Resuming a finished run says so and trains nothing (exit 0, no "completed" summary).
    capsys.readouterr()
    assert main([*flags, "--steps", "6", "--resume"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("nothing left to do: ") and "status:" not in out
    # Flags that change the run are refused in one line naming each.
    assert main([*flags, "--steps", "6", "--resume", "--seed", "1", "--lr", "1e-3"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("eqx-longctx-train: error: --resume must continue") and err.count("\n") == 1
    )
    assert "differs in 2: --lr: recorded 0.003, given 0.001; --seed: recorded 0, given 1." in err
    # No readable checkpoint: a clear stop, not a traceback and not a fresh start.
    for step in ("4", "6"):
        (run_dir / "checkpoints" / step / "meta" / "metadata").unlink()
    assert main([*flags, "--steps", "6", "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("eqx-longctx-train: error: resuming needs a readable checkpoint")


# Errors: each one names the rule, the values seen and the fix.


def test_error_checkpoint_dir_with_foreign_files(tmp_path, datasets):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="must hold only orbax step folders.*notes.txt"):
        Trainer(small_config(tmp_path), datasets=datasets)
    with pytest.raises(ValueError, match="must hold only orbax step folders"):
        Trainer(small_config(tmp_path, resume=True), datasets=datasets)
    assert (tmp_path / "checkpoints" / "notes.txt").read_text() == "mine"


def test_error_checkpoint_path_is_a_file(tmp_path, datasets):
    (tmp_path / "checkpoints").write_text("not a directory")
    with pytest.raises(ValueError, match="is a file"):
        Trainer(small_config(tmp_path), datasets=datasets)
    (tmp_path / "run_file").write_text("x")
    with pytest.raises(ValueError, match="run_dir must be a directory"):
        Trainer(small_config(tmp_path / "run_file"), datasets=datasets)


def test_error_resume_without_checkpoint(tmp_path, datasets):
    with pytest.raises(ValueError, match="resuming needs a saved checkpoint"):
        Trainer(small_config(tmp_path, resume=True), datasets=datasets)


def test_error_resume_with_other_model_config(tmp_path, datasets):
    trainer = Trainer(small_config(tmp_path), datasets=datasets)
    trainer.run(stop_at=4)
    trainer.close()
    other = {**SMALL_MODEL, "n_layers": 1}
    with pytest.raises(ValueError, match=r"--override: recorded \{.*'n_layers': 2\}, given"):
        Trainer(small_config(tmp_path, resume=True, model_overrides=other), datasets=datasets)
    # Behind the flags, the checkpoint's own model record is compared (remat may change).
    meta = Checkpointer(tmp_path / "checkpoints").read_meta()
    wanted = {**meta["model_config"], "remat": "full"}
    check_meta_matches(meta, wanted, "ckpt")
    with pytest.raises(ValueError, match=r"must match the checkpoint's; ckpt .*n_layers: saved=2"):
        check_meta_matches(meta, {**wanted, "n_layers": 1}, "ckpt")
    with pytest.raises(ValueError, match="must not mix with an earlier run's checkpoints"):
        Trainer(small_config(tmp_path), datasets=datasets)


def test_error_token_ids_outside_vocabulary(tmp_path, datasets):
    def shift(i, batch):
        return batch._replace(tokens=batch.tokens + 300)

    trainer = Trainer(small_config(tmp_path), datasets=datasets, batch_hook=shift)
    with pytest.raises(ValueError, match=r"must lie in \[0, vocab_size\) = \[0, 259\)"):
        trainer.run()
    trainer.close()
    batch = datasets[0].batch(0, 2)
    with pytest.raises(ValueError, match="every targets id must lie in"):
        check_batch(batch._replace(targets=batch.targets - 1000), 259)


def test_error_data(tmp_path, datasets):
    with pytest.raises(ValueError, match="does not exist"):
        Trainer(small_config(tmp_path, data=str(tmp_path / "missing.txt")))
    with pytest.raises(ValueError, match="packed at the configured seq_len"):
        Trainer(small_config(tmp_path, seq_len=32), datasets=datasets)


def test_error_model_choice(tmp_path, datasets):
    with pytest.raises(ValueError, match="preset must be one of"):
        Trainer(small_config(tmp_path, preset="gpt-5"), datasets=datasets)
    with pytest.raises(ValueError, match="must name LlamaConfig fields"):
        Trainer(small_config(tmp_path, model_overrides={"depth": 3}), datasets=datasets)
    with pytest.raises(ValueError, match="needs that many JAX devices.*this process has 8"):
        Trainer(small_config(tmp_path, devices=16, batch_size=16), datasets=datasets)
