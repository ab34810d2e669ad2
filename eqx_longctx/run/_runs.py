"""Run directories: where a run goes by default, the newest run, and the flags it recorded
(`flags.json`). (Its model, read back from a checkpoint, is `_run_model.py`'s.)

A run directory (`python -m eqx_longctx.train`'s `--run-dir`) holds `flags.json`,
`metrics.jsonl`, `loss.png`, `checkpoints/<step>/` and, for a run started from a Hugging Face
checkpoint, `init_hf/` (its config and tokenizer).
"""

import json
import pathlib
import time
from typing import Any

FLAGS_FILE = "flags.json"
"""The file of a run directory that records the flags it was started with."""


def default_run_dir(resume: bool, root: str = "runs") -> pathlib.Path:
    """A fresh `runs/<date>-<time>` directory, or for `resume` the newest run with checkpoints
    (the one whose `checkpoints/` changed last).

    **Raises:** `ValueError` for `resume` when no run under `root` has checkpoints.
    """
    base = pathlib.Path(root)
    if resume:
        runs = [d for d in base.glob("*") if (d / "checkpoints").is_dir()]
        if not runs:
            raise ValueError(
                f"--resume without --run-dir continues the newest run under {base}/, but none "
                "there has checkpoints. Pass --run-dir of the run to continue."
            )
        # Newest by when its checkpoints last changed, not by name: runs may be renamed.
        return max(runs, key=lambda d: ((d / "checkpoints").stat().st_mtime, d.name))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = base / stamp, 1
    while path.exists():
        path, n = base / f"{stamp}-{n}", n + 1
    return path


def read_flags(run_dir: str | pathlib.Path) -> dict[str, Any] | None:
    """**Returns:** the recorded flags of the run in `run_dir`, or `None` when it has no
    `flags.json` (deleted: then `--resume` compares with the newest checkpoint's record).

    **Raises:** `ValueError` when the file cannot be read as a JSON object.
    """
    path = pathlib.Path(run_dir) / FLAGS_FILE
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        record = e
    if not isinstance(record, dict):
        raise ValueError(
            f"--resume compares the flags with the run's record, but {path} is not a JSON "
            f"object ({record}). Restore the file, delete it to compare with the newest "
            "checkpoint's record instead, or start a new --run-dir."
        )
    return record
