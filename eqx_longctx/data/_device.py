"""Move host batches onto the mesh, already in the sharding spec's token layout."""

import jax
import numpy as np

from .._layout import to_layout
from .._sharding import ShardingSpec
from ._packing import Batch


def place_batch(batch: Batch, spec: ShardingSpec | None) -> Batch:
    """Permute every field into `spec`'s layout on the host, then shard it over the mesh.

    Tokens, targets, positions, segment ids and the loss mask move together, so the loss (a
    sum over token slots) is unchanged by the layout. With `spec=None` the batch goes to the
    default device as is.

    **Arguments:**

    - `batch`: a host `Batch` of `[batch, seq]` arrays.
    - `spec`: the `ShardingSpec`, or `None`.

    **Returns:** a `Batch` of global `jax.Array`s sharded `P(batch_axis, sequence axes)`.

    **Raises:** `ValueError` (with a spec) when a field has fewer than 2 axes or `seq` does
    not split evenly under the spec's layout (see `eqx_longctx.to_layout`).
    """
    if spec is None:
        return Batch(*(jax.device_put(np.asarray(x)) for x in batch))
    sharding = spec.sharding(spec.token_pspec())
    return Batch(*(jax.device_put(to_layout(np.asarray(x), spec, axis=1), sharding) for x in batch))
