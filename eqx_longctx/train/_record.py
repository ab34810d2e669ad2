"""The run record: the flags a run was started with (`<run_dir>/flags.json`), and the rule
for which of them `--resume` may change.

Every `TrainConfig` field falls in one of three groups:

- `RUN_FLAGS` define the run: the data and its order (`data`, `max_bytes`, `val_fraction`,
  `seed`), the shapes (`seq_len`, `batch_size`), the model (`model`, `preset`,
  `model_overrides`, and `init_hf`, the Hugging Face checkpoint a fine-tuning run started
  from: recorded as an absolute path; on `--resume` it may be left out, since the weights
  come from the run's checkpoint and the config and tokenizer from the run's own copy, and
  if given it must be the recorded one; `init_run`, the run whose weights it started
  from, likewise)
  and the optimizer with its schedule (`lr`, `warmup_steps`, `weight_decay`, `clip_norm`,
  `steps`: the cosine decay spans `steps`, so a different value changes the learning rate
  of every step after warmup, including ones already taken). Resuming with another value
  would not continue the same run, so `--resume` refuses it.
- `RESHARDABLE_FLAGS` say where and how the same arithmetic runs (`devices`, `mesh`,
  `fsdp_axes`, `strategy`, `load_balance`, `remat`, `grad_accum`, `loss_chunk`,
  `host_offload`: a checkpoint restores into the shardings of the current mesh): changing
  them on resume gives the same mathematics, equal up to floating-point summation order
  (bitwise-exact resume holds for unchanged values only).
- `FREE_FLAGS` are bookkeeping and policy (strides, evaluation sizes, checkpoints kept,
  `on_nonfinite`, which a run stopped by a non-finite loss changes to `skip` to continue)
  and per-invocation switches.
"""

import json
import pathlib
import shutil
from typing import Any

from ..data import TOKENIZER_FILES
from ..run import (
    CONFIG_FILE,
    FLAGS_FILE,
    SOURCE_COPY,
    SOURCE_EXTRAS,
    HFStart,
    resolve_overrides,
)
from ._config import TrainConfig, flag_name

RUN_FLAGS = (
    "model",
    "preset",
    "model_overrides",
    "init_hf",
    "init_run",
    "seq_len",
    "batch_size",
    "steps",
    "lr",
    "warmup_steps",
    "weight_decay",
    "clip_norm",
    "data",
    "max_bytes",
    "val_fraction",
    "seed",
    "synthetic",
    "synthetic_share",
    "synthetic_loss",
    "synthetic_filler",
)
RESHARDABLE_FLAGS = (
    "devices", "mesh", "fsdp_axes", "strategy", "load_balance", "remat", "grad_accum",
    "loss_chunk", "host_offload",
)  # fmt: skip
FREE_FLAGS = (
    "checkpoint_every",
    "eval_every",
    "log_every",
    "eval_batches",
    "final_eval_batches",
    "keep_checkpoints",
    "on_nonfinite",
    "run_dir",
    "resume",
    "overwrite",
    "progress",
)
_NOT_RECORDED = ("run_dir", "resume", "overwrite", "progress")


def run_flags(config: TrainConfig | dict[str, Any]) -> dict[str, Any]:
    """The record of a run's flags, normalised so that equal runs give equal records.

    Model overrides are parsed against the preset (`"2"` from the CLI equals `2` from
    Python) and `data`, `init_hf` and `init_run` become absolute paths. Per-invocation
    switches (`run_dir`, `resume`, `overwrite`, `progress`) are left out.

    **Arguments:**

    - `config`: a `TrainConfig`, or a dict of all its fields.

    **Returns:** a JSON-serialisable dict.

    **Raises:** `ValueError` for an unknown preset or override field (as `--preset` and
    `--override` do).
    """
    fields = vars(config) if isinstance(config, TrainConfig) else dict(config)
    record = {k: v for k, v in fields.items() if k not in _NOT_RECORDED}
    record["model_overrides"] = resolve_overrides(
        record["preset"], record.get("model_overrides") or {}, model=record["model"]
    )
    for name in ("data", "init_hf", "init_run"):
        if record.get(name) is not None:
            record[name] = str(pathlib.Path(record[name]).expanduser().resolve())
    return json.loads(json.dumps(record, default=str))


