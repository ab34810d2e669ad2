"""One call that lets go of every compiled program JAX and this library keep."""

import gc
from collections.abc import Callable

import jax

_CLEARS: list[Callable[[], None]] = []


def on_clear_caches(clear: Callable[[], None]) -> Callable[[], None]:
    """Register `clear()` to run in every [`clear_caches`][]: how a module that keeps
    compiled programs of its own (the trainer's steps, the block attention's staged sides)
    lets them go, without this floor module naming it. **Returns:** `clear`."""
    _CLEARS.append(clear)
    return clear


def clear_caches() -> None:
    """Drop every compiled program that JAX and `eqx_longctx` keep, so its memory is freed.

    XLA:CPU maps each compiled program's code into the process's memory, and a process
    that compiles thousands of programs (a notebook open for a day, a sweep over shapes,
    a test suite) keeps them all: JAX caches its jitted functions, the trainer keeps its
    compiled steps (so a fresh `Trainer` or a resume reuses them) and the block attention
    keeps one jitted function per implementation and configuration. On Linux the mappings
    count against `vm.max_map_count` (65,530 by default), and past it the next compile
    crashes inside LLVM with no message.

    This empties all three and collects garbage. Nothing is lost but time: the next call
    of each program compiles it again. Arrays, models and optimizer states stay valid.

    Example:
        ```python
        import eqx_longctx as el

        for seq in (1024, 2048, 4096):
            run_sweep_point(seq)  # compiles programs for this length
            el.clear_caches()  # they are not needed again
        ```
    """
    jax.clear_caches()
    # The library's own caches register themselves when their modules load, so clearing
    # never imports the trainer and its checkpointing stack into a process that never
    # used them.
    for clear in _CLEARS:
        clear()
    gc.collect()
