"""Collectives over several mesh axes, counted in the order the axes are named.

`lax.axis_index(axes)`, `lax.all_gather(x, axes)` and `lax.all_to_all(x, axes, ...)` number
the devices of a tuple of mesh axes in the tuple's order (the first named axis major), as
a `PartitionSpec` entry `(ulysses, context)` lays a sequence out. `lax.ppermute(x, axes,
perm)` numbers them in the *mesh's* axis order instead (measured on JAX 0.10: on a mesh
`("context", "ulysses")`, a shift by one over `("ulysses", "context")` moves data between
devices that are not neighbours in the sequence). `ppermute` here takes `perm` in the
tuple's order, like the other collectives, and translates it.
"""

from collections.abc import Sequence

import jax
import numpy as np
from jax import lax


def ppermute(x, axis: str | Sequence[str], perm: Sequence[tuple[int, int]]):
    """`lax.ppermute(x, axis, perm)` with the devices of a tuple `axis` numbered in the
    tuple's order (first axis major), as `lax.axis_index(axis)` numbers them; inside
    `shard_map`."""
    if isinstance(axis, str) or len(axis) == 1:
        return lax.ppermute(x, axis, perm)
    axes = tuple(axis)
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(mesh.axis_names)
    if not set(axes) <= set(names):
        return lax.ppermute(x, axes, perm)
    in_mesh_order = tuple(sorted(axes, key=names.index))
    if in_mesh_order == axes:
        return lax.ppermute(x, axes, perm)
    sizes = tuple(mesh.shape[a] for a in axes)
    mesh_sizes = tuple(mesh.shape[a] for a in in_mesh_order)
    where = [axes.index(a) for a in in_mesh_order]

    def to_mesh(i: int) -> int:
        coords = np.unravel_index(i, sizes)
        return int(np.ravel_multi_index([coords[w] for w in where], mesh_sizes))

    return lax.ppermute(x, in_mesh_order, [(to_mesh(s), to_mesh(d)) for s, d in perm])
