"""Every pod recipe (examples/recipes/*.sh) runs what the whole-step planner says fits.

For each slice a recipe was planned for (its `SLICES`, read by
`test_multihost_examples.recipe_slices`), its FLAGS are

- planned at full size by the planner's own `main` (`--train --chip SLICE --json`, the
  strategy and remat left to it), in one child process with as many fake CPU devices as
  the largest slice has chips (this process has 8). It runs while this process compiles
  the stand-ins below. A slice the recipe accepts must fit the chip's HBM with the recipe's
  strategy and remat, and those must be the planner's choice or within `SLACK` of its
  step time; a slice the recipe refuses (exit status 2) must be one where nothing fits.
- compiled as a tiny stand-in, once per (family, strategy, remat): the same family at
  `--preset tiny`, `SEQ` tokens, the recipe's mesh halved down to this process's 8
  devices, by the planner's `--compile` in this process; the prediction must be within
  `TOLERANCE` of XLA's memory analysis, as tests/test_plan_step.py holds for its cases.
"""

import contextlib
import dataclasses
import io
import json
import math
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest
from helpers import CHILD_XLA_FLAGS, ROOT
from test_multihost_examples import RECIPES, recipe_slices
from test_plan_step import TOLERANCE

import eqx_longctx as el
from eqx_longctx.plan import main
from eqx_longctx.run import parse_mesh, placement_from_flags

# A recipe may keep a (strategy, remat) that fits and that the planner ranks within 10% of
# its fastest: deepseek-v2-lite-256k on v6e keeps ring with `dots` (3.27 s), where the
# planner now picks all_gather with `offload` (3.08 s).
SLACK = 0.10
SEQ = 2048  # the stand-in's tokens per row: the tiny presets' max_seq_len
DEVICES = 8
# Trainer flags the planner reads (each with one value); --strategy and --remat are left to
# the planner, so that its choice can be compared with the recipe's.
PLANNED = (
    "--model", "--preset", "--seq-len", "--batch-size", "--mesh", "--fsdp-axes",
    "--load-balance", "--host-offload", "--grad-accum", "--loss-chunk", "--override",
)  # fmt: skip
# Overrides the stand-in leaves out. XLA:CPU has no bfloat16 matmuls or ragged_dot of its
# own: it holds float32 copies and per-group temporaries that a TPU does not, so with them
# the tiny compiles measured 1.45 to 1.7 (bfloat16) and 1.24 to 1.32 (ragged_dot) times the
# prediction, which counts the TPU's program. Without them the six stand-ins compile to
# 0.88 to 1.07 times the prediction (SEQ=2048).
CPU_UNLIKE = ("compute_dtype", "grouped_matmul")


@dataclasses.dataclass(frozen=True)
class Slice:
    """One slice of one recipe: its environment, the exit status of sourcing the recipe
    there (2: refused), the FLAGS it sets and what it printed on stderr."""

    recipe: pathlib.Path
    env: dict[str, str]
    status: int
    flags: tuple[str, ...]
    stderr: str

    @property
    def name(self) -> str:
        return f"{self.recipe.name} " + " ".join(f"{k}={v}" for k, v in self.env.items())

    def flag(self, name: str) -> str | None:
        values = [v for f, v in _pairs(self.flags) if f == name]
        return values[-1] if values else None


def _pairs(flags) -> list[tuple[str, str]]:
    """The recipe's `--flag value` pairs (every recipe flag takes one value)."""
    pairs = list(zip(flags[::2], flags[1::2], strict=True))
    assert all(f.startswith("--") and not v.startswith("--") for f, v in pairs), flags
    return pairs


