"""Tiling of the blockwise kernel: block lengths, head tiles, and the block-major layouts.

`_Blocks` pads and reshapes one (query, key) problem into blocks and head tiles, and back;
`QueryTiles` keeps the query side of a problem tiled across many K/V blocks (the ring's
hops). The arithmetic on the tiles is in `_local.py`.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._block_contract import BlockOptions
from .._types import Array

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512
# Heads are tiled so that one block of float32 scores stays within this many bytes (8 heads
# of a 512 x 512 block). Devices that share one cache hierarchy (fake CPU devices) get less:
# see `_tiling_policy.tiling`.
TILE_BYTES = 8 * 2**20
# Padded query rows and padded keys get segment ids that match nothing real.
_PAD_Q_SEGMENT = -2
_PAD_KV_SEGMENT = -1


class Tiling(NamedTuple):
    """Tile sizes of the blockwise kernel: the query and key block length, and the bytes one
    block of float32 scores may take (the heads of a block are tiled to fit)."""

    block: int = DEFAULT_BLOCK_Q
    tile_bytes: int = TILE_BYTES
    block_k: int | None = None  # key block length, if not `block`

    @property
    def kv_block(self) -> int:
        return self.block if self.block_k is None else self.block_k


DEFAULT_TILING = Tiling()


class _Config(NamedTuple):
    causal: bool
    scale: float
    use_segments: bool
    window: int | None = None  # keys with q_pos - kv_pos >= window are hidden (causal only)
    softcap: float | None = None  # scaled scores x -> softcap * tanh(x / softcap)
    chunk: int | None = None  # keys with kv_pos // chunk != q_pos // chunk are hidden

    @property
    def options(self):
        """The `BlockOptions` this configuration masks by (the skip rules' input)."""
        return BlockOptions(self.causal, self.window, self.scale, self.softcap, self.chunk)


class QueryTiles(NamedTuple):
    """The query side of blockwise attention, tiled once and attended to many K/V blocks in
    turn (the hops of a ring), so that queries, output and query gradient are not re-tiled
    for every K/V block: `XlaBlockImpl`'s `qt` (see the contract in `_block.py`).
    `XlaBlockImpl.attend` and `.attend_backward` work in block-major layouts; `split_q`,
    `split_rows`, `merge_q`, `merge_rows` and `dq` convert."""

    q: jax.ShapeDtypeStruct
    positions: Array
    segment_ids: Array | None
    causal: bool
    scale: float | None
    tiling: Tiling
    blocks: "_Blocks"
    qb: Array  # block-major queries
    window: int | None = None
    softcap: float | None = None
    chunk: int | None = None

    @staticmethod
    def make(
        q,
        positions,
        segment_ids,
        kv,
        *,
        causal,
        scale,
        tiling: Tiling,
        window=None,
        softcap=None,
        chunk=None,
    ) -> "QueryTiles":
        """`kv`: anything with the `.shape` of the K/V blocks to come."""
        q_like = jax.ShapeDtypeStruct(q.shape, q.dtype)
        blocks = _Blocks.make(  # the query side only: K/V positions are placeholders
            q_like, kv, positions, None, segment_ids, None, tiling.block, tiling.kv_block,
            tiling.tile_bytes,
        )  # fmt: skip
        return QueryTiles(
            q_like, positions, segment_ids, causal, scale, tiling, blocks, blocks.split_q(q),
            window, softcap, chunk,
        )  # fmt: skip

    def hop(self, k, kv_positions, kv_segment_ids) -> tuple["_Blocks", _Config]:
        t = self.tiling
        blocks = _Blocks.make(
            self.q, k, self.positions, kv_positions, self.segment_ids, kv_segment_ids, t.block,
            t.kv_block, t.tile_bytes,
        )  # fmt: skip
        config = blocks.config(self.causal, self.scale, self.q.shape[-1], self.window)
        return blocks, config._replace(softcap=self.softcap, chunk=self.chunk)

    @property
    def rows(self) -> tuple[int, ...]:
        """Shape of the block-major row statistics (the output without its last axis)."""
        return self.qb.shape[:-1]

    def split_q(self, x):
        return self.blocks.split_q(x)

    def split_rows(self, x):
        return self.blocks.split_rows(x)

    def merge_q(self, x):
        return self.blocks.merge_q(x)

    def merge_rows(self, x):
        return self.blocks.merge_rows(x)

    def zeros_dq(self):
        """The float32 query-gradient accumulator `attend_tiles_backward` adds to."""
        return _zeros_dq_transposed(self.qb)

    def dq(self, dq_t):
        """`[batch, seq, q_heads, head_dim]` float32 query gradient from the accumulator."""
        return self.merge_q(_dq_from_transposed(dq_t))


class _Blocks(NamedTuple):
    """Static tiling of one (query, key) problem and the padded block-major mask inputs.

    Block-major layouts: queries `[c, n, b, k, g, block, d]` and keys/values
    `[c', n, b, k, block, d]`, with `n` the block index, `k` the K/V heads and `g` the query
    heads per K/V head of one head tile, `c'` the K/V head tiles and `c = c' x` the query-head
    tiles per K/V head tile (a GQA group larger than a tile is split, sharing its K/V tile).
    """

    b: int
    sq: int
    sk: int
    hk: int
    g: int
    bq: int
    bk: int
    nq: int
    nk: int
    hk_tile: int  # K/V heads per head tile
    g_tile: int  # query heads per K/V head per head tile
    use_segments: bool
    # q_pos, kv_pos, q_seg, kv_seg in block-major layout [n, b, block]
    masks: tuple[Array, Array, Array | None, Array | None]

    @staticmethod
    def make(
        q, k, q_positions, kv_positions, q_segment_ids, kv_segment_ids, block_q, block_k, tile_bytes
    ):
        b, sq, hq, _ = q.shape
        sk, hk = k.shape[1], k.shape[2]
        bq, bk = min(block_q, sq), min(block_k, sk)
        nq, nk = -(-sq // bq), -(-sk // bk)
        pad_q, pad_k = nq * bq - sq, nk * bk - sk
        if q_positions is None:
            q_positions = jnp.broadcast_to(jnp.arange(sq, dtype=jnp.int32), (b, sq))
        if kv_positions is None:
            kv_positions = jnp.broadcast_to(jnp.arange(sk, dtype=jnp.int32), (b, sk))
        use_segments = q_segment_ids is not None or pad_k > 0
        if use_segments and q_segment_ids is None:
            q_segment_ids = jnp.zeros((b, sq), jnp.int32)
        if use_segments and kv_segment_ids is None:
            kv_segment_ids = jnp.zeros((b, sk), jnp.int32)

        def rows(x, pad, value, n, block):
            x = _pad_seq(x.astype(jnp.int32), pad, value)
            return x.reshape(b, n, block).transpose(1, 0, 2)

        masks = (
            rows(q_positions, pad_q, 0, nq, bq),
            rows(kv_positions, pad_k, 0, nk, bk),
            rows(q_segment_ids, pad_q, _PAD_Q_SEGMENT, nq, bq) if use_segments else None,
            rows(kv_segment_ids, pad_k, _PAD_KV_SEGMENT, nk, bk) if use_segments else None,
        )
        g = hq // hk
        hk_tile, g_tile = head_tile(b, hk, g, bq, bk, tile_bytes)
        return _Blocks(b, sq, sk, hk, g, bq, bk, nq, nk, hk_tile, g_tile, use_segments, masks)

    def config(
        self, causal: bool, scale: float | None, head_dim: int, window: int | None = None
    ) -> "_Config":
        scale = 1.0 / float(np.sqrt(head_dim)) if scale is None else float(scale)
        window = None if window is None else int(window)
        return _Config(bool(causal), scale, self.use_segments, window)

    def split_q(self, x):
        """`[b, s, h, d]` -> `[c, n, b, k, g, block, d]`: a GQA group shares one K/V head."""
        x = _pad_seq(x, self.nq * self.bq - self.sq, 0)
        kt, gt = self.hk // self.hk_tile, self.g // self.g_tile
        x = x.reshape(self.b, self.nq, self.bq, kt, self.hk_tile, gt, self.g_tile, x.shape[-1])
        x = x.transpose(3, 5, 1, 0, 4, 6, 2, 7)
        return x.reshape(kt * gt, *x.shape[2:])

    def split_kv(self, x):
        """`[b, s, k, d]` -> `[c', n, b, k, block, d]`."""
        x = _pad_seq(x, self.nk * self.bk - self.sk, 0)
        kt = self.hk // self.hk_tile
        x = x.reshape(self.b, self.nk, self.bk, kt, self.hk_tile, x.shape[-1])
        return x.transpose(3, 1, 0, 4, 2, 5)

    def kv_padded(self, x):
        """`[b, s, k, d]` padded to whole key blocks, in its own layout (a copy only where
        the keys are padded): the forward reads its blocks and head tiles from it."""
        return _pad_seq(x, self.nk * self.bk - self.sk, 0)

    def all_finite(self, x):
        """`[b, s, k, d]` -> `[n]`: whether every value of a key block is finite, read in
        `x`'s own layout (no block-major copy)."""
        x = _pad_seq(x, self.nk * self.bk - self.sk, 0)
        x = x.reshape(self.b, self.nk, self.bk * x.shape[2] * x.shape[3])
        return jnp.all(jnp.isfinite(x), axis=(0, 2))

    def split_rows(self, x):
        """`[b, s, h]` row statistics -> `[c, n, b, k, g, block]`."""
        return self.split_q(x[..., None])[..., 0]

    def merge_q(self, x):
        kt, gt = self.hk // self.hk_tile, self.g // self.g_tile
        x = x.reshape(kt, gt, *x.shape[1:]).transpose(3, 2, 6, 0, 4, 1, 5, 7)
        return x.reshape(self.b, self.nq * self.bq, self.hk * self.g, x.shape[-1])[:, : self.sq]

    def merge_kv(self, x):
        x = x.transpose(2, 1, 4, 0, 3, 5)
        return x.reshape(self.b, self.nk * self.bk, self.hk, x.shape[-1])[:, : self.sk]

    def merge_rows(self, x):
        return self.merge_q(x[..., None])[..., 0]


def head_tile(b: int, hk: int, g: int, bq: int, bk: int, tile_bytes: int) -> tuple[int, int]:
    """(K/V heads, query heads per K/V head) of one head tile: as many heads as keep a block
    of float32 scores (`b x heads x bq x bk`) within `tile_bytes`, at least one."""
    fit = max(1, tile_bytes // (b * bq * bk * 4))
    if fit >= g:
        return max(t for t in range(1, hk + 1) if hk % t == 0 and t * g <= fit), g
    return 1, max(t for t in range(1, g + 1) if g % t == 0 and t <= fit)


def _map_head_tiles(fn, qb, kv_tiles: int):
    """`fn(q_tile, kv_tile)` over the head tiles of block-major queries `qb`, with the index
    of the K/V head tile each reads (of `kv_tiles`), outputs stacked."""
    per_kv = qb.shape[0] // kv_tiles
    if qb.shape[0] == 1:
        return jax.tree.map(lambda x: x[None], fn(qb[0], 0))

    def one(args):
        c, qc = args
        return fn(qc, c // per_kv)

    return lax.map(one, (jnp.arange(qb.shape[0]), qb))


def _pad_seq(x, pad: int, value):
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _zeros_dq_transposed(qb):
    """Float32 zeros for the transposed query gradient of block-major queries `qb`."""
    c, n, b, hk, g, bq, d = qb.shape
    return jnp.zeros((c, n, b, hk, d, g, bq), jnp.float32)


def _dq_from_transposed(dq_t):
    return dq_t.transpose(0, 1, 2, 3, 5, 6, 4)
