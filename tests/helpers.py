"""Shared test helpers: tolerances keyed by dtype, relative error, random inputs, and the
check that shell commands of the project's CLIs are accepted."""

import importlib
import itertools
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

# Relative tolerances (max abs error / max abs reference), written once.
RTOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2e-2}


def rel_err(actual, expected) -> float:
    """Max absolute difference, relative to the largest reference magnitude."""
    a = np.asarray(jnp.asarray(actual, jnp.float32))
    e = np.asarray(jnp.asarray(expected, jnp.float32))
    return float(np.max(np.abs(a - e)) / (np.max(np.abs(e)) + 1e-30))


def assert_close(actual, expected, dtype=jnp.float32, factor: float = 1.0, what: str = ""):
    tol = RTOL[jnp.dtype(dtype)] * factor
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3e} > tolerance {tol:.1e}"


def random_segment_ids(key, batch: int, seq: int, max_docs: int = 4):
    """Sorted random segment ids: packed documents of random lengths in each row."""
    return jnp.sort(jax.random.randint(key, (batch, seq), 0, max_docs), axis=1).astype(jnp.int32)


def pairwise_cover(factors: dict, seed_rows=()) -> list[dict]:
    """Rows (`{factor: value}`) in which every pair of values of every two factors appears.

    Keeps `seed_rows` first, then adds rows of the full product greedily, each covering the
    most pairs not yet covered (ties go to the earliest in product order, so the result is
    the same in every pytest-xdist worker).
    """
    names = list(factors)

    def pairs(row):
        return frozenset((a, row[a], b, row[b]) for a, b in itertools.combinations(names, 2))

    uncovered = {
        (a, x, b, y)
        for a, b in itertools.combinations(names, 2)
        for x in factors[a]
        for y in factors[b]
    }
    rows = [dict(r) for r in seed_rows]
    for row in rows:
        uncovered -= pairs(row)
    candidates = [
        dict(zip(names, values, strict=True)) for values in itertools.product(*factors.values())
    ]
    candidate_pairs = [pairs(row) for row in candidates]
    while uncovered:
        best = max(range(len(candidates)), key=lambda i: len(candidate_pairs[i] & uncovered))
        rows.append(candidates[best])
        uncovered -= candidate_pairs[best]
    return rows


def segment_ids_from_lengths(rows_of_lengths) -> np.ndarray:
    """`int32 [batch, seq]` segment ids of packed rows: document `j` of a row gets id `j`."""
    return np.stack([np.repeat(np.arange(len(ls)), ls) for ls in rows_of_lengths]).astype(np.int32)


def need_devices(n: int) -> None:
    """Skip the calling test when fewer than `n` devices exist (a single-chip runtime, such
    as a v5e-1 or v6e-1 in Colab), instead of failing on the mesh."""
    import pytest

    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices; this runtime has {jax.device_count()}")


def make_mesh(shape: tuple, names: tuple, axes: str = "explicit"):
    """A mesh over the fake CPU devices: `"explicit"` as users build it (`jax.make_mesh`,
    Explicit axes), or `"auto"` (`jax.sharding.Mesh`, Auto axes)."""
    if axes == "explicit":
        return jax.make_mesh(shape, names)
    n = int(np.prod(shape))
    return jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def packed_rows(vocab_size: int, batch: int = 4, seq: int = 64, seed: int = 0):
    """Random `(tokens, positions, segment_ids)` int32 rows of up to 3 packed documents
    each, positions restarting at 0 in every document."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab_size, (batch, seq)).astype(np.int32)
    seg = np.sort(rng.integers(1, 4, (batch, seq)), axis=1).astype(np.int32)
    pos = np.zeros_like(seg)
    for r in range(batch):
        for d in np.unique(seg[r]):
            idx = np.flatnonzero(seg[r] == d)
            pos[r, idx] = np.arange(idx.size)
    return tokens, pos, seg


def resolve_dotted(path: str):
    """The object at a dotted path: the longest importable module, then attributes.

    Raises `ImportError` when no prefix imports, `AttributeError` naming the missing one."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module of {path!r} imports")


ROOT = pathlib.Path(__file__).resolve().parents[1]
# The XLA flags every test process compiles with (conftest.py sets them for this one, as
# far as this jaxlib knows them): LLVM's -O0 backend and the older fusion emitter, which
# compile the test programs in about half the time. Child processes (CLIs, multi-process
# runs, doc blocks) get them too, without the device count.
CHILD_XLA_FLAGS = " ".join(
    f for f in os.environ.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
)  # fmt: skip


