"""Hybrid layer orders: a model whose layers are of several kinds (linear attention and
softmax attention, say), in the order a checkpoint's `layer_types` gives.

Each maximal run of consecutive layers of one kind is one `LayerStack` (its weights
stacked, its body compiled once and scanned), so a 3:1 hybrid of 48 layers is 24 stacks of
two bodies. Every stack is uniform, which is what training, the KV cache (one
`StackLayout` per stack) and the planner already walk.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from eqx_longctx.nn import LayerStack

from . import _decoder


def runs(kinds: Sequence[str]) -> tuple[tuple[str, int, int], ...]:
    """**Returns:** `(kind, first layer, number of layers)` of each maximal run of equal
    consecutive entries of `kinds`, in order."""
    out: list[tuple[str, int, int]] = []
    for i, kind in enumerate(kinds):
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1], out[-1][2] + 1)
        else:
            out.append((kind, i, 1))
    return tuple(out)


def hybrid_stacks(
    kinds: Sequence[str],
    make: Mapping[str, Callable[[PRNGKeyArray], eqx.Module]],
    *,
    key: PRNGKeyArray,
    remat: str,
    spec,
) -> tuple[LayerStack, ...]:
    """One `LayerStack` per run of `kinds` (see `runs`), its layers built by `make[kind]`.

    The run starting at layer `i` is initialised from `jax.random.fold_in(key, i)`.

    **Raises:** `ValueError` for a kind `make` does not build, naming the kinds it does.
    """
    unknown = sorted(set(kinds) - set(make))
    if unknown:
        raise ValueError(
            f"layer kinds {unknown} have no builder; this model builds {sorted(make)}. "
            "Set each entry of layer_types to one of those."
        )
    return tuple(
        LayerStack(make[kind], n, key=jax.random.fold_in(key, first), remat=remat, spec=spec)
        for kind, first, n in runs(kinds)
    )


def kind_layers(
    c: Any,
    kinds: Sequence[str],
    make_block: Callable[..., eqx.Module],
    *,
    key: PRNGKeyArray,
    spec,
) -> tuple[jax.Array, jax.Array | None, tuple[LayerStack, ...]]:
    """What a hybrid decoder's `__init__` builds alike: `(embed, lm_head, layers)`.

    `key` is split into the embedding's, the layers' and the LM head's keys, in that
    order; the embedding and head come from `_decoder.embed_and_head` in
    `c.param_dtype`, and the layers from `hybrid_stacks(kinds, ...)`, each of kind `kind`
    built by `make_block(c, kind, key=k, spec=spec)`.
    """
    k_embed, k_layers, k_head = jax.random.split(key, 3)
    embed, lm_head = _decoder.embed_and_head(c, k_embed, k_head, jnp.dtype(c.param_dtype))
    make = {
        kind: (lambda k, kind=kind: make_block(c, kind, key=k, spec=spec)) for kind in set(kinds)
    }
    layers = hybrid_stacks(kinds, make, key=k_layers, remat=c.remat, spec=spec)
    return embed, lm_head, layers
