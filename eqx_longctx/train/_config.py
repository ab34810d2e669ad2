"""What a training run is: every knob in one frozen dataclass, validated on construction."""

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._family import family_names
from ..run import default_mesh as default_mesh_shape
from ..run import default_run_dir, fsdp_axes_of, mesh_shape, mesh_text, preset_model_config
from ._offload import host_offload_of

NONFINITE_MODES = ("stop", "skip")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run (the CLI flags map one to one onto these fields).

    Every field is checked on construction by [`check_train_config`][] (types, ranges,
    choices, the mesh), before any data is read or anything traced; `Trainer` then checks
    the mesh against the batch, sequence and heads with `eqx_longctx.run.Placement.check_run`.

    **Raises:** `TypeError` and `ValueError` as [`check_train_config`][]; `ValueError` also
    when `resume` is set without a `run_dir` and no run under `runs/` has checkpoints.

    **Arguments:**

    - `model`: the model family, one of `eqx_longctx.family_names()` (the zoo's `"llama"`
      and `"deepseek"`, or any family registered as a plugin: see `eqx_longctx.ModelFamily`).
    - `preset`: key of that family's presets (`eqx_longctx.model_family(model).presets`).
    - `model_overrides`: fields of the family's config to replace, e.g. `{"n_layers": 2}`.
    - `init_hf`: a Hugging Face checkpoint directory of family `model` to fine-tune from
      (`None`: a fresh model of `preset`). Its `config.json` gives the architecture (`preset`
      is then unused), its weights the starting point, its `tokenizer.json` the tokens of
      `data`; `model_overrides` may change only what keeps every weight's shape (e.g.
      `rope_theta`, `max_seq_len`). See `eqx_longctx.train._init_hf`.
    - `init_run`: a run directory of `python -m eqx_longctx.train` whose newest readable
      checkpoint's weights this run starts from, with a fresh optimizer and step count:
      the long stage after a short one (context extension). The model is this run's
      (`model`, `preset`, `model_overrides`), which may differ from that run's only in
      what keeps every weight (`seq_len`, `max_seq_len`, `rope_theta`, `rope_scaling`);
      the data, batch and schedule are this run's flags. Not with `init_hf`.
    - `seq_len`, `batch_size`: tokens per row, rows per optimizer step.
    - `grad_accum`: the step's rows run as this many micro-batches one after another, their
      gradients summed in float32 before one optimizer update (`make_train_step`): the
      same update with one micro-batch's activations. It must divide `batch_size`.
    - `loss_chunk`: tokens per chunk of the loss on each device: the cross-entropy meets the
      logits a chunk at a time and the backward recomputes them, so the whole `[tokens,
      vocab]` logits are never held (`eqx_longctx.train.loss_fn`). `None`: automatic
      (`eqx_longctx.nn.LOSS_CHUNK_BYTES` of float32 logits per chunk); `0`: the whole
      logits at once.
    - `steps`: total optimizer steps (the cosine schedule spans them).
    - `lr`, `warmup_steps`, `weight_decay`, `clip_norm`: see `make_optimizer`; `lr` finite
      and positive, `warmup_steps` below `steps` (`None`: `min(20, steps // 10)`).
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
    - `mesh`: their mesh, e.g. `"data=2,context=4"` or `"fsdp=2,context=4"` (axes from
      `eqx_longctx.run.MESH_AXES`; `None`: `eqx_longctx.run.default_mesh`).
    - `fsdp_axes`: the mesh axes the parameters, gradients and optimizer state are split
      over, comma-separated (e.g. `"fsdp,context"`); `None`: `"fsdp"` when the mesh has that
      axis, else none (every weight replicated, as without FSDP).
    - `strategy`, `load_balance`: context-parallel attention (see `ShardingSpec`).
    - `seed`: model init, validation split and batch order.
    - `on_nonfinite`: `"stop"` ends the run at a non-finite loss; `"skip"` drops the update.
    - `remat`: one of `eqx_longctx.nn.REMAT_POLICIES` (`"none"`, `"full"`, `"dots"`, ...;
      see `eqx_longctx.nn.LayerStack`); `None` keeps the preset's.
    - `host_offload`: what lives in host memory between steps, comma-separated among
      `eqx_longctx.train.HOST_OFFLOADS` (`"opt_state"`: AdamW's moments; `"params"`: the
      parameters), streamed to the device inside each step (`make_train_step`); `None`:
      everything on the device.
    - `synthetic`: comma-separated retrieval tasks (`eqx_longctx.evals.TASKS`, e.g.
      `"passkey,niah_multikey"`) whose generated documents are mixed into the training rows
      (`None`: text only); the validation split stays text.
    - `synthetic_share`: the share of training rows that hold them, in `[0, 1)`.
    - `synthetic_loss`: what the loss counts in those documents: `"all"` their tokens, or
      `"answers"` the answers alone (`eqx_longctx.evals.retrieval_dataset`).
    - `synthetic_filler`: `None` (whole prompts of varied lengths), or drills: the tasks'
      needles and question without the intro in 0 to this many filler tokens, several to a
      row (`retrieval_dataset`'s `max_filler`); how a small model first learns to retrieve.
    - `progress`: show a tqdm progress bar.
    """

    model: str = "llama"
    preset: str = "tiny"
    model_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    init_hf: str | os.PathLike[str] | None = None
    init_run: str | os.PathLike[str] | None = None
    seq_len: int = 256
    batch_size: int = 8
    grad_accum: int = 1
    loss_chunk: int | None = None
    steps: int = 200
    lr: float = 3e-3
    warmup_steps: int | None = None
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    data: str | os.PathLike[str] | None = None
    max_bytes: int | None = 4 * 2**20
    val_fraction: float = 0.05
    run_dir: str | os.PathLike[str] | None = None
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
    fsdp_axes: str | None = None
    host_offload: str | None = None
    strategy: str = "ring"
    load_balance: str = "zigzag"
    seed: int = 0
    on_nonfinite: str = "stop"
    remat: str | None = None
    synthetic: str | None = None
    synthetic_share: float = 0.5
    synthetic_loss: str = "all"
    synthetic_filler: int | None = None
    progress: bool = True

    def __post_init__(self):
        for name in ("run_dir", "data", "init_hf", "init_run"):  # accept paths, record strings
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, name, os.fspath(value))
        if self.warmup_steps is None and isinstance(self.steps, int):
            object.__setattr__(self, "warmup_steps", min(20, self.steps // 10))
        check_train_config(self)
        if self.run_dir is None:
            object.__setattr__(self, "run_dir", str(default_run_dir(self.resume)))


def flag_name(field: str) -> str:
    """**Returns:** the CLI flag of a `TrainConfig` field (`seq_len` -> `--seq-len`), or the
    field's own name for those only the library sets."""
    if field in _LIBRARY_ONLY:
        return field
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


_FLAGS = {"model_overrides": "--override", "progress": "--no-progress"}
_LIBRARY_ONLY = ("keep_checkpoints", "val_fraction")

# Integer fields: (smallest allowed value or None, what the number counts).
_INTS = {
    "seq_len": (1, "tokens per row"),
    "batch_size": (1, "rows per step"),
    "grad_accum": (1, "micro-batches per optimizer step"),
    "loss_chunk": (0, "tokens per chunk of the loss; 0: the whole logits"),
    "steps": (None, "optimizer steps"),  # ranges: check_optimizer_settings
    "warmup_steps": (None, "steps of learning-rate warmup"),
    "checkpoint_every": (1, "steps between checkpoints"),
    "eval_every": (1, "steps between evaluations"),
    "log_every": (1, "steps between metrics lines"),
    "keep_checkpoints": (1, "newest checkpoints kept"),
    "devices": (1, "devices to run on"),
    "seed": (0, "the random seed"),
    "max_bytes": (1, "corpus bytes to read; None: the data package's default"),
    "synthetic_filler": (0, "the most filler tokens of a retrieval drill; None: whole prompts"),
    "eval_batches": (1, "validation batches per evaluation; None: the whole split"),
    "final_eval_batches": (1, "validation batches after the last step; None: the whole split"),
}
_OPTIONAL = (
    "max_bytes", "eval_batches", "final_eval_batches", "data", "run_dir", "mesh", "fsdp_axes",
    "remat", "loss_chunk", "host_offload", "init_hf", "init_run", "synthetic",
    "synthetic_filler",
)  # fmt: skip
# Examples for the fields whose default is None:
_EXAMPLES = {"final_eval_batches": 16, "loss_chunk": 1024, "synthetic_filler": 32}
# Float fields: (rule, test, example); None: the range is check_optimizer_settings's.
_FLOATS = {
    "lr": (None, None, "3e-3"),
    "weight_decay": (None, None, "0.1"),
    "clip_norm": (None, None, "1.0"),
    "val_fraction": ("finite and strictly between 0 and 1", lambda x: 0 < x < 1, "0.05"),
    "synthetic_share": ("finite, at least 0 and below 1", lambda x: 0 <= x < 1, "0.5"),
}
_STRS = (
    "model", "preset", "data", "run_dir", "mesh", "fsdp_axes", "host_offload", "init_hf",
    "init_run", "synthetic", "synthetic_loss",
)  # fmt: skip
_BOOLS = ("resume", "overwrite", "progress")
_SEED_LIMIT = 2**32


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_train_config(config: "TrainConfig") -> None:
    """Check every field of `config` before anything runs: types, ranges, choices, the mesh.

    Each rule has one home: the optimizer's ranges are `check_optimizer_settings`'s (which
    `make_optimizer` runs too), the mesh syntax is `eqx_longctx.run.parse_mesh`'s, and batch,
    sequence-length and head divisibility by the mesh are the `ShardingSpec`'s, run by
    `Placement.check_run`.

    **Arguments:**

    - `config`: the settings to check.

    **Raises:** each error names the flag, the value and the fix.

    - `TypeError` for a field of the wrong type: an integer field that is not an int (a
      bool is not one), `lr`, `weight_decay`, `clip_norm` or `val_fraction` not a number, a
      string or bool field that is not one, or `model_overrides` not a mapping with string
      keys.
    - `ValueError` for an integer below its minimum (`seq_len`, `batch_size`, the strides,
      `keep_checkpoints`, `devices`, `max_bytes`, the evaluation sizes, `grad_accum`: 1;
      `seed`: 0), a `batch_size` that `grad_accum` does not divide, a
      `seed >= 2**32`, `val_fraction` not strictly between 0 and 1, a `model`, `strategy`,
      `load_balance`, `on_nonfinite` or `remat` not among the choices, an optimizer setting
      out of range (`lr` finite and > 0, `steps >= 1`, `warmup_steps >= 0`,
      `weight_decay` finite and >= 0, `clip_norm` finite and > 0), `warmup_steps >= steps`,
      a `mesh` or `fsdp_axes` rejected by `eqx_longctx.run.mesh_shape` or
      `eqx_longctx.run.fsdp_axes_of`, both `resume` and `overwrite`, or both
      `init_hf` and `init_run`.
    """
    from eqx_longctx._sharding import LOAD_BALANCES, STRATEGIES
    from eqx_longctx.nn import REMAT_POLICIES

    from ._step import check_optimizer_settings

    defaults = {f.name: f.default for f in dataclasses.fields(config)} | _EXAMPLES
    for name, (low, what) in _INTS.items():
        value, flag = getattr(config, name), flag_name(name)
        if value is None and name in _OPTIONAL:
            continue
        if value is None or not _is_int(value):
            raise TypeError(
                f"{flag} ({what}) must be an integer; got {type(value).__name__} {value!r}. "
                f"Pass e.g. {flag} {defaults[name]}."
            )
        if low is not None and value < low:
            raise ValueError(
                f"{flag} ({what}) must be at least {low}; got {flag} {value}. Pass e.g. "
                f"{flag} {defaults[name]}."
            )
    if config.seed >= _SEED_LIMIT:
        raise ValueError(
            f"--seed must be below 2**32 (it seeds JAX and NumPy generators); got --seed "
            f"{config.seed}. Pass e.g. --seed {config.seed % _SEED_LIMIT}."
        )
    for name, (rule, ok, example) in _FLOATS.items():
        value, flag = getattr(config, name), flag_name(name)
        if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(
            value, (bool, np.bool_)
        ):
            raise TypeError(
                f"{flag} must be a number; got {type(value).__name__} {value!r}. Pass e.g. "
                f"{flag} {example}."
            )
        if ok is not None and not (math.isfinite(value) and ok(value)):
            raise ValueError(
                f"{flag} must be {rule}; got {flag} {value}. Pass e.g. {flag} {example}."
            )
    for name in _STRS + _BOOLS:
        value, flag = getattr(config, name), flag_name(name)
        kind = bool if name in _BOOLS else str
        if not isinstance(value, kind) and not (value is None and name in _OPTIONAL):
            fix = (
                "True or False"
                if kind is bool
                else "a string" + (" or None" if name in _OPTIONAL else "")
            )
            raise TypeError(
                f"{flag} must be a {kind.__name__}; got {type(value).__name__} {value!r}. "
                f"Pass {fix}."
            )
        empty_is_bad = ("data", "run_dir", "mesh", "fsdp_axes", "init_hf", "init_run", "synthetic")
        if name in empty_is_bad and value == "":
            raise ValueError(
                f"{flag} must not be empty; got {flag} ''. Leave the flag out for its "
                "default, or pass a value."
            )
    if not isinstance(config.model_overrides, Mapping) or not all(
        isinstance(k, str) for k in config.model_overrides
    ):
        raise TypeError(
            "--override (model_overrides) must map field names of the model's config (e.g. "
            f"LlamaConfig) to values; got {config.model_overrides!r}. Pass e.g. "
            "{'n_layers': 2} (CLI: --override n_layers=2)."
        )
    choices = {
        "model": family_names(),
        "strategy": STRATEGIES,
        "load_balance": LOAD_BALANCES,
        "on_nonfinite": NONFINITE_MODES,
        "remat": (*REMAT_POLICIES, None),
        "synthetic_loss": ("all", "answers"),
    }
    for name, allowed in choices.items():
        value, flag = getattr(config, name), flag_name(name)
        if value not in allowed:
            raise ValueError(
                f"{flag} must be one of {allowed}; got {flag} {value!r}. Pass e.g. {flag} "
                f"{allowed[0]}."
            )
    check_optimizer_settings(
        lr=config.lr,
        total_steps=config.steps,
        warmup_steps=config.warmup_steps,
        weight_decay=config.weight_decay,
        clip_norm=config.clip_norm,
    )
    # make_schedule would clip a longer warmup; from the CLI that is a mistake to report.
    if config.warmup_steps and config.warmup_steps >= config.steps:
        raise ValueError(
            "--warmup-steps must be below --steps (the learning rate warms up, then decays "
            f"over the rest of the run); got --warmup-steps {config.warmup_steps} and --steps "
            f"{config.steps}. Pass e.g. --warmup-steps {config.steps // 10}."
        )
    shape = None
    if config.devices > 1 or config.mesh is not None:
        shape = mesh_shape(config.mesh, config.devices)
    text = config.mesh or mesh_text(default_mesh_shape(config.devices))
    fsdp_axes_of(config.fsdp_axes, shape, text)
    host_offload_of(config.host_offload)
    k = config.grad_accum
    if config.batch_size % k:
        raise ValueError(
            f"--batch-size (rows per optimizer step) must split into --grad-accum "
            f"micro-batches; got --batch-size {config.batch_size} and --grad-accum {k}. Pass "
            f"a --batch-size that is a multiple of {k} (e.g. {-(-config.batch_size // k) * k})."
        )
    if config.synthetic is not None:
        from eqx_longctx.evals import TASKS

        unknown = [t for t in config.synthetic.split(",") if t not in TASKS]
        if unknown:
            raise ValueError(
                f"--synthetic takes comma-separated retrieval tasks among {', '.join(TASKS)}; "
                f"got unknown {unknown}. Pass e.g. --synthetic passkey,niah_multikey."
            )
    if config.resume and config.overwrite:
        raise ValueError(
            "--resume continues the checkpoints in --run-dir while --overwrite deletes them; "
            "got both. Pass only one of --resume / --overwrite."
        )
    if config.init_hf is not None and config.init_run is not None:
        raise ValueError(
            f"a run starts from one set of weights; got both --init-hf {config.init_hf} and "
            f"--init-run {config.init_run}. Pass only one of them."
        )


def build_model_config(config: TrainConfig, vocab_size: int):
    """The model config a run of a fresh model trains: the preset of its family, fitted to
    the tokenizer and `seq_len` (`eqx_longctx.run.preset_model_config` of the run's
    `model`, `preset`, `model_overrides`, `seq_len` and `remat`).

    **Arguments:**

    - `config`: the run settings.
    - `vocab_size`: the tokenizer's vocabulary size.

    **Returns:** an instance of `eqx_longctx.model_family(config.model).config` (e.g.
    `LlamaConfig`).

    **Raises:** `ValueError` for a `preset` the family does not have, an override that is
    not a field of its config or whose text does not parse as the preset's value for that
    field; `TypeError` and `ValueError` as the config's constructor for the values that
    result.
    """
    return preset_model_config(
        config.model, config.preset, config.model_overrides, vocab_size=vocab_size,
        seq_len=config.seq_len, remat=config.remat,
    )  # fmt: skip
