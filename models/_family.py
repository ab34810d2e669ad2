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
"""The `--model` names of the families, in the order the CLI lists them."""
_MODULES = {"llama": ("models.llama", "LlamaConfig", "Llama"),
            "deepseek": ("models.deepseek", "DeepSeekConfig", "DeepSeek")}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One model family.

    **Arguments:**

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
    """Look a family up by its `--model` name.

    **Arguments:**

    - `name`: one of `FAMILY_NAMES`.

    **Returns:** its `ModelFamily` (the family module is imported on first use).

    **Raises:** `ValueError` for an unknown name; the message lists the choices.
    """
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
    """The family a model or config instance belongs to.

    **Arguments:**

    - `model_or_config`: e.g. a `models.llama.Llama` or a `models.deepseek.DeepSeekConfig`.

    **Returns:** its `ModelFamily`.

    **Raises:** `ValueError` when it is an instance of no family's model or config class.
    """
    for name in FAMILY_NAMES:
        fam = family(name)
        if isinstance(model_or_config, (fam.config, fam.model)):
            return fam
    raise ValueError(
        f"{type(model_or_config).__name__} belongs to no known model family {FAMILY_NAMES}."
    )