def write_flags(run_dir: pathlib.Path, config: TrainConfig) -> pathlib.Path:
    """Write `run_flags(config)` to `<run_dir>/flags.json`; **returns** its path."""
    path = pathlib.Path(run_dir) / FLAGS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run_flags(config), indent=1, sort_keys=True) + "\n")
    return path


def flag_differences(recorded: dict[str, Any], given: dict[str, Any]) -> list[str]:
    """**Returns:** one `"--flag: recorded X, given Y"` entry per run flag (`RUN_FLAGS`)
    whose values differ: `recorded` as `run_flags` wrote it, `given` (a dict of every
    `TrainConfig` field) normalised the same way."""
    given = run_flags(given)
    out = []
    for name in RUN_FLAGS:
        if name in recorded and recorded[name] != given.get(name):
            why = " (the cosine schedule spans --steps)" if name == "steps" else ""
            out.append(
                f"{flag_name(name)}: recorded {recorded[name]!r}, given {given.get(name)!r}{why}"
            )
    return out


def _as_flag(name: str, value: Any) -> str:
    """A recorded run flag as the command line passes it (`--seq-len 64`, `--no-progress`,
    `--override n_layers=2`)."""
    flag = flag_name(name)
    if isinstance(value, bool):
        return flag if value else f"(no {flag})"
    if value is None:
        return f"(no {flag})"
    if isinstance(value, dict):
        return " ".join(f"{flag} {k}={v}" for k, v in value.items()) or f"(no {flag})"
    return f"{flag} {value}"


def check_resume_flags(
    recorded: dict[str, Any] | None, config: TrainConfig, where: str, step: int
) -> bool:
    """Check that `--resume` continues the recorded run.

    **Arguments:**

    - `recorded`: the run's recorded flags (`flags.json`, else the checkpoint's record).
    - `config`: the flags given now.
    - `where`: where the record came from, for the message.
    - `step`: the step the run would resume from.

    **Returns:** `True` when there is nothing left to do (`step >= config.steps`; then a
    different `--steps` is no error: nothing will be trained), else `False`. Raises
    `ValueError` naming every run flag that differs, its recorded and given values, and
    the fix.
    """
    if recorded is None:
        raise ValueError(
            f"--resume must continue a run with the flags it was started with, but {where} "
            "records none to compare with. Start a new --run-dir (or --overwrite this one)."
        )
    given = vars(config)
    for name in ("init_hf", "init_run"):  # left out on resume: the checkpoint wins
        if getattr(config, name) is None:
            given = {**given, name: recorded.get(name)}
    diffs = flag_differences(recorded, given)
    done = step >= config.steps
    if done:
        diffs = [d for d in diffs if not d.startswith("--steps:")]
    if diffs:
        normalised = run_flags(given)
        names = [n for n in RUN_FLAGS if n in recorded and recorded[n] != normalised.get(n)]
        if done:
            names = [n for n in names if n != "steps"]
        again = " ".join(_as_flag(n, recorded[n]) for n in names)
        raise ValueError(
            "--resume must continue a run with the flags it was started with; "
            f"{where} differs in {len(diffs)}: {'; '.join(diffs)}. Pass the recorded values "
            f"({again}) to continue this run, or start a new --run-dir. "
            f"({', '.join(flag_name(f) for f in RESHARDABLE_FLAGS)} and the strides may "
            "change on resume.)"
        )
    return done


def keep_source(run_dir: pathlib.Path, start: HFStart | None) -> None:
    """Record where a fresh run starts: copy `config.json` and the tokenizer files of its
    source checkpoint into `<run_dir>/init_hf/`, or (a fresh model) remove an earlier run's
    copy, which would make `--resume` read that checkpoint's config."""
    copy = pathlib.Path(run_dir) / SOURCE_COPY
    if start is not None and copy.resolve() == start.source.resolve():
        return
    shutil.rmtree(copy, ignore_errors=True)
    if start is None:
        return
    copy.mkdir(parents=True)
    for name in (CONFIG_FILE, *TOKENIZER_FILES, *SOURCE_EXTRAS):
        if (start.source / name).is_file():
            shutil.copyfile(start.source / name, copy / name)
