"""Preemption: SIGTERM stops a run at a step boundary every process agrees on, with a
checkpoint there, one line naming the step and exit status `EXIT_PREEMPTED`; `--resume`
then continues as if nothing happened.

Real processes: `python -m eqx_longctx.train` alone, and as 2 processes (gloo over
localhost, launched as `test_multihost` does) with SIGTERM sent to one of them; each
interrupted run is resumed in this process and compared with an uninterrupted one. Every
wait is bounded and every process started is killed in a `finally`.
"""

import dataclasses
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
from test_multihost import (
    RUN_TIMEOUT,
    SETTINGS,
    assert_same_run,
    child_env,
    copy_run_at,
    flags,
    launch,
    train_records,
)
from test_train import params_of

from eqx_longctx.data import load_datasets
from eqx_longctx.run import EXIT_PREEMPTED
from eqx_longctx.train import Checkpointer, TrainConfig, Trainer
from eqx_longctx.train._cli import PROG
from eqx_longctx.train._preempt import PreemptionNotice

BOUND = 60  # seconds from SIGTERM to the exit of every process (one compile included)
LINE = re.compile(
    rf"^{re.escape(PROG)}: preempted: saved step (\d+) to (\S+); resume with --resume$", re.M
)
# One device, 8 steps, checkpoints at 4 and 8, one evaluation at the end, a record per step.
ONE = {**SETTINGS, "devices": 1, "steps": 8, "checkpoint_every": 4, "log_every": 1}


@pytest.fixture(scope="module")
def datasets():
    return load_datasets(None, seq_len=64, max_bytes=100_000)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, datasets):
    """The uninterrupted one-process run: its directory and final parameters."""
    run_dir = tmp_path_factory.mktemp("preemption") / "reference"
    trainer = Trainer(TrainConfig(run_dir=str(run_dir), **ONE), datasets=datasets)
    try:
        result = trainer.run()
    finally:
        trainer.close()
    assert result.status == "completed"
    return run_dir, params_of(result.model)


def resume(run: TrainConfig, datasets, step: int):
    """Resume `run` (its newest checkpoint: `step`) in this process to its last step."""
    trainer = Trainer(dataclasses.replace(run, resume=True), datasets=datasets)
    try:
        assert trainer.step == step
        result = trainer.run()
    finally:
        trainer.close()
    assert result.status == "completed"
    return params_of(result.model)


def records(run_dir) -> list[dict]:
    """Every record of `metrics.jsonl` but its timings."""
    timings = ("tokens_per_s", "wall_time")
    lines = (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k not in timings} for x in lines]


def saved_steps(run_dir) -> list[int]:
    checkpointer = Checkpointer(run_dir / "checkpoints")
    try:
        return checkpointer.steps()
    finally:
        checkpointer.close()


def wait_for(condition, run, what: str) -> None:
    while not condition():
        assert all(p.poll() is None for p in run.procs), run.output()
        assert time.monotonic() - run.started < RUN_TIMEOUT, f"no {what}:\n{run.output()}"
        time.sleep(0.05)


def test_sigterm_mid_run_stops_at_the_next_boundary(tmp_path, datasets, reference):
    """SIGTERM during step 3 (sent by the batch hook): the run stops after step 3 with a
    checkpoint there, and the previous handler is back once `run` returns; resuming gives
    the uninterrupted run's records and parameters exactly."""

    def sigterm_at_3(step, batch):
        if step == 2:  # the batch of step 3
            os.kill(os.getpid(), signal.SIGTERM)
        return batch

    before = signal.getsignal(signal.SIGTERM)
    run_dir = tmp_path / "run"
    run = TrainConfig(run_dir=str(run_dir), **ONE)
    trainer = Trainer(run, datasets=datasets, batch_hook=sigterm_at_3)
    try:
        assert signal.getsignal(signal.SIGTERM) != before  # held from construction
        result = trainer.run()
        assert signal.getsignal(signal.SIGTERM) == before
    finally:
        trainer.close()
    assert (result.status, result.step) == ("preempted", 3)
    assert result.checkpoint_steps == [3]  # checkpoint_every=4: this one is the preemption's
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3]

    params = resume(run, datasets, 3)
    assert records(run_dir) == records(reference[0])
    for x, y in zip(params, reference[1], strict=True):
        assert (x == y).all()


