"""Where a training run's arrays live: one device, or a mesh with a `ShardingSpec`.

On a mesh the batch is split over `"data"` (if the mesh has it), the sequence over
`"context"` (and `"ulysses"` under USP) in the spec's load-balanced layout, and the model
and optimizer state are replicated; attention runs the spec's context-parallel strategy and
XLA inserts the gradient reductions.
"""

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eqx_longctx import ShardingSpec
from eqx_longctx.data import place_batch

from ._config import default_mesh, mesh_shape


class Placement:
    """The devices, mesh and sharding spec of one run.

    **Arguments:**

    - `devices`: how many devices to use; 1 keeps everything on the default device.
    - `mesh`: axis sizes such as `"data=2,context=4"` (product = `devices`), or `None` for
      `default_mesh(devices)`.
    - `strategy`, `load_balance`: the `ShardingSpec`'s (see `eqx_longctx.ShardingSpec`).
    """

    def __init__(
        self,
        devices: int,
        mesh: str | None = None,
        strategy: str = "ring",
        load_balance: str = "zigzag",
    ):
        available = jax.devices()
        if not 1 <= devices <= len(available):
            raise ValueError(
                f"devices={devices} needs that many JAX devices (and at least 1); this "
                f"process has {len(available)}. On CPU, pass --devices before JAX starts (the "
                "CLI does) or set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{devices}; or pass fewer devices."
            )
        self.num_devices = devices
        self.spec: ShardingSpec | None = None
        if devices == 1 and mesh is None:
            self._replicated = available[0]
            return
        shape = mesh_shape(mesh, devices)
        # Auto axes: jit propagates shardings through the replicated model and optimizer.
        grid = np.array(available[:devices]).reshape(tuple(shape.values()))
        self.mesh = Mesh(grid, tuple(shape))
        try:
            self.spec = ShardingSpec(
                self.mesh,
                strategy=strategy,
                load_balance=load_balance,
                ulysses_axis="ulysses" if "ulysses" in shape else None,
                tensor_axis="tensor" if "tensor" in shape else None,
            )
        except ValueError as e:
            text = mesh or default_mesh(devices)
            raise ValueError(f"--mesh {text!r} with --strategy {strategy!r}: {e}") from None
        self._replicated = NamedSharding(self.mesh, PartitionSpec())

    def check_run(self, batch_size: int, seq_len: int, model_config) -> None:
        """Check that a run's batches and the model's heads split over this mesh, before
        anything is built or traced.

        The rules are the attention's own (`ShardingSpec.check_batch`,
        `check_sequence_length`, the tensor and Ulysses head checks), applied to the shapes
        every step will have; their messages are prefixed with the flags that set them.

        **Arguments:**

        - `batch_size`, `seq_len`: `--batch-size`, `--seq-len`.
        - `model_config`: the `LlamaConfig` (its `n_heads`, `n_kv_heads`, `head_dim`).
        """
        if self.spec is None:
            return
        from eqx_longctx._layout import check_sequence_length
        from eqx_longctx.attention._validate import check_spec_inputs

        self.spec.check_batch(batch_size, what=f"--batch-size {batch_size}")
        try:
            check_sequence_length(self.spec, seq_len)
        except ValueError as e:
            raise ValueError(f"--seq-len {seq_len}: {e}") from None
        c = model_config
        kv_heads = c.n_kv_heads or c.n_heads
        q = jax.ShapeDtypeStruct((batch_size, seq_len, c.n_heads, c.head_dim), np.float32)
        k = jax.ShapeDtypeStruct((batch_size, seq_len, kv_heads, c.head_dim), np.float32)
        try:
            check_spec_inputs(self.spec, q, k, None)
        except ValueError as e:
            raise ValueError(
                f"--strategy {self.spec.strategy!r} on mesh {dict(self.mesh.shape)} with the "
                f"model's {c.n_heads} query / {kv_heads} key-value heads: {e}"
            ) from None

    def describe(self) -> str:
        if self.spec is None:
            return "1 device"
        axes = ", ".join(f"{k}={v}" for k, v in self.mesh.shape.items())
        return (
            f"{self.num_devices} devices (mesh {axes}; strategy={self.spec.strategy}, "
            f"load_balance={self.spec.load_balance})"
        )

    def replicate(self, tree):
        """**Returns:** `tree` with every array copied to all devices (other leaves kept)."""
        arrays, rest = eqx.partition(tree, eqx.is_array)
        return eqx.combine(jax.device_put(arrays, self._replicated), rest)

    def shard_batch(self, batch):
        """**Returns:** `batch` in the spec's token layout, split over the mesh."""
        return place_batch(batch, self.spec)
