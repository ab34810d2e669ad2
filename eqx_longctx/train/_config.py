"""What a training run is: every knob in one frozen dataclass, validated on construction."""

import dataclasses
import pathlib
import time
from collections.abc import Mapping
from typing import Any

NONFINITE_MODES = ("stop", "skip")
MESH_AXES = ("data", "ulysses", "context", "tensor")


def parse_mesh(text: str) -> dict[str, int]:
    """`"data=2,context=4"` -> `{"data": 2, "context": 4}` (axes in the order given)."""
    shape: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, size = part.partition("=")
        if not sep or not size.strip().isdigit() or name.strip() not in MESH_AXES:
            raise ValueError(
                f"mesh must look like 'data=2,context=4' with axes from {MESH_AXES}; got "
                f"{text!r} (bad part {part!r})."
            )
        shape[name.strip()] = int(size)
    if "context" not in shape:
        raise ValueError(
            f"mesh needs a 'context' axis (the sequence is split over it); got {text!r}. "
            "Add context=1 for plain data parallelism."
        )
    return shape


def default_run_dir(resume: bool, root: str = "runs") -> pathlib.Path:
    """A fresh `runs/<date>-<time>` directory, or for `resume` the newest run with checkpoints."""
    base = pathlib.Path(root)
    if resume:
        runs = sorted(d for d in base.glob("*") if (d / "checkpoints").is_dir())
        if not runs:
            raise ValueError(
                f"--resume without --run-dir continues the newest run under {base}/, but none "
                "there has checkpoints. Pass --run-dir of the run to continue."
            )
        return runs[-1]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = base / stamp, 1
    while path.exists():
        path, n = base / f"{stamp}-{n}", n + 1
    return path