def test_open_notices_share_one_handler():
    """The handler the first open notice replaced comes back when the last one closes; a
    SIGTERM meanwhile flags every open notice, and nothing else."""
    before = signal.getsignal(signal.SIGTERM)
    a, b = PreemptionNotice(), PreemptionNotice()
    try:
        assert a.watching and not a.requested() and not b.requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert a.requested() and b.requested()
        a.close()
        assert signal.getsignal(signal.SIGTERM) not in (before, signal.SIG_DFL)
    finally:
        a.close()
        b.close()
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.slow
def test_sigterm_to_one_process(tmp_path, datasets, reference):
    """`python -m eqx_longctx.train` alone, SIGTERM once it has started (before its first
    step ends): exit status `EXIT_PREEMPTED` within the bound, the one line naming step 1,
    that checkpoint alone; resuming it gives the uninterrupted run (to rounding: the child
    compiles at another optimisation level)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "eqx_longctx.train", *flags(ONE), "--run-dir", str(run_dir)]
    log = tmp_path / "one.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env())
    run = _Single(proc, log)
    try:
        # Printed once the Trainer (which holds the SIGTERM handler) is built.
        wait_for(lambda: "training " in run.output(), run, "start")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=BOUND)
    finally:
        run.kill()
    out = run.output()
    assert code == EXIT_PREEMPTED, out
    assert LINE.findall(out) == [("1", str(run_dir / "checkpoints"))], out
    assert "status:" not in out  # the one line, no summary
    assert saved_steps(run_dir) == [1], out

    params = resume(TrainConfig(run_dir=str(run_dir), **ONE), datasets, 1)
    assert_same_run(train_records(run_dir), train_records(reference[0]), params, reference[1])


@dataclasses.dataclass
class _Single:
    """One process, with what `wait_for` uses of `test_multihost.Launch`."""

    proc: subprocess.Popen
    log: pathlib.Path

    def __post_init__(self):
        self.procs, self.started = [self.proc], time.monotonic()

    def output(self) -> str:
        return self.log.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes(tmp_path, datasets, reference, victim=1):
    """The reference run resumed at step 4 on 2 processes; SIGTERM to one of them once it
    has started. Both save the same step and exit with `EXIT_PREEMPTED` within the bound,
    process 0 printing one line; resuming that checkpoint in one process to the last step
    gives the uninterrupted run's losses and parameters (to the rounding of
    `test_multihost`: the 2 processes sum the gradient in another order).

    Resumed, because JAX's sync point counts calls from 0 in each process: numbered by
    training step, a notice that came before the first step (as here, most likely) would
    never be reached."""
    run_dir = copy_run_at(reference[0], tmp_path / "two", 4)
    # One device per process: they still all-reduce every step (over gloo), and each
    # compile is a fraction of an 8-device mesh's.
    two = {**ONE, "devices": 2, "mesh": "data=2,context=1", "resume": True}
    run = launch(tmp_path, flags(two) + ["--run-dir", str(run_dir)])
    try:
        # Process 0 prints this once every process has joined (JAX's SIGTERM handler is
        # in place) and restored step 4, before the first step.
        wait_for(lambda: "resuming at step 4" in run.output(0), run, "start")
        run.procs[victim].send_signal(signal.SIGTERM)
        codes = run.wait(timeout=time.monotonic() - run.started + BOUND)
    finally:
        run.kill()
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], run.output()
    lines = LINE.findall(run.output(0))
    assert len(lines) == 1, run.output()
    assert not LINE.search(run.output(1)), run.output()
    step = int(lines[0][0])
    assert 4 < step < ONE["steps"], run.output()
    # The newest checkpoint, written by both processes at the step they agreed on.
    assert saved_steps(run_dir) == [4, step], run.output()

    params = resume(TrainConfig(run_dir=str(run_dir), **ONE), datasets, step)
    assert_same_run(train_records(run_dir), train_records(reference[0]), params, reference[1])
