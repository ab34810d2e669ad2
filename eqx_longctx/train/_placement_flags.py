"""The placement flags of a run: `--mesh` and `--devices` (the axis sizes), `--fsdp-axes`
and `--host-offload`, parsed and checked with errors that name the flag and the fix."""

import argparse
import math
from collections.abc import Mapping

from .._mesh import parse_mesh
from ._offload import HOST_OFFLOADS


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with each flag's default, unless its help already says what the default is
    (`"(default: the preset's)"` would otherwise be followed by `"(default: None)"`)."""

    def _get_help_string(self, action):
        text = action.help or ""
        return text if "default" in text else super()._get_help_string(action)


def mesh_shape(mesh: str | None, devices: int) -> dict[str, int]:
    """The parsed mesh of a run on `devices` devices, checked to use exactly that many.

    **Arguments:**

    - `mesh`: `--mesh` text, or `None` for [`default_mesh`][]`(devices)`.
    - `devices`: the device count (`--devices`).

    **Returns:** the axis sizes (see [`parse_mesh`][]).

    **Raises:** `ValueError` when the axis sizes do not multiply to `devices`; `TypeError`
    and `ValueError` as [`parse_mesh`][].
    """
    shape = parse_mesh(mesh or default_mesh(devices))
    total = math.prod(shape.values())
    if total != devices:
        raise ValueError(
            f"the mesh's axis sizes must multiply to --devices; got --mesh "
            f"{mesh or default_mesh(devices)!r} ({total} devices) and --devices {devices}. Pass "
            f"--devices {total}, or axis sizes whose product is {devices}."
        )
    return shape


def default_mesh(devices: int) -> str:
    """The mesh of a run on `devices` devices by default: the batch over 2 of them if it can,
    the sequence over the rest (context parallelism)."""
    if devices >= 4 and devices % 2 == 0:
        return f"data=2,context={devices // 2}"
    return f"context={devices}"


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


def fsdp_axes_of(fsdp_axes: str | None, shape: Mapping[str, int] | None, mesh: str) -> tuple:
    """The mesh axes a run splits its weights over (`--fsdp-axes`), checked against the mesh.

    **Arguments:**

    - `fsdp_axes`: `--fsdp-axes` text such as `"fsdp,context"`, or `None` for the default:
      `("fsdp",)` when the mesh has an `fsdp` axis, else `()`.
    - `shape`: the parsed mesh ([`mesh_shape`][]), or `None` for one device without a mesh.
    - `mesh`: the `--mesh` text, for the messages.

    **Returns:** the axis names, in the order given.

    **Raises:** `ValueError` when `fsdp_axes` is given without a mesh, names an axis the
    mesh lacks (or an empty one), names one twice, or leaves out a mesh `fsdp` axis (its
    devices would repeat the same work).
    """
    if fsdp_axes is None:
        return ("fsdp",) if shape is not None and "fsdp" in shape else ()
    names = tuple(a.strip() for a in fsdp_axes.split(","))
    if shape is None:
        raise ValueError(
            f"--fsdp-axes splits the weights over mesh axes, but --devices 1 without --mesh "
            f"has no mesh; got --fsdp-axes {fsdp_axes!r}. Pass --devices N with --mesh (e.g. "
            "--mesh fsdp=2,context=4), or drop --fsdp-axes."
        )
    if not all(names) or any(a not in shape for a in names):
        raise ValueError(
            f"--fsdp-axes names mesh axes joined by commas, each one of --mesh {mesh!r}'s axes "
            f"{tuple(shape)}; got --fsdp-axes {fsdp_axes!r}. Pass e.g. --fsdp-axes "
            f"{'fsdp' if 'fsdp' in shape else 'context'}, or add the axis to --mesh."
        )
    if len(set(names)) != len(names):
        raise ValueError(
            f"--fsdp-axes names each axis at most once; got --fsdp-axes {fsdp_axes!r}. Pass "
            f"--fsdp-axes {','.join(dict.fromkeys(names))}."
        )
    if "fsdp" in shape and "fsdp" not in names:
        raise ValueError(
            f"--mesh {mesh!r} has an fsdp axis of size {shape['fsdp']}, but --fsdp-axes "
            f"{fsdp_axes!r} leaves it out, so its devices would all do the same work. Add it "
            f"(--fsdp-axes fsdp,{','.join(names)}), or move those devices to data=."
        )
    return names
