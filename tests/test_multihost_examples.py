"""The examples stay runnable: every recipe's and the Cloud TPU launcher's flags are valid
CLI flags whose mesh, strategy and remat the trainer accepts for that model and sequence (on
as many fake CPU devices as the slice has chips: nothing is built), and the Colab notebook's
code compiles."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RECIPES = sorted((EXAMPLES / "recipes").glob("*.sh"))

# Runs in a fresh process with 64 fake CPU devices: parse each command line like the CLI,
# build its TrainConfig and Placement, and check batch, sequence, heads and experts against
# the mesh (Placement.check_run), exactly as the trainer does before building anything.
CHECK = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 64)
from eqx_longctx.data import ByteTokenizer
from eqx_longctx.train._cli import build_parser
from eqx_longctx.train._config import TrainConfig, build_model_config
from eqx_longctx.train._parallel import Placement
for flags in json.loads(sys.argv[1]):
    a = build_parser().parse_args(flags + ["--run-dir", "unused"])
    config = TrainConfig(
        model=a.model, preset=a.preset, model_overrides=dict(a.override), seq_len=a.seq_len,
        batch_size=a.batch_size, steps=a.steps, lr=a.lr, warmup_steps=a.warmup_steps,
        devices=a.devices, mesh=a.mesh, fsdp_axes=a.fsdp_axes, strategy=a.strategy,
        load_balance=a.load_balance, remat=a.remat, run_dir="unused",
    )
    model_config = build_model_config(config, ByteTokenizer().vocab_size)
    placement = Placement(
        config.devices, config.mesh, config.strategy, config.load_balance, config.fsdp_axes,
        vocab_size=model_config.vocab_size,
    )
    placement.check_run(config.batch_size, config.seq_len, model_config)
    print("ok", placement.describe())
"""


def shell_flags(script: str, env: dict[str, str]) -> list[str]:
    """The FLAGS a shell file sets (sourced by bash, nothing else run)."""
    out = subprocess.run(
        ["bash", "-c", 'source "$0" >/dev/null; printf "%s" "$FLAGS"', script],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return out.split()


def launcher_flags() -> list[str]:
    """The main job's flags in cloud_tpu.sh (its FLAGS line, for the 16-chip slices)."""
    text = (EXAMPLES / "cloud_tpu.sh").read_text()
    devices = 16
    line = text[text.index('  FLAGS="--devices $DEVICES') :].split('"')[1]
    line = line.replace("$((DEVICES / 2))", str(devices // 2)).replace("$DEVICES", str(devices))
    return line.replace("\\", " ").split()


def test_example_flags_are_accepted():
    commands = [launcher_flags()]
    for recipe in RECIPES:
        for slice_ in ("v5p", "v6e"):
            commands.append(shell_flags(str(recipe), {"SLICE": slice_}))
    assert len(RECIPES) == 2 and all("--remat" in c for c in commands[1:])
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, "-c", CHECK, json.dumps(commands)],
        env={**env, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("ok ") == len(commands), result.stdout


def test_shell_scripts_parse():
    for script in [EXAMPLES / "cloud_tpu.sh", *RECIPES]:
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)


def test_colab_notebook_code_compiles():
    cells = json.loads((EXAMPLES / "colab_tpu.ipynb").read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code and cells[0]["cell_type"] == "markdown"
    for i, cell in enumerate(code):
        compile("".join(cell["source"]), f"colab_tpu.ipynb cell {i}", "exec")
