"""Model families as plugins: what the trainer, the planner and inference ask of a model.

The library never names a family. A family (the zoo's Llama and DeepSeek, or one written in
another package) is a `ModelFamily` object; the library finds the installed ones through
the Python entry-point group `eqx_longctx.models`:

```toml
[project.entry-points."eqx_longctx.models"]
mymodel = "mypackage.family:FAMILY"
```

and code can add one at run time with `register_family` (a notebook, a test).
"""

import abc
import math
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any, NamedTuple

import equinox as eqx
import jax

ENTRY_POINT_GROUP = "eqx_longctx.models"
"""The entry-point group families register under."""


class AttentionShape(NamedTuple):
    """The widths of a model's attention, as the planner and the placement checks see it:
    `q_heads` query heads and `kv_heads` key/value heads (the heads the strategies move and
    split over a tensor or Ulysses axis), `qk_dim` the query/key width, `v_dim` the value
    width."""

    q_heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int


class MoEShape(NamedTuple):
    """A model's routed experts: `experts` routed experts of `hidden_dim` hidden width
    (SwiGLU: three `[dim, hidden_dim]` matrices each) in each of `layers` MoE layers,
    `top_k` of them per token, and the `capacity_factor` of an expert's buffer (`None`:
    dropless)."""

    experts: int
    top_k: int
    capacity_factor: float | None
    layers: int
    hidden_dim: int


class ModelFamily(abc.ABC):
    """One model family: everything the trainer, the planner and inference need to build,
    load and size a model of it, without knowing it by name.

    A family's config is a frozen dataclass with at least `vocab_size`, `max_seq_len`,
    `dim`, `n_layers`, `param_dtype`, `compute_dtype` and `remat` (and optionally
    `sliding_window`), and a classmethod `from_preset(name, **overrides)`. Its model is an
    `eqx_longctx.nn.AbstractDecoder` built as `model(config, key=key, spec=spec)`.

    Subclasses set the class attributes and implement the abstract methods.

    **Attributes:**

    - `name`: the `--model` value, e.g. `"llama"`.
    - `config`: the config class.
    - `model`: the model class.
    - `presets`: preset name -> config (`--preset`).
    - `model_types`: the Hugging Face `config.json` `model_type`s `from_hf` reads (what
      `eqx_longctx.from_hf` picks the family by); empty for a family without a reader.
    """

    name: str
    config: type
    model: type
    presets: Mapping[str, Any]
    model_types: tuple[str, ...] = ()

    # ------------------------------------------------------------------ checkpoints
    def from_hf(self, path: Any, **kwargs) -> Any:
        """Read a Hugging Face checkpoint directory into a model of this family.

        **Raises:** `ValueError` when the family has no Hugging Face converter.
        """
        raise ValueError(f"model family {self.name!r} has no Hugging Face reader (from_hf).")

    def config_from_hf(self, path: Any, **kwargs) -> Any:
        """Read the config of a Hugging Face checkpoint directory (its `config.json`; no
        weights), as `from_hf(path, **kwargs)` would build it.

        **Raises:** `ValueError` when the family has no Hugging Face converter.
        """
        raise ValueError(f"model family {self.name!r} has no Hugging Face reader (from_hf).")

    def to_hf(self, model: Any, path: Any, **kwargs) -> None:
        """Write a model of this family as a Hugging Face checkpoint directory.

        **Raises:** `ValueError` when the family has no Hugging Face converter.
        """
        raise ValueError(f"model family {self.name!r} has no Hugging Face writer (to_hf).")

    # ------------------------------------------------------------------ the planner's questions
    @abc.abstractmethod
    def local_config(self, config: Any, *, tensor: int = 1, expert: int = 1) -> Any:
        """A config with one layer of each kind the model has, at the widths one device
        computes with under a tensor axis of size `tensor` (heads and hidden widths divided)
        and an expert axis of size `expert` (each local expert receives the rows of
        `expert` devices): the planner traces it to list what a layer saves."""

    @abc.abstractmethod
    def attention_shape(self, config: Any) -> AttentionShape:
        """**Returns:** the model's `AttentionShape`."""

    def moe_shape(self, config: Any) -> MoEShape | None:
        """**Returns:** the model's routed experts, or `None` (the default) without MoE."""
        return None

    def active_params(self, config: Any) -> float:
        """Parameters one token's forward pass multiplies with: every weight but the token
        embedding, an MoE layer counting `top_k` of its routed experts."""
        model = eqx.filter_eval_shape(self.model, config, key=jax.random.key(0))
        total = sum(math.prod(x.shape) for x in jax.tree.leaves(model))
        total -= math.prod(model.embed.shape)
        moe = self.moe_shape(config)
        if moe is not None:
            routed = moe.layers * moe.experts * 3 * config.dim * moe.hidden_dim
            total -= routed * (1 - moe.top_k / moe.experts)
        return float(total)

    def __repr__(self) -> str:
        return f"<model family {self.name!r}: {self.config.__name__}, {self.model.__name__}>"


_REGISTERED: dict[str, ModelFamily] = {}


