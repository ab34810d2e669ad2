"""`python -m eqx_longctx.selftest`: check this installation on the backend that is present.

Run it first on a new machine (a TPU above all: `impl="auto"` runs the Pallas kernels
there). It prints the environment, then a table with one row per check, and exits with
status 1 if any check fails or raises (0 when all pass):

- **attention cases** (causal, sliding window, packed documents, GQA in bfloat16): the
  implementation under test (the Pallas kernels compiled by Mosaic on a TPU, the same
  kernels in TPU interpret mode on a CPU, whatever `impl="auto"` picks on a GPU) and the
  XLA path, each against the float32 oracle, and the one under test against XLA: `out`,
  `lse` and the gradients `dq`, `dk`, `dv`, relative errors within 1e-4 (float32) or
  2e-2 (bfloat16);
- **the kernels' matrix** (`MATRIX`: float32 and bfloat16, with and without segment ids,
  head dims 64, 128, 256 and MLA's 192/128, MHA, GQA and MQA, batch 1 and 2), each held
  against the oracle and XLA as above, at the generation's default blocks on a TPU and in
  interpret mode at small sizes on a CPU; a check that raises is labelled `VMEM-OOM`,
  `MOSAIC` or `OTHER` with the first line of its message;
- **kernel properties**: rows that see no key give `out = 0`, `lse = -inf` and zero
  gradients exactly; two runs are bitwise equal; on a TPU one timing row, causal bfloat16
  at 8K tokens, forward + backward TFLOP/s of ours and of JAX's splash attention;
- **ring attention** over every local device (a ring of one on one device), forward and
  backward against the oracle;
- **three train steps** of the tiny Llama through the trainer of `python -m
  eqx_longctx.train`: the loss finite at every step, the step compiled once (one process
  only: on a slice of several hosts, where every worker runs the selftest at once and
  checks its own chips, the train job itself is the multi-host check).

Flags: `--devices N` fake CPU devices when the backend is a CPU (default 8), `--quick`
(no train steps), `--no-ring`, `--case NAME` (repeatable), `--verbose` (tracebacks).
"""

import argparse
import sys
import time
from collections.abc import Sequence

from ._report import CheckFailed as CheckFailed
from ._report import Row as Row
from ._report import run_check as run_check

PROG = "python -m eqx_longctx.selftest"


def _parser() -> argparse.ArgumentParser:
    from ._attention import CASES, MATRIX

    p = argparse.ArgumentParser(
        prog=PROG, description="Check this installation on the backend that is present."
    )
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices (CPU backend only)")
    p.add_argument("--quick", action="store_true", help="skip the train steps")
    p.add_argument("--no-ring", action="store_true", help="skip the ring attention check")
    p.add_argument(
        "--case", action="append", choices=[c.name for c in (*CASES, *MATRIX)],
        help="run only these attention cases (default: all)",
    )  # fmt: skip
    p.add_argument("--verbose", action="store_true", help="print tracebacks of errors")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the selftest and print its report.

    **Arguments:**

    - `argv`: the flags (default `sys.argv[1:]`); see the module docstring.

    **Returns:** the exit status: 0 when every check passed, 1 otherwise.
    """
    args = _parser().parse_args(argv)
    from .. import run

    # On a Cloud TPU slice of several hosts every worker runs this at once, as one program
    # (the trainer's start-up); each checks its own chips.
    cluster = run.cluster_from_flags(None, None, None, args.devices)
    runtime = None
    if cluster is None:
        run.set_cpu_devices(args.devices)
    else:
        runtime = run.start_processes(
            cluster, devices=args.devices, init_timeout=600, peer_timeout=600
        )
    import jax

    from . import _attention, _report

    start = time.perf_counter()
    _report.set_verbose(args.verbose)
    platform = jax.default_backend()
    impls = _attention.implementations(platform)
    lines = [*_report.environment(), ("implementations", ", ".join(impls))]
    width = max(len(k) for k, _ in lines)
    print("\n".join(f"{k.ljust(width)}  {v}" for k, v in lines), flush=True)
    sizes = _attention.sizes_for(platform)
    rows: list[Row] = []
    for case in (*_attention.CASES, *_attention.MATRIX):
        if args.case is None or case.name in args.case:
            _progress(case.name)
            rows += _attention.case_rows(case, sizes, impls)
    if args.case is None:
        from . import _kernels

        _progress("kernel properties")
        rows += [_kernels.empty_rows_row(impls, sizes), _kernels.bitwise_row(impls, sizes)]
        if platform == "tpu":
            _progress("timing against splash attention")
            rows.append(_kernels.splash_timing_row(impls))
    if not args.no_ring:
        _progress("ring")
        rows += _attention.ring_rows(impls, sizes)
    if not args.quick and jax.process_count() == 1:  # several hosts: the train job itself
        from ._train import train_row

        _progress("train")
        rows.append(train_row())
    print()
    print(_report.table(rows))
    failed = [r for r in rows if not r.ok]
    took = time.perf_counter() - start
    verdict = "all passed" if not failed else f"{len(failed)} of {len(rows)} did not pass"
    print(f"\n{len(rows)} checks in {took:.0f} s: {verdict}", flush=True)
    if runtime is not None:
        runtime.finish()
    return 1 if failed else 0


def _progress(what: str) -> None:
    print(f"running {what} ...", file=sys.stderr, flush=True)
