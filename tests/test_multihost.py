"""Multi-host training with real processes: `python -m eqx_longctx.train` started as 2
processes x 4 fake CPU devices (gloo over localhost) against one process with 8 devices (this
test process, whose conftest makes 8).

What is compared (see `assert_same_run`): every train record of `metrics.jsonl` (step, the
learning rate and the loss-bearing token count exactly; loss, bits and gradient norm to
float32 summation-order tolerance: gloo sums the cross-process all-reduce in another order
than one process does, so the last bits differ) and every final parameter (restored in this
process from the run's last checkpoint). Resume crosses process counts both ways.

Every wait is bounded (`communicate(timeout=...)`, `--init-timeout`, `--peer-timeout`) and
every process started is killed in a `finally`.
"""

import dataclasses
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import CHILD_XLA_FLAGS

from eqx_longctx.data import load_datasets
from eqx_longctx.run import EXIT_PEER_LOST, PEER_TIMEOUT, check_device_count, cluster_from_flags
from eqx_longctx.train import Checkpointer, TrainConfig, Trainer
from eqx_longctx.train._cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN_TIMEOUT = 240  # seconds any one launch may take before the test fails (and kills it)
BOUND = 120  # the bound on a survivor's exit after a peer dies

# A small Llama, 4 steps, no evaluation until the last step.
SETTINGS = dict(
    model_overrides={"n_layers": 1, "dim": 64, "hidden_dim": 128},
    seq_len=64,
    batch_size=2,
    steps=4,
    warmup_steps=1,
    max_bytes=100_000,
    eval_every=1000,
    eval_batches=1,
    final_eval_batches=1,
    checkpoint_every=2,
    devices=8,
    progress=False,
)
MESHES = {"ring": "context=8", "usp": "ulysses=2,context=4"}
RESUME_MESHES = {"usp": "fsdp=2,ulysses=2,context=2"}  # weights split across the processes
# Summation order differs across the gloo all-reduce: float32 rounding, nothing more. The
# losses agree to 1e-6 at every step. After 4 Adam steps a parameter whose gradient is near
# zero can differ by more: Adam divides the gradient by its running RMS, and rounding noise
# divided by a tiny RMS is not tiny. Measured: at most 1.3e-5 on one of 8192 weights of the
# ring case (under the tests' LLVM -O0 backend; 0 over 1e-5 at -O2). A wrong shard, batch
# or reduction moves the losses and thousands of weights by orders of magnitude more.
LOSS_RTOL = 1e-6
PARAM_RTOL, PARAM_ATOL = 1e-5, 3e-5


def flags(settings: dict) -> list[str]:
    out = []
    for key, value in settings.items():
        if key == "model_overrides":
            out += [f"--override={k}={v}" for k, v in value.items()]
        elif key == "progress":
            out += [] if value else ["--no-progress"]
        elif key in ("resume", "overwrite"):
            out += [f"--{key}"] if value else []
        else:
            out += [f"--{key.replace('_', '-')}", str(value)]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    return {**env, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": CHILD_XLA_FLAGS,
            **extra}  # fmt: skip


@dataclasses.dataclass
class Launch:
    """Processes of one multi-process run, their logs in `logs`."""

    procs: list[subprocess.Popen]
    logs: list[pathlib.Path]
    started: float

    def wait(self, timeout: float = RUN_TIMEOUT) -> list[int]:
        deadline = self.started + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"processes still running after {timeout} s:\n{self.output()}")
        return codes

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)

    def output(self, i: int | None = None) -> str:
        logs = self.logs if i is None else [self.logs[i]]
        return "\n".join(f"--- {log.name}\n{log.read_text()}" for log in logs if log.exists())


