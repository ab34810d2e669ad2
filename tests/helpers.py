"""Shared test helpers: tolerances keyed by dtype, relative error, random inputs."""

import jax
import jax.numpy as jnp
import numpy as np

# Relative tolerances (max abs error / max abs reference), written once.
RTOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2e-2}


def rel_err(actual, expected) -> float:
    """Max absolute difference, relative to the largest reference magnitude."""
    a = np.asarray(jnp.asarray(actual, jnp.float32))
    e = np.asarray(jnp.asarray(expected, jnp.float32))
    return float(np.max(np.abs(a - e)) / (np.max(np.abs(e)) + 1e-30))


def assert_close(actual, expected, dtype=jnp.float32, factor: float = 1.0, what: str = ""):
    tol = RTOL[jnp.dtype(dtype)] * factor
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3e} > tolerance {tol:.1e}"


def random_segment_ids(key, batch: int, seq: int, max_docs: int = 4):
    """Sorted random segment ids: packed documents of random lengths in each row."""
    return jnp.sort(jax.random.randint(key, (batch, seq), 0, max_docs), axis=1).astype(jnp.int32)
