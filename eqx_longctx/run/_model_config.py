"""A run's model config from what the command line says of it: the family (`--model`), its
preset (`--preset`), `--override FIELD=VALUE` and `--remat`, fitted to the tokenizer and the
row length (`--seq-len`). The trainer builds its model with it, and every reader of a run
(generate, export, the planner) rebuilds the same config from the run's record.
"""

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from .._family import model_family


def resolve_overrides(
    preset: str, overrides: Mapping[str, Any], *, model: str = "llama"
) -> dict[str, Any]:
    """Check a preset name and its overrides; turn CLI strings into the preset's types.

    **Arguments:**

    - `preset`: a key of the family's presets (`--preset`).
    - `overrides`: config field -> value (`--override FIELD=VALUE`; strings parse as the
      preset's value for that field).
    - `model`: the family (`--model`).

    **Returns:** the overrides with parsed values.

    **Raises:** `ValueError` for a preset the family does not have, an override that is not
    a field of its config, or one whose text does not parse as the preset's value.
    """
    fam = model_family(model)
    if preset not in fam.presets:
        raise ValueError(
            f"--preset must be one of --model {model}'s presets {sorted(fam.presets)}; got "
            f"--preset {preset!r}. Pass e.g. --preset tiny."
        )
    base = fam.presets[preset]
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"--override must name {fam.config.__name__} fields; got unknown {unknown} (--model "
            f"{model}). Valid fields: {sorted(fields)}."
        )
    return {
        name: coerce_override(value, getattr(base, name), name) for name, value in overrides.items()
    }


def coerce_override(value: Any, like: Any, name: str) -> Any:
    """Turn a CLI string into the type of the preset's value for that field (where that
    value is None, e.g. `sliding_window` or `rope_scaling`: `none`, a JSON value (a number,
    a list as a tuple, an object), or the string as is; where it is a tuple, e.g.
    `layer_types`: a JSON list, as a tuple, or `none`).

    **Raises:** `ValueError` when the text does not parse as `like`'s type.
    """
    if isinstance(value, str) and like is None:
        if value.lower() == "none":
            return None
        try:  # numbers, and JSON lists / objects (layer_types, rope_scaling)
            parsed = json.loads(value)
        except ValueError:
            return value
        return tuple(parsed) if isinstance(parsed, list) else parsed
    if not isinstance(value, str) or isinstance(like, str):
        return value
    if isinstance(like, tuple):  # a JSON list (layer_types=["linear", "full"]), or none
        if value.lower() == "none":
            return None
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if isinstance(parsed, list):
            return tuple(parsed)
        raise ValueError(
            f"override {name}={value!r} must be a JSON list like the preset's value "
            f"{list(like)!r}. Pass e.g. --override '{name}={json.dumps(list(like))}'."
        )
    if isinstance(like, bool):
        if value.lower() in ("1", "true", "yes"):
            return True
        if value.lower() in ("0", "false", "no"):
            return False
    else:
        try:
            return type(like)(value)
        except (TypeError, ValueError):
            pass
    raise ValueError(
        f"override {name}={value!r} must parse as {type(like).__name__} like the preset's "
        f"value {like!r}. Pass e.g. --override {name}={like}."
    )


def preset_model_config(
    model: str,
    preset: str,
    overrides: Mapping[str, Any],
    *,
    vocab_size: int,
    seq_len: int,
    remat: str | None = None,
):
    """The model config of a run of a fresh model: the preset of its family, fitted to the
    tokenizer and the row length.

    **Arguments:**

    - `model`, `preset`, `overrides`: `--model`, `--preset`, `--override` (as
      [`resolve_overrides`][] takes them).
    - `vocab_size`: the tokenizer's vocabulary size.
    - `seq_len`: tokens per row (`max_seq_len` is raised to it).
    - `remat`: `--remat`, or `None` for the preset's.

    **Returns:** an instance of `eqx_longctx.model_family(model).config` (e.g.
    `LlamaConfig`).

    **Raises:** `ValueError` as [`resolve_overrides`][] and [`check_model_fits`][], and for
    an override the config's constructor refuses (`TypeError` and `ValueError` as the
    config's own checks for the values that result).
    """
    fam = model_family(model)
    parsed = resolve_overrides(preset, overrides, model=model)
    changes: dict[str, Any] = {
        "vocab_size": vocab_size,
        "max_seq_len": max(fam.presets[preset].max_seq_len, seq_len),
    }
    if remat is not None:
        changes["remat"] = remat
    changes.update(parsed)
    try:
        model_config = fam.config.from_preset(preset, **changes)
    except TypeError as e:
        given = " ".join(f"{k}={v}" for k, v in overrides.items())
        raise ValueError(f"--override {given}: {e}") from None
    check_model_fits(model_config, seq_len, vocab_size)
    return model_config


def check_model_fits(model_config: Any, seq_len: int, vocab_size: int | None) -> None:
    """**Raises:** `ValueError` when the model cannot take a run's rows: `max_seq_len`
    below `seq_len` (`--seq-len`), or a vocabulary smaller than the tokenizer's
    `vocab_size` (`None`: not checked here). A fresh run checks this before it deletes
    anything: tracing the first step would fail only after it had."""
    if model_config.max_seq_len < seq_len:
        raise ValueError(
            f"the model's max_seq_len={model_config.max_seq_len} is shorter than --seq-len "
            f"{seq_len}. Raise it (--override max_seq_len={seq_len}) or pass a shorter "
            "--seq-len."
        )
    if vocab_size is not None and model_config.vocab_size < vocab_size:
        raise ValueError(
            f"the model's vocab_size={model_config.vocab_size} is smaller than the "
            f"tokenizer's {vocab_size} tokens. Drop --override vocab_size, or pass one of at "
            f"least {vocab_size}."
        )