def default_mesh(devices: int) -> str:
    """The mesh of a run on `devices` devices by default: the batch over 2 of them if it can,
    the sequence over the rest (context parallelism)."""
    if devices >= 4 and devices % 2 == 0:
        return f"data=2,context={devices // 2}"
    return f"context={devices}"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run (the CLI flags map one to one onto these fields).

    **Arguments:**

    - `preset`: key of `models.llama.PRESETS`.
    - `model_overrides`: `LlamaConfig` fields to replace, e.g. `{"num_layers": 2}`.
    - `seq_len`, `batch_size`: tokens per row, rows per step.
    - `steps`: total optimizer steps (the cosine schedule spans them).
    - `lr`, `warmup_steps`, `weight_decay`, `clip_norm`: see `make_optimizer`.
    - `data`: corpus path (`None`: the Python standard library); `max_bytes`: read at most
      this much of it (`None`: the data package's default); `val_fraction`: held-out share.
    - `run_dir`: where `metrics.jsonl`, `loss.png` and `checkpoints/` go (`None`: a new
      `runs/<date>-<time>`, or with `resume` the newest run under `runs/`).
    - `checkpoint_every`, `eval_every`, `log_every`: in steps; the last step always
      evaluates and checkpoints.
    - `eval_batches`: validation batches per periodic evaluation (`None`: the whole
      split); `final_eval_batches`: the same for the evaluation after the last step.
    - `keep_checkpoints`: how many newest checkpoints orbax keeps.
    - `resume`: continue from the newest checkpoint in `run_dir`.
    - `overwrite`: delete an earlier run's checkpoints and metrics in `run_dir`.
    - `devices`: how many (on CPU: fake) devices to run on.
    - `mesh`: their mesh, e.g. `"data=2,context=4"` (`None`: every device on `"context"`).
    - `strategy`, `load_balance`: context-parallel attention (see `ShardingSpec`).
    - `seed`: model init, validation split and batch order.
    - `on_nonfinite`: `"stop"` ends the run at a non-finite loss; `"skip"` drops the update.
    - `remat`: `"none"`, `"full"` or `"dots"` (see `eqx_longctx.nn.LayerStack`);
      `None` keeps the preset's.
    - `progress`: show a tqdm progress bar.
    """

    preset: str = "tiny"
    model_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 200
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    data: str | None = None
    max_bytes: int | None = 4 * 2**20
    val_fraction: float = 0.05
    run_dir: str | None = None
    checkpoint_every: int = 100
    eval_every: int = 50
    log_every: int = 1
    eval_batches: int | None = 16
    final_eval_batches: int | None = None
    keep_checkpoints: int = 2
    resume: bool = False
    overwrite: bool = False
    devices: int = 8
    mesh: str | None = None
    strategy: str = "ring"
    load_balance: str = "zigzag"
    seed: int = 0
    on_nonfinite: str = "stop"
    remat: str | None = None
    progress: bool = True

    def __post_init__(self):
        if self.run_dir is None:
            object.__setattr__(self, "run_dir", str(default_run_dir(self.resume)))
        if self.on_nonfinite not in NONFINITE_MODES:
            raise ValueError(
                f"on_nonfinite must be one of {NONFINITE_MODES}; got "
                f"on_nonfinite={self.on_nonfinite!r}. Pass 'stop' to end the run at the first "
                "non-finite loss or 'skip' to drop that update and continue."
            )
        positive = {
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "steps": self.steps,
            "checkpoint_every": self.checkpoint_every,
            "eval_every": self.eval_every,
            "log_every": self.log_every,
            "keep_checkpoints": self.keep_checkpoints,
            "devices": self.devices,
        }
        bad = {k: v for k, v in positive.items() if v < 1}
        if bad:
            raise ValueError(f"these settings must be at least 1; got {bad}. Pass positive values.")
        for name in ("eval_batches", "final_eval_batches"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(
                    f"{name} must be >= 1 or None (the whole split); got {name}={value}. "
                    "Pass a positive count or None."
                )
        if self.devices > 1 or self.mesh is not None:
            self._check_mesh()
        if self.resume and self.overwrite:
            raise ValueError(
                "resume continues the checkpoints in run_dir while overwrite deletes them; got "
                "resume=True and overwrite=True. Pass only one of --resume / --overwrite."
            )

    def _check_mesh(self) -> None:
        shape = parse_mesh(self.mesh or default_mesh(self.devices))
        total = 1
        for size in shape.values():
            total *= size
        if total != self.devices:
            raise ValueError(
                f"the mesh {shape} has {total} devices but devices={self.devices}; make the "
                "axis sizes multiply to the device count (--mesh / --devices)."
            )
        data = shape.get("data", 1)
        if self.batch_size % data:
            raise ValueError(
                f"the batch is split over the mesh axis 'data' of size {data}, so batch_size "
                f"must be divisible by {data}; got batch_size={self.batch_size}. Pass "
                f"--batch-size as a multiple of {data}."
            )
        n = shape["context"] * shape.get("ulysses", 1)
        need = 2 * n if self.load_balance == "zigzag" else n
        if self.seq_len % need:
            raise ValueError(
                f"load_balance={self.load_balance!r} over {n} sequence shards needs seq_len "
                f"divisible by {need}; got seq_len={self.seq_len}. Pass --seq-len as a "
                f"multiple of {need}."
            )


def build_model_config(config: TrainConfig, vocab_size: int):
    """The `LlamaConfig` a run trains: the preset, fitted to the tokenizer and `seq_len`.

    **Arguments:**

    - `config`: the run settings (`preset`, `model_overrides`, `remat`, `seq_len`).
    - `vocab_size`: the tokenizer's vocabulary size.

    **Returns:** a `models.llama.LlamaConfig`.
    """
    from models.llama import PRESETS, LlamaConfig

    if config.preset not in PRESETS:
        raise ValueError(
            f"preset must be one of {sorted(PRESETS)}; got preset={config.preset!r}. "
            "Pass e.g. --preset tiny."
        )
    base = PRESETS[config.preset]
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(config.model_overrides) - fields)
    if unknown:
        raise ValueError(
            f"model overrides must name LlamaConfig fields; got unknown {unknown}. "
            f"Valid fields: {sorted(fields)}."
        )
    changes: dict[str, Any] = {
        "vocab_size": vocab_size,
        "max_seq_len": max(base.max_seq_len, config.seq_len),
    }
    if config.remat is not None:
        changes["remat"] = config.remat
    for name, value in config.model_overrides.items():
        changes[name] = _coerce(value, getattr(base, name), name)
    return LlamaConfig.from_preset(config.preset, **changes)


def _coerce(value: Any, like: Any, name: str) -> Any:
    """Turn a CLI string into the type of the preset's value for that field."""
    if not isinstance(value, str) or isinstance(like, str) or like is None:
        return value
    if isinstance(like, bool):
        if value.lower() in ("1", "true", "yes"):
            return True
        if value.lower() in ("0", "false", "no"):
            return False
    else:
        try:
            return type(like)(value)
        except (TypeError, ValueError):
            pass
    raise ValueError(
        f"override {name}={value!r} must parse as {type(like).__name__} like the preset's "
        f"value {like!r}. Pass e.g. --override {name}={like}."
    )
