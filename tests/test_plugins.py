"""Model families are plugins: a family written outside the library (`third_family.py`,
built from the public API only) is installed through an `eqx_longctx.models` entry point,
trained and resumed by the training CLI and planned by the step planner, with no edit to
the library; `register_family` adds one at run time; and the library never imports the
zoo (`models`)."""

import ast
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import pytest
import third_family
from helpers import CHILD_XLA_FLAGS

import eqx_longctx
from eqx_longctx import _family

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent
NAME = third_family.FAMILY.name


def install(tmp_path: pathlib.Path) -> dict[str, str]:
    """Install the third family as a distribution would (a `*.dist-info` with its entry
    point) in a directory of its own. **Returns:** the environment of a process that sees
    it (that directory and the tests' on `PYTHONPATH`)."""
    site = tmp_path / "site"
    info = site / "toygpt_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toygpt-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[eqx_longctx.models]\n{NAME} = third_family:FAMILY\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    path = os.pathsep.join(map(str, (ROOT, TESTS, site)))
    return {**env, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": CHILD_XLA_FLAGS}


def run(args: list[str], env: dict[str, str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600
    )


def test_cli_trains_and_resumes_an_entry_point_family(tmp_path):
    env, run_dir = install(tmp_path), tmp_path / "run"
    flags = [
        "-m", "eqx_longctx.train", "--model", NAME, "--preset", "tiny", "--steps", "3",
        "--devices", "8", "--seq-len", "64", "--batch-size", "2", "--max-bytes", "100000",
        "--eval-batches", "1", "--final-eval-batches", "1", "--checkpoint-every", "2",
        "--warmup-steps", "1", "--run-dir", str(run_dir), "--no-progress",
    ]  # fmt: skip
    done = run([*flags, "--mesh", "data=2,context=4"], env, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"training {NAME} tiny (82,432 parameters)" in done.stdout
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert json.loads((run_dir / "flags.json").read_text())["model"] == NAME
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2", "3"]

    # Killed before its last save: resume from step 2, resharded over fsdp (the family's
    # own layers place their weights through their annotations).
    shutil.rmtree(run_dir / "checkpoints" / "3")
    done = run([*flags, "--mesh", "fsdp=2,context=4", "--resume"], env, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming at step 2" in done.stdout and "status:        completed" in done.stdout
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2", "3"]


def test_planner_plans_an_entry_point_family(tmp_path):
    args = [
        "-m", "eqx_longctx.plan", "--model", NAME, "--preset", "tiny", "--train",
        "--mesh", "data=2,context=4", "--seq", "256", "--batch", "2", "--json",
    ]  # fmt: skip
    done = run(args, install(tmp_path), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads(done.stdout.strip().splitlines()[-1])
    assert plan["model"] == NAME and plan["chosen"] is not None
    # Replicated float32 weights (no fsdp axis): 4 bytes per parameter on every device.
    model = third_family.ToyGPT(third_family.PRESETS["tiny"], key=jax.random.key(0))
    assert plan["breakdown"]["params"] == 4 * model.num_params()


@pytest.fixture
def registry(monkeypatch):
    """The families registered at run time, restored after the test."""
    monkeypatch.setattr(_family, "_REGISTERED", dict(_family._REGISTERED))


def test_register_family(registry):
    assert NAME not in eqx_longctx.family_names()  # installed only in the subprocesses above
    with pytest.raises(ValueError, match=rf"unknown model family '{NAME}'; choose one of") as e:
        eqx_longctx.model_family(NAME)
    assert str(eqx_longctx.family_names()) in str(e.value)
    assert {"llama", "deepseek"} <= set(eqx_longctx.family_names())
    assert eqx_longctx.register_family(third_family.FAMILY) is third_family.FAMILY
    assert eqx_longctx.model_family(NAME) is third_family.FAMILY
    assert NAME in eqx_longctx.family_names()
    assert eqx_longctx.model_families()[NAME] is third_family.FAMILY
    eqx_longctx.register_family(third_family.FAMILY)  # the same object again: a no-op

    class Another(third_family.ToyGPTFamily):
        pass

    with pytest.raises(ValueError, match=rf"a model family named '{NAME}' is already registered"):
        eqx_longctx.register_family(Another())
    with pytest.raises(
        TypeError, match="register_family takes a ModelFamily instance; got ABCMeta. Subclass"
    ):
        eqx_longctx.register_family(third_family.ToyGPTFamily)  # the class, not an instance
    with pytest.raises(TypeError, match="got str"):
        eqx_longctx.register_family(NAME)


def test_registered_family_reaches_the_trainer(registry):
    from eqx_longctx.train import TrainConfig, build_model_config
    from eqx_longctx.train._cli import build_parser

    with pytest.raises(ValueError, match=rf"--model must be one of .*; got --model '{NAME}'"):
        TrainConfig(model=NAME, run_dir="unused")
    eqx_longctx.register_family(third_family.FAMILY)
    (model_action,) = [a for a in build_parser()._actions if a.dest == "model"]
    assert NAME in (model_action.choices or ())
    config = TrainConfig(model=NAME, seq_len=512, model_overrides={"n_layers": "3"}, run_dir="x")
    got = build_model_config(config, vocab_size=300)
    assert got == third_family.ToyGPTConfig(vocab_size=300, max_seq_len=512, n_layers=3)
    with pytest.raises(ValueError, match=r"--override must name ToyGPTConfig fields; got unknown"):
        build_model_config(
            TrainConfig(model=NAME, model_overrides={"n_kv_heads": 1}, run_dir="x"), 1
        )


def imports_models(path: pathlib.Path) -> list[str]:
    """The statements of a module that import `models` (any form, anywhere in it)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"line {node.lineno}: {n}" for n in names if n.split(".")[0] == "models"]
    return found


def test_import_finder_sees_every_form(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "import models\nimport models.llama as l\nfrom models import family\n"
        "from models._family import LLAMA\ndef f():\n    from models import x\n"
        "import modelsx\nfrom . import models\nfrom eqx_longctx import models_\n"
    )
    lines = {int(x.split(":")[0].removeprefix("line ")) for x in imports_models(path)}
    assert lines == {1, 2, 3, 4, 6}


def test_library_never_imports_models():
    offenders = {}
    for path in sorted((ROOT / "eqx_longctx").rglob("*.py")):
        found = imports_models(path)
        if found:
            offenders[path.relative_to(ROOT).as_posix()] = found
    assert not offenders, offenders


def test_third_family_uses_the_public_api_only():
    """What a package outside this repository could write: no private module or name of
    the library, and nothing of the zoo."""
    private = []
    tree = ast.parse((TESTS / "third_family.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names = [f"{node.value.id}.{node.attr}"] if node.value.id == "eqx_longctx" else []
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "models" or (
                parts[0] == "eqx_longctx" and any(p.startswith("_") for p in parts)
            ):
                private.append(name)
    assert private == []
