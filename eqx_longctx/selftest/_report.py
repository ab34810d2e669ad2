"""What the selftest reports: the environment header, one labelled row per check, the table.

`run_check` runs one check (a function that returns its measured errors), times it, judges
it against its tolerance and turns an exception into a row labelled by `error_label` with
the first line of the message, so one broken case never hides the others.
"""

import dataclasses
import importlib.metadata
import platform
import time
import traceback
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Largest error relative to the reference's largest magnitude, by the dtype computed in.
TOLERANCES = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 2e-2}
PASS, FAIL = "PASS", "FAIL"


def tolerance(dtype) -> float:
    """**Returns:** the selftest's tolerance for results computed in `dtype`."""
    return TOLERANCES[jnp.dtype(dtype)]


@dataclasses.dataclass
class Row:
    """One line of the table.

    - `case`: what was run (shape, mask, dtype); `impl`: which implementation ran it;
      `check`: what it was held against (`"f32 ref"`, `"xla"`, ...).
    - `errors`: name -> measured error (e.g. `{"out": 1e-7, "dq": 3e-7}`), or free text.
    - `tol`: the bound every error must stay within (`None`: none applies).
    - `status`: `PASS`, `FAIL`, or an error label (`VMEM-OOM`, `MOSAIC`, `OTHER`; see
      `error_label`).
    - `seconds`: wall time of the check; `note`: why it did not pass, or a remark.
    """

    case: str
    impl: str
    check: str
    errors: dict[str, float] | str = dataclasses.field(default_factory=dict)
    tol: float | None = None
    status: str = PASS
    seconds: float = 0.0
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.status == PASS


def judged(row: Row) -> Row:
    """`row` with its status set from its errors and tolerance (NaN fails)."""
    if isinstance(row.errors, dict) and row.tol is not None:
        bad = [k for k, e in row.errors.items() if not (e <= row.tol)]
        if bad:
            row.status = FAIL
            row.note = row.note or f"{', '.join(bad)} above {row.tol:.0e}"
    return row


def rel_err(actual, expected) -> float:
    """Largest absolute difference relative to the largest reference magnitude (float32).
    Non-finite entries must sit at the same places (`-inf` rows of a logsumexp), else
    `inf`."""
    a = np.asarray(jnp.asarray(actual, jnp.float32))
    e = np.asarray(jnp.asarray(expected, jnp.float32))
    if not np.array_equal(np.isfinite(a), np.isfinite(e)) or not np.array_equal(
        a[~np.isfinite(e)], e[~np.isfinite(e)]
    ):
        return float("inf")
    fin = np.isfinite(e)
    if not fin.any():
        return 0.0
    return float(np.max(np.abs(a[fin] - e[fin])) / (np.max(np.abs(e[fin])) + 1e-30))


ERROR_LABELS = ("VMEM-OOM", "MOSAIC", "OTHER")


def error_label(error: BaseException) -> str:
    """The status of a check that raised, from its message: `VMEM-OOM` when a kernel ran
    out of VMEM (XLA's "Ran out of memory in memory space vmem", a scoped-VMEM limit),
    `MOSAIC` for any other Mosaic, Triton or Pallas lowering or compile error, `OTHER`
    otherwise."""
    text = f"{type(error).__name__}: {error}"
    low = text.lower()
    if "vmem" in low and any(w in low for w in ("out of memory", "resource_exhausted", "exceed")):
        return "VMEM-OOM"
    if any(w in low for w in ("mosaic", "tpu_custom_call", "pallas", "triton")):
        return "MOSAIC"
    return "OTHER"


class CheckFailed(Exception):
    """Raised by a check whose result is wrong in a way no tolerance measures; `errors` is
    what it measured (as `Row.errors`)."""

    def __init__(self, note: str, errors: dict[str, float] | str = ""):
        super().__init__(note)
        self.errors = errors


def run_check(case: str, impl: str, check: str, tol: float | None, fn: Callable) -> Row:
    """Run one check, timed, and judge it.

    **Arguments:**

    - `case`, `impl`, `check`, `tol`: as the `Row` fields.
    - `fn`: `fn() -> errors` or `(errors, note)`, `errors` as `Row.errors`; it raises
      `CheckFailed` for a wrong result no tolerance measures.

    **Returns:** the row; an exception becomes a row labelled by `error_label`, with the
    first line of its message as the note.
    """
    start = time.perf_counter()
    row = Row(case, impl, check, tol=tol)
    try:
        got = fn()
        row.errors, row.note = got if isinstance(got, tuple) else (got, "")
        judged(row)
    except CheckFailed as e:
        row.status, row.note, row.errors = FAIL, str(e), e.errors
    except Exception as e:  # noqa: BLE001 (reported in the table, never hidden)
        lines = [line for line in str(e).splitlines() if line.strip()] or [""]
        row.status, row.note = error_label(e), f"{type(e).__name__}: {lines[0]}"[:160]
        if _verbose_errors:
            traceback.print_exc()
    row.seconds = time.perf_counter() - start
    return row


_verbose_errors = False


def set_verbose(verbose: bool) -> None:
    """Print the traceback of every check that raises (`--verbose`)."""
    global _verbose_errors
    _verbose_errors = verbose


def environment() -> list[tuple[str, str]]:
    """`(name, value)` lines that say where the selftest ran."""
    import jaxlib.version

    from .. import kernels

    devices = jax.devices()
    bq, bk = kernels.default_block_sizes()
    return [
        ("python", platform.python_version()),
        ("jax", jax.__version__),
        ("jaxlib", jaxlib.version.__version__),
        ("libtpu", _version("libtpu") or _version("libtpu-nightly") or "not installed"),
        ("backend", jax.default_backend()),
        ("device kind", devices[0].device_kind),
        ("devices", f"{len(devices)} ({jax.local_device_count()} local, "
                    f"{jax.process_count()} processes)"),
        ("kernel VMEM", f"{kernels.vmem_capacity() // 2**20} MiB per core, kernels ask for "
                        f"{kernels.vmem_budget() // 2**20} MiB"),
        ("kernel SMEM", f"{kernels.SMEM_BYTES // 2**10} KiB per core, schedules within "
                        f"{kernels.SMEM_BYTES // 2**11} KiB"),
        ("kernel blocks", f"{bq} x {bk} (default_block_sizes)"),
    ]  # fmt: skip


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def format_errors(errors: dict[str, float] | str) -> str:
    if isinstance(errors, str):
        return errors
    return " ".join(f"{k} {v:.1e}" for k, v in errors.items())


def table(rows: Sequence[Row]) -> str:
    """The rows as an aligned text table, one line per row."""
    head = ("case", "impl", "vs", "max errors (relative)", "tol", "time", "result")
    lines: list[tuple[str, ...]] = [head]
    for r in rows:
        tol = "-" if r.tol is None else f"{r.tol:.0e}"
        result = f"{r.status}: {r.note}" if r.note else r.status
        lines.append((r.case, r.impl, r.check, format_errors(r.errors), tol,
                      f"{r.seconds:.1f}s", result))  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    out = []
    for line in lines:
        cells = [c.ljust(w) for c, w in zip(line[:-1], widths, strict=True)]
        out.append("  ".join([*cells, line[-1]]).rstrip())
    return "\n".join(out)
