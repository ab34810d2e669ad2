"""The conventions every command line of the library shares (`python -m eqx_longctx.train`,
`.generate`, `.export`, `.plan`, `.selftest`): a parser whose errors are raised rather
than printed, one line per error (`PROG: error: <rule, values, fix>`, exit status 2), the
placement flags (`--devices`, `--mesh`, `--fsdp-axes`, `--strategy`, `--load-balance`)
parsed into the values [`Placement`][eqx_longctx.run.Placement] takes, and `--override
FIELD=VALUE`.

Flag wording lives here and in each command's own module; the placement itself
(`_placement.py`) speaks of values, not flags.
"""

import argparse
import math
from collections.abc import Mapping

import jax

from ._placement import MESH_AXES, Placement, SpecError, check_device_count, default_mesh


class UsageError(Exception):
    """A flag argparse could not parse (raised instead of printing usage and exiting)."""


class Parser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose parse errors raise [`UsageError`][] (the command
    reports them in its one line) instead of printing usage and exiting."""

    def error(self, message: str):  # pyright: ignore[reportIncompatibleMethodOverride]
        """**Raises:** `UsageError` with argparse's `message` (always)."""
        raise UsageError(message)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with each flag's default, unless its help already says what the default is
    (`"(default: the preset's)"` would otherwise be followed by `"(default: None)"`)."""

    def _get_help_string(self, action):
        text = action.help or ""
        return text if "default" in text else super()._get_help_string(action)


def positive_int(text: str) -> int:
    """An argparse type: a whole number of seconds `>= 1` (`--init-timeout`, ...)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of seconds >= 1; got {text!r}")
    return value


def parse_override(text: str) -> tuple[str, str]:
    """An argparse type: `--override FIELD=VALUE` as `(field, value text)` (the value is
    parsed later, against the preset: see `eqx_longctx.run.resolve_overrides`).

    **Raises:** `argparse.ArgumentTypeError` for text without `=` or without a field.
    """
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(
            f"--override takes FIELD=VALUE (a field of the model's config, e.g. LlamaConfig); "
            f"got {text!r}. Example: --override n_layers=2"
        )
    return key, value


def add_placement_flags(
    p: argparse.ArgumentParser,
    *,
    devices: int,
    default_mesh_help: str,
    strategy: str = "ring",
    load_balance: str = "zigzag",
) -> None:
    """Add the flags that say where a model runs: `--devices`, `--mesh`, `--fsdp-axes`,
    `--strategy` and `--load-balance`, with the same meaning in every command (read them
    back with [`placement_from_flags`][]).

    **Arguments:**

    - `p`: the parser to add them to.
    - `devices`: the default `--devices`.
    - `default_mesh_help`: what `--mesh` is by default, for the help text.
    - `strategy`, `load_balance`: their defaults.
    """
    p.add_argument(
        "--devices",
        type=int,
        default=devices,
        help="devices to run on (on CPU: fake devices; 1 = no mesh)",
    )
    p.add_argument(
        "--mesh",
        default=None,
        help=f"mesh axis sizes, AXIS=SIZE with axes {', '.join(MESH_AXES)}, e.g. "
        f"data=2,context=4 or fsdp=2,context=4 (default: {default_mesh_help})",
    )
    p.add_argument(
        "--fsdp-axes",
        default=None,
        help="mesh axes the parameters, gradients and optimizer state are split over, "
        "comma-separated, e.g. fsdp,context (default: fsdp when --mesh has it, else none)",
    )
    p.add_argument(
        "--strategy",
        default=strategy,
        choices=("all_gather", "ulysses", "ring", "usp", "auto"),
        help="context-parallel attention strategy",
    )
    p.add_argument(
        "--load-balance",
        default=load_balance,
        choices=("none", "zigzag", "striped"),
        help="token layout that balances causal work over the context axis",
    )


