"""Fine-tuning from a Hugging Face checkpoint (`--init-hf DIR`): what a run takes from it,
and what it keeps of it.

The checkpoint's `config.json` gives the architecture (the family reads it with its
`config_from_hf`), its safetensors the starting weights (read straight into their shards by
the family's `from_hf(spec=...)`), its `tokenizer.json` the tokens of the data. The run
trains float32 parameters (the checkpoint's dtype stays the compute dtype) and extends
`max_seq_len` to `--seq-len` when that is longer; `--override` may change what keeps every
weight's shape (`rope_theta`, `rope_scaling`, `max_seq_len`, ...).

A fresh run copies `config.json` and the tokenizer files into `<run_dir>/init_hf/`. From
then on the run no longer needs the source directory: `--resume` restores the weights from
the run's checkpoint and rebuilds the config and tokenizer from that copy, and the export
(`python -m eqx_longctx.export`) writes the copy's tokenizer next to the trained weights.
"""

import dataclasses
import os
import pathlib
import shutil
from typing import Any

from .._family import ModelFamily, family_names, model_family
from ._config import TrainConfig, _coerce, check_model_fits
from ._record import read_flags

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


def hf_start(config: TrainConfig, run_dir: pathlib.Path) -> HFStart | None:
    """The Hugging Face checkpoint a run reads its config and tokenizer from, or `None` for
    a run of a fresh model.

    A fresh run reads `config.init_hf`. A resumed one reads its own copy
    (`<run_dir>/init_hf/`) when it was started from a checkpoint; the checkpoint wins, so
    `init_hf` may then be left out (if given, `--resume` checks it is the recorded one).

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
    if config.resume:
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
    elif config.init_hf is None:
        return None
    else:
        source = pathlib.Path(config.init_hf)
    family = model_family(config.model)
    base = _stored_config(family, source, config.model)
    changes: dict[str, Any] = {
        "param_dtype": "float32",
        "compute_dtype": base.compute_dtype,
        "max_seq_len": max(base.max_seq_len, config.seq_len),
    }
    if config.remat is not None:
        changes["remat"] = config.remat
    for name, value in config.model_overrides.items():
        like = getattr(base, name, None)
        changes[name] = _coerce(value, like, name) if hasattr(base, name) else value
    try:
        model_config = family.config_from_hf(source, **changes)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--init-hf {source} with --override: {e}") from e
    check_model_fits(model_config, config, None)  # the tokenizer checks the vocabulary
    tokenizer = _tokenizer(source, model_config.vocab_size)
    return HFStart(source, family, changes, model_config, tokenizer)


def keep_source(run_dir: pathlib.Path, start: HFStart | None) -> None:
    """Record where a fresh run starts: copy `config.json` and the tokenizer files of its
    source checkpoint into `<run_dir>/init_hf/`, or (a fresh model) remove an earlier run's
    copy, which would make `--resume` read that checkpoint's config."""
    from eqx_longctx.data._hf_tokenizer import TOKENIZER_FILES

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
    from eqx_longctx.data import HFTokenizer

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


def run_model_config(config: TrainConfig, run_dir: str | os.PathLike):
    """The tokenizer and model config of a run, fresh or fine-tuned (as `Trainer` builds
    them); for readers of a run's checkpoints (generate, export).

    **Returns:** `(tokenizer, model config, HFStart or None)`.
    """
    from eqx_longctx.data import ByteTokenizer

    from ._config import build_model_config

    start = hf_start(dataclasses.replace(config, resume=True), pathlib.Path(run_dir))
    if start is None:
        tokenizer = ByteTokenizer()
        return tokenizer, build_model_config(config, tokenizer.vocab_size), None
    return start.tokenizer, start.model_config, start
