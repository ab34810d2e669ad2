"""Arrays that travel together take one collective per dtype.

A collective is a rendezvous of every device of its axis. When K, V, their token positions
and segment ids each take their own (an all-gather per array, a `ppermute` per array and
ring hop), a small step pays for the rendezvous more than for the bytes: on 8 fake CPU
devices sharing two cores every one of them waits for the slowest device. `together`
concatenates the arrays of one dtype along their trailing axes, runs the collective once,
and slices them back; 4-byte integer ids ride in float32 lanes (a bitcast, which moves bits
and never rounds them), so float32 K/V and their ids travel as one array.

The ring's hops use it: three collective-permutes per hop became one, and the main job
(`python -m eqx_longctx.train`, ring, 8x256, data=2 x context=4) went from 784 to 743 ms a
step (medians of six alternated runs of 40 steps; faster in each pair). The all-gather
strategy does not: its one gather per layer of K, V and positions, packed, changed nothing
measurable (676-706 ms against 688-725 ms), and the packed copy is the whole gathered K/V.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def together(tree, collective: Callable[[jax.Array], jax.Array]):
    """`jax.tree.map(collective, tree)` with one call of `collective` per dtype.

    **Arguments:**

    - `tree`: arrays `[batch, seq, ...]` sharing their two leading axes (`None` leaves stay
      `None`); any other tree is mapped leaf by leaf.
    - `collective`: a function of one array that moves data along the two leading axes only
      (an all-gather over the sequence axis, a `ppermute`), never touching the trailing
      ones, and whose transpose is such a function too (autodiff sends each group's
      gradient back in one collective).

    Integer leaves of 4 bytes join the float32 group when there is one (they get no
    gradient). A 2-byte float group travels without them: XLA may widen it on the way,
    which would not keep an integer's bits.
    """
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves or len({x.shape[:2] for x in leaves}) != 1 or leaves[0].ndim < 2:
        return jax.tree.map(collective, tree)
    has_f32 = any(x.dtype == jnp.float32 for x in leaves)

    def lane(x):
        if jnp.issubdtype(x.dtype, jnp.integer) and np.dtype(x.dtype).itemsize == 4:
            return jnp.dtype(jnp.float32 if has_f32 else jnp.int32)
        return x.dtype

    out: list = [None] * len(leaves)
    for dtype in dict.fromkeys(lane(x) for x in leaves):
        group = [i for i, x in enumerate(leaves) if lane(x) == dtype]
        parts = []
        for i in group:
            x = leaves[i]
            if x.dtype != dtype:
                x = lax.stop_gradient(lax.bitcast_convert_type(x, dtype))
            parts.append(x.reshape(x.shape[:2] + (-1,)))
        whole = collective(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1))
        start = 0
        for i, part in zip(group, parts, strict=True):
            x, width = leaves[i], part.shape[-1]
            piece = whole[..., start : start + width]
            start += width
            if x.dtype != dtype:
                piece = lax.bitcast_convert_type(piece, x.dtype)
            out[i] = piece.reshape(whole.shape[:2] + x.shape[2:])
    return jax.tree.unflatten(treedef, out)
