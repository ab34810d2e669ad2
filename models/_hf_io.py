"""A family's `from_hf`, `config_from_hf` and `to_hf`, written once.

A family describes its Hugging Face checkpoint with an `HFFormat`: its config reader and
writer (`models/_llama_hf.py`, ...) and its tensor tables. `HFFormat` reads `config.json`
(`models/_hf_config.py`), builds the model's shapes, and reads or writes the safetensors
(`models/_hf.py`), splitting and joining fused tensors (`models/_hf_fused.py`) where the
family has them. Each family module keeps its public functions (their signatures and
docstrings are its API) and hands them to its `HFFormat`.
"""

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, Protocol, cast, final, runtime_checkable

import equinox as eqx
import jax

from eqx_longctx.family import check_instance

from . import _hf, _hf_config
from ._hf import HFTensor
from ._hf_fused import (
    Fused,
    FusedCheckpoint,
    check_parts,
    fuse_params,
    fuse_table,
    leaf_shapes,
    split_table,
)


class HFTables(NamedTuple):
    """How a family's model maps onto a Hugging Face checkpoint.

    - `table`: `{zoo parameter path: HFTensor}` (as for `_hf.load_params`), but for the
      parts of `fused` tensors.
    - `fused`: the tensors that hold several zoo parameters (`models/_hf_fused.py`).
    - `ignore`: regular expressions of checkpoint tensors that reading skips.
    """

    table: Mapping[str, HFTensor]
    fused: Sequence[Fused] = ()
    ignore: Iterable[str] = ()


SWIGLU = (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))
"""`(zoo name, Hugging Face name)` of a SwiGLU's three projections."""


def decoder_ends(c: Any, base: str = "model.") -> dict[str, HFTensor]:
    """The table entries of what every zoo decoder has outside its layers: the embedding,
    the final norm and, unless the config `c` ties it, the LM head; the model's tensors
    are under `base`."""
    table = {
        "embed": HFTensor(base + "embed_tokens.weight"),
        "norm.weight": HFTensor(base + "norm.weight"),
    }
    if not c.tie_embeddings:
        table["lm_head"] = HFTensor("lm_head.weight", "linear")
    return table


def block_tensors(
    table: dict[str, HFTensor], stack: str, offsets: tuple = (), base: str = "model."
) -> Callable[..., None]:
    """Put the two norms of every zoo `DecoderBlock` of a layer stack in `table`, and
    return `add(ours, theirs, kind="same", n_in=1, stored_shape=None)`, which puts the
    others there: zoo path `stack + ours` -> the Hugging Face tensor
    `{base}layers.{layer}.{theirs}` (`HFTensor`'s arguments; layer `i` of the stack is named
    `i + offsets`)."""

    def add(
        ours: str,
        theirs: str,
        kind: Literal["same", "flat", "linear"] = "same",
        n_in: int = 1,
        stored_shape: tuple[int, ...] | None = None,
    ) -> None:
        name = f"{base}layers.{{layer}}.{theirs}"
        table[stack + ours] = HFTensor(name, kind, n_in, offsets, stored_shape)

    add("attn_norm.weight", "input_layernorm.weight")
    add("mlp_norm.weight", "post_attention_layernorm.weight")
    return add


@runtime_checkable
class FormatModule(Protocol):
    """What a family's format module (`models/_llama_hf.py`, ...) provides."""

    def config_from_hf(self, hf: dict, file: str, /) -> tuple[dict, dict[str, Any]]:
        """`(config.json, its file) -> (checked config.json, config fields)`: the family
        reader (its errors name the file)."""
        ...

    def config_to_hf(self, c: Any, /) -> dict:
        """config -> the `config.json` contents `to_hf` writes."""
        ...

    def tables(self, c: Any, hf: dict, path: str | None, /) -> HFTables:
        """The tables of the config `c` for a checkpoint with the checked `config.json`
        `hf` in the directory `path`; when writing, `hf` is `config_to_hf`'s and `path`
        `None`."""
        ...