# `family` is checked below, with an error that says how to make one.
def register_family(family: object) -> ModelFamily:
    """Make a family available by name at run time (for a family that is not installed as
    a package with an `eqx_longctx.models` entry point, e.g. one defined in a notebook).

    **Arguments:**

    - `family`: a `ModelFamily` instance.

    **Returns:** `family`, so that it can be used as `FAMILY = register_family(MyFamily())`.

    **Raises:** `TypeError` when `family` is not a `ModelFamily`; `ValueError` when another
    family already has its name.
    """
    if not isinstance(family, ModelFamily):
        raise TypeError(
            f"register_family takes a ModelFamily instance; got {type(family).__name__}. "
            "Subclass eqx_longctx.ModelFamily and pass an instance."
        )
    known = model_families()
    if family.name in known and known[family.name] is not family:
        raise ValueError(
            f"a model family named {family.name!r} is already registered ({known[family.name]!r}); "
            "give yours another `name`."
        )
    _REGISTERED[family.name] = family
    return family


def _entry_points() -> dict[str, Callable[[], Any]]:
    return {ep.name: ep.load for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def family_names() -> tuple[str, ...]:
    """**Returns:** the names of the installed and registered families (sorted, with
    `"llama"` first when present: the CLIs' default), without importing any of them."""
    names = set(_entry_points()) | set(_REGISTERED)
    return tuple(sorted(names, key=lambda n: (n != "llama", n)))


def model_families() -> dict[str, ModelFamily]:
    """**Returns:** every installed (entry point) and registered family, by name (each
    family's module is imported)."""
    return {name: model_family(name) for name in family_names()}


def model_family(name: str) -> ModelFamily:
    """Look a family up by name (`--model`).

    **Arguments:**

    - `name`: an installed family's entry-point name, or a registered family's `name`.

    **Returns:** its `ModelFamily`.

    **Raises:** `ValueError` for an unknown name (the message lists the known ones), or
    when the entry point does not give a `ModelFamily` of that name.
    """
    if name in _REGISTERED:
        return _REGISTERED[name]
    points = _entry_points()
    if name not in points:
        raise ValueError(
            f"unknown model family {name!r}; choose one of {family_names()} (--model), or "
            "install a package that registers it under the entry-point group "
            f"{ENTRY_POINT_GROUP!r} (or call eqx_longctx.register_family)."
        )
    family = points[name]()
    if not isinstance(family, ModelFamily) or family.name != name:
        raise ValueError(
            f"the {ENTRY_POINT_GROUP!r} entry point {name!r} must name a ModelFamily instance "
            f"whose name is {name!r}; got {family!r}."
        )
    _REGISTERED[name] = family
    return family


def family_for_model_type(model_type: str) -> ModelFamily:
    """The installed or registered family whose `model_types` include `model_type`.

    **Raises:** `ValueError` when no family reads it, listing the model types that are read.
    """
    families = model_families()
    for family in families.values():
        if model_type in family.model_types:
            return family
    known = sorted(t for f in families.values() for t in f.model_types)
    raise ValueError(
        f"no installed model family reads model_type {model_type!r}; the supported model "
        f"types are {known}. Install a family plugin that declares it in model_types."
    )


def from_hf(path: Any, *, spec: Any = None, **kwargs) -> Any:
    """Read a Hugging Face checkpoint directory into a model of whichever installed family
    reads its `config.json`'s `model_type` (each family declares its `model_types`).

    **Arguments:**

    - `path`: the checkpoint directory (`config.json` and safetensors weights).
    - `spec`: the sharding spec of the returned model, or `None` for one device.
    - `**kwargs`: passed on to the family's reader (`dtype`, config overrides).

    **Returns:** the model.

    **Raises:** `ValueError` when `path` has no readable `config.json`, when it names no
    `model_type`, or when no installed family reads that model type (the message lists the
    supported ones); as the family's `from_hf` otherwise.
    """
    return family_for_model_type(_model_type(path)).from_hf(path, spec=spec, **kwargs)


def to_hf(model: Any, path: Any, **kwargs) -> None:
    """Write a model of any installed family as a Hugging Face checkpoint directory (the
    family whose model class `model` is an instance of writes it).

    **Raises:** `TypeError` when no installed family builds models of `type(model)`; as
    the family's `to_hf` otherwise.
    """
    for family in model_families().values():
        if isinstance(model, family.model):
            family.to_hf(model, path, **kwargs)
            return
    raise TypeError(
        f"no installed model family builds {type(model).__name__} models; to_hf writes "
        f"models of the families {family_names()}."
    )


def _model_type(path: Any) -> str:
    import json
    from pathlib import Path

    file = Path(path) / "config.json"
    try:
        hf = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"from_hf needs a checkpoint directory with a readable config.json; reading "
            f"{file} failed: {e}"
        ) from None
    model_type = hf.get("model_type") if isinstance(hf, dict) else None
    if not isinstance(model_type, str):
        raise ValueError(
            f"{file} names no model_type (a string); it cannot say which family reads it."
        )
    return model_type
