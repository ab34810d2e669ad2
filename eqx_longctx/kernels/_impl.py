"""`PallasBlockImpl`: the block contract (`eqx_longctx/attention/_block.py`) on the Pallas
TPU kernels, so every strategy runs them without knowing it.

The query side is transposed once into the kernels' heads-major layout (`[batch, heads,
seq, dim]`) and padded, its id tiles built once (`tile_queries`); each K/V block is read
in place, `[batch, kv_seq, kv_heads * dim]`, when its head dims are multiples of 128 (else
transposed as it arrives), and dK/dV come back in the same layout. The backward's row
statistics (`lse`, `delta`) are laid out once as the kernels read them; the float32
query-gradient accumulator is heads-major and the dQ kernel adds into it in place.
"""

from typing import Any, NamedTuple

import equinox as eqx
import jax.numpy as jnp

from .._block_contract import AbstractBlockImpl, BlockOptions
from ._blocks import Config, default_block_sizes, make_config
from ._flash_pallas import QuerySide, forward_sides, kv_side, query_side
from ._flash_pallas_bwd import backward_sides
from ._operands import pad_axis, rows_to_kernel

KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
"""The input dtypes the kernels run (float16 is refused; `impl="auto"` keeps it on XLA)."""


def _swap(x):
    """`[b, s, h, ...]` <-> `[b, h, s, ...]`."""
    return jnp.swapaxes(x, 1, 2)


class _Queries(NamedTuple):
    """The query side, built once: heads-major padded queries with their id tiles
    (`QuerySide`) and the kernel configuration."""

    side: QuerySide
    cfg: Config

    @property
    def rows(self) -> tuple[int, ...]:
        b, h, _, _ = self.side.qh.shape
        return (b, h, self.side.seq)

    def split_q(self, x):
        """`dout` `[b, s, h, dv]` -> padded heads-major, as the dQ kernel reads it."""
        sqp = self.side.qh.shape[2]
        return pad_axis(_swap(x), sqp - x.shape[1], 2, 0)

    def split_rows(self, x):
        """`lse`, `delta` `[b, s, h]` -> the kernels' lane-dense `[b, h, 8, padded_s]`."""
        return rows_to_kernel(_swap(x), self.side.qh.shape[2])

    def merge_q(self, x):
        return _swap(x)

    def merge_rows(self, x):
        return _swap(x)

    def zeros_dq(self):
        return jnp.zeros(self.side.qh.shape, jnp.float32)

    def dq(self, acc):
        return _swap(acc[:, :, : self.side.seq])


