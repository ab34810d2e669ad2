"""`eqx_longctx._collectives.ppermute`: a shift over a tuple of mesh axes moves data
between neighbours of the sequence (the tuple's order, as the layouts and
`lax.axis_index` count), whatever order the mesh names the axes in."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eqx_longctx._collectives import ppermute

AXES = ("ulysses", "context")


@pytest.mark.parametrize("names", [("context", "ulysses"), ("ulysses", "context")])
@pytest.mark.parametrize("explicit", [True, False])
def test_a_shift_reaches_the_next_device_of_the_sequence(names, explicit):
    shape = (4, 2) if names[0] == "context" else (2, 4)
    if explicit:
        mesh = jax.make_mesh(shape, names)
    else:
        mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(shape), names)

    def shift(x):
        index = jax.lax.axis_index(AXES).astype(x.dtype)
        moved = ppermute(x, AXES, [(j, j + 1) for j in range(7)])
        return jnp.stack([index, moved[0]])[None]

    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P(AXES)))
    out = jax.jit(jax.shard_map(shift, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES)))(x)
    index, received = np.asarray(out).T
    np.testing.assert_array_equal(index, np.arange(8))  # the spec's order, device by device
    np.testing.assert_array_equal(received, [0, 0, 1, 2, 3, 4, 5, 6])  # 0 gets nothing


def test_one_axis_is_lax_ppermute():
    mesh = jax.make_mesh((8,), ("context",))
    f = jax.shard_map(
        lambda x: ppermute(x, "context", [(j, (j + 1) % 8) for j in range(8)]),
        mesh=mesh, in_specs=P("context"), out_specs=P("context"),
    )  # fmt: skip
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("context")))
    np.testing.assert_array_equal(np.asarray(f(x)), np.roll(np.arange(8.0), 1))
