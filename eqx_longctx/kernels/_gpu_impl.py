"""`PallasGpuBlockImpl`: the block contract (`eqx_longctx/attention/_block.py`) on the
Pallas GPU kernels of `_flash_gpu.py`, so every strategy and decoding run them unchanged.

The native layout is the contract's own (`[batch, seq, heads, dim]`): no transposes. The
query side is padded once (`tile_queries`) to whole query blocks and a power-of-two head
dim; each K/V block is padded as it arrives when its length or head dims need it, and
every result is cut back, so `attend` returns exactly the rows and value dim it was given.
"""

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from .._block_contract import AbstractBlockImpl, BlockOptions
from ._flash_gpu import GpuConfig, backward, forward, next_power_of_two
from ._operands import pad_axis

GPU_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
"""The input dtypes the GPU kernels run (products accumulate in float32)."""


def pad_to(x, axis: int, size: int, edge: bool = False):
    """`x` padded at the end of `axis` to `size`: zeros, or the edge value for ids (which
    keeps a block's position range as tight as its real rows)."""
    return pad_axis(x, size - x.shape[axis], axis, None if edge else 0)


class _GpuQueries(NamedTuple):
    """The padded query side with its ids and the call's configuration."""

    q: jax.Array  # [b, sq_pad, h, d_pad]
    positions: jax.Array  # [b, sq_pad]
    segment_ids: jax.Array | None
    cfg: GpuConfig
    head_dim: int

    @property
    def seq(self) -> int:
        return self.cfg.seq_q

    @property
    def rows(self) -> tuple[int, ...]:
        b, _, h, _ = self.q.shape
        return (b, self.seq, h)

    def split_q(self, x):
        """`dout` `[b, s, h, dv]` -> padded to whole blocks and a power-of-two dim."""
        x = pad_to(x, 1, self.q.shape[1])
        return pad_to(x, 3, next_power_of_two(x.shape[3]))

    def split_rows(self, x):
        """`lse`, `delta` `[b, s, h]` -> padded to whole blocks (pad rows are masked)."""
        return pad_to(x, 1, self.q.shape[1])

    def merge_q(self, x):
        return x

    def merge_rows(self, x):
        return x

    def zeros_dq(self):
        return jnp.zeros(self.q.shape, jnp.float32)

    def dq(self, acc):
        return acc[:, : self.seq, :, : self.head_dim]


