"""Reading a run's checkpoints: the layout of a checkpoint directory (only orbax step
folders, `<step>/state` and `<step>/meta`; anything else means the path is not ours), why a
step cannot be read, whether it was written for the same model, and a read-only reader
that restores a model without its optimizer state (`python -m eqx_longctx.generate
--run-dir`, the export, the evals). Writing them is the trainer's (`Checkpointer`).
"""

import json
import pathlib
import re
from typing import Any

import equinox as eqx
import jax

RESHARDABLE_MODEL_FIELDS = ("remat",)
"""Model-config fields a checkpoint may be read back under another value of (recomputing
the same values)."""
TMP_RE = re.compile(r"^\d+\.orbax-checkpoint-tmp(-\d+)?$")
"""orbax's half-written step folders."""


def is_step_dir(path: pathlib.Path) -> bool:
    # A numbered folder is a step, damaged or not: resume reports it rather than refusing
    # the whole directory as someone else's.
    return path.is_dir() and path.name.isdigit()


def check_checkpoint_dir(directory: str | pathlib.Path) -> pathlib.Path:
    """Check that `directory` is absent, empty, or holds only orbax checkpoints.

    **Arguments:**

    - `directory`: the checkpoint directory.

    **Returns:** the directory as an absolute `pathlib.Path`.

    **Raises:** `ValueError` when `directory` is a file, or a folder that holds anything but
    orbax step folders (`<step>/`) and orbax's half-written ones.
    """
    path = pathlib.Path(directory).absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(
            "a checkpoint directory must be a directory that holds only orbax step folders; "
            f"{path} is a file. Remove it or choose another --run-dir."
        )
    if path.is_dir():
        foreign = sorted(
            p.name for p in path.iterdir() if not (is_step_dir(p) or TMP_RE.match(p.name))
        )
        if foreign:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise ValueError(
                "a checkpoint directory must hold only orbax step folders (<step>/); "
                f"{path} also holds {len(foreign)} other entries: {shown}. Refusing to write "
                "there or resume from it: choose another --run-dir or move those files away."
            )
    return path


def to_json(obj: Any) -> Any:
    # Round trip through JSON so configs compare equal to what a checkpoint stored.
    return json.loads(json.dumps(obj, default=str))


def is_array_or_shape(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)


def abstract_of(tree):
    def spec(x):
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(spec, tree)


def unreadable_reason(error: BaseException, limit: int = 240) -> str:
    """One line on why a checkpoint failed to load: the innermost cause's type and the
    first line of its message (tensorstore's long spec dump cut off).

    **Arguments:**

    - `error`: what orbax raised.
    - `limit`: most characters of message kept.

    **Returns:** e.g. `"ValueError: OUT_OF_RANGE: Error reading "params.w/0.0" ..."`.
    """
    while error.__cause__ is not None:
        error = error.__cause__
    text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    text = str(text).strip().split("\n")[0].split(" [tensorstore_spec")[0]
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}"


def check_meta_matches(meta: dict[str, Any], model_config: dict[str, Any], where: str) -> None:
    """Check that a checkpoint was written for the same model config.

    **Arguments:**

    - `meta`: the checkpoint's JSON record (holds `model_config`).
    - `model_config`: the requested config as a dict.
    - `where`: the checkpoint path, for the message.

    **Raises:** `ValueError` listing the fields that differ, or when `meta` records no
    model config.
    """
    saved = meta.get("model_config")
    wanted = to_json(model_config)
    if isinstance(saved, dict):  # remat recomputes the same values: free to change
        saved = {k: v for k, v in saved.items() if k not in RESHARDABLE_MODEL_FIELDS}
        wanted = {k: v for k, v in wanted.items() if k not in RESHARDABLE_MODEL_FIELDS}
    if saved == wanted:
        return
    if not isinstance(saved, dict):
        raise ValueError(
            f"a checkpoint must record its model config; {where} has none. Resume only from "
            "checkpoints written by eqx_longctx.train, or start a fresh --run-dir."
        )
    keys = sorted(set(saved) | set(wanted))
    diffs = [
        f"{k}: saved={saved.get(k)!r} requested={wanted.get(k)!r}"
        for k in keys
        if saved.get(k) != wanted.get(k)
    ]
    raise ValueError(
        "the resumed model config must match the checkpoint's; "
        f"{where} differs in {'; '.join(diffs)}. Pass the same --preset/--override flags "
        "as the run that wrote it, or start a fresh --run-dir."
    )


class CheckpointReader:
    """Read-only access to a run's checkpoints, for using a model rather than resuming its
    training (`python -m eqx_longctx.generate --run-dir`): it never cleans, moves or writes
    anything, so it may read a run that is still training.

    **Arguments:**

    - `directory`: the checkpoint directory (`<run_dir>/checkpoints`).

    **Raises:** `ValueError` as [`check_checkpoint_dir`][], and when `directory` is not a
    folder.
    """

    def __init__(self, directory: str | pathlib.Path):
        self.directory = check_checkpoint_dir(directory)
        if not self.directory.is_dir():
            raise ValueError(
                f"reading a run's model needs its checkpoints; {self.directory} does not "
                "exist. Point --run-dir at a run of python -m eqx_longctx.train that saved one."
            )
        import orbax.checkpoint as ocp  # loaded by the readers that need it

        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(read_only=True),
            item_handlers={
                "state": ocp.PyTreeCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    def steps(self) -> list[int]:
        """**Returns:** the saved steps, oldest first."""
        return sorted(self._manager.all_steps())

    def read_meta(self, step: int) -> dict[str, Any]:
        """**Returns:** the JSON record of `step` (model config, the run's flags, ...)."""
        import orbax.checkpoint as ocp

        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored["meta"])

    def read_model(self, model, step: int):
        """The parameters of `step` restored into `model`'s structure and shardings; the
        optimizer state is not read.

        **Arguments:**

        - `model`: a model of the checkpoint's config, built or abstract (e.g.
          `Placement.abstract_model`); its arrays give the shapes, dtypes and shardings.
        - `step`: a saved step.

        **Returns:** the model with the checkpoint's parameters.
        """
        import orbax.checkpoint as ocp

        params, static = eqx.partition(model, is_array_or_shape)
        target = abstract_of(params)
        stored = self._manager.item_metadata(step)["state"]
        stored = getattr(stored, "tree", stored)
        skip = jax.tree.map(lambda _: ocp.PLACEHOLDER, stored["opt_state"])
        item = {"params": target, "opt_state": skip}
        restore_args = {
            "params": ocp.checkpoint_utils.construct_restore_args(target),
            "opt_state": skip,
        }
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.PyTreeRestore(item, restore_args=restore_args)),
        )
        return eqx.combine(restored["state"]["params"], static)

    def close(self) -> None:
        """Release the manager."""
        self._manager.close()
