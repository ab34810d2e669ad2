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
    - `stages`: the stages trained before the run itself, in order, each the
      `TrainConfig` fields it changes (e.g. `seq_len`, `steps`, `synthetic_filler`): stage
      `k` trains into `RUN_DIR/stage-k` from the weights of stage `k - 1` (`init_run`),
      and the run itself from the last one's; `()`: the run alone.
    """

    name: str
    summary: str
    flags: Mapping[str, Any]
    eval_task: str | None = None
    eval_samples: int = 10
    eval_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    stages: tuple[Mapping[str, Any], ...] = ()


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

_SIZE = [("dim", "128"), ("n_heads", "8"), ("n_kv_heads", "8"), ("head_dim", "16"),
         ("hidden_dim", "344")]  # fmt: skip
_SMALL_LLAMA = [("n_layers", "2"), *_SIZE]
"""The passkey recipe's model: the tiny Llama at 2 layers of width 128 (0.4M parameters),
small enough to learn retrieval in minutes on a CPU."""

_SMALL_HYBRID = [
    ("n_layers", "2"), ("layer_types", '["linear_attention", "full_attention"]'), *_SIZE,
    ("linear_n_heads", "8"), ("linear_n_key_heads", "8"), ("linear_head_dim", "16"),
    ("linear_v_head_dim", "16"), ("mlp_only_layers", "[0, 1]"),
]  # fmt: skip
"""`passkey-hybrid`'s model: Qwen3-Next's layers at the Llama's size, a Gated DeltaNet layer
(8 heads of 16) then a gated full-attention one, dense SwiGLU feed-forwards (no experts)."""
_SMALL_GEMMA3 = [
    ("n_layers", "2"), ("layer_types", '["sliding_attention", "full_attention"]'), *_SIZE,
    ("query_pre_attn_scalar", "16"),
]  # fmt: skip
"""`passkey-gemma3`'s model: Gemma 3's layers at the Llama's size, a local layer (a 256-token
window) then a global one."""

_PASSKEY = {
    **_RETRIEVAL,
    "synthetic": "passkey",
    "synthetic_share": 0.98,
    "lr": 1e-3,
    "steps": 150,
    "eval_every": 75,
    "checkpoint_every": 75,
}
"""The passkey recipes' last stage: 150 steps of 8 rows of 2048 tokens, 98% passkey
documents, from the drills' weights."""

_DRILLS = {
    "seq_len": 256,
    "batch_size": 16,
    "steps": 1000,
    "lr": 3e-3,
    "synthetic": "passkey",
    "synthetic_share": 0.98,
    "synthetic_filler": 60,
    "eval_every": 500,
    "checkpoint_every": 500,
}
"""The passkey recipe's first stage: drills whose filler ramps from 0 to 60 tokens, where
the model learns to copy a needle and then to find it by its content (docs/recipes.md)."""

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "passkey",
            "a 2-layer tiny Llama trained for retrieval in two stages: passkey drills whose "
            "filler ramps from 0 to 60 tokens in 256-token rows, then stdlib text mixed with "
            "passkey documents at every depth in 2048-token rows, ring attention over zig-zag "
            "on 8 devices; ends with the passkey eval at 2047 tokens",
            {**_PASSKEY, "override": _SMALL_LLAMA},
            eval_task="passkey",
            stages=(_DRILLS,),
        ),
        Recipe(
            "passkey-hybrid",
            "the passkey recipe on a Qwen3-Next hybrid of the same size (a Gated DeltaNet "
            "layer, then a full-attention one): the same two stages and eval",
            {**_PASSKEY, "model": "qwen3_next", "override": _SMALL_HYBRID},
            eval_task="passkey",
            stages=(_DRILLS,),
        ),
        Recipe(
            "passkey-gemma3",
            "the passkey recipe on a Gemma 3 of the same size (a sliding-window local layer, "
            "by neighbour exchange, then a global one): the same two stages and eval",
            {
                **_PASSKEY,
                "model": "gemma3_text",
                "preset": "gemma3-tiny",
                "override": _SMALL_GEMMA3,
            },  # fmt: skip
            eval_task="passkey",
            stages=(_DRILLS,),
        ),
    )
}


def recipe_help() -> str:
    """The `--help` text listing the recipes."""
    return "recipes: " + "; ".join(f"{r.name}: {r.summary}" for r in RECIPES.values())


STAGE_DIR = "stage-{}"
"""The folder of a recipe's run directory that holds its stage `k`'s run (`k` from 1)."""


def recipe_stages(recipe: Recipe, config: Any) -> list[Any]:
    """The runs `--recipe` makes for `config` (a `TrainConfig`): `[config]`, or, for a
    recipe with `stages`, each stage's run in `RUN_DIR/stage-k` starting from the one
    before (the first from scratch), then `config` starting from the last. Each stage
    takes `config` with its own changes, and TrainConfig's default warmup unless it sets
    one. A start given by the user (`init_run` or `init_hf`) replaces the stages. With
    `resume`, a stage that saved no checkpoint yet starts fresh, one that did resumes.

    **Raises:** `ValueError` as `TrainConfig` for stage values it refuses.
    """
    if not recipe.stages or config.init_run is not None or config.init_hf is not None:
        return [config]
    runs, before = [], None
    for k, changes in enumerate(recipe.stages, start=1):
        run_dir = pathlib.Path(str(config.run_dir)) / STAGE_DIR.format(k)
        runs.append(dataclasses.replace(
            config, **{"warmup_steps": None, **changes}, run_dir=str(run_dir), init_run=before,
            resume=config.resume and _has_checkpoints(run_dir),
        ))  # fmt: skip
        before = str(run_dir)
    main = dataclasses.replace(
        config, init_run=before,
        resume=config.resume and _has_checkpoints(pathlib.Path(str(config.run_dir))),
    )  # fmt: skip
    return [*runs, main]


def _has_checkpoints(run_dir: pathlib.Path) -> bool:
    folder = run_dir / "checkpoints"
    return folder.is_dir() and any(is_step_dir(p) for p in folder.iterdir())