def _source(recipe: pathlib.Path, env: dict[str, str]) -> Slice:
    """Source a recipe in bash (nothing else run): its status, FLAGS and stderr."""
    script = 'source "$0" >/dev/null; status=$?; printf "%s\\n%s" "$status" "$FLAGS"'
    out = subprocess.run(
        ["bash", "-c", script, str(recipe)], env={**os.environ, **env},
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    status, _, flags = out.stdout.partition("\n")
    return Slice(recipe, env, int(status), tuple(flags.split()), out.stderr)


def planner_argv(s: Slice) -> list[str]:
    """The planner's command for a slice's FLAGS at full size, priced on the slice's chip.
    A MoE family's `grouped_matmul="auto"` is named as what it picks on a TPU: the planner
    traces on CPU, where "auto" is "scan"."""
    argv = [x for f, v in _pairs(s.flags) if f in PLANNED for x in (f, v)]
    config = el.model_family(s.flag("--model") or "llama").presets[s.flag("--preset") or "tiny"]
    named = [v.partition("=")[0] for f, v in _pairs(s.flags) if f == "--override"]
    if hasattr(config, "grouped_matmul") and "grouped_matmul" not in named:
        argv += ["--override", "grouped_matmul=ragged_dot"]
    return [*argv, "--train", "--chip", s.env["SLICE"], "--json"]


def scaled_mesh(mesh: str, devices: int = DEVICES) -> str:
    """The mesh with its largest axis (the innermost of equals) halved until it has at most
    `devices` devices: `expert=2,tensor=4,context=64` -> `expert=2,tensor=2,context=2`."""
    axes = parse_mesh(mesh)
    while math.prod(axes.values()) > devices:
        largest = max(reversed(list(axes)), key=lambda a: axes[a])
        axes[largest] //= 2
    return ",".join(f"{a}={n}" for a, n in axes.items())


def stand_in_argv(s: Slice) -> list[str]:
    """The planner's `--compile` command for a tiny stand-in of a slice's run: same family,
    strategy, remat, fsdp axes, layout and host offload, `--preset tiny`, `SEQ` tokens,
    the mesh scaled down, as few rows as the batch axes take."""
    mesh = scaled_mesh(s.flag("--mesh") or f"context={DEVICES}")
    strategy, remat = s.flag("--strategy") or "ring", s.flag("--remat") or "none"
    load_balance, fsdp = s.flag("--load-balance") or "zigzag", s.flag("--fsdp-axes")
    spec = placement_from_flags(DEVICES, mesh, strategy, load_balance, fsdp).spec
    assert spec is not None, mesh
    accum = int(s.flag("--grad-accum") or 1)
    argv = [
        "--model", s.flag("--model") or "llama", "--preset", "tiny", "--seq-len", str(SEQ),
        "--batch-size", str(spec.batch_parallel_size * accum), "--mesh", mesh,
        "--strategy", strategy, "--remat", remat, "--load-balance", load_balance,
        "--train", "--compile", "--json",
    ]  # fmt: skip
    for name in ("--fsdp-axes", "--host-offload", "--grad-accum", "--loss-chunk"):
        if s.flag(name) is not None:
            argv += [name, str(s.flag(name))]
    for f, v in _pairs(s.flags):
        if f == "--override" and v.partition("=")[0] not in CPU_UNLIKE:
            argv += [f, v]
    return argv


# Runs in a fresh process with argv[2] fake CPU devices: the planner's main for each argv
# of argv[1], one JSON line per plan with what it printed (the record, then on a budget
# nothing fits, the reason and exit status 2).
_PLAN_ALL = r"""
import contextlib, io, json, sys
import jax
jax.config.update("jax_num_cpu_devices", int(sys.argv[2]))
from eqx_longctx.plan import main
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(argv)
    except SystemExit:
        pass
    print(json.dumps({"stdout": out.getvalue(), "stderr": err.getvalue()[-3000:]}), flush=True)
"""


class FullSize:
    """Every recipe slice, and its full-size plan from one child process started here (the
    plans arrive in recipe order; `record` waits for one)."""

    def __init__(self, slices: list[Slice], log: pathlib.Path):
        self.slices, self.log, self._records = slices, log, []
        argvs = [planner_argv(s) for s in slices]
        devices = max(math.prod(parse_mesh(s.flag("--mesh") or "").values()) for s in slices)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": CHILD_XLA_FLAGS}  # fmt: skip
        with log.open("w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _PLAN_ALL, json.dumps(argvs), str(devices)],
                stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
            )  # fmt: skip

    def record(self, s: Slice) -> dict[str, Any]:
        i = self.slices.index(s)
        assert self.proc.stdout is not None
        while len(self._records) <= i:
            line = self.proc.stdout.readline()
            assert line, f"the planning process ended early:\n{self.log.read_text()[-3000:]}"
            self._records.append(json.loads(line))
        out = self._records[i]
        assert out["stdout"].strip(), f"{s.name}: the planner refused {planner_argv(s)}: {out}"
        return json.loads(out["stdout"])


@pytest.fixture(scope="module")
def full_size(tmp_path_factory):
    slices = [_source(r, env) for r in RECIPES for env in recipe_slices(str(r))]
    plans = FullSize(slices, tmp_path_factory.mktemp("pod_recipes") / "planner.log")
    yield plans
    plans.proc.kill()
    plans.proc.wait()


_COMPILED: dict[tuple[str, str, str], float] = {}  # (family, strategy, remat) -> ratio


def _check_stand_in(s: Slice) -> None:
    key = (s.flag("--model") or "llama", s.flag("--strategy") or "", s.flag("--remat") or "")
    if key in _COMPILED:
        return
    argv = stand_in_argv(s)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(argv)
    record = json.loads(out.getvalue())
    ratio = record["predicted_bytes_per_device"] / record["compiled_bytes_per_device"]
    assert abs(ratio - 1) <= TOLERANCE, (s.name, argv, ratio, record["breakdown"])
    _COMPILED[key] = ratio


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_runs_what_the_planner_fits(recipe, full_size):
    slices = [s for s in full_size.slices if s.recipe == recipe]
    assert slices, recipe
    for s in slices:  # while the child plans the full-size runs
        assert s.status in (0, 2), (s.name, s.status, s.stderr)
        if s.status == 0:
            _check_stand_in(s)
    for s in slices:
        record = full_size.record(s)
        chosen, budget = record["chosen"], record["memory_budget_bytes"]
        if s.status == 2:
            assert s.stderr.strip(), f"{s.name}: refused without saying why"
            assert chosen is None, f"{s.name} is refused, but the planner fits {chosen}"
            continue
        rows = {(r["strategy"], r["remat"]): r for r in record["rows"]}
        mine = (s.flag("--strategy"), s.flag("--remat"))
        assert mine in rows, f"{s.name}: the planner has no row {mine}; it has {list(rows)}"
        row = rows[mine]
        assert row["device"] <= budget, (
            f"{s.name}: {mine} needs {row['device'] / 2**30:.1f} GiB per chip, over the "
            f"{budget / 2**30:.0f} GiB of {s.env['SLICE']}; the planner says: {record['reason']}"
        )
        assert chosen is not None, (s.name, record["reason"])
        fastest = rows[(chosen["strategy"], chosen["remat"])]
        assert mine == (chosen["strategy"], chosen["remat"]) or (
            row["time_s"] <= (1 + SLACK) * fastest["time_s"]
        ), f"{s.name}: {mine} takes {row['time_s']:.3g} s, {chosen} {fastest['time_s']:.3g} s"
