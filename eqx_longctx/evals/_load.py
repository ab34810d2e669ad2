"""The model an eval runs: a training run's newest checkpoint or a Hugging Face checkpoint,
under the placement flags, with `--override` applied to its config."""

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax

from ._runner import EvalModel

SCALINGS = ("linear", "llama3", "yarn")


def rope_scaling_of(value: Any) -> Any:
    """A RoPE scaling from `--override rope_scaling=JSON`: `{"rope_type": "yarn" | "llama3"
    | "linear", ...fields}` (Hugging Face's names: `factor`,
    `original_max_position_embeddings`, `low_freq_factor`, `high_freq_factor`,
    `beta_fast`, `beta_slow`, ...); a scaling object or `None` passes through.

    **Raises:** `ValueError` for another type or fields the scaling does not take.
    """
    from ..nn import LinearRopeScaling, Llama3RopeScaling, YarnRopeScaling

    if not isinstance(value, dict):
        return value
    fields = dict(value)
    kind = fields.pop("rope_type", fields.pop("type", None))
    cls = {"linear": LinearRopeScaling, "llama3": Llama3RopeScaling, "yarn": YarnRopeScaling}
    if kind not in cls:
        raise ValueError(
            f"--override rope_scaling takes a JSON object with rope_type one of {SCALINGS}; "
            f'got rope_type={kind!r}. Example: --override \'rope_scaling={{"rope_type": '
            '"yarn", "factor": 4, "original_max_position_embeddings": 2048}\''
        )
    names = {f.name for f in dataclasses.fields(cls[kind])}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise ValueError(
            f"--override rope_scaling of rope_type {kind!r} takes the fields {sorted(names)}; "
            f"got unknown {unknown}."
        )
    return cls[kind](**fields)


def with_overrides(model: Any, overrides: Sequence[tuple[str, str]]) -> Any:
    """`model` rebuilt from its config with `overrides` (`(field, text)` pairs) applied,
    keeping every weight: only fields that leave the weights' shapes alone may change
    (`rope_theta`, `rope_scaling`, `max_seq_len`, `sliding_window`, ...).

    **Raises:** `ValueError` for a field the config lacks, a value that does not parse or
    that the config refuses, or one that changes a weight.
    """
    from ..run import coerce_override, transplant

    if not overrides:
        return model
    config = model.config
    names = {f.name for f in dataclasses.fields(config)}
    changes = {}
    for name, text in overrides:
        if name not in names:
            raise ValueError(
                f"--override must name a field of {type(config).__name__}; got {name!r}. "
                f"Fields: {sorted(names)}."
            )
        value = coerce_override(text, getattr(config, name), name)
        changes[name] = rope_scaling_of(value) if name == "rope_scaling" else value
    try:
        new_config = dataclasses.replace(config, **changes)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--override {changes}: {e}") from None
    family = _family_of(config)
    spec = model.spec
    abstract = eqx.filter_eval_shape(
        lambda: family.model(new_config, key=jax.random.key(0), spec=spec)
    )
    # The weights are the model's; everything else (static fields) is the new config's.
    return transplant(model, abstract, what=f"--override {sorted(changes)}")


def _family_of(config: Any) -> Any:
    from .._family import model_families

    for family in model_families().values():
        if isinstance(config, family.config):
            return family
    raise ValueError(f"no installed model family has the config class {type(config).__name__}.")


def load_eval_model(args: argparse.Namespace, **placement: Any) -> EvalModel:
    """The `EvalModel` the flags name (`--run-dir` or `--hf`, `--model`, the placement
    flags, `--override`); `placement` replaces placement flags (e.g. `strategy="ulysses"`,
    `devices=1, mesh=None`).

    **Raises:** `ValueError` as `eqx-longctx-generate` does for the same flags, and for an
    `--hf` checkpoint without a `tokenizer.json`.
    """
    from ..inference import cli_load_hf as _load_hf
    from ..inference import cli_load_run as _load_run

    flags = argparse.Namespace(**{**vars(args), **placement})
    if flags.hf is not None:
        model, text, eos = _load_hf(flags)
        if text is None:
            raise ValueError(
                f"--hf {flags.hf}: the evals need the checkpoint's tokenizer.json (and the "
                "tokenizers package: pip install tokenizers) to write their prompts."
            )
        tok = text.tok
        start = tuple(int(i) for i in tok.encode_prompt(""))
        name = str(flags.hf)
    else:
        if flags.model is not None:
            raise ValueError(
                f"--model picks the family of an --hf checkpoint; a run records its own model. "
                f"Drop --model {flags.model}."
            )
        model, text, eos = _load_run(flags)
        tok = text.tok
        start = (int(tok.bos_id),)
        name = str(flags.run_dir or "newest run")
    model = with_overrides(model, flags.override)
    return EvalModel(model, tok, start, frozenset(eos), name)
