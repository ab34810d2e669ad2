"""`after(x, *deps)`: `x`, unchanged, but computed after `deps`.

Why the library orders some of its collectives by hand: XLA:CPU (jaxlib 0.10) starts a
device's collectives in program order but lets them overlap, and each one blocks a thread of
a pool sized to the device count while it waits for its peers. A collective with no data
dependence on a loop whose body holds collectives (the layer stack's scan, the ring's hops)
can run beside that loop, and the fake devices can run out of threads and wait for each
other until XLA aborts the process (`Termination timeout for 'all reduce ...'`): Ulysses
training on `data=2,context=4` under full remat did in most runs. A data dependence orders
the two; optimization barriers do not, as XLA:CPU drops them before its runtime.
`tests/test_collective_order.py` reads compiled train steps for any such pair, and
`docs/architecture.md` ("Collectives beside loops on XLA:CPU") lists where it remains.
"""

import jax.numpy as jnp
from jaxtyping import Array


def after(x: Array, *deps: Array) -> Array:
    """`x` with a data dependence on each of `deps` and its values unchanged: `x` plus
    `d[0] > inf` (false for every number, NaN included, and not folded by XLA) as `x`'s
    dtype, for the first element `d[0]` of each dependency."""
    for d in deps:
        x = x + (d.reshape(-1)[0] > jnp.inf).astype(x.dtype)
    return x
