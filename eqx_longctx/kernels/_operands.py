"""The kernels' operands, laid out once: padded ids and their tiles per side, and K/V in the
layout the kernels read without a transpose.

- **Id tiles.** A side's positions and segment ids, padded to its block, as the kernels
  read them: lane-broadcast columns `[b, s, 128]` (blocks `(block, 128)`: the side whose
  tokens are rows of the score tile) and sublane-broadcast rows `[b, 8, s]` (blocks
  `(8, block)`: the side in lanes). `Side` holds both; a ring builds the query side once
  (`PallasBlockImpl.tile_queries`) and only the K/V side per hop.
- **K/V layout** (`KvOperand`): heads-major `[b, heads, s, dim]`, a `(block, dim)` block
  per head (any dim; the KV cache's layout), or flat: the model's own `[b, s, heads, dim]`
  viewed as `[b, s, heads * dim]` (a reshape, no copy), head `h`'s `(block, dim)` block at
  column block `h`, which Mosaic can tile only when `dim` is a multiple of 128 (or the
  only head's, MQA). A ring
  hop's K/V and its float32 dK/dV then need no transpose.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

NUM_LANES = 128
NUM_SUBLANES = 8


def pad_axis(x, pad: int, axis: int, value=None):
    """`x` padded by `pad` at the end of `axis`: repeating the edge (`value=None`) or with
    `value`."""
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    if value is None:
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


def lanes(x):
    """`[b, s]` -> `[b, s, 128]`: one value per row of a `[s, 128]` tile (a column)."""
    return jnp.broadcast_to(x[:, :, None], (*x.shape, NUM_LANES))


def sublanes(x):
    """`[b, s]` -> `[b, 8, s]`: one value per lane of an `[8, s]` tile (a row)."""
    return jnp.broadcast_to(x[:, None, :], (x.shape[0], NUM_SUBLANES, x.shape[1]))


class Side(NamedTuple):
    """One side's padded ids `[b, padded_s]` int32 (segments may be None) and their tiles:
    lane-broadcast columns `[b, padded_s, 128]` and sublane-broadcast rows
    `[b, 8, padded_s]`. Tiles a kernel does not read are dead code to XLA."""

    pos: jax.Array
    seg: jax.Array | None
    pos_lanes: jax.Array
    pos_rows: jax.Array
    seg_lanes: jax.Array | None
    seg_rows: jax.Array | None


def pad_side(positions, segment_ids, *, block: int, use_segments: bool, pad_segment: int):
    """Pad one side's ids to a multiple of `block`: positions repeat the last one (tight
    block ranges), segment ids of padding are `pad_segment` (matching nothing); zero
    segment ids are made up when only padding needs them. **Returns:** a `Side`."""
    pad = -positions.shape[1] % block
    pos = pad_axis(positions.astype(jnp.int32), pad, 1)
    if not use_segments:
        return Side(pos, None, lanes(pos), sublanes(pos), None, None)
    if segment_ids is None:
        segment_ids = jnp.zeros(positions.shape, jnp.int32)
    seg = pad_axis(segment_ids.astype(jnp.int32), pad, 1, pad_segment)
    return Side(pos, seg, lanes(pos), sublanes(pos), lanes(seg), sublanes(seg))


def flat_ok(dim: int, heads: int) -> bool:
    """Whether a `dim`-wide head can be read as a column block of `[b, s, heads * dim]`:
    TPU blocks span a multiple of 128 lanes or the whole minor dim (one head, MQA)."""
    return dim % NUM_LANES == 0 or heads == 1


class KvOperand(NamedTuple):
    """K or V (and the layout of its gradient): `x` `[b, heads, padded_s, dim]` (`flat`
    False) or `[b, padded_s, heads * dim]` (`flat` True)."""

    x: jax.Array
    flat: bool
    heads: int
    dim: int

    @property
    def seq(self) -> int:
        return self.x.shape[1] if self.flat else self.x.shape[2]

    def spec(self, block: int, index, dim: int | None = None):
        """A `(block, dim)` BlockSpec in this layout (`dim` default this operand's);
        `index(*grid)` gives `(batch, head, block index)`."""
        dim = self.dim if dim is None else dim
        if self.flat:
            return pl.BlockSpec((None, block, dim), lambda *g: _flat_index(*index(*g)))
        return pl.BlockSpec((None, None, block, dim), lambda *g: (*index(*g), 0))

    def out_shape(self, dim: int) -> tuple[int, ...]:
        """The shape of a kernel output in this layout with head dim `dim`."""
        b = self.x.shape[0]
        if self.flat:
            return (b, self.seq, self.heads * dim)
        return (b, self.heads, self.seq, dim)

    def result(self, y, seq: int, *, heads_major: bool):
        """A kernel output `y` in this layout -> `[b, seq, heads, dim]` (or heads-major),
        padding cut."""
        if self.flat:
            b, s, _ = y.shape
            y = y.reshape(b, s, self.heads, -1)[:, :seq]
            return jnp.swapaxes(y, 1, 2) if heads_major else y
        y = y[:, :, :seq]
        return y if heads_major else jnp.swapaxes(y, 1, 2)


def _flat_index(b, h, j):
    return b, j, h


def kv_operand(x, block: int, *, heads_major: bool) -> KvOperand:
    """K or V for the kernels: `[b, s, heads, dim]` (`[b, heads, s, dim]` when
    `heads_major`), zero-padded to a multiple of `block`; flat when the input is
    sequence-major and the dim allows (a reshape, no copy), else heads-major."""
    if heads_major:
        b, h, s, d = x.shape
        return KvOperand(pad_axis(x, -s % block, 2, 0), False, h, d)
    b, s, h, d = x.shape
    x = pad_axis(x, -s % block, 1, 0)
    if flat_ok(d, h):
        return KvOperand(x.reshape(b, x.shape[1], h * d), True, h, d)
    return KvOperand(jnp.swapaxes(x, 1, 2), False, h, d)


def rows_to_kernel(x, sq_padded: int):
    """Heads-major row statistics `[b, h, s]` -> the kernels' lane-dense
    `[b, h, 8, padded_s]` float32 (zero padding: padded rows see no key)."""
    x = pad_axis(x.astype(jnp.float32), sq_padded - x.shape[2], 2, 0.0)
    return jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], NUM_SUBLANES, x.shape[2]))


def _varying(*inputs) -> frozenset:
    return frozenset().union(
        *(jax.typeof(x).manual_axis_type.varying for x in inputs if x is not None)
    )


def vary_like(x, *inputs):
    """`x` typed as varying over every manual mesh axis any of `inputs` varies over (inside
    `jax.shard_map(..., check_vma=True)`), as an output aliased to it must be."""
    missing = _varying(*inputs) - _varying(x)
    if not missing:
        return x
    return lax.pcast(x, tuple(sorted(missing)), to="varying")


def out_struct(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
    """A kernel output's type. Inside `jax.shard_map(..., check_vma=True)` Pallas needs to
    be told over which manual mesh axes the output varies: those any input varies over."""
    varying = _varying(*inputs)
    if not varying:
        return jax.ShapeDtypeStruct(shape, dtype)
    mat = type(jax.typeof(inputs[0]).manual_axis_type)(varying=varying)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
