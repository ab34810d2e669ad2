"""Hugging Face tensors that hold several zoo parameters side by side (a fused projection
such as Qwen3-Next's `in_proj_qkvz`, or a query and its gate in one `q_proj`).

`models/_hf.py` maps one zoo parameter to one Hugging Face tensor (per stacking index). A
`Fused` tensor is read through `FusedCheckpoint`, which shows `load_params` each part as a
tensor of its own (`"<name>#<part>"`, already in the zoo layout), cut from the real one on
the host; writing concatenates the parts (`fuse_params`) into one array that an ordinary
`HFTensor` maps, so `save_params` writes it. Both directions are exact.
"""

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._hf import HFTensor, SafetensorsCheckpoint


@dataclasses.dataclass(frozen=True)
class Fused:
    """Several zoo parameters stored as one Hugging Face tensor.

    **Arguments:**

    - `tensor`: the Hugging Face tensor, its layout given against the *fused* zoo array:
      the parts concatenated along `axis` of their per-index shapes.
    - `parts`: `(zoo parameter path, per-index shape of its slice)`, in order; the slice
      is the parameter reshaped (e.g. `[embed, heads, d]` as `[embed, key_heads, r * d]`).
    - `axis`: the per-index axis the parts are concatenated along.
    """

    tensor: HFTensor
    parts: tuple[tuple[str, tuple[int, ...]], ...]
    axis: int

    def fused_shape(self) -> tuple[int, ...]:
        """The per-index shape of the fused zoo array."""
        shape = list(self.parts[0][1])
        shape[self.axis] = sum(s[self.axis] for _, s in self.parts)
        return tuple(shape)

    def part_tensor(self, i: int) -> HFTensor:
        """The table entry of part `i`: a tensor of its own, in the zoo layout."""
        return HFTensor(f"{self.tensor.name}#{i}", "same", offsets=self.tensor.offsets)


def split_table(table: Mapping[str, HFTensor], fused: Sequence[Fused]) -> dict[str, HFTensor]:
    """`table` with an entry per part of every fused tensor (for reading)."""
    out = dict(table)
    for f in fused:
        for i, (path, _) in enumerate(f.parts):
            out[path] = f.part_tensor(i)
    return out


def fuse_table(table: Mapping[str, HFTensor], fused: Sequence[Fused]) -> dict[str, HFTensor]:
    """`table` with one entry per fused tensor (`"fused.<n>"`) instead of its parts (for
    writing the arrays of `fuse_params`)."""
    parts = {p for f in fused for p, _ in f.parts}
    out = {k: v for k, v in table.items() if k not in parts}
    out.update({f"fused.{n}": f.tensor for n, f in enumerate(fused)})
    return out


def fuse_params(params: Mapping[str, Any], fused: Sequence[Fused]) -> dict[str, Any]:
    """`{path: array}` of a model's parameters with each fused tensor's parts concatenated
    into `"fused.<n>"` (stacking axes kept in front), the parts removed."""
    out = dict(params)
    for n, f in enumerate(fused):
        stack = len(f.tensor.fields)
        arrays = []
        for path, shape in f.parts:
            leaf = out.pop(path)
            arrays.append(jnp.reshape(leaf, (*leaf.shape[:stack], *shape)))
        out[f"fused.{n}"] = jnp.concatenate(arrays, axis=stack + f.axis)
    return out


class FusedCheckpoint:
    """A `SafetensorsCheckpoint` whose fused tensors appear as their parts (what
    `load_params` reads with a `split_table`), cut on the host from one read of the real
    tensor (the last one read is kept for its other parts).

    **Arguments:**

    - `checkpoint`: the open checkpoint.
    - `fused`: the fused tensors.
    - `shapes`: zoo parameter path -> its full shape (stacking axes included).
    """

    def __init__(
        self,
        checkpoint: SafetensorsCheckpoint,
        fused: Iterable[Fused],
        shapes: Mapping[str, tuple[int, ...]],
    ):
        self._inner = checkpoint
        self.source, self.path = checkpoint.source, checkpoint.path
        # virtual name -> (real name, fused tensor, part number, per-index zoo shape)
        self._parts: dict[str, tuple[str, Fused, int, tuple[int, ...]]] = {}
        for f in fused:
            for i, (path, _) in enumerate(f.parts):
                part, real, shape = f.part_tensor(i), f.tensor, shapes[path]
                zoo = shape[len(real.fields) :]
                for (_, virtual), (_, name) in zip(
                    part.names(shape), real.names(shape), strict=True
                ):
                    self._parts[virtual] = (name, f, i, zoo)
        self._reals = {p[0] for p in self._parts.values()}
        self._cache: tuple[str, np.ndarray] | None = None

    @property
    def names(self) -> set[str]:
        names = self._inner.names
        virtual = {v for v, p in self._parts.items() if p[0] in names}
        return (names - self._reals) | virtual

    def file(self, name: str) -> str:
        return self._inner.file(self._parts[name][0] if name in self._parts else name)

    def dtype(self, name: str) -> str:
        return self._inner.dtype(self._parts[name][0] if name in self._parts else name)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._parts:
            return self._inner.shape(name)
        real, f, _, zoo = self._parts[name]
        found, expected = self._inner.shape(real), f.tensor.hf_shape(f.fused_shape())
        if found != expected:
            raise ValueError(
                f"checkpoint {self.path!r} has tensor(s) of the wrong shape for its "
                f"config.json: {real}: expected {expected}, found {found} in "
                f"{os.path.basename(self._inner.file(real))}. Check config.json (sizes, "
                "heads, head_dim) against the weights."
            )
        return zoo

    def read(self, name: str) -> np.ndarray:
        if name not in self._parts:
            return self._inner.read(name)
        real, f, i, zoo = self._parts[name]
        if self._cache is None or self._cache[0] != real:
            self._cache = (real, self._inner.read(real))
        fused = f.tensor.to_zoo(self._cache[1], f.fused_shape())
        starts = np.cumsum([0] + [s[f.axis] for _, s in f.parts])
        index = [slice(None)] * fused.ndim
        index[f.axis] = slice(int(starts[i]), int(starts[i + 1]))
        return np.ascontiguousarray(fused[tuple(index)].reshape(zoo))


def leaf_shapes(abstract) -> dict[str, tuple[int, ...]]:
    """`{path: shape}` of a model's array leaves, paths as `models/_hf.py` writes them."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    return {
        jax.tree_util.keystr(p, simple=True, separator="."): tuple(x.shape)
        for p, x in leaves
        if hasattr(x, "shape")
    }


def check_parts(fused: Sequence[Fused], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Assert that every part's slice holds exactly its parameter (a table bug otherwise)."""
    for f in fused:
        stack = len(f.tensor.fields)
        for path, shape in f.parts:
            assert math.prod(shapes[path][stack:]) == math.prod(shape), (path, shape)
