"""Orbax checkpoints of (params, optimizer state) plus a JSON record of step and config.

In a multi-process run every process calls every method (orbax's saves, restores and
deletes are collective: each process writes and reads the shards its devices hold, and
process 0 alone writes the JSON record); what is done here to files directly (cleaning
half-written saves, moving an unreadable step aside) is done by process 0 while the others
wait.

A checkpoint directory holds only orbax step folders (`<step>/state`, `<step>/meta`).
Anything else there means the path is not ours: we refuse to write into or resume from it
rather than clobber someone's files.

A step folder that cannot be read back (a truncated data file, deleted metadata, a missing
`state/`) is not fatal while an older one is intact: `restore_newest_readable` skips it and
says why, and `set_aside` moves it to `<directory>-unreadable/` so the step can be saved
again.
"""

import dataclasses
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import equinox as eqx
import orbax.checkpoint as ocp

from ..run import (
    TMP_RE,
    abstract_of,
    all_readable,
    check_checkpoint_dir,
    is_array_or_shape,
    is_primary,
    is_step_dir,
    sync,
    to_json,
    unreadable_reason,
)


class _Manager(ocp.CheckpointManager):
    """orbax's manager without its own look at JAX's preemption sync point: the loop owns
    it (`_preempt.py`), and orbax's calls, numbered by checkpoint step, would move the
    counter that the loop's calls number from 1 in each process."""

    def reached_preemption(self, step: int) -> bool:
        return False


