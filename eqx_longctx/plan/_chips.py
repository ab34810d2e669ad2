"""The chips the planners price a step on: peak FLOP/s, HBM and link bandwidth, per chip.

`--chip NAME` (`python -m eqx_longctx.plan`) and `plan_train_step(chip=...)` read this table:
the time is priced at the chip's dense bfloat16 peak, the default memory budget is its HBM,
and a ring hop moves at one link's bandwidth in one direction. The planners count per
*device* (one entry of the mesh): where a chip shows up as several JAX devices (TPU7x, two
chiplets), each gets its share.

The figures are the vendors' published ones (sources beside each entry). The cost model's
`bytes_per_s` is what one ring hop gets: one link, one direction, so a TPU's bidirectional
inter-chip bandwidth is divided by its links and by two. On NVIDIA systems a hop inside one
NVLink node (8 GPUs, NVSwitch) gets NVLink's one-way bandwidth; a ring over more GPUs than
one node crosses InfiniBand, one 400 Gb/s NIC per GPU, and every hop waits for the slowest.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator's published figures.

    - `name`: the `--chip` value.
    - `flops_per_s`: peak dense bfloat16 FLOP/s of the chip.
    - `hbm_bytes`: HBM of the chip.
    - `hbm_bytes_per_s`: HBM bandwidth of the chip.
    - `link_bytes_per_s`: one inter-chip link in one direction (ICI; NVLink through the
      NVSwitch): what a ring hop gets.
    - `devices_per_chip`: JAX devices one chip shows up as.
    - `link_devices`: the most devices the links join (one NVLink node); `None` when the
      links span the whole slice (a TPU's ICI).
    - `network_bytes_per_s`: per device, between link domains (`None` with `link_devices`).
    """

    name: str
    flops_per_s: float
    hbm_bytes: int
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    devices_per_chip: int = 1
    link_devices: int | None = None
    network_bytes_per_s: float | None = None

    @property
    def device_flops_per_s(self) -> float:
        """Peak dense bfloat16 FLOP/s of one device."""
        return self.flops_per_s / self.devices_per_chip

    @property
    def device_hbm_bytes(self) -> int:
        """HBM bytes of one device: the default memory budget."""
        return self.hbm_bytes // self.devices_per_chip

    def hop_bytes_per_s(self, ring_devices: int) -> float:
        """Bytes/s of one hop of a ring over `ring_devices` devices (the mesh's sequence
        axes, taken to be its innermost): the link inside one link domain, the network
        across them."""
        if self.link_devices is None or ring_devices <= self.link_devices:
            return self.link_bytes_per_s
        return self.network_bytes_per_s or self.link_bytes_per_s


_GiB = 2**30
_IB_NDR = 400e9 / 8  # one 400 Gb/s InfiniBand NDR NIC per GPU (DGX/HGX H100, H200)

CHIPS: dict[str, Chip] = {
    c.name: c
    for c in (
        # Google Cloud, "TPU v5p" and "TPU7x (Ironwood)" pages: 459 TFLOP/s bf16, 95 GiB
        # HBM2e at 2765 GB/s; 1200 GB/s bidirectional ICI per chip over a 3D torus (6 links).
        Chip("v5p", 459e12, 95 * _GiB, 2765e9, 1200e9 / 6 / 2),
        # Google Cloud, "TPU v5e": 197 TFLOP/s bf16, 16 GiB HBM2 at 819 GB/s; 400 GB/s
        # bidirectional ICI per chip over 4 ports (2D torus).
        Chip("v5e", 197e12, 16 * _GiB, 819e9, 400e9 / 4 / 2),
        # Google Cloud, "TPU v6e" (Trillium): 918 TFLOP/s bf16, 32 GiB at 1638 GB/s; 800 GB/s
        # bidirectional ICI per chip over 4 ports.
        Chip("v6e", 918e12, 32 * _GiB, 1638e9, 800e9 / 4 / 2),
        # Google Cloud, "TPU7x (Ironwood)": 2307 TFLOP/s bf16 (4614 fp8), 192 GiB at 7380 GB/s;
        # 1200 GB/s bidirectional ICI per chip (3D torus, 6 links). Its two chiplets are two
        # JAX devices ("dual-chiplet architecture"), each with half the FLOP/s and HBM.
        Chip("tpu7x", 2307e12, 192 * _GiB, 7380e9, 1200e9 / 6 / 2, devices_per_chip=2),
        # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense bf16 (1979 with sparsity), 80 GB
        # HBM3 at 3.35 TB/s; NVLink 4 900 GB/s bidirectional per GPU, 8 GPUs per NVSwitch node.
        Chip(
            "h100", 989e12, 80 * 10**9, 3.35e12, 450e9, link_devices=8, network_bytes_per_s=_IB_NDR
        ),  # fmt: skip
        # NVIDIA H200 SXM datasheet: 989 TFLOP/s dense bf16, 141 GB HBM3e at 4.8 TB/s; NVLink
        # as the H100's.
        Chip(
            "h200", 989e12, 141 * 10**9, 4.8e12, 450e9, link_devices=8, network_bytes_per_s=_IB_NDR
        ),  # fmt: skip
    )
}


def as_chip(value: "str | Chip", what: str = "--chip") -> Chip:
    """**Returns:** `value` if it is a `Chip`, else the table's chip of that name.

    **Raises:** `ValueError` for a name not in `CHIPS` (the message lists them); `TypeError`
    for anything else.
    """
    if isinstance(value, Chip):
        return value
    names = ", ".join(CHIPS)
    if not isinstance(value, str):
        raise TypeError(
            f"{what} must be a Chip or the name of one ({names}); got {type(value).__name__} "
            f"{value!r}."
        )
    if value not in CHIPS:
        raise ValueError(
            f"{what} must be one of {names}; got {value!r}. For another chip pass its FLOP/s "
            "and bytes/s (--tflops, --gbps, --memory-budget-gib; or a Chip)."
        )
    return CHIPS[value]
