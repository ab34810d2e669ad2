"""Named recipes: `python -m eqx_longctx.train --recipe NAME` takes its flag defaults from
one (the user's own flags still win), and a recipe may end with an eval of the trained
model."""

import dataclasses
import pathlib
from collections.abc import Mapping
from typing import Any

from ..run import is_step_dir


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A named set of training flag defaults.

    **Arguments:**

    - `name`: what `--recipe` takes.
    - `summary`: one line for `--help` and `docs/recipes.md`.
    - `flags`: argparse destinations of `python -m eqx_longctx.train` (e.g. `seq_len`,
      `override` as a list of `(field, text)` pairs) and their values.
    - `eval_task`: a retrieval task (`eqx_longctx.evals.TASKS`) run on the trained model
      at its training length after the last step (`None`: none).
    - `eval_samples`: samples per depth of that eval.
    - `eval_depths`: its needle depths.
    - `first`: `TrainConfig` fields of a short first stage (e.g. `seq_len`, `batch_size`,
      `steps`), trained into `RUN_DIR/short` before the run itself, which then starts
      from its weights (`init_run`); `None`: one stage.
    """

    name: str
    summary: str
    flags: Mapping[str, Any]
    eval_task: str | None = None
    eval_samples: int = 10
    eval_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    first: Mapping[str, Any] | None = None


_RETRIEVAL = {
    "seq_len": 2048,
    "batch_size": 8,
    "steps": 120,
    "lr": 3e-3,
    "synthetic": "passkey,niah_multikey",
    "synthetic_share": 0.75,
    "synthetic_loss": "answers",
    "eval_every": 60,
    "eval_batches": 4,
    "final_eval_batches": 8,
    "checkpoint_every": 60,
    "strategy": "ring",
    "load_balance": "zigzag",
}

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "passkey",
            "the tiny Llama trained for retrieval: stdlib text mixed with passkey and multi-key "
            "needle documents at every depth, 2048-token rows, ring attention over zig-zag on "
            "8 devices; ends with the passkey eval at 2047 tokens",
            _RETRIEVAL,
            eval_task="passkey",
        ),
        Recipe(
            "passkey-hybrid",
            "the passkey recipe on the tiny Qwen3-Next hybrid (Gated DeltaNet layers beside "
            "full-attention ones)",
            {**_RETRIEVAL, "model": "qwen3_next"},
            eval_task="passkey",
        ),
        Recipe(
            "passkey-gemma3",
            "the passkey recipe on the tiny Gemma 3 (sliding-window local layers beside "
            "global ones, local layers by neighbour exchange)",
            {**_RETRIEVAL, "model": "gemma3_text", "preset": "gemma3-tiny"},
            eval_task="passkey",
        ),
    )
}


def recipe_help() -> str:
    """The `--help` text listing the recipes."""
    return "recipes: " + "; ".join(f"{r.name}: {r.summary}" for r in RECIPES.values())


FIRST_STAGE_DIR = "short"
"""The folder of a recipe's run directory that holds its first stage's run."""


def recipe_stages(recipe: Recipe, config: Any) -> list[Any]:
    """The runs `--recipe` makes for `config` (a `TrainConfig`): `[config]`, or, for a
    recipe with a `first` stage, that stage's run in `RUN_DIR/short` and then `config`
    starting from its weights (`init_run`). A start given by the user (`init_run` or
    `init_hf`) replaces the first stage. With `resume`, a stage that saved no checkpoint
    yet starts fresh.

    **Raises:** `ValueError` as `TrainConfig` for first-stage values it refuses.
    """
    if recipe.first is None or config.init_run is not None or config.init_hf is not None:
        return [config]
    short = pathlib.Path(str(config.run_dir)) / FIRST_STAGE_DIR
    changes = {"warmup_steps": None, **recipe.first}  # None: TrainConfig's default warmup
    first = dataclasses.replace(
        config, run_dir=str(short), resume=config.resume and _has_checkpoints(short), **changes
    )
    main = dataclasses.replace(
        config, init_run=str(short),
        resume=config.resume and _has_checkpoints(pathlib.Path(str(config.run_dir))),
    )  # fmt: skip
    return [first, main]


def _has_checkpoints(run_dir: pathlib.Path) -> bool:
    folder = run_dir / "checkpoints"
    return folder.is_dir() and any(is_step_dir(p) for p in folder.iterdir())
