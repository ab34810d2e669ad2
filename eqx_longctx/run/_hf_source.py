"""Fine-tuning from a Hugging Face checkpoint (`--init-hf DIR`): what a run takes from it,
and what it keeps of it.

The checkpoint's `config.json` gives the architecture (the family reads it with its
`config_from_hf`), its safetensors the starting weights (read straight into their shards by
the family's `from_hf(spec=...)`), its `tokenizer.json` the tokens of the data. The run
trains float32 parameters (the checkpoint's dtype stays the compute dtype) and extends
`max_seq_len` to `--seq-len` when that is longer; `--override` may change what keeps every
weight's shape (`rope_theta`, `rope_scaling`, `max_seq_len`, ...).

A fresh run copies `config.json` and the tokenizer files into `<run_dir>/init_hf/` (the
trainer's `keep_source`). From then on the run no longer needs the source directory:
`--resume` restores the weights from the run's checkpoint and rebuilds the config and
tokenizer from that copy, and the export (`python -m eqx_longctx.export`) writes the copy's
tokenizer next to the trained weights. Reading that copy is every reader's, so it lives
here with the run directories.
"""

import dataclasses
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from .._family import ModelFamily, family_names, model_family
from ._model_config import check_model_fits, coerce_override, preset_model_config
from ._runs import read_flags

SOURCE_COPY = "init_hf"
"""The folder of a run directory that holds its copy of the source checkpoint's
`config.json` and tokenizer files."""
CONFIG_FILE = "config.json"
SOURCE_EXTRAS = ("generation_config.json", "chat_template.jinja", "chat_template.json")
"""Files of a source checkpoint besides its tokenizer that a run keeps and its export
writes back: how transformers generates from it (stop tokens) and its chat template."""


@dataclasses.dataclass(frozen=True)
class HFStart:
    """What a run started from a Hugging Face checkpoint reads from it.

    - `source`: the directory read: `--init-hf` for a fresh run, the run's copy on resume.
    - `family`: the model family.
    - `changes`: the `from_hf` keyword arguments (dtypes, context length, overrides).
    - `model_config`: the config they give.
    - `tokenizer`: the checkpoint's `eqx_longctx.data.HFTokenizer`.
    """

    source: pathlib.Path
    family: ModelFamily
    changes: dict[str, Any]
    model_config: Any
    tokenizer: Any

    def load(self, spec):
        """**Returns:** the checkpoint's model (of config `model_config`), each weight read
        into its shards under `spec` (`None`: one device).

        **Raises:** `ValueError`, naming `--init-hf` and the file, for missing, damaged or
        wrongly shaped weights (see the family's `from_hf`).
        """
        try:
            return self.family.from_hf(self.source, spec=spec, **self.changes)
        except (ValueError, TypeError) as e:
            raise ValueError(f"--init-hf {self.source}: {e}") from e


