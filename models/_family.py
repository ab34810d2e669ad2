"""The model families, by name: what the trainer and the planner build from `--model`.

A family module (`models/llama.py`, `models/deepseek.py`) defines a config class with
`from_preset`, a model class built as `Model(config, key=, spec=)`, a `PRESETS` dict and
`from_hf` / `to_hf`. Code that takes `--model NAME` looks the family up here, so it never
imports a family module by name.
"""

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

FAMILY_NAMES = ("llama", "deepseek")
_MODULES = {"llama": ("models.llama", "LlamaConfig", "Llama"),
            "deepseek": ("models.deepseek", "DeepSeekConfig", "DeepSeek")}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One model family.

    - `name`: the `--model` value (`"llama"`, `"deepseek"`).
    - `config`: the config class (has `from_preset(name, **overrides)`).
    - `model`: the model class (`model(config, key=key, spec=spec)`).
    - `presets`: preset name -> config.
    - `from_hf`, `to_hf`: the Hugging Face converters.
    """

    name: str
    config: type
    model: type
    presets: dict[str, Any]
    from_hf: Callable[..., Any]
    to_hf: Callable[..., Any]


def family(name: str) -> ModelFamily:
    """**Returns:** the family called `name`; `ValueError` naming the choices otherwise."""
    if name not in _MODULES:
        raise ValueError(f"unknown model family {name!r}; choose one of {FAMILY_NAMES} (--model).")
    path, config, model = _MODULES[name]
    module = importlib.import_module(path)
    return ModelFamily(
        name=name,
        config=getattr(module, config),
        model=getattr(module, model),
        presets=module.PRESETS,
        from_hf=module.from_hf,
        to_hf=module.to_hf,
    )


def family_of(model_or_config: Any) -> ModelFamily:
    """**Returns:** the family a model or config instance belongs to."""
    for name in FAMILY_NAMES:
        fam = family(name)
        if isinstance(model_or_config, (fam.config, fam.model)):
            return fam
    raise ValueError(
        f"{type(model_or_config).__name__} belongs to no known model family {FAMILY_NAMES}."
    )
