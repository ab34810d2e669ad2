"""Plain data parallelism through `jit`: the batch is split over a mesh axis `"data"`, the
model and optimizer state are replicated, and XLA inserts the gradient all-reduce."""

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


class DataParallel:
    """Placement of a data-parallel run over the first `num_devices` JAX devices.

    **Arguments:**

    - `num_devices`: devices to use; 1 keeps everything on the default device.
    """

    def __init__(self, num_devices: int):
        available = jax.devices()
        if not 1 <= num_devices <= len(available):
            raise ValueError(
                f"devices={num_devices} needs that many JAX devices (and at least 1); this "
                f"process has {len(available)}. On CPU, pass --devices before JAX starts (the "
                "CLI does) or set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{num_devices}; or pass fewer devices."
            )
        self.num_devices = num_devices
        if num_devices == 1:
            self.mesh = None
            self._batch = self._replicated = available[0]
        else:
            # An Auto-axis mesh (not jax.make_mesh's Explicit default): jit propagates the
            # shardings and eager ops on the replicated model keep working.
            self.mesh = Mesh(np.array(available[:num_devices]), ("data",))
            self._batch = NamedSharding(self.mesh, PartitionSpec("data"))
            self._replicated = NamedSharding(self.mesh, PartitionSpec())

    def replicate(self, tree):
        """**Returns:** `tree` with every array copied to all devices (other leaves kept)."""
        arrays, rest = eqx.partition(tree, eqx.is_array)
        return eqx.combine(jax.device_put(arrays, self._replicated), rest)

    def shard_batch(self, batch):
        """**Returns:** `batch` with every `[batch, ...]` array split over the devices."""
        return jax.device_put(batch, self._batch)