def hf_start(
    run_dir: str | os.PathLike,
    *,
    model: str,
    init_hf: str | os.PathLike | None,
    seq_len: int,
    overrides: Mapping[str, Any],
    remat: str | None = None,
    resume: bool = False,
) -> HFStart | None:
    """The Hugging Face checkpoint a run reads its config and tokenizer from, or `None` for
    a run of a fresh model.

    A fresh run reads `init_hf`. A resumed one (`resume`, and every reader of a run) reads
    its own copy (`<run_dir>/init_hf/`) when it was started from a checkpoint; the
    checkpoint wins, so `init_hf` may then be left out (if given, `--resume` checks it is
    the recorded one).

    **Arguments:** `run_dir`; and the run's `--model`, `--init-hf`, `--seq-len`,
    `--override` (a field -> value mapping), `--remat` and `--resume`.

    **Raises:** `ValueError` (each naming `--init-hf`, the directory and the fix) for a
    directory that is missing or holds no readable `config.json` of `config.model`'s
    family (a checkpoint of another installed family is named as such), an override that
    is not a field of the config or would change a weight's shape, a missing or unreadable
    `tokenizer.json` or a `config.json` without `eos_token_id`, a tokenizer with more ids
    than the model's `vocab_size`; on resume, a run whose record names a source checkpoint
    but whose copy of it is gone.
    """
    run_dir = pathlib.Path(run_dir)
    copy = run_dir / SOURCE_COPY
    if resume:
        if (copy / CONFIG_FILE).is_file():
            source = copy
        else:
            recorded = read_flags(run_dir) if run_dir.is_dir() else None
            started = (recorded or {}).get("init_hf")
            if started is None:
                return None  # a run of a fresh model; --resume checks a given --init-hf
            raise ValueError(
                f"the run in {run_dir} was started with --init-hf {started}, but its copy of "
                f"that checkpoint's config and tokenizer ({copy}) is gone. Copy config.json "
                f"and tokenizer.json of {started} into {copy} to resume."
            )
    elif init_hf is None:
        return None
    else:
        source = pathlib.Path(init_hf)
    family = model_family(model)
    base = _stored_config(family, source, model)
    changes: dict[str, Any] = {
        "param_dtype": "float32",
        "compute_dtype": base.compute_dtype,
        "max_seq_len": max(base.max_seq_len, seq_len),
    }
    if remat is not None:
        changes["remat"] = remat
    for name, value in overrides.items():
        like = getattr(base, name, None)
        changes[name] = coerce_override(value, like, name) if hasattr(base, name) else value
    try:
        model_config = family.config_from_hf(source, **changes)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--init-hf {source} with --override: {e}") from e
    check_model_fits(model_config, seq_len, None)  # the tokenizer checks the vocabulary
    tokenizer = _tokenizer(source, model_config.vocab_size)
    return HFStart(source, family, changes, model_config, tokenizer)


def _stored_config(family: ModelFamily, source: pathlib.Path, model: str):
    """The checkpoint's own config; a checkpoint that another family reads is named so."""
    try:
        return family.config_from_hf(source)
    except (ValueError, TypeError) as e:
        error = e
    for other in family_names():
        if other == model:
            continue
        try:
            model_family(other).config_from_hf(source)
        except Exception:  # not that family either
            continue
        raise ValueError(
            f"--init-hf {source} is a checkpoint of the {other!r} family, which --model "
            f"{model} cannot read ({error}). Pass --model {other}."
        )
    raise ValueError(f"--init-hf {source}: {error}")


def _tokenizer(source: pathlib.Path, vocab_size: int):
    from ..data import HFTokenizer

    try:
        tokenizer = HFTokenizer.from_checkpoint(source)
    except ValueError as e:
        raise ValueError(f"--init-hf {source}: {e}") from e
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"--init-hf {source}: the tokenizer {tokenizer.file} has {tokenizer.vocab_size} "
            f"ids but the model's embedding only {vocab_size} (config.json vocab_size); "
            "they must belong together. Use the tokenizer saved with these weights."
        )
    return tokenizer


def run_model_config(flags: Mapping[str, Any], run_dir: str | os.PathLike):
    """The tokenizer and model config of a run, fresh or fine-tuned (as the trainer builds
    them), from the run's recorded flags; for readers of a run's checkpoints (generate,
    export).

    **Arguments:**

    - `flags`: the run's flags as `flags.json` records them (`model`, `preset`,
      `model_overrides`, `remat`, `seq_len`, `init_hf`).
    - `run_dir`: the run directory (its `init_hf/` copy, for a fine-tuning run).

    **Returns:** `(tokenizer, model config, HFStart or None)`.

    **Raises:** `ValueError` as [`hf_start`][] and `preset_model_config`.
    """
    from ..data import ByteTokenizer

    overrides = flags.get("model_overrides") or {}
    start = hf_start(
        run_dir, model=flags["model"], init_hf=flags.get("init_hf"), seq_len=flags["seq_len"],
        overrides=overrides, remat=flags.get("remat"), resume=True,
    )  # fmt: skip
    if start is None:
        tokenizer = ByteTokenizer()
        config = preset_model_config(
            flags["model"], flags["preset"], overrides, vocab_size=tokenizer.vocab_size,
            seq_len=flags["seq_len"], remat=flags.get("remat"),
        )  # fmt: skip
        return tokenizer, config, None
    return start.tokenizer, start.model_config, start