@final
@dataclasses.dataclass(frozen=True)
class HFFormat:
    """A family's Hugging Face checkpoint format, and the functions its `from_hf`,
    `config_from_hf` and `to_hf` hand their arguments to.

    **Arguments:**

    - `model_cls`, `config_cls`: the family's model and config classes; the model's
      module (e.g. `"models.llama"`) names the family in the messages.
    - `fmt`: the family's format module.
    - `build`: the end of `to_hf`'s error for a model of another class (how to build one).
    """

    model_cls: type
    config_cls: type
    fmt: FormatModule
    build: str

    @property
    def family(self) -> str:
        return self.model_cls.__module__

    def read_config(self, path: Any, spec: Any, dtype: Any, overrides: Mapping[str, Any]):
        """`_hf_config.read_model_config` with this family's reader: `(checkpoint directory,
        checked config.json, config)`."""

        def parse(hf: dict, file: str) -> tuple[dict, Any]:
            hf, fields = self.fmt.config_from_hf(hf, file)
            return hf, self.config_cls(**fields)

        return _hf_config.read_model_config(
            path, self.family, parse, model_cls=self.model_cls, config_cls=self.config_cls,
            spec=spec, dtype=dtype, overrides=overrides,
        )  # fmt: skip

    def config_from_hf(self, path: Any, dtype: Any, overrides: Mapping[str, Any]) -> Any:
        """The family's `config_from_hf`: the config `from_hf` would build."""
        return self.read_config(path, None, dtype, overrides)[2]

    def from_hf(self, path: Any, spec: Any, dtype: Any, overrides: Mapping[str, Any]) -> Any:
        """The family's `from_hf`: the config, then the shapes of `model_cls(config,
        spec=spec)` (nothing allocated), filled by `_hf.load_params` from the safetensors,
        each parameter (or part of a fused tensor) straight into its shards under `spec`.
        With tied embeddings the checkpoint may also store `lm_head.weight`, if it equals
        the embedding."""
        path, hf, config = self.read_config(path, spec, dtype, overrides)
        table, fused, ignore = self.fmt.tables(config, hf, path)
        abstract = eqx.filter_eval_shape(self.model_cls, config, key=jax.random.key(0), spec=spec)
        shapes = leaf_shapes(abstract)
        check_parts(fused, shapes)
        tied = {"lm_head.weight": table["embed"].name} if config.tie_embeddings else None
        with _hf.SafetensorsCheckpoint(path) as checkpoint:
            return _hf.load_params(
                abstract, split_table(table, fused),
                FusedCheckpoint(checkpoint, fused, shapes) if fused else checkpoint,
                dtype=config.param_dtype, sharding=_hf.shardings_by_path(abstract, spec),
                ignore=ignore, tied=tied,
            )  # fmt: skip

    def to_hf(self, model: object, path: object, max_shard_size: int | None) -> None:
        """The family's `to_hf`: check `model`, then write `config_to_hf` of its config and
        its arrays (fused tensors joined), after `_hf.check_concrete`."""
        check_instance(model, f"{self.family}.to_hf's model", self.model_cls, self.build)
        config = cast(Any, model).config
        hf_config = self.fmt.config_to_hf(config)
        table, fused, _ = self.fmt.tables(config, hf_config, None)
        _hf.check_concrete(model, f"{self.family}.to_hf")
        params = eqx.filter(model, eqx.is_array)
        if fused:
            leaves = jax.tree_util.tree_flatten_with_path(params)[0]
            arrays = {jax.tree_util.keystr(p, simple=True, separator="."): x for p, x in leaves}
            check_parts(fused, leaf_shapes(arrays))
            params, table = fuse_params(arrays, fused), fuse_table(table, fused)
        _hf.save_params(params, table, path, hf_config, max_shard_size=max_shard_size)
