"""A training run's model read back from its newest readable checkpoint: what `python -m
eqx_longctx.generate --run-dir`, `python -m eqx_longctx.export` and the evals start from.
"""

import dataclasses
import pathlib
import sys
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from ._runs import read_flags


class RunModel(NamedTuple):
    """A run's model as a checkpoint holds it: the `step`, the run's recorded `flags` (as
    `flags.json` has them: `model`, `preset`, `seq_len`, ...), its `tokenizer`, model
    `config`, the `--init-hf` source (`start`, an `HFStart`, or `None`) and the `model`
    itself."""

    step: int
    flags: dict[str, Any]
    tokenizer: Any
    config: Any
    start: Any
    model: Any


def read_run_model(
    run_dir: pathlib.Path,
    placement_of: Callable[[Any, Any], Any],
    *,
    reader: str,
    step: int | None = None,
) -> RunModel:
    """The model of `run_dir`'s newest readable checkpoint (or of `step`), each unreadable
    newer one reported in one line on stderr.

    **Arguments:**

    - `run_dir`: a run of `python -m eqx_longctx.train`.
    - `placement_of(config, family) -> Placement`: where to read the model (it may check
      the run against it and raise).
    - `reader`: the command reading, for messages (e.g. `"generate"`).
    - `step`: the checkpoint to read (`None`: the newest readable one).

    **Returns:** a `RunModel`.

    **Raises:** `ValueError` when `run_dir` holds no checkpoint (or not `step`), none can
    be read, one records no flags, or its model config differs from the flags'.
    """
    import jax

    from .._family import model_family
    from ._checkpoints import CheckpointReader, check_meta_matches, unreadable_reason
    from ._hf_source import run_model_config

    run_dir = pathlib.Path(run_dir)
    checkpoints = CheckpointReader(run_dir / "checkpoints")
    try:
        steps = checkpoints.steps()
        if step is not None and step not in steps:
            raise ValueError(
                f"--step must be a saved step of {checkpoints.directory}; got --step {step}, "
                f"saved steps {steps}. Pass one of them, or leave --step out for the newest."
            )
        if not steps:
            raise ValueError(
                f"--run-dir {run_dir} holds no checkpoint ({checkpoints.directory} is empty). "
                "Train first (python -m eqx_longctx.train --run-dir ...), or point at a run "
                "that saved one."
            )
        failures = []
        for s in [step] if step is not None else list(reversed(steps)):
            where = str(checkpoints.directory / str(s))
            try:
                meta = checkpoints.read_meta(s)
            except Exception as e:  # orbax and tensorstore raise many types
                failures.append(f"step {s}: {unreadable_reason(e)}")
                continue
            flags = meta.get("train_config") or read_flags(run_dir)
            if not isinstance(flags, dict):
                raise ValueError(
                    f"{where} records no training flags and {run_dir} has no flags.json; "
                    f"{reader} reads runs of python -m eqx_longctx.train only."
                )
            _check_recorded(flags, where)
            tokenizer, config, start = run_model_config(flags, run_dir)
            check_meta_matches(meta, dataclasses.asdict(config), where)
            family = model_family(flags["model"])
            placement = placement_of(config, family)
            abstract = placement.abstract_model(
                lambda spec: family.model(config, key=jax.random.key(0), spec=spec)  # noqa: B023
            )
            try:
                model = checkpoints.read_model(abstract, s)
            except Exception as e:  # orbax and tensorstore raise many types
                failures.append(f"step {s}: {unreadable_reason(e)}")
                continue
            for failure in failures:
                print(f"checkpoint {failure} cannot be read; using step {s}", file=sys.stderr)
            return RunModel(s, dict(flags), tokenizer, config, start, model)
        raise ValueError(
            f"--run-dir {run_dir}: no checkpoint in {checkpoints.directory} can be read "
            f"({'; '.join(failures)})."
        )
    finally:
        checkpoints.close()


_RECORDED = {"model": str, "preset": str, "seq_len": int, "model_overrides": Mapping}


def _check_recorded(flags: Mapping[str, Any], where: str) -> None:
    """**Raises:** `ValueError` when a run's record lacks a flag its model is built from."""
    bad = [
        name for name, kind in _RECORDED.items()
        if not isinstance(flags.get(name, {} if kind is Mapping else None), kind)
    ]  # fmt: skip
    if bad:
        raise ValueError(
            f"{where} records its flags without a readable {', '.join(bad)}; only runs of "
            "python -m eqx_longctx.train can be read. Point --run-dir at such a run."
        )