def plan_json(argv: list[str]) -> dict:
    """`python -m eqx_longctx.plan *argv` (which must include `--json`) in its own process,
    for meshes larger than this process's 8 devices; **returns** its JSON record."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": CHILD_XLA_FLAGS}  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "eqx_longctx.plan", *argv], text=True,
                          capture_output=True, timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


# Runs in a fresh process with argv[2] fake CPU devices. For each `[module, *flags]` it
# parses the flags with that CLI's own parser and runs its checks up to the point where
# the work would start, printing one JSON line: {"ok": mesh} or {"refused": message}.
# - eqx_longctx.train: the trainer's parser, multi-process flags, TrainConfig, the
#   placement of its flags and Placement.check_run (batch, sequence, heads and experts
#   against the mesh) in the trainer's wording, as Trainer does before reading data or
#   building anything.
# - eqx_longctx.plan: the planner's own main(), stopped where its placement is built (the
#   trainer's, through trainer_run) after the same check_run; the plan itself, a budget
#   that nothing fits included, is the planner's answer, not a refusal.
# - eqx_longctx.generate: the generation CLI's parser and its placement flags (the
#   placement of the same flags); the run or checkpoint it names is not read.
CLI_CHECK = r"""
import contextlib, io, json, sys
import jax
jax.config.update("jax_num_cpu_devices", int(sys.argv[2]))
from eqx_longctx.data import ByteTokenizer
from eqx_longctx.run import UsageError, cluster_from_flags, placement_from_flags
from eqx_longctx.train._cli import build_parser
from eqx_longctx.train._config import TrainConfig, build_model_config, flag_name
import eqx_longctx.plan._cli as plan_cli
import eqx_longctx.inference._cli as generate_cli

class Placed(Exception):
    pass

def check_train(flags):
    a = build_parser().parse_args(flags + ["--run-dir", "unused"])
    cluster_from_flags(a.coordinator, a.num_processes, a.process_id, a.devices)
    config = TrainConfig(
        model=a.model, preset=a.preset, model_overrides=dict(a.override), seq_len=a.seq_len,
        batch_size=a.batch_size, steps=a.steps, lr=a.lr, warmup_steps=a.warmup_steps,
        devices=a.devices, mesh=a.mesh, fsdp_axes=a.fsdp_axes, strategy=a.strategy,
        load_balance=a.load_balance, remat=a.remat, run_dir="unused",
    )
    model_config = build_model_config(config, ByteTokenizer().vocab_size)
    placement = placement_from_flags(
        config.devices, config.mesh, config.strategy, config.load_balance, config.fsdp_axes,
        vocab_size=model_config.vocab_size,
    )
    placement.check_run(config.batch_size, config.seq_len, model_config, name=flag_name)
    return placement.describe()

trainer_run = plan_cli.trainer_run

def placed_run(settings, vocab_size=None):
    run = trainer_run(settings, vocab_size)
    run.placement.check_run(settings.batch_size, settings.seq_len, run.config, run.family)
    raise Placed(run.placement.describe())

plan_cli.trainer_run = placed_run

def check_plan(flags):
    try:
        plan_cli.main(flags)
    except Placed as e:
        return str(e)
    return "planned"  # one attention call (no --model): its whole plan ran

def check_generate(flags):
    a = generate_cli.build_parser().parse_args(flags)
    devices, mesh = generate_cli.placement_flags(a)
    return placement_from_flags(devices, mesh, a.strategy, a.load_balance, a.fsdp_axes).describe()

CHECKS = {"eqx_longctx.train": check_train, "eqx_longctx.plan": check_plan,
          "eqx_longctx.generate": check_generate}

for module, *flags in json.loads(sys.argv[1]):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ok = CHECKS[module](flags)
        result = {"ok": ok}
    except (UsageError, ValueError, TypeError) as e:
        result = {"refused": f"{type(e).__name__}: {e}"}
    except SystemExit as e:  # argparse: --help (0), or the planner's one-line error (2)
        lines = err.getvalue().strip().splitlines() or [f"exit status {e.code}"]
        result = {"ok": "help"} if e.code == 0 else {"refused": lines[-1]}
    print(json.dumps(result), flush=True)
"""


def check_cli_commands(commands: list[list[str]], devices: int = 64) -> list[str]:
    """Check shell commands of `python -m eqx_longctx.train` / `.plan` / `.generate`
    the way those CLIs check them before any work (see `CLI_CHECK`), on `devices` fake CPU
    devices in one fresh process.

    **Arguments:**

    - `commands`: each `[module, *flags]`, `module` `"eqx_longctx.train"`,
      `"eqx_longctx.plan"` or `"eqx_longctx.generate"`.
    - `devices`: fake CPU devices to make (at least the largest mesh).

    **Returns:** for each command, `""` when accepted, else the CLI's refusal.
    """
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, "-c", CLI_CHECK, json.dumps(commands), str(devices)],
        env={
            **env,
            "PYTHONPATH": str(ROOT),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": CHILD_XLA_FLAGS,
        },  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(commands), result.stdout[-3000:]
    return [line.get("refused", "") for line in lines]