class PallasGpuBlockImpl(AbstractBlockImpl):
    """Flash attention in Pallas for NVIDIA (and ROCm) GPUs, through Triton, behind the
    block contract: what `impl="auto"` runs on a CUDA device, and `impl="pallas_gpu"`.

    Forward `(out, lse)` with a float32 natural-log `lse`; the backward takes the merged
    `lse` and `delta` (so ring hops merge exactly); positions and segment ids, `window`,
    `chunk` and `softcap` in the kernel (sinks join after the merge, as for every
    implementation); GQA and MQA read each K/V head once per group, never repeated; MLA's
    `dk != dv`; float32 (IEEE products), bfloat16 and float16 inputs with float32
    accumulation. Key blocks that no query of a query block sees are skipped.

    **Arguments:**

    - `block_q`, `block_k`: block lengths, powers of two >= 16 (cut to the sequence when it
      is shorter).
    - `interpret`: `None` compiles on a GPU and runs Pallas' interpreter on any other host
      (decided when the program is traced); `True` / `False` force it.
    - `num_warps`, `num_stages`: Triton's launch parameters.

    **Raises:** (when a strategy runs it) `ValueError` for another input dtype, or block
    lengths that are not powers of two >= 16.
    """

    block_q: int = eqx.field(static=True, default=64)
    block_k: int = eqx.field(static=True, default=64)
    interpret: bool | None = eqx.field(static=True, default=None)
    num_warps: int = eqx.field(static=True, default=4)
    num_stages: int = eqx.field(static=True, default=2)

    @staticmethod
    def for_platform(platform: str, interpret: bool | None = None) -> "PallasGpuBlockImpl":
        """Default blocks; compiled on `"gpu"`, interpreted elsewhere unless `interpret`."""
        return PallasGpuBlockImpl(interpret=platform != "gpu" if interpret is None else interpret)

    def _interpret(self) -> bool:
        if self.interpret is not None:
            return bool(self.interpret)
        return jax.devices()[0].platform != "gpu"

    def tile_queries(self, q, positions, segment_ids, kv_like, options: BlockOptions):
        """The padded query side and the call's configuration.

        **Raises:** `ValueError` for a dtype outside `GPU_KERNEL_DTYPES` or bad blocks.
        """
        if jnp.dtype(q.dtype) not in GPU_KERNEL_DTYPES:
            raise ValueError(
                f"impl='pallas_gpu' runs float32, bfloat16 or float16 inputs; got {q.dtype}. "
                "Cast q, k, v (e.g. .astype(jnp.float32)), or use impl='xla'."
            )
        for name, n in (("block_q", self.block_q), ("block_k", self.block_k)):
            if not isinstance(n, int) or n < 16 or n & (n - 1):
                raise ValueError(
                    f"PallasGpuBlockImpl: {name} must be a power of two >= 16 (Triton's "
                    f"tiles); got {name}={n!r}. Use 32, 64 or 128."
                )
        b, sq, h, d = q.shape
        kv_heads = kv_like.shape[2]
        block_q = min(self.block_q, next_power_of_two(sq))
        sqp = -(-sq // block_q) * block_q
        cfg = GpuConfig(
            causal=options.causal, window=options.window, chunk=options.chunk,
            softcap=options.softcap, scale=options.scale, block_q=block_q,
            block_k=self.block_k, seq_q=sq, seq_k=0, group=h // kv_heads, heads_major=False,
            interpret=self._interpret(), num_warps=self.num_warps,
            num_stages=self.num_stages, exact=jnp.dtype(q.dtype) == jnp.float32,
        )  # fmt: skip
        qp = pad_to(positions.astype(jnp.int32), 1, sqp, edge=True)
        qs = None
        if segment_ids is not None:
            qs = pad_to(segment_ids.astype(jnp.int32), 1, sqp, edge=True)
        qpad = pad_to(pad_to(q, 1, sqp), 3, next_power_of_two(d))
        return _GpuQueries(qpad, qp, qs, cfg, d)

    def _keys(self, qt: _GpuQueries, k, v, kv_positions, kv_segment_ids, heads_major: bool):
        """K/V and their ids padded to whole key blocks, and the call's configuration."""
        seq_axis = 2 if heads_major else 1
        sk = k.shape[seq_axis]
        block_k = min(qt.cfg.block_k, next_power_of_two(sk))
        skp = -(-sk // block_k) * block_k
        k, v = (x.astype(qt.q.dtype) for x in (k, v))
        k = pad_to(pad_to(k, seq_axis, skp), 3, qt.q.shape[3])
        v = pad_to(pad_to(v, seq_axis, skp), 3, next_power_of_two(v.shape[3]))
        kp = pad_to(kv_positions.astype(jnp.int32), 1, skp, edge=True)
        ks = None
        if kv_segment_ids is not None:
            ks = pad_to(kv_segment_ids.astype(jnp.int32), 1, skp, edge=True)
        cfg = qt.cfg._replace(block_k=block_k, seq_k=sk, heads_major=heads_major)
        return cfg, k, v, kp, ks

    def _attend(self, qt: _GpuQueries, k, v, kv_positions, kv_segment_ids, heads_major):
        dv = v.shape[3]
        cfg, k, v, kp, ks = self._keys(qt, k, v, kv_positions, kv_segment_ids, heads_major)
        qs = qt.segment_ids if ks is not None else None
        out, lse = forward(cfg, qt.q, k, v, qt.positions, kp, qs, ks)
        return out[:, : qt.seq, :, :dv], lse[:, : qt.seq]

    def attend(self, qt: _GpuQueries, k, v, kv_positions, kv_segment_ids):
        """**Returns:** `(out, lse)` of `qt` against this K/V block (`[batch, kv_seq,
        kv_heads, dim]`): `out` `[batch, seq, heads, v_dim]` in the queries' dtype, `lse`
        float32 `[batch, seq, heads]`, `-inf` for rows that see no key of the block."""
        return self._attend(qt, k, v, kv_positions, kv_segment_ids, heads_major=False)

    def attend_heads_major(self, qt: _GpuQueries, k, v, kv_positions, kv_segment_ids):
        """`attend` with K/V `[batch, kv_heads, kv_seq, dim]` (the KV cache's layout), read
        in place: how `generate` decodes on a GPU."""
        return self._attend(qt, k, v, kv_positions, kv_segment_ids, heads_major=True)

    def attend_backward(
        self, qt: _GpuQueries, k, v, kv_positions, kv_segment_ids, dout, lse, delta, dq
    ):
        """**Returns:** `(dq, dk, dv)`: the accumulator `dq` plus this block's part (added in
        place by the dQ kernel), and this block's float32 dK, dV (`[batch, kv_seq, kv_heads,
        dim]`), from the row's global `lse` and `delta` as `qt.split_rows` pads them."""
        sk, d, dv = k.shape[1], k.shape[3], v.shape[3]
        cfg, k, v, kp, ks = self._keys(qt, k, v, kv_positions, kv_segment_ids, False)
        qs = qt.segment_ids if ks is not None else None
        dq, dk, dv_ = backward(
            cfg, qt.q, k, v, qt.positions, kp, qs, ks, dout.astype(qt.q.dtype), lse, delta, dq
        )
        return dq, dk[:, :sk, :, :d], dv_[:, :sk, :, :dv]