def parse_mesh(text: str) -> dict[str, int]:
    """`--mesh` text, `"data=2,context=4"` -> `{"data": 2, "context": 4}` (axes in the order
    given).

    **Arguments:**

    - `text`: comma-separated `AXIS=SIZE` parts; axes from `MESH_AXES`, each at most once,
      sizes positive integers, `context` required.

    **Returns:** the axis sizes.

    **Raises:** `TypeError` when `text` is not a string; `ValueError` (naming the bad part
    and the fix) for a part that is not `AXIS=SIZE` with an axis from `MESH_AXES`, a size
    that is not a positive integer, an axis named twice, or no `context` axis.
    """
    if not isinstance(text, str):
        raise TypeError(
            f"--mesh must be a string such as 'data=2,context=4'; got {type(text).__name__} "
            f"{text!r}. Pass the axis sizes as AXIS=SIZE parts joined by commas."
        )
    shape: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, size = (s.strip() for s in part.partition("="))
        if not sep or name not in MESH_AXES:
            raise ValueError(
                f"--mesh takes AXIS=SIZE parts with axes from {MESH_AXES}; got --mesh {text!r} "
                f"(bad part {part!r}). Pass e.g. --mesh data=2,context=4."
            )
        if not size.isdigit() or int(size) < 1:
            raise ValueError(
                f"--mesh axis sizes must be positive integers; got --mesh {text!r} (axis "
                f"{name!r} has size {size!r}). Pass e.g. {name}=2."
            )
        if name in shape:
            raise ValueError(
                f"--mesh names each axis at most once; got --mesh {text!r}, where {name!r} "
                f"appears twice ({name}={shape[name]} and {name}={size}). Keep one {name}=SIZE "
                "part."
            )
        shape[name] = int(size)
    if "context" not in shape:
        raise ValueError(
            f"--mesh needs a 'context' axis (the sequence is split over it); got --mesh "
            f"{text!r}. Add context=1 for plain data parallelism."
        )
    return shape


def mesh_text(shape: Mapping[str, int]) -> str:
    """**Returns:** `shape` as `--mesh` text, e.g. `"data=2,context=4"`."""
    return ",".join(f"{k}={v}" for k, v in shape.items())


def mesh_shape(mesh: str | None, devices: int) -> dict[str, int]:
    """The parsed mesh of a run on `devices` devices, checked to use exactly that many.

    **Arguments:**

    - `mesh`: `--mesh` text, or `None` for `default_mesh(devices)`.
    - `devices`: the device count (`--devices`).

    **Returns:** the axis sizes (see [`parse_mesh`][]).

    **Raises:** `ValueError` when the axis sizes do not multiply to `devices`; `TypeError`
    and `ValueError` as [`parse_mesh`][].
    """
    text = mesh_text(default_mesh(devices)) if mesh is None else mesh
    shape = parse_mesh(text)
    total = math.prod(shape.values())
    if total != devices:
        raise ValueError(
            f"the mesh's axis sizes must multiply to --devices; got --mesh {text!r} ({total} "
            f"devices) and --devices {devices}. Pass --devices {total}, or axis sizes whose "
            f"product is {devices}."
        )
    return shape


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


def placement_from_flags(
    devices: int,
    mesh: str | None = None,
    strategy: str = "ring",
    load_balance: str = "zigzag",
    fsdp_axes: str | None = None,
    *,
    vocab_size: int | None = None,
) -> Placement:
    """The [`Placement`][eqx_longctx.run.Placement] the placement flags describe.

    **Arguments:**

    - `devices`, `mesh`, `strategy`, `load_balance`, `fsdp_axes`: `--devices`, `--mesh`
      (text, or `None`: on one device no mesh, else the default mesh of `devices`),
      `--strategy`, `--load-balance`, `--fsdp-axes` (text or `None`).
    - `vocab_size`: as `Placement`'s.

    **Returns:** the placement.

    **Raises:** `TypeError` and `ValueError` as [`mesh_shape`][] and [`fsdp_axes_of`][];
    `ValueError` as `Placement`, prefixed with the flags that set it.
    """
    shape = None
    if devices > 1 or mesh is not None:
        shape = mesh_shape(mesh, devices)
    text = mesh if mesh is not None else (mesh_text(shape) if shape else "")
    fsdp = fsdp_axes_of(fsdp_axes, shape, text)
    check_device_count(devices, len(jax.devices()), jax.process_count())
    try:
        return Placement(devices, shape, strategy, load_balance, fsdp, vocab_size=vocab_size)
    except SpecError as e:
        flags = f"--mesh {text!r} with --strategy {strategy!r}"
        if fsdp_axes is not None:
            flags += f" and --fsdp-axes {fsdp_axes!r}"
        raise ValueError(f"{flags}: {e.reason}") from None
