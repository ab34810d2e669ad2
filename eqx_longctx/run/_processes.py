"""What the processes of a multi-process run do together, for the loop and the
checkpoints: who writes (process 0), barriers, and agreeing on values, through
`jax.distributed`'s key-value store. In a single-process run each is a no-op.

Every process must make the same sequence of calls (each gets a numbered key, like a
collective), and every wait is bounded by a timeout.
"""

import json
import re
from typing import Any

INIT_TIMEOUT = 300
"""Default `--init-timeout`, and the bound of every wait here: seconds."""

PREFIX = "eqx_longctx"


def kv_client():
    from .._compat import distributed_client

    client = distributed_client()
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


def is_primary() -> bool:
    """**Returns:** whether this is process 0, the one that writes the run's files (flags,
    metrics, plot) and prints; `True` in a single-process run."""
    import jax

    return jax.process_index() == 0


_SYNCS = [0]


def sync(name: str, timeout: float = INIT_TIMEOUT) -> None:
    """Wait until every process reaches this point (nothing in a single-process run).

    Every process must call the same sequence of `sync`s: each gets a numbered barrier.

    **Arguments:**

    - `name`: what is awaited, for the barrier's id and any timeout message.
    - `timeout`: seconds to wait.
    """
    import jax

    if jax.process_count() == 1:
        return
    _SYNCS[0] += 1
    kv_client().wait_at_barrier(f"{PREFIX}/sync/{_SYNCS[0]}-{name}", int(timeout * 1000))


def agree(name: str, value: Any, timeout: float = INIT_TIMEOUT) -> None:
    """Check that `value` (JSON-serialisable) is the same on every process (nothing in a
    single-process run).

    **Raises:** `RuntimeError` listing each process's value when they differ; `ValueError`
    when a process does not report within `timeout` seconds.
    """
    import jax

    if jax.process_count() == 1:
        return
    _SYNCS[0] += 1
    values = exchange(f"{_SYNCS[0]}-{name}", json.dumps(value, sort_keys=True), timeout)
    if len(set(values)) > 1:
        listed = "; ".join(f"process {p}: {v}" for p, v in enumerate(values))
        raise RuntimeError(
            f"the processes must agree on {name} (global arrays reduced by jit); they "
            f"differ: {listed}. This is a bug: please report it."
        )


def all_readable(name: str, why: str, timeout: float = INIT_TIMEOUT) -> str:
    """Agree across processes on whether something could be read.

    **Arguments:**

    - `name`: what was read (unique per call sequence, like [`sync`][]).
    - `why`: `""` when this process read it, else why not.

    **Returns:** `""` when every process read it, else the first process's reason (with its
    process id when it was another's). A single-process run returns `why`.
    """
    import jax

    if jax.process_count() == 1:
        return why
    _SYNCS[0] += 1
    whys = exchange(f"{_SYNCS[0]}-{name}", why, timeout)
    for p, reason in enumerate(whys):
        if reason:
            return reason if p == jax.process_index() else f"process {p}: {reason}"
    return ""


def exchange(name: str, value: str, timeout: float) -> list[str]:
    """Publish `value` under `name` and read every process's (in process order); raises
    `ValueError` when one has not published within `timeout` seconds."""
    import jax

    client = kv_client()
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", name)
    client.key_value_set(f"{PREFIX}/x/{name}/{jax.process_index()}", value)
    values = []
    for p in range(jax.process_count()):
        try:
            values.append(
                client.blocking_key_value_get(f"{PREFIX}/x/{name}/{p}", int(timeout * 1000))
            )
        except Exception as e:
            raise ValueError(
                f"every process of the run must report its {name}; process {p} did not within "
                f"{timeout} s ({str(e).splitlines()[0]}). Check that it is running (its own "
                "log says why not)."
            ) from None
    return values


def primary_value(name: str, value: str, timeout: float = INIT_TIMEOUT) -> str:
    """**Returns:** process 0's `value` on every process (each publishes its own)."""
    import jax

    if jax.process_count() == 1:
        return value
    return exchange(name, value, timeout)[0]
