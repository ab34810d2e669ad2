"""The examples stay runnable: every recipe's and the Cloud TPU launcher's flags are valid
CLI flags whose mesh, strategy and remat the trainer accepts for that model and sequence (on
as many fake CPU devices as the slice has chips: nothing is built), and the Colab notebook's
code compiles."""

import json
import os
import subprocess

from helpers import ROOT, check_cli_commands

EXAMPLES = ROOT / "examples"
RECIPES = sorted((EXAMPLES / "recipes").glob("*.sh"))


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


def recipe_slices(script: str) -> list[dict[str, str]]:
    """The environments a recipe was planned for: its `SLICES` (`SLICE:CHIPS` pairs, e.g.
    `v5p:32 v5p:64`), or SLICE=v5p and SLICE=v6e for a recipe without one."""
    out = subprocess.run(
        ["bash", "-c", 'source "$0" >/dev/null 2>&1; printf "%s" "${SLICES:-v5p v6e}"', script],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    pairs = [entry.partition(":") for entry in out.split()]
    return [{"SLICE": s, **({"CHIPS": c} if c else {})} for s, _, c in pairs]


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
        for env in recipe_slices(str(recipe)):  # a slice the recipe refuses still sets FLAGS
            commands.append(shell_flags(str(recipe), env))
    assert len(RECIPES) >= 2 and all("--remat" in c for c in commands[1:])
    devices = max(int(c[c.index("--devices") + 1]) for c in commands)
    refusals = check_cli_commands([["eqx_longctx.train", *c] for c in commands], devices=devices)
    assert not any(refusals), [(c, r) for c, r in zip(commands, refusals, strict=True) if r]


def test_shell_scripts_parse():
    for script in [EXAMPLES / "cloud_tpu.sh", *RECIPES]:
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)


def test_colab_notebook_code_compiles():
    cells = json.loads((EXAMPLES / "colab_tpu.ipynb").read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code and cells[0]["cell_type"] == "markdown"
    for i, cell in enumerate(code):
        compile("".join(cell["source"]), f"colab_tpu.ipynb cell {i}", "exec")
