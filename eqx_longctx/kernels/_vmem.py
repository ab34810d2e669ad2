"""VMEM of the Pallas kernels: what each TPU generation has, what a kernel asks for, and
the key sub-block that keeps a kernel's score temporaries inside it.

A kernel's VMEM is, per grid step:

- **buffers**: every block the kernel reads or writes, twice (Pallas double-buffers its
  pipeline), at the array's dtype: q, k, v (and `dout`, dq/dk/dv in the backward), the
  position and segment-id tiles, the row statistics;
- **scratch**: the forward's running max, denominator (`[block_q, 128]` float32 each) and
  float32 accumulator `[block_q, v_head_dim]`;
- **temporaries**: the float32 `[block_q, block_k_compute]` tiles one key sub-block makes
  (scores, probabilities, `dp` and `ds` in the backward; the mask and the two broadcast id
  tiles when the pair is masked), the sub-block's K/V values, and the `[rows, dim]` float32
  products added into the accumulators.

The first two are exact counts of what the `pallas_call` declares (a test reads them back
from the traced kernel); the third is an estimate, since Mosaic decides what it keeps live.
The key sub-block (`block_k_compute`, splash attention's `block_kv_compute`) divides
`block_k`: each grid step walks its key block in sub-blocks, so the temporaries scale with
the sub-block and not with the whole key block.

**Budget.** Each kernel asks Mosaic for `vmem_limit_bytes = vmem_budget(kind)`, the
smaller of the TensorCore's VMEM and 32 MiB (XLA keeps the rest of a large VMEM), and the
automatic sub-block keeps the estimate within `VMEM_HEADROOM` (3/4) of it, for Mosaic's
own scratch and the estimate's error. The VMEM comes from `pltpu.get_tpu_info()` on a TPU
and from `VMEM_CAPACITY` otherwise; a host that is not a TPU (exporting a TPU program from
a CPU) sizes for the smallest generation in the table.
"""

from typing import NamedTuple

import jax
from jax.experimental.pallas import tpu as pltpu

MiB = 2**20
# VMEM per TensorCore by `device_kind` (the numbers JAX's own TPU info gives).
VMEM_CAPACITY = {
    "TPU v4": 16 * MiB,
    "TPU v4 lite": 16 * MiB,
    "TPU v5 lite": 128 * MiB,
    "TPU v5e": 128 * MiB,
    "TPU v5": 64 * MiB,
    "TPU v5p": 64 * MiB,
    "TPU v6 lite": 128 * MiB,
    "TPU v6e": 128 * MiB,
    "TPU7x": 64 * MiB,
}
"""VMEM bytes per TensorCore for each TPU `device_kind` (used when JAX cannot tell)."""
_MAX_LIMIT = 32 * MiB
VMEM_HEADROOM = 0.75
"""Fraction of the budget the automatic key sub-block fills at most."""
_LANES, _SUBLANES = 128, 8


def vmem_capacity(device_kind: str | None = None) -> int:
    """VMEM bytes of one TensorCore.

    **Arguments:**

    - `device_kind`: a TPU `device_kind`; `None` asks the local device: on a TPU, JAX's own
      chip info (`pltpu.get_tpu_info()`), on any other host the smallest entry of
      `VMEM_CAPACITY` (a TPU program lowered there must fit every generation).

    **Returns:** bytes.
    """
    if device_kind is None:
        device = jax.devices()[0]
        if device.platform != "tpu":
            return min(VMEM_CAPACITY.values())
        info = getattr(pltpu, "get_tpu_info", None)
        if info is not None:
            try:
                return int(info().vmem_capacity_bytes)
            except ValueError:  # a TPU kind this JAX does not know
                pass
        device_kind = str(device.device_kind)
    return VMEM_CAPACITY.get(device_kind, min(VMEM_CAPACITY.values()))


def vmem_budget(device_kind: str | None = None) -> int:
    """The scoped VMEM each kernel asks for (`vmem_limit_bytes`): the TensorCore's VMEM,
    at most 32 MiB. **Arguments:** `device_kind` as in `vmem_capacity`."""
    return min(vmem_capacity(device_kind), _MAX_LIMIT)


class VmemEstimate(NamedTuple):
    """Bytes of one grid step of one kernel (see the module docstring)."""

    buffers: int
    scratch: int
    temporaries: int

    @property
    def total(self) -> int:
        return self.buffers + self.scratch + self.temporaries


KERNELS = ("forward", "dq", "dkv")