class PallasBlockImpl(AbstractBlockImpl):
    """The Pallas TPU flash-attention kernels behind the block contract.

    **Arguments:**

    - `block_q`, `block_k`: kernel block lengths (multiples of 128).
    - `interpret`: `None` (the default) compiles for TPU and runs Pallas' interpreter on any
      other platform, chosen for the platform the program is lowered for, not the host;
      `False` always compiles for TPU; `True` runs Pallas' interpreter (any backend); a
      `pltpu.InterpretParams` runs TPU interpret mode (see `race_detecting_interpret`).
    - `max_live_blocks`: a bound on the non-empty partner blocks of any query or key block
      (`None`: none, or that of the sliding window or chunk when there is one,
      `window_live_blocks`); the kernels' sequential grid axes take that many steps, and a
      bound some block exceeds falls back to the whole grid at run time (see
      `pallas_flash_forward`).
    - `block_k_compute`: the key sub-block each grid step walks its key block in (`None`:
      the largest that fits the VMEM budget; see `pallas_flash_forward`).

    Pass it as `impl=` to `eqx_longctx.attention` or a `ShardingSpec`; `impl="pallas"`
    builds one with `for_platform`.

    **Raises:** (when a strategy runs it) `ValueError` for inputs other than float32 or
    bfloat16, and as `pallas_flash_forward` for block lengths and options.
    """

    block_q: int = eqx.field(static=True)
    block_k: int = eqx.field(static=True)
    interpret: Any = eqx.field(static=True, default=None)
    max_live_blocks: int | None = eqx.field(static=True, default=None)
    block_k_compute: int | None = eqx.field(static=True, default=None)

    @property
    def pure_forward(self) -> bool:
        """`False` in TPU interpret mode (`pltpu.InterpretParams`), whose race detector
        runs callbacks; see `AbstractBlockImpl.pure_forward`."""
        return isinstance(self.interpret, (bool, type(None)))

    @staticmethod
    def for_platform(platform: str, interpret: Any = None) -> "PallasBlockImpl":
        """Default blocks for the local TPU generation; interpret mode off TPU.

        **Arguments:**

        - `platform`: `"tpu"`, `"cpu"` or `"gpu"`, the platform it will run on.
        - `interpret`: as the field; `None` compiles the kernels for a TPU and interprets
          them on any other platform, chosen when the program is lowered (so a TPU program
          exported from a CPU host carries them).

        **Returns:** a `PallasBlockImpl` with `default_block_sizes()`.
        """
        block_q, block_k = default_block_sizes()
        return PallasBlockImpl(block_q, block_k, interpret)

    def tile_queries(self, q, positions, segment_ids, kv_like, options: BlockOptions):
        """The query side in the kernels' heads-major layout, with the kernel configuration.

        **Arguments:**

        - `q`: `[batch, seq, heads, head_dim]` queries; `positions`, `segment_ids` (or
          `None`): their `[batch, seq]` ids.
        - `kv_like`: a key block (its shape sizes the key blocks).
        - `options`: the mask, scale and score cap (`window`, `chunk`, `softcap` run in the
          kernels; key blocks outside every chunk of a query block are skipped).

        **Returns:** the tiled queries that [`attend`][] and [`attend_backward`][] take.

        **Raises:** `ValueError` when `q` is not float32 or bfloat16, `block_q` or `block_k`
        is not a positive multiple of 128, `options.window` or `options.chunk` is not a
        positive int or is set without `options.causal`, `options.softcap` is not a finite
        number > 0, or `max_live_blocks` is not a positive int.
        """
        if jnp.dtype(q.dtype) not in KERNEL_DTYPES:
            raise ValueError(
                f"impl='pallas' runs float32 or bfloat16 inputs; got {q.dtype}. Cast q, k, v "
                "with .astype(jnp.float32) (or bfloat16), or use impl='xla'."
            )
        cfg = make_config(
            q, kv_like, segment_ids, causal=options.causal, window=options.window,
            scale=options.scale, block_q=self.block_q, block_k=self.block_k,
            interpret=self.interpret, max_live_blocks=self.max_live_blocks,
            block_k_compute=self.block_k_compute, softcap=options.softcap, chunk=options.chunk,
        )  # fmt: skip
        return _Queries(query_side(cfg, _swap(q), positions, segment_ids), cfg)

    def attend(self, qt: _Queries, k, v, kv_positions, kv_segment_ids):
        """**Returns:** `(out, lse)` of the queries `qt` against this K/V block
        (`[batch, kv_seq, kv_heads, dim]`, read in place when the head dims are multiples
        of 128), heads-major; `lse` float32, `-inf` for rows that see no key of the
        block."""
        kvs = kv_side(qt.cfg, k, v, kv_positions, kv_segment_ids, heads_major=False)
        return forward_sides(qt.cfg, qt.side, kvs)

    def attend_heads_major(self, qt: _Queries, k, v, kv_positions, kv_segment_ids):
        """`attend` with K/V already in the kernels' heads-major layout (`[batch, kv_heads,
        kv_seq, dim]`, the KV cache's): no transpose."""
        kvs = kv_side(qt.cfg, k, v, kv_positions, kv_segment_ids, heads_major=True)
        return forward_sides(qt.cfg, qt.side, kvs)

    def attend_backward(
        self, qt: _Queries, k, v, kv_positions, kv_segment_ids, dout, lse, delta, dq
    ):
        """**Returns:** `(dq, dk, dv)`: the query-gradient accumulator `dq` plus this
        block's part (the dQ kernel adds into the accumulator's buffer), and this block's
        float32 dK, dV (`[batch, kv_seq, kv_heads, dim]`), given the row's global `lse` and
        `delta = rowsum(dout * out) - dlse` (as `qt.split_rows` lays them out)."""
        kvs = kv_side(qt.cfg, k, v, kv_positions, kv_segment_ids, heads_major=False)
        dq, dk, dv = backward_sides(qt.cfg, qt.side, kvs, dout, lse, delta, dq)
        return (dq, kvs.k.result(dk, kvs.seq, heads_major=False),
                kvs.v.result(dv, kvs.seq, heads_major=False))  # fmt: skip
