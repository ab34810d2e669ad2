"""Every use of JAX's private modules (`jax._src`), in one place.

JAX may move or rename any of these between releases. So nothing here is imported when
`eqx_longctx` is: each function imports what it needs when it is called, and only the
feature that calls it (the step planner, multi-process runs, Cloud TPU detection) breaks if
a name moves. `tests/test_compat.py` checks that no other module touches `jax._src` and that
`import eqx_longctx` survives these names being gone.

Tested with the JAX range stated in `pyproject.toml`.
"""

from collections.abc import Callable
from typing import Any


def saved_residuals(f: Callable, *args) -> list[tuple[Any, str]]:
    """What the backward pass of `f(*args)` saves: `(aval, why)` pairs, where `why` is the
    text JAX's public `jax.ad_checkpoint.print_saved_residuals` prints for each residual
    (it starts with `"from the argument"` for an input saved as it is)."""
    from jax._src.ad_checkpoint import saved_residuals as impl

    return impl(f, *args)


def is_argument_residual(why: str, name: str | None = None) -> bool:
    """Whether a `saved_residuals` entry is one of `f`'s inputs saved unchanged (named
    `name` when given), read from the text JAX attaches to it."""
    if not why.startswith("from the argument"):
        return False
    return name is None or f"argument {name}" in why


def distributed_client():
    """**Returns:** `jax.distributed`'s key-value store client (`None` when
    `jax.distributed.initialize` has not run)."""
    from jax._src import distributed

    return distributed.global_state.client


def preemption_service_running() -> bool:
    """**Returns:** whether `jax.distributed` runs its preemption service (on by default,
    `jax_enable_preemption_service`), which catches SIGTERM and lets
    `jax.experimental.multihost_utils.reached_preemption_sync_point` agree on a step."""
    from jax._src import distributed

    state = distributed.global_state
    return state.client is not None and state.preemption_sync_manager is not None


def running_in_cloud_tpu_vm() -> bool:
    """**Returns:** whether this host has TPU chips (JAX's Cloud TPU detection)."""
    import jax  # noqa: F401  (runs the Cloud TPU detection)
    from jax._src import cloud_tpu_init

    return bool(cloud_tpu_init.running_in_cloud_tpu_vm)


def cloud_tpu_process_count() -> int | None:
    """**Returns:** the number of hosts of this Cloud TPU slice from the environment (GKE)
    or the VM's metadata (GCE); `None` when neither is present."""
    from jax._src.clusters.cloud_tpu_cluster import GceTpuCluster, GkeTpuCluster

    for cls in (GkeTpuCluster, GceTpuCluster):
        if cls.is_env_present():
            return int(cls.get_process_count())
    return None


def pallas_interpret_module():
    """**Returns:** the module behind Pallas' TPU interpret mode (its race detector lives
    there; tests record the detectors it makes)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    return interpret_pallas_call