def vmem_estimate(
    kernel: str, *, block_q: int, block_k: int, block_k_compute: int, head_dim: int,
    v_head_dim: int, itemsize: int, segments: bool, masked: bool, softcap: bool = False,
) -> VmemEstimate:  # fmt: skip
    """VMEM of one grid step of a kernel.

    **Arguments:**

    - `kernel`: `"forward"`, `"dq"` or `"dkv"`.
    - `block_q`, `block_k`, `block_k_compute`: the blocks and the key sub-block.
    - `head_dim`, `v_head_dim`: the q/k and v head dims.
    - `itemsize`: bytes per element of q, k, v (4 for float32, 2 for bfloat16).
    - `segments`: whether segment-id tiles are read (segment ids, or padding).
    - `masked`: whether some pair may need the per-token mask (causal, window, segments).
    - `softcap`: whether scores are soft-capped (`tanh(x / c)` kept for the backward).

    **Returns:** a `VmemEstimate`.

    **Raises:** `ValueError` for a `kernel` other than the three.
    """
    bq, bk, bc, it = block_q, block_k, block_k_compute, itemsize
    d, dv = _lanes(head_dim), _lanes(v_head_dim)  # VMEM tiles pad the minor dim to 128
    q_col, q_row = bq * _LANES * 4, _SUBLANES * bq * 4  # position tiles, int32
    k_col, k_row = bk * _LANES * 4, _SUBLANES * bk * 4
    if kernel == "forward":
        blocks = [bq * d * it, bk * d * it, bk * dv * it, q_col, k_row, bq * dv * it, q_row]
        ids = [q_col, k_row]
        scratch = 2 * bq * _LANES * 4 + bq * dv * 4
        tiles, out_rows = 2, [bq * dv * 4, bq * dv * 4]  # p @ v, alpha broadcast
    elif kernel == "dq":
        # ..., dq in (aliased to dq out), dq out
        blocks = [bq * d * it, bk * d * it, bk * dv * it, bq * dv * it, q_row, q_row, q_col,
                  k_row, bq * d * 4, bq * d * 4]  # fmt: skip
        ids = [q_col, k_row]
        scratch, tiles, out_rows = 0, 4, [bq * d * 4]
    elif kernel == "dkv":
        blocks = [bq * d * it, bk * d * it, bk * dv * it, bq * dv * it, q_row, q_row, k_col,
                  q_row, bk * d * 4, bk * dv * 4]  # fmt: skip
        ids = [k_col, q_row]
        scratch, tiles, out_rows = 0, 4, [bc * d * 4, bc * dv * 4]
    else:
        raise ValueError(f"kernel must be one of {KERNELS}; got {kernel!r}.")
    if segments:
        blocks += ids
    if masked:
        tiles += 2 + segments  # the mask and the broadcast position (and segment) tiles
    if softcap:
        tiles += 1  # tanh(x / c): the capped scores, and the backward's 1 - t^2
    if it != 4:
        tiles += 1  # the probabilities cast for the next product (half a tile, rounded up)
    temporaries = tiles * bq * bc * 4 + bc * (d + dv) * it + sum(out_rows)
    return VmemEstimate(2 * sum(blocks), scratch, temporaries)


def _lanes(n: int) -> int:
    return -(-n // _LANES) * _LANES


def key_sub_block(
    cfg, *, head_dim: int, v_head_dim: int, itemsize: int, budget: int | None = None
) -> int:  # fmt: skip
    """The key sub-block of a kernel call: `cfg.block_k_compute` when set, else the largest
    of `block_k, block_k / 2, ..., 128` (dividing `block_k`) whose largest kernel estimate
    is within `VMEM_HEADROOM` of the budget.

    **Arguments:** `cfg` a kernel `Config`; the dims and itemsize as in `vmem_estimate`;
    `budget` default `vmem_budget()`.

    **Raises:** `ValueError` naming the estimate, the budget and the fix when the chosen (or
    smallest) sub-block does not fit in the budget.
    """
    budget = vmem_budget() if budget is None else budget
    masked = cfg.causal or cfg.window is not None or cfg.use_segments

    def need(bc):
        return max(
            vmem_estimate(k, block_q=cfg.block_q, block_k=cfg.block_k, block_k_compute=bc,
                          head_dim=head_dim, v_head_dim=v_head_dim, itemsize=itemsize,
                          segments=cfg.use_segments, masked=masked,
                          softcap=cfg.softcap is not None).total
            for k in KERNELS
        )  # fmt: skip

    if cfg.block_k_compute is not None:
        chosen = cfg.block_k_compute
    else:
        options = [b for b in range(cfg.block_k, 0, -_LANES) if cfg.block_k % b == 0]
        fits = [b for b in options if need(b) <= VMEM_HEADROOM * budget]
        chosen = fits[0] if fits else options[-1]
    if need(chosen) > budget:
        raise ValueError(
            f"the Pallas kernels need about {need(chosen) / MiB:.1f} MiB of VMEM per grid "
            f"step at block_q={cfg.block_q}, block_k={cfg.block_k}, block_k_compute={chosen}, "
            f"head dims {head_dim}/{v_head_dim} ({itemsize}-byte inputs); the budget is "
            f"{budget / MiB:.0f} MiB (vmem_budget()). Use smaller blocks (block_q, block_k) "
            "or a smaller block_k_compute."
        )
    return chosen


def kernel_vmem(cfg, *, head_dim: int, v_head_dim: int, itemsize: int) -> tuple[int, int]:
    """`(key sub-block, vmem_limit_bytes)` of a kernel call on this host's target (see
    `key_sub_block` and `vmem_budget`)."""
    budget = vmem_budget()
    sub = key_sub_block(cfg, head_dim=head_dim, v_head_dim=v_head_dim, itemsize=itemsize,
                        budget=budget)  # fmt: skip
    return sub, budget
