"""Wall-clock timing of a compiled function, shared by the selftest and the benchmarks."""

import time

import jax


def best_seconds(fn, *args, repeats: int = 5) -> float:
    """The fastest of `repeats` runs of `fn(*args)` after one warm-up run (which compiles
    it), each waited for with `jax.block_until_ready`."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best
