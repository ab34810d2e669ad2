"""Preemption: SIGTERM (a Cloud TPU spot reclaim or maintenance event) ends a run at a step
boundary every process agrees on, where the loop saves a checkpoint and stops.

The loop asks [`PreemptionNotice.requested`][] once at every step boundary, on every
process, and stops there when it answers `True`:

- One process: a SIGTERM handler, installed while a notice is open (from the main thread
  only; the previous handler is restored when the last open notice closes), sets a flag
  that the boundary reads. No collective, no system call: the step is not slowed.
- Several processes (`jax.distributed`): JAX's preemption service catches SIGTERM in C++
  (on by default, `jax_enable_preemption_service`), tells every process through the
  coordination service, and agrees on the boundary after the furthest one's
  (`jax.experimental.multihost_utils.reached_preemption_sync_point`). Between notices
  that is a mutex and a comparison in C++. No Python handler is installed there: it would
  replace JAX's, and only the signalled process would know.

With several processes and the preemption service turned off, SIGTERM keeps its default
action (the process ends, and its peers exit with status 3 after `--peer-timeout`).
"""

import signal
import threading

from .._compat import preemption_service_running

_BOUNDARIES = [0]
# JAX's sync point is "one past the furthest process's last call", in the numbers the calls
# pass, 0 before any. So the calls are numbered from 1 in each process, not by training step:
# a notice that comes while a resumed run restores (no call yet) must stop it at its first
# boundary, not at step 1, which it has passed. Numbered across Trainers, as the service
# lives as long as the process; no one else may call it (see `_checkpoint._Manager`).

_OPEN: list["PreemptionNotice"] = []  # the notices our handler flags
_PREVIOUS: list = []  # the handler ours replaced, while ours is installed


def _handle(signum, frame) -> None:
    for notice in _OPEN:
        notice.received = True


class PreemptionNotice:
    """Whether this run was asked to stop, agreed at step boundaries.

    Open from construction to [`close`][] (or use it as a context manager).

    **Arguments:**

    - `signum`: the signal caught in a single-process run (SIGTERM, the notice of Cloud
      TPU preemptions and of most schedulers).
    """

    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = signum
        self.received = False
        self.closed = False
        self._jax = preemption_service_running()
        self._open = False
        if not self._jax and _process_count() == 1 and _in_main_thread():
            if not _PREVIOUS:
                _PREVIOUS.append(signal.signal(signum, _handle))
            _OPEN.append(self)
            self._open = True

    @property
    def watching(self) -> bool:
        """Whether a notice can reach this process (`False` once closed, off the main
        thread of a single-process run, or with several processes and JAX's preemption
        service off)."""
        return not self.closed and (self._jax or self._open)

    def requested(self) -> bool:
        """**Returns:** whether every process stops at this step boundary. Call it once
        at every boundary, on every process (with several, the calls are counted)."""
        if self._jax:
            from jax.experimental.multihost_utils import reached_preemption_sync_point

            _BOUNDARIES[0] += 1
            if reached_preemption_sync_point(_BOUNDARIES[0]):
                self.received = True
        return self.received

    def close(self) -> None:
        """Stop watching; the last open notice restores the handler ours replaced."""
        self.closed = True
        if not self._open:
            return
        self._open = False
        _OPEN.remove(self)
        if not _OPEN and _in_main_thread():  # elsewhere signal.signal refuses
            previous = _PREVIOUS.pop()
            signal.signal(self.signum, signal.SIG_DFL if previous is None else previous)

    def __enter__(self) -> "PreemptionNotice":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _process_count() -> int:
    import jax

    return jax.process_count()


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
