"""A trained model retrieves: the passkey recipe's first stage (its drills, 1000 steps of 16
rows of 256 tokens on the recipe's 8 devices, ring over zig-zag) ends with the recipe's
passkey eval at 255 tokens, whose prompts (intro, filler, needle, question) no drill
shows; the model answers far above chance, and the same model untrained answers none.

About 8 minutes of both cores alone (14 beside another run): in the full tier
(`tests/full_tier.txt`), with the rest of the recipe's runs in docs/recipes.md. The default
tier's tests/test_evals.py checks the same commands, files and scoring on a 20-step run.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
from helpers import ROOT

from eqx_longctx.data import ByteTokenizer
from eqx_longctx.evals import EvalModel, run_samples, task_samples
from eqx_longctx.train._recipes import _SMALL_LLAMA, RECIPES

TOK = ByteTokenizer()
# A guessed five-digit key is right about once in 100,000 prompts. The stage's model
# answered 10 of these 50 (by depth 0 / 0.25 / 0.5 / 0.75 / 1: 0, 0, 3, 1, 6), and drill
# models of other seeds 10-60% of such prompts (docs/recipes.md): 5 of 50 is thousands of
# times chance, with room for another platform's rounding to take another path.
FLOOR = 0.1


def _flags(stage: dict) -> list[str]:
    """The stage's `TrainConfig` changes as the trainer's flags."""
    return [a for k, v in stage.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def test_the_drilled_model_finds_the_key_and_the_untrained_one_does_not(tmp_path):
    from models import LLAMA

    recipe = RECIPES["passkey"]
    run = tmp_path / "run"
    # The command as a user runs it: its own process, without the test session's XLA flags
    # (LLVM at -O0 compiles sooner and runs this long a run several times slower) or its
    # runtime type checks.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", MPLBACKEND="Agg")
    flags = ["--recipe", "passkey", "--no-stages", *_flags(dict(recipe.stages[0])),
             "--run-dir", str(run), "--no-progress"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "eqx_longctx.train", *flags], env=env, cwd=ROOT,
        capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    records = [json.loads(x) for x in (run / "eval" / "samples.jsonl").read_text().splitlines()]
    assert len(records) == recipe.eval_samples * len(recipe.eval_depths) == 50
    assert {r["length"] for r in records} == {255}
    right = sum(r["correct"] for r in records)
    assert right >= FLOOR * len(records), (right, [r["output"] for r in records])
    table = json.loads((run / "eval" / "results.json").read_text())["tasks"]["passkey"]
    assert abs(table["overall"] - right / len(records)) < 1e-9

    # The same prompts to the same model, untrained: no key.
    sizes = {k: int(v) for k, v in _SMALL_LLAMA}
    config = dataclasses.replace(LLAMA.presets["tiny"], vocab_size=259, **sizes)
    fresh = LLAMA.model(config, key=jax.random.key(0))
    em = EvalModel(fresh, TOK, (TOK.bos_id,), frozenset({TOK.eos_id}))
    # The recipe's eval draws its prompts from the run's seed + 1 (train/_recipe_eval.py).
    samples = task_samples(em, ["passkey"], [255], recipe.eval_depths, recipe.eval_samples, 1)
    assert [s.prompt for s in samples] == [r["prompt"] for r in records]
    assert sum(r["correct"] for r in run_samples(em, samples)) == 0
