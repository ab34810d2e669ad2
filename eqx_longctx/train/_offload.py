"""Host offload of the training state: AdamW's moments and the parameters can live in host
memory between steps (`--host-offload`), streamed to the device inside the compiled step.
"""

import equinox as eqx
import jax

HOST_OFFLOADS = ("opt_state", "params")
"""What `--host-offload` may keep in host memory between steps (see [`make_train_step`][])."""


def host_offload_of(host_offload: str | None) -> tuple[str, ...]:
    """`--host-offload` text (e.g. `"opt_state,params"`) as the tuple `make_train_step`
    takes; `None`: `()`.

    **Raises:** `ValueError` for a name not in `HOST_OFFLOADS`, or one named twice.
    """
    if host_offload is None:
        return ()
    names = tuple(name.strip() for name in host_offload.split(","))
    if any(n not in HOST_OFFLOADS for n in names) or len(set(names)) != len(names):
        raise ValueError(
            f"--host-offload takes distinct names among {','.join(HOST_OFFLOADS)}, joined by "
            f"commas; got --host-offload {host_offload!r}. Pass e.g. --host-offload opt_state."
        )
    return names


def check_host_offload(host_offload: object) -> None:
    """**Raises:** `ValueError` unless `host_offload` is a tuple of distinct names from
    `HOST_OFFLOADS`."""
    ok = (
        isinstance(host_offload, tuple)
        and all(x in HOST_OFFLOADS for x in host_offload)
        and len(set(host_offload)) == len(host_offload)
    )
    if not ok:
        raise ValueError(
            f"host_offload (--host-offload) names what lives in host memory between steps: "
            f"distinct names among {', '.join(HOST_OFFLOADS)}; got {host_offload!r}. Pass "
            "e.g. ('opt_state',) (--host-offload opt_state) or ('opt_state', 'params')."
        )


def _to_space(tree, space):
    arrays, rest = eqx.partition(tree, eqx.is_array)
    return eqx.combine(jax.device_put(arrays, space), rest)


def to_host(tree):
    """**Returns:** `tree` with its arrays in host memory (pinned where the platform has
    it), each keeping its sharding: how a caller places what `make_train_step(...,
    host_offload=...)` takes there."""
    return _to_space(tree, jax.memory.Space.Host)


def to_device(tree):
    """**Returns:** `tree` with its arrays in device memory (the inverse of [`to_host`][])."""
    return _to_space(tree, jax.memory.Space.Device)
