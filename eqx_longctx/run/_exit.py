"""How a training process reports a fatal error and ends: one line on stderr,
`eqx-longctx-train: error: <rule, values, fix>`, then the exit status; and how it reports
a preemption (`eqx-longctx-train: preempted: ...`, status [`EXIT_PREEMPTED`][]).

The CLI (`_cli.py`) and the multi-process runtime (`_distributed.py`, whose watchdog
threads end the process while the main thread is blocked in a collective) both end runs
this way.
"""

import os
import sys

PROG = "eqx-longctx-train"

EXIT_PREEMPTED = 75
"""Exit status of every process of a run that stopped on SIGTERM (a Cloud TPU spot
reclaim or maintenance event) after saving a checkpoint at a step they all agreed on:
continue with the same flags plus `--resume`. It is `EX_TEMPFAIL` of `sysexits.h` (try
again later), unlike 143, which a shell reports for a process SIGTERM killed outright."""


def error_line(error: BaseException | str, prog: str = PROG) -> str:
    """**Returns:** the CLI's one-line report of `error`: `eqx-longctx-train: error: ...`
    (`prog` names another CLI built on the trainer's, e.g. `eqx-longctx-generate`)."""
    return f"{prog}: error: {' '.join(str(error).split())}"


def preempted_line(step: int, checkpoint_dir, prog: str = PROG) -> str:
    """**Returns:** the one line a preempted run prints (process 0 alone), e.g.
    `eqx-longctx-train: preempted: saved step 7 to runs/a/checkpoints; resume with
    --resume`."""
    return f"{prog}: preempted: saved step {step} to {checkpoint_dir}; resume with --resume"


def die(message: str, code: int) -> None:
    """Print the CLI's one-line error and end the process at once (from any thread, even
    while the main thread is blocked in a collective)."""
    sys.stdout.flush()
    print(error_line(message), file=sys.stderr, flush=True)
    os._exit(code)


def exit_now(code: int) -> None:
    """End the process with `code` without waiting for the other processes (JAX's shutdown
    would wait for them at a barrier)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
