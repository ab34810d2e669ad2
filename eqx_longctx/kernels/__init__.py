"""Pallas TPU and GPU kernels, each beside an XLA twin with the same contract.

Flash attention (FlashAttention-2, arXiv:2307.08691) with masks computed in the kernel from
per-token positions, segment ids and a sliding window; the XLA twin is `XlaBlockImpl` in
`eqx_longctx/attention/_local.py`.

- `PallasBlockImpl`: the kernels behind the block contract (`impl="pallas"`), what every
  strategy runs; differentiable through the contract's one custom VJP. One call on one
  device: `eqx_longctx.flash_attention(..., impl=PallasBlockImpl(block_q, block_k))`.
- `pallas_flash_forward`, `pallas_flash_backward`: the two halves, for strategies that
  schedule them (ring attention passes the global `lse`, `delta` to each hop's backward).
- `*_heads_major`: the same on `[batch, heads, seq, dim]` arrays, the kernels' own layout.
- `PallasGpuBlockImpl`: the same contract on Pallas GPU kernels (Triton), what
  `impl="auto"` runs on a GPU (`impl="pallas_gpu"`); `GPU_KERNEL_DTYPES` the dtypes they
  run; `next_power_of_two` how they round blocks and head dims.
- `vmem_capacity`, `vmem_budget`, `vmem_estimate`: the VMEM each TPU generation has, what
  each kernel asks Mosaic for, and what a kernel needs per grid step at given blocks.

The gated delta rule's chunk work (the UT transform, the decayed scores; Gated DeltaNet and
Kimi Delta Attention), whose XLA twin is `intra_chunk_reference` here and whose whole XLA
path is `eqx_longctx/linear/_chunked.py`:

- `PallasGatedDeltaImpl`: what `eqx_longctx.gated_delta_rule(..., impl="pallas")` runs.
- `pallas_chunk_gated_delta`: the rule over a sequence with the forward and backward
  kernels (the state scan in XLA); `gated_delta_vmem` their VMEM per grid step.
"""

from ._blocks import DEFAULT_BLOCK_SIZES as DEFAULT_BLOCK_SIZES
from ._blocks import SMEM_BYTES as SMEM_BYTES
from ._blocks import default_block_sizes as default_block_sizes
from ._blocks import race_detecting_interpret as race_detecting_interpret
from ._flash_gpu import next_power_of_two as next_power_of_two
from ._flash_pallas import pallas_flash_forward as pallas_flash_forward
from ._flash_pallas import (
    pallas_flash_forward_heads_major as pallas_flash_forward_heads_major,
)
from ._flash_pallas_bwd import pallas_flash_backward as pallas_flash_backward
from ._flash_pallas_bwd import (
    pallas_flash_backward_heads_major as pallas_flash_backward_heads_major,
)
from ._gated_delta import PallasGatedDeltaImpl as PallasGatedDeltaImpl
from ._gated_delta import pallas_chunk_gated_delta as pallas_chunk_gated_delta
from ._gated_delta_pallas import gated_delta_vmem as gated_delta_vmem
from ._gated_delta_twin import intra_chunk_reference as intra_chunk_reference
from ._gpu_impl import GPU_KERNEL_DTYPES as GPU_KERNEL_DTYPES
from ._gpu_impl import PallasGpuBlockImpl as PallasGpuBlockImpl
from ._impl import KERNEL_DTYPES as KERNEL_DTYPES
from ._impl import PallasBlockImpl as PallasBlockImpl
from ._vmem import VMEM_CAPACITY as VMEM_CAPACITY
from ._vmem import VmemEstimate as VmemEstimate
from ._vmem import vmem_budget as vmem_budget
from ._vmem import vmem_capacity as vmem_capacity
from ._vmem import vmem_estimate as vmem_estimate