def launch(
    tmp: pathlib.Path,
    args: list[str],
    n: int = 2,
    ids: list[int] | None = None,
    port: int | None = None,
    extra: list[list[str]] | None = None,
    env: dict[str, str] | None = None,
) -> Launch:
    """Start processes `ids` (default all) of an `n`-process run of the CLI."""
    port = port or free_port()
    procs, logs = [], []
    for i in ids if ids is not None else range(n):
        log = tmp / f"process{i}-{port}.log"
        cmd = [sys.executable, "-m", "eqx_longctx.train", *args]
        cmd += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n)]
        cmd += ["--process-id", str(i), *(extra[i] if extra else [])]
        with log.open("w") as out:
            procs.append(
                subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, env=env or child_env(), cwd=tmp
                )
            )
        logs.append(log)
    return Launch(procs, logs, time.monotonic())


def run_processes(tmp: pathlib.Path, args: list[str], n: int = 2) -> Launch:
    run = launch(tmp, args, n)
    try:
        codes = run.wait()
    finally:
        run.kill()
    assert codes == [0] * n, run.output()
    return run


@pytest.fixture(scope="module")
def datasets():
    return load_datasets(None, seq_len=64, max_bytes=100_000)


def config(run_dir, strategy: str, **changes) -> TrainConfig:
    settings = {**SETTINGS, "mesh": MESHES[strategy], "strategy": strategy, **changes}
    return TrainConfig(run_dir=str(run_dir), **settings)


def cli_flags(run_dir, strategy: str, **changes) -> list[str]:
    return flags({**SETTINGS, "mesh": MESHES[strategy], "strategy": strategy, **changes}) + [
        "--run-dir",
        str(run_dir),
    ]


def train_records(run_dir) -> list[dict]:
    lines = (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "train"]


def final_params(run_dir, strategy: str, datasets):
    """The parameters of the newest checkpoint in `run_dir`, restored in this process."""
    trainer = Trainer(config(run_dir, strategy, resume=True), datasets=datasets)
    trainer.close()
    assert trainer.nothing_to_do is not None  # restored at the last step
    return jax.tree.leaves(eqx.filter(trainer.model, eqx.is_array))


def assert_same_run(records, reference, params=None, reference_params=None) -> None:
    """Same steps, learning rates and token counts; losses, bits and gradient norms equal
    to float32 rounding; parameters likewise."""
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for r, ref in zip(records, reference, strict=True):
        assert (r["lr"], r["tokens"], r["skipped_steps"]) == (
            ref["lr"],
            ref["tokens"],
            ref["skipped_steps"],
        )
        for key in ("loss", "bits_per_token", "bpb", "grad_norm"):
            np.testing.assert_allclose(r[key], ref[key], rtol=LOSS_RTOL, err_msg=key)
    if params is not None:
        assert reference_params is not None
        for x, y in zip(params, reference_params, strict=True):
            np.testing.assert_allclose(
                np.asarray(x), np.asarray(y), rtol=PARAM_RTOL, atol=PARAM_ATOL
            )