class Checkpointer:
    """Saves and restores `(model, opt_state)` with orbax, keeping the newest few steps.

    **Arguments:**

    - `directory`: where step folders go; validated with [`check_checkpoint_dir`][].
    - `max_to_keep`: how many of the newest checkpoints to keep.
    - `async_save`: write in a background thread (the host copy is taken before `save`
      returns, so training may continue at once).

    **Raises:** `ValueError` when `max_to_keep < 1`, and as [`check_checkpoint_dir`][].
    """

    def __init__(
        self, directory: str | pathlib.Path, *, max_to_keep: int = 2, async_save: bool = True
    ):
        if max_to_keep < 1:
            raise ValueError(
                f"max_to_keep must be >= 1; got max_to_keep={max_to_keep}. Pass 1 or more."
            )
        self.directory = check_checkpoint_dir(directory)
        # Half-written saves of a killed run; removed here, synchronously (orbax's own
        # cleanup runs in a thread that a quick close() would cut short), by process 0 while
        # the others wait.
        if self.directory.is_dir() and is_primary():
            for p in self.directory.iterdir():
                if TMP_RE.match(p.name):
                    shutil.rmtree(p)
        sync("checkpoint directory cleaned")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save
        )
        self._manager = _Manager(self.directory, options=options)

    def steps(self) -> list[int]:
        """**Returns:** the saved steps, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """**Returns:** the newest saved step, or `None` when there is none."""
        return self._manager.latest_step()

    def save(self, step: int, model, opt_state, meta: dict[str, Any]) -> None:
        """Save `eqx.filter(model, eqx.is_array)`, `opt_state` and the JSON-able `meta`.

        **Arguments:**

        - `step`: number of completed updates.
        - `model`: the Equinox model.
        - `opt_state`: the optimizer state.
        - `meta`: JSON-serialisable record (config, counters); `step` is added.
        """
        state = {"params": eqx.filter(model, eqx.is_array), "opt_state": opt_state}
        meta = to_json({**meta, "step": step})
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
        )

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """**Returns:** the JSON record of `step` (default: the newest).

        **Raises:** `ValueError` when no checkpoint is saved, or `step` is not a saved one.
        """
        step = self._require_step(step)
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored["meta"])

    def restore(self, model, opt_state, step: int | None = None):
        """Restore into the structure, shapes, dtypes and shardings of `model`/`opt_state`.

        The checkpoint may have been saved under another mesh (or on one device): each
        array is read straight into the target's sharding.

        **Arguments:**

        - `model`: a model of the same config whose arrays give the targets: built, or
          abstract (`jax.ShapeDtypeStruct`s with a `sharding`, e.g.
          `Placement.abstract_model`, which allocates nothing).
        - `opt_state`: its optimizer state, likewise built or abstract.
        - `step`: which checkpoint (default: the newest).

        **Returns:** `(model, opt_state, meta)`.

        **Raises:** `ValueError` when no checkpoint is saved, or `step` is not a saved one.
        """
        step = self._require_step(step)
        params, static = eqx.partition(model, is_array_or_shape)
        target = abstract_of({"params": params, "opt_state": opt_state})
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
            ),
        )
        state = restored["state"]
        return eqx.combine(state["params"], static), state["opt_state"], dict(restored["meta"])

    def restore_newest_readable(
        self, model, opt_state, check: Callable[[dict[str, Any], str], None] | None = None
    ) -> "Restored":
        """Restore the newest checkpoint that reads back whole, skipping damaged ones.

        A checkpoint is unreadable when its JSON record or any array fails to load (a
        truncated data file, deleted metadata, a missing folder). Nothing is moved or
        deleted here: see [`set_aside`][].

        **Arguments:**

        - `model`, `opt_state`: restore targets, as for [`restore`][].
        - `check`: called as `check(meta, where)` on each readable record before its arrays
          are read; its `ValueError` (e.g. another model config) ends the search.

        **Returns:** a [`Restored`][].

        **Raises:** `ValueError` when no checkpoint is saved; when none can be read (naming
        every step and why); when `check` raises `ValueError` (raised again, with the newer
        unreadable steps appended); and in a multi-process run when a process does not
        report whether it could read a checkpoint within the timeout.
        """
        self._require_step(None)
        failures: list[tuple[int, str]] = []
        for step in reversed(self.steps()):
            where = str(self.directory / str(step))
            meta, why = None, ""
            try:
                meta = {"step": step, **self.read_meta(step)}
            except Exception as e:  # orbax and tensorstore raise many types
                why = unreadable_reason(e)
            # Every process must pick the same step: one that any process cannot read is
            # unreadable for all (else they would train from different states).
            why = all_readable(f"checkpoint {step} record", why)
            if meta is None or why:
                failures.append((step, why))
                continue
            if check is not None:
                try:
                    check(meta, where)
                except ValueError as e:
                    if not failures:
                        raise
                    listed = "; ".join(f"step {s}: {why}" for s, why in failures)
                    raise ValueError(f"{e} (Newer checkpoints cannot be read: {listed}.)") from None
            restored, why = None, ""
            try:
                restored = self.restore(model, opt_state, step)
            except Exception as e:
                why = unreadable_reason(e)
            why = all_readable(f"checkpoint {step} arrays", why)
            if restored is None or why:
                failures.append((step, why))
                continue
            return Restored(*restored, step=step, unreadable=failures)
        listed = "; ".join(f"step {s}: {why}" for s, why in failures)
        raise ValueError(
            f"resuming needs a readable checkpoint, and none in {self.directory} can be read "
            f"({listed}). Start a new --run-dir, or pass --overwrite instead of --resume to "
            "discard this run."
        )

    def set_aside(self, step: int) -> pathlib.Path:
        """Move the folder of `step` (an unreadable checkpoint) out of the checkpoint
        directory, so training can save that step again (collective: process 0 moves it).

        **Arguments:**

        - `step`: a saved step (its folder `<directory>/<step>` exists, readable or not).

        **Returns:** where it went: `<directory>-unreadable/<step>` (a suffix `-1`, `-2`, ...
        if that exists).

        **Raises:** `ValueError` when `<directory>/<step>` is not a folder (naming the step
        folders that are there).
        """
        self.wait()
        source = self.directory / str(step)
        if not source.is_dir():
            held = []
            if self.directory.is_dir():
                held = sorted(int(p.name) for p in self.directory.iterdir() if is_step_dir(p))
            has = f"step folders {held}" if held else "no step folders"
            raise ValueError(
                f"set_aside moves a saved step's folder; {self.directory} holds {has}, not "
                f"step {step}. Pass one of the steps there (Checkpointer.steps() lists the "
                "readable ones)."
            )
        sync("checkpoint set aside")  # nobody still reads it
        target = self.directory.with_name(self.directory.name + "-unreadable") / str(step)
        n = 0
        while target.exists():
            n += 1
            target = target.with_name(f"{step}-{n}")
        if is_primary():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(source, target)
        sync("checkpoint moved")
        self._manager.reload()
        return target

    def wait(self) -> None:
        """Block until any background save has finished."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager."""
        self._manager.wait_until_finished()
        self._manager.close()

    def delete_all(self) -> None:
        """Delete every checkpoint in the (validated) directory."""
        self.wait()
        for step in self.steps():
            self._manager.delete(step)

    def _require_step(self, step: int | None) -> int:
        steps = self.steps()
        if not steps:
            raise ValueError(
                f"resuming needs a saved checkpoint; {self.directory} holds none. Train "
                "without --resume first, or point --run-dir at the run that saved one."
            )
        if step is None:
            return steps[-1]
        if step not in steps:
            raise ValueError(
                f"a checkpoint can be restored only from a saved step; {self.directory} holds "
                f"steps {steps}, not step {step}. Pass one of those steps (or None: the newest)."
            )
        return step


@dataclasses.dataclass
class Restored:
    """What [`Checkpointer.restore_newest_readable`][] found.

    - `model`, `opt_state`, `meta`: as [`Checkpointer.restore`][] returns them.
    - `step`: the step restored.
    - `unreadable`: `(step, reason)` of each newer checkpoint that could not be read.
    """

    model: Any
    opt_state: Any
    meta: dict[str, Any]
    step: int
    unreadable: list[tuple[int, str]]
