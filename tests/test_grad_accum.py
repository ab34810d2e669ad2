"""Gradient accumulation (`--grad-accum K`): K micro-batches summed in one compiled step
equal the same rows in one batch (losses and parameters after 3 steps, 1e-5) on one device
and under fsdp (a batch axis, as data is) and context meshes; a step holds one
micro-batch's activations; resuming may change K; a batch that does not split is a
one-line error."""

import dataclasses

import numpy as np
import pytest
from test_train import SEQ, params_of, small_config
from test_train_sharded import LLAMA, assert_same_run, build, run_steps

from eqx_longctx.run import placement_from_flags
from eqx_longctx.train import (
    TrainConfig,
    Trainer,
    make_optimizer,
    make_train_step,
    micro_batches,
)
from eqx_longctx.train._step import lower_train_step


@pytest.fixture(scope="module")
def datasets():
    from eqx_longctx.data import load_datasets

    return load_datasets(None, seq_len=SEQ, max_bytes=300_000, val_fraction=0.1)


def _uneven(batch):
    """Rows 0 and 2 (both in micro-batch 0 of 2) lose half their loss tokens, so that the
    micro-batches hold different token counts and only a token-weighted sum is right."""
    mask = np.array(batch.loss_mask)
    mask[[0, 2], : SEQ // 2] = 0
    return batch._replace(loss_mask=mask)


# No data=2,context=4 case (~25 s of one core): the batch splits over the spec's batch
# axes, and fsdp=2 is one (with the weights split too), so that case ran no other path.
@pytest.mark.parametrize(
    ("devices", "mesh", "k"),
    [(1, None, 4), (8, "fsdp=2,context=4", 2), (8, "context=8", 4)],
    ids=["one-device", "fsdp-a-batch-axis-too", "context"],
)
def test_micro_batches_equal_one_batch(datasets, devices, mesh, k):
    placement = placement_from_flags(devices, mesh)
    accumulated = run_steps(placement, datasets, 3, grad_accum=k, prepare=_uneven)
    assert_same_run(accumulated, run_steps(placement, datasets, 3, prepare=_uneven))


def test_micro_batches_hold_every_row_once():
    rows = np.arange(8)[:, None] * np.ones((1, 3), np.int32)
    split = np.asarray(micro_batches(rows, 4))
    assert split.shape == (4, 2, 3)
    assert sorted(split[:, :, 0].ravel().tolist()) == list(range(8))
    assert split[1, :, 0].tolist() == [1, 5]  # rows k, k + K: each device's block shares


def _temporaries(grad_accum: int, batch: int) -> int:
    placement = placement_from_flags(1)
    optimizer = make_optimizer(1e-2, 1, 8)
    model, opt_state = build(placement, dataclasses.replace(LLAMA, max_seq_len=256), optimizer)
    abstract = placement.abstract_batch(batch, 256)
    lowered = lower_train_step(optimizer, model, opt_state, abstract, grad_accum=grad_accum)
    return lowered.compile().memory_analysis().temp_size_in_bytes


def test_a_step_holds_one_micro_batch():
    whole, accumulated = _temporaries(1, 16), _temporaries(4, 16)
    micro = _temporaries(1, 4)  # one micro-batch's step, for scale
    assert accumulated < 0.5 * whole, (accumulated, whole)
    assert accumulated < 1.5 * micro, (accumulated, micro)


def test_resume_may_change_grad_accum(tmp_path, datasets):
    config = dict(steps=8, checkpoint_every=4)
    full = Trainer(small_config(tmp_path / "full", grad_accum=2, **config), datasets=datasets)
    expected = full.run()
    full.close()
    part = Trainer(small_config(tmp_path / "part", grad_accum=2, **config), datasets=datasets)
    assert part.run(stop_at=5).status == "interrupted"
    part.close()
    resumed = Trainer(
        small_config(tmp_path / "part", grad_accum=4, resume=True, **config), datasets=datasets
    )
    assert resumed.step == 4
    got = resumed.run()
    resumed.close()
    for a, b in zip(params_of(got.model), params_of(expected.model), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_bad_grad_accum_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"--grad-accum .*must be at least 1; got --grad-accum 0"):
        TrainConfig(grad_accum=0, run_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"--batch-size 6 and --grad-accum 4.*multiple of 4"):
        TrainConfig(batch_size=6, grad_accum=4, run_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"grad_accum \(--grad-accum\) must be an int >= 1"):
        make_train_step(make_optimizer(1e-2, 1, 8), grad_accum=0)
    # 8 rows in 4 micro-batches of 2: the data axis (4) cannot split a micro-batch.
    placement = placement_from_flags(8, "data=4,context=2")
    with pytest.raises(ValueError, match=r"a micro-batch \(batch_size=8 / grad_accum=4 = 2"):
        placement.check_run(8, SEQ, LLAMA, grad_accum=4)
    placement.check_run(8, SEQ, LLAMA, grad_accum=2)  # micro-batches of 4 split over 4


def test_grad_accum_runs_from_the_command_line(tmp_path):
    from eqx_longctx.train._cli import main

    flags = ["--steps", "2", "--batch-size", "4", "--grad-accum", "2", "--seq-len", "64",
             "--devices", "1", "--run-dir", str(tmp_path), "--no-progress", "--eval-every",
             "2", "--eval-batches", "1", "--override", "n_layers=1", "--override", "dim=32",
             "--override", "n_heads=2", "--override", "n_kv_heads=1",
             "--override", "hidden_dim=64", "--max-bytes", "100000"]  # fmt: skip
    assert main(flags) == 0
    assert '"grad_accum": 2' in (tmp_path / "flags.json").read_text()