def copy_run_at(src, dst, step: int) -> pathlib.Path:
    """A copy of run `src` whose newest checkpoint is `step` (later ones removed)."""
    shutil.copytree(src, dst)
    for d in (dst / "checkpoints").iterdir():
        if int(d.name) > step:
            shutil.rmtree(d)
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ring", "usp"])
def test_two_processes_match_one(tmp_path, datasets, strategy):
    """2 processes x 4 devices give the losses and parameters of 1 process x 8. Then resume
    across process counts, continuing the run (same steps, learning rates, tokens; losses
    and parameters to rounding): ring 2 -> 1; usp 1 -> 2 under another mesh (fsdp=2, which
    splits the weights and Adam moments across the processes)."""
    one = tmp_path / "one"
    result = Trainer(config(one, strategy), datasets=datasets).run()
    assert result.status == "completed"
    reference = train_records(one)
    reference_params = jax.tree.leaves(eqx.filter(result.model, eqx.is_array))

    two = tmp_path / "two"
    run = run_processes(tmp_path, cli_flags(two, strategy, progress=True))
    out0, out1 = run.output(0), run.output(1)
    assert "on 2 processes" in out0 and "status:        completed" in out0
    assert "train: 100%" in out0  # the progress bar
    for text in ("training", "train:", "status:", "val loss"):  # process 0 alone prints
        assert text not in out1, out1
    assert (two / "loss.png").exists()
    # The data iterator's state is saved with each checkpoint (the next step's batch).
    checkpointer = Checkpointer(two / "checkpoints")
    try:
        assert checkpointer.read_meta(4)["data_state"]["grain"]["next_index"] == 4
    finally:
        checkpointer.close()
    assert_same_run(
        train_records(two), reference, final_params(two, strategy, datasets), reference_params
    )
    if strategy == "ring":
        # 2 -> 1: resume the 2-process run's step-2 checkpoint in this process.
        back = copy_run_at(two, tmp_path / "two_then_one", 2)
        resumed = Trainer(config(back, strategy, resume=True), datasets=datasets)
        assert resumed.step == 2
        resumed.run()
        assert_same_run(
            train_records(back),
            train_records(two),
            jax.tree.leaves(eqx.filter(resumed.model, eqx.is_array)),
            final_params(two, strategy, datasets),
        )
    else:
        # 1 -> 2: resume the 1-process run's step-2 checkpoint on 2 processes, and on another
        # mesh: the weights and Adam moments now split over an fsdp axis across the processes.
        mesh = RESUME_MESHES[strategy]
        forth = copy_run_at(one, tmp_path / "one_then_two", 2)
        run = run_processes(tmp_path, cli_flags(forth, strategy, resume=True, mesh=mesh))
        assert "resuming at step 2" in run.output(0), run.output()
        assert f"mesh {mesh.replace(',', ', ')}" in run.output(0), run.output()
        assert_same_run(
            train_records(forth),
            reference,
            final_params(forth, strategy, datasets),
            reference_params,
        )


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_peer_death_ends_survivor(tmp_path, victim):
    """kill -9 one process mid-run: the other exits non-zero within the bound, saying why.

    Process 1 lost: our heartbeat notices after --peer-timeout and process 0 exits with
    status 3 and a line naming process 1. Process 0 lost (the coordinator goes with it):
    process 1 is aborted at once by whichever notices first, JAX's client (its own fatal
    log) or, when process 1 was inside a collective with process 0, gloo's TCP transport
    (its `gloo::EnforceNotMet` on the broken connection; seen once in a loaded CI run)."""
    timeout = 10
    args = cli_flags(tmp_path / "run", "ring", steps=10_000, checkpoint_every=10_000)
    run = launch(tmp_path, args + ["--peer-timeout", str(timeout)])
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert all(p.poll() is None for p in run.procs), run.output()
            assert time.monotonic() - run.started < RUN_TIMEOUT, run.output()
            time.sleep(0.5)
        run.procs[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        survivor = run.procs[1 - victim]
        code = survivor.wait(timeout=BOUND)
        elapsed = time.monotonic() - killed
    finally:
        run.kill()
    out = run.output(1 - victim)
    if victim == 1:
        assert code == EXIT_PEER_LOST, out
        assert "process 0 of 2 stops: process 1 sent no heartbeat" in out, out
        assert "--resume" in out, out
        assert elapsed < timeout + 20, (elapsed, out)
    else:
        assert code != 0, out
        noticed = ("JAX distributed service detected fatal errors", "gloo::EnforceNotMet")
        assert any(line in out for line in noticed), out
        assert elapsed < 20, (elapsed, out)
    assert PEER_TIMEOUT + 2 < BOUND  # the default bound keeps the promise


def test_unreachable_coordinator(tmp_path):
    """Process 1 alone, nobody at the coordinator's port: a clear error within the bound."""
    run = launch(tmp_path, flags({"devices": 8}) + ["--init-timeout", "3"], ids=[1])
    try:
        codes = run.wait(timeout=60)
    finally:
        run.kill()
    assert codes == [2], run.output()
    out = run.output()
    assert "process 1 of 2" in out and "could not reach the coordinator" in out, out
    assert "nothing accepts connections" in out, out


def test_missing_process(tmp_path):
    """Process 0 alone of 2: it says not all processes joined, within the bound."""
    run = launch(tmp_path, flags({"devices": 8}) + ["--init-timeout", "3"], ids=[0])
    try:
        codes = run.wait(timeout=60)
    finally:
        run.kill()
    assert codes == [2], run.output()
    assert "not all 2 processes joined the run within --init-timeout 3 s" in run.output()


def test_flags_differ_across_processes(tmp_path):
    args = cli_flags(tmp_path / "run", "ring")
    run = launch(tmp_path, args, extra=[[], ["--steps", "5"]])
    try:
        codes = run.wait(timeout=120)
    finally:
        run.kill()
    assert all(c != 0 for c in codes), run.output()
    for i in range(2):
        assert "--steps: process 0 has 4, process 1 has 5" in run.output(i), run.output()


def test_mesh_does_not_match_global_devices(tmp_path):
    args = cli_flags(tmp_path / "run", "ring", mesh="context=4")
    run = launch(tmp_path, args)
    try:
        codes = run.wait(timeout=120)
    finally:
        run.kill()
    assert all(c != 0 for c in codes), run.output()
    assert "must multiply to --devices" in run.output(0), run.output()


def test_devices_not_the_global_count(tmp_path):
    """Each process has 8 devices (16 in all) but --devices says 8: refused by name."""
    run = launch(
        tmp_path, cli_flags(tmp_path / "run", "ring"), env=child_env(JAX_NUM_CPU_DEVICES="8")
    )
    try:
        codes = run.wait(timeout=120)
    finally:
        run.kill()
    assert all(c != 0 for c in codes), run.output()
    assert "the processes have 16 (8 each)" in run.output(0), run.output()


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--coordinator", "127.0.0.1:1234"], "needs --coordinator HOST:PORT, --num-processes N"),
        (["--num-processes", "2", "--process-id", "0"], "missing --coordinator"),
        (
            ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"],
            "--process-id must lie in 0..num_processes-1",
        ),
        (
            ["--coordinator", "h", "--num-processes", "2", "--process-id", "0"],
            "--coordinator must be HOST:PORT",
        ),
        (
            ["--coordinator", "h:1", "--num-processes", "3", "--process-id", "0"],
            "must split evenly over the processes",
        ),
        (["--coordinator", "h:1", "--num-processes", "0", "--process-id", "0"], "at least 1"),
    ],
)
def test_error_distributed_flags(argv, match, capsys):
    """Bad multi-process flags fail before anything connects, as one line."""
    assert main(["--devices", "8", *argv]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "args, match",
    [
        ((None, 2, 0, 8), "missing --coordinator"),
        (("h:99999", 2, 0, 8), "port in 1..65535"),
        (("h:1", 4, 0, 6), "Pass --devices 4"),
    ],
)
def test_error_cluster_from_flags(args, match):
    with pytest.raises(ValueError, match=match):
        cluster_from_flags(*args)


def test_error_device_count():
    with pytest.raises(ValueError, match="must equal the devices of all 2 processes"):
        check_device_count(8, 16, 2)
    check_device_count(8, 8, 2)
    with pytest.raises(ValueError, match="needs that many JAX devices"):
        check_device_count(16, 8, 1)


def test_cloud_tpu_slice_needs_no_flags(monkeypatch):
    """On a Cloud TPU slice of several workers no flag is needed: the processes come from
    the TPU metadata (`jax.distributed.initialize()` finds the coordinator and the ids)."""
    from eqx_longctx.run import _distributed

    monkeypatch.setattr(_distributed, "tpu_worker_count", lambda: 4)
    cluster = cluster_from_flags(None, None, None, 16)
    assert cluster is not None and (cluster.coordinator, cluster.num_processes) == (None, 4)
    assert "this process of 4" in cluster.describe()
    monkeypatch.setattr(_distributed, "tpu_worker_count", lambda: 1)
    assert cluster_from_flags(None, None, None, 8) is None  # one host: no jax.distributed
