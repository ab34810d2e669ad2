"""The training loop: data, model, optimizer, metrics, evaluation and checkpoints in order.

Batches come from `GrainBatches`: a pure function of (seed, step), each process reading and
placing only the rows and sequence slots its devices hold. Resume is exact: the checkpoint
holds the parameters, the optimizer state (whose step count drives the schedule), the step,
the skipped-step count and the data iterator's state, so step `s + 1` after a resume sees
what it would have seen, at any process count and mesh (the arithmetic then equal up to
floating-point summation order).

A fresh run writes its flags to `<run_dir>/flags.json`; `--resume` refuses flags that would
make it a different run (see `_record.py` for which may change) and falls back past
checkpoints it cannot read.

In a multi-process run (`jax.distributed` initialized) every process runs the same loop on
its share of the global arrays; process 0 alone prints, shows the progress bar and writes
`flags.json`, `metrics.jsonl` and the plot, while checkpoints are written by all (see
`_checkpoint.py`).

SIGTERM (a preemption) stops the run at the next step boundary every process agrees on,
with a checkpoint saved there (see `_preempt.py`); resuming from it is exact like any other.
"""

import dataclasses
import math
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax

from .._family import model_family
from ..data import place_batch
from ..run import (
    FLAGS_FILE,
    agree,
    check_checkpoint_dir,
    check_meta_matches,
    hf_start,
    is_primary,
    placement_from_flags,
    read_flags,
    sync,
)
from ._checkpoint import Checkpointer
from ._config import TrainConfig, build_model_config, flag_name
from ._eval import check_batch, evaluate
from ._init_run import weights_of_run
from ._metrics import MetricsLog, TrainResult, describe_loss, plot_metrics
from ._offload import host_offload_of, to_device, to_host
from ._preempt import PreemptionNotice
from ._record import check_resume_flags, keep_source, run_flags, write_flags
from ._step_cache import cached_train_step

BatchHook = Callable[[int, Any], Any]


def _quiet(*_: Any, **__: Any) -> None:
    """Where the messages of processes other than process 0 go."""


class Trainer:
    """Builds everything a run needs from a [`TrainConfig`][], then [`run`][] trains.

    Construction validates the run directory: it resumes from (`resume=True`), clears
    (`overwrite=True`), or refuses to touch an earlier run's checkpoints. Resuming restores
    the newest readable checkpoint (each unreadable newer one is reported in one line on
    stderr and moved aside) after checking that the flags continue the recorded run; when
    that checkpoint is already at `config.steps`, `nothing_to_do` holds a message saying so
    (else `None`) and [`run`][] trains nothing.

    A single-process Trainer built in the main thread holds the SIGTERM handler from its
    construction until [`run`][] returns (see there), or [`close`][]; then the one it
    replaced is back.

    **Arguments:**

    - `config`: the run settings; `config.model` picks the family
      (`eqx_longctx.model_family`), so the loop trains a Llama, a DeepSeek (MLA + MoE) or
      any family registered as a plugin alike.
    - `datasets`: `(train, val)` `PackedDataset`s to use instead of loading `config.data`
      (encoded with `ByteTokenizer`, like `load_datasets`).
    - `batch_hook`: `hook(step, batch) -> batch` applied to every training batch, a
      `Batch` of global `jax.Array`s in the spec's token layout (a field returned as a host
      array of the same shape, e.g. by `np.full_like`, is placed like the one it replaces)
      (to inject
      faults in tests, or augment).

    With `config.init_hf` the model, its config and the tokenizer come from a Hugging Face
    checkpoint (see `eqx_longctx.train._init_hf`); `datasets` must then be encoded with
    that checkpoint's `HFTokenizer`.

    **Raises:** `ValueError` (before any step is trained) for:

    - a `preset` or `model_overrides` the family rejects (see [`build_model_config`][]),
      and `TypeError` or `ValueError` from the model config's own checks;
    - a mesh the devices, batch, sequence, heads or experts do not fit (see
      `eqx_longctx.run.Placement` and its `check_run`), or a weight dimension it does not
      divide (see `eqx_longctx.param_pspecs`);
    - a `run_dir` that is a file, or whose `checkpoints/` holds foreign files (see
      [`check_checkpoint_dir`][]);
    - a fresh run (neither `resume` nor `overwrite`) over an earlier run's checkpoints;
    - `resume` with no checkpoint, none readable, flags that differ from the recorded
      run's (`flags.json`, or the checkpoint's record; an unreadable `flags.json`), another
      model config, or a data state from another seed, batch size or data;
    - a corpus that `load_datasets` cannot read or split (or, with `init_hf`, that the
      checkpoint's tokenizer cannot encode), or `datasets` packed at another `seq_len`;
    - an `init_hf` checkpoint that cannot start the run (see `hf_start`), or an
      `init_run` whose weights cannot (see `weights_of_run` in `_init_run.py`).
    """

    def __init__(self, config: TrainConfig, *, datasets=None, batch_hook: BatchHook | None = None):
        from ..data import ByteTokenizer, GrainBatches, GrainEvalBatches, load_datasets

        self.config = config
        self.batch_hook = batch_hook
        self.primary = is_primary()
        self.run_dir = pathlib.Path(str(config.run_dir))  # resolved by TrainConfig
        # Every check that needs no data comes first: bad flags fail before the corpus is
        # read and the model built.
        self.family = model_family(config.model)
        self.hf_start = hf_start(
            self.run_dir, model=config.model, init_hf=config.init_hf, seq_len=config.seq_len,
            overrides=config.model_overrides, remat=config.remat, resume=config.resume,
        )  # fmt: skip
        if self.hf_start is None:
            self.tokenizer: Any = ByteTokenizer()
            self.model_config = build_model_config(config, self.tokenizer.vocab_size)
        else:
            self.tokenizer = self.hf_start.tokenizer
            self.model_config = self.hf_start.model_config
        self.parallel = placement_from_flags(
            config.devices, config.mesh, config.strategy, config.load_balance,
            config.fsdp_axes, vocab_size=self.model_config.vocab_size,
        )  # fmt: skip
        self.parallel.check_run(
            config.batch_size, config.seq_len, self.model_config, family=self.family,
            grad_accum=config.grad_accum, name=flag_name,
        )  # fmt: skip
        # The layout of every weight: a dimension the mesh does not divide fails here.
        self._abstract_model = self.parallel.abstract_model(self._make_model)
        for path in (self.run_dir, *self.run_dir.parents):
            if path.exists() and not path.is_dir():
                raise ValueError(
                    f"run_dir must be a directory; got run_dir={str(self.run_dir)!r}, and "
                    f"{str(path)!r} is a file. Pass another --run-dir."
                )
        checkpoint_dir = check_checkpoint_dir(self.run_dir / "checkpoints")
        if config.resume and not checkpoint_dir.is_dir():
            raise ValueError(
                f"resuming needs a saved checkpoint; {checkpoint_dir} does not exist. Train "
                "without --resume first, or point --run-dir at the run that saved one."
            )
        if datasets is None:
            kwargs: dict[str, Any] = {}
            if config.max_bytes is not None:
                kwargs["max_bytes"] = config.max_bytes
            try:
                datasets = load_datasets(
                    config.data,
                    seq_len=config.seq_len,
                    seed=config.seed,
                    val_fraction=config.val_fraction,
                    tokenizer=self.tokenizer,
                    **kwargs,
                )
            except ValueError as e:
                if self.hf_start is None:
                    raise
                raise ValueError(f"--data {config.data or '(the standard library)'}: {e}") from e
        if config.synthetic is not None and config.synthetic_share > 0:
            from ..evals import with_retrieval

            datasets = (with_retrieval(
                datasets[0], config.synthetic.split(","), self.tokenizer,
                share=config.synthetic_share, loss=config.synthetic_loss, seed=config.seed,
                max_filler=config.synthetic_filler, samples=config.steps * config.batch_size,
            ), datasets[1])  # fmt: skip
        self.train_data, self.val_data = datasets
        lengths = {d.tokens.shape[1] for d in datasets}
        if lengths != {config.seq_len}:
            raise ValueError(
                "the datasets must be packed at the configured seq_len; got rows of length "
                f"{sorted(lengths)} and seq_len={config.seq_len}. Pack them with "
                f"load_datasets(seq_len={config.seq_len}) or change seq_len."
            )
        # Each process reads and places only the rows and sequence slots its devices hold.
        spec, seed = self.parallel.spec, getattr(self.train_data, "seed", config.seed)
        self.batches = GrainBatches(
            self.train_data, batch_size=config.batch_size, seed=seed, spec=spec
        )
        self.val_batches = GrainEvalBatches(self.val_data, batch_size=config.batch_size, spec=spec)

        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self.plot_path = self.run_dir / "loss.png"
        self.checkpointer = Checkpointer(checkpoint_dir, max_to_keep=config.keep_checkpoints)
        self.preemption = PreemptionNotice()  # a SIGTERM from here on stops run() in time
        try:
            self._init_state()
        except BaseException:
            self.close()
            raise
        self.last_val: dict[str, float] | None = None

    def _make_model(self, spec):
        return self.family.model(self.model_config, key=jax.random.key(self.config.seed), spec=spec)

    def _init_state(self) -> None:
        """Build model and optimizer state straight into their shards: fresh, or restored
        from the newest readable checkpoint into this run's layout (whatever the mesh that
        saved it)."""
        config, checkpointer, parallel = self.config, self.checkpointer, self.parallel
        if not config.resume and checkpointer.steps() and not config.overwrite:
            raise ValueError(
                "a fresh run must not mix with an earlier run's checkpoints; "
                f"{checkpointer.directory} holds steps {checkpointer.steps()}. Pass --resume "
                "to continue that run, --overwrite to delete it, or a new --run-dir."
            )
        self.optimizer, self.train_step = cached_train_step(
            config, self.model_config, parallel, self._abstract_model, self.tokenizer
        )
        self.step, self.skipped, self.wall_offset = 0, 0, 0.0
        self.nothing_to_do: str | None = None
        if config.resume:
            abstract = self._abstract_model
            target = parallel.abstract_opt_state(self.optimizer, abstract)
            model, opt_state = self._resume(abstract, target)
        else:
            if self.hf_start is not None:
                model = self.hf_start.load(parallel.spec)
            elif config.init_run is not None:
                model = weights_of_run(
                    config.init_run, parallel, self._abstract_model, config.model
                )
            else:
                model = parallel.build_model(self._make_model)
            opt_state = parallel.init_opt_state(self.optimizer, model)
            checkpointer.delete_all()  # empty unless overwrite=True
            if self.primary:
                self.metrics.reset()
                write_flags(self.run_dir, config)
                keep_source(self.run_dir, self.hf_start)
            sync("fresh run recorded")
        offload = host_offload_of(config.host_offload)
        if "params" in offload:
            model = to_host(model)
        if "opt_state" in offload:
            opt_state = to_host(opt_state)
        self.model, self.opt_state = model, opt_state

    def _resume(self, model, opt_state):
        """Restore the newest readable checkpoint, after checking the flags continue its run.

        Unreadable newer checkpoints are reported one line each and, when training goes
        on, moved aside (so their steps can be saved again).
        """
        config, checkpointer = self.config, self.checkpointer
        wanted = dataclasses.asdict(self.model_config)
        flags_record = read_flags(self.run_dir)
        done = False

        def check(meta: dict[str, Any], where: str) -> None:
            nonlocal done
            recorded, source = flags_record, str(self.run_dir / FLAGS_FILE)
            if recorded is None:
                recorded, source = meta.get("train_config"), f"{where} (no {FLAGS_FILE})"
            done = check_resume_flags(recorded, config, source, meta["step"])
            check_meta_matches(meta, wanted, where)

        found = checkpointer.restore_newest_readable(model, opt_state, check=check)
        self._report_unreadable(found.unreadable, found.step, move=not done)
        self.step = found.step
        self.skipped = found.meta.get("skipped_steps", 0)
        self.wall_offset = found.meta.get("wall_time", 0.0)
        if "data_state" in found.meta:  # older checkpoints: the step says where data is
            self.batches.set_state(found.meta["data_state"])
        self._seek_data()
        if done:
            self.nothing_to_do = (
                f"nothing left to do: the newest readable checkpoint in {checkpointer.directory} "
                f"is step {found.step} and --steps {config.steps} asks for no more; nothing was "
                "trained or changed. To train longer, start a new --run-dir with a larger "
                "--steps (the cosine schedule spans --steps, so a run cannot be extended)."
            )
        elif self.primary:
            self.metrics.truncate_after(self.step)
        return found.model, found.opt_state

    def _report_unreadable(self, unreadable: list[tuple[int, str]], good: int, move: bool):
        for step, why in unreadable:
            if move:
                moved = self.checkpointer.set_aside(step)
                then = f"resuming from step {good} instead (step {step} moved to {moved})"
            else:
                then = f"the newest readable checkpoint is step {good}"
            if not self.primary:
                continue
            print(
                f"checkpoint step {step} in {self.checkpointer.directory} cannot be read "
                f"({why}); {then}.",
                file=sys.stderr,
                flush=True,
            )

    def _meta(self, wall_time: float) -> dict[str, Any]:
        return {
            "model_config": dataclasses.asdict(self.model_config),
            "train_config": run_flags(self.config),
            "skipped_steps": self.skipped,
            "wall_time": wall_time,
            "data_state": self.batches.get_state(),
        }

    def _seek_data(self) -> None:
        """Make the batch iterator's next batch the one of `self.step` (after a resume
        from a checkpoint without a data state, or a step that stopped the run)."""
        if self.batches.step == self.step:
            return
        state = self.batches.get_state()
        self.batches.set_state({**state, "grain": {**state["grain"], "next_index": self.step}})

    def evaluate(self, final: bool = False) -> dict[str, float]:
        """Validation loss (nats and bits per token; bits per byte for a byte tokenizer)
        of the current model, on `eval_batches` batches (`final_eval_batches` when
        `final`).

        **Returns:** as [`evaluate`][eqx_longctx.train.evaluate], plus `"final"`.

        **Raises:** `ValueError` when the batches hold no loss-bearing token.
        """
        cfg = self.config
        max_batches = cfg.final_eval_batches if final else cfg.eval_batches
        model = self.model
        if "params" in host_offload_of(cfg.host_offload):
            model = to_device(model)  # a copy on the device, for the evaluation only
        val = evaluate(
            model,
            self.val_batches,
            cfg.batch_size,
            max_batches=max_batches,
            tokenizer=self.tokenizer,
        )
        return {**val, "final": final}

    def run(self, stop_at: int | None = None) -> TrainResult:
        """Train from the current step to `config.steps` (or to `stop_at`, like a kill).

        A SIGTERM since the Trainer was built or the last `run` returned (the notice of a
        Cloud TPU preemption or maintenance event; with several processes, JAX's
        preemption notice to any of them) ends the run at the next step boundary all
        processes agree on: each saves a checkpoint there and the result's status is
        `"preempted"`.

        **Arguments:**

        - `stop_at`: end after this step without a final evaluation or checkpoint.

        **Returns:** a [`TrainResult`][].

        **Raises:** `ValueError` when the first batch of the segment (after `batch_hook`)
        holds a token or target id outside the model's vocabulary. In a multi-process run,
        `RuntimeError` when the processes end with different metrics (a bug), and
        `ValueError` when one does not report them within the timeout.
        """
        from tqdm.auto import tqdm

        cfg = self.config
        if self.nothing_to_do is not None:
            self.preemption.close()
            return self._result("nothing_to_do", 0.0)
        end = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
        tokens_per_step = cfg.batch_size * cfg.seq_len
        start = time.perf_counter() - self.wall_offset
        bar = tqdm(
            total=cfg.steps,
            initial=self.step,
            disable=not (cfg.progress and self.primary),
            desc="train",
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
        )
        say = (bar.write if cfg.progress else print) if self.primary else _quiet
        batch_spec = self.parallel.spec
        status = "completed" if stop_at is None or stop_at >= cfg.steps else "interrupted"
        smooth, checked, last = None, False, None
        if self.preemption.closed:  # an earlier run() returned
            self.preemption = PreemptionNotice()
        try:
            while self.step < end:
                t0 = time.perf_counter()
                if not checked:
                    self._seek_data()
                batch = next(self.batches)
                if self.batch_hook is not None:
                    batch = place_batch(
                        self.batch_hook(self.step, batch), batch_spec, laid_out=True
                    )
                if not checked:  # once per segment: ids are all in range or nothing runs
                    check_batch(batch, self.model_config.vocab_size)
                    checked = True
                # The step donates the state passed in; a non-finite step returns it unchanged.
                self.model, self.opt_state, m = self.train_step(self.model, self.opt_state, batch)
                m = {k: v.item() for k, v in jax.device_get(m).items()}
                last = m
                dt = time.perf_counter() - t0
                if not m["finite"]:
                    if cfg.on_nonfinite == "stop":
                        status = "nonfinite"
                        say(self._stop_message(self.step + 1, m))
                        break
                    self.skipped += 1
                    say(
                        f"step {self.step + 1}: non-finite loss={m['loss']} grad_norm="
                        f"{m['grad_norm']}; update skipped ({self.skipped} so far)."
                    )
                self.step += 1
                if math.isfinite(m["loss"]):
                    smooth = m["loss"] if smooth is None else 0.9 * smooth + 0.1 * m["loss"]
                bar.update(1)
                bar.set_postfix(
                    loss=f"{smooth:.3f}" if smooth is not None else "nan",
                    tok_s=f"{tokens_per_step / dt:,.0f}",
                    refresh=False,
                )
                wall = time.perf_counter() - start
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    keys = ("loss", "bits_per_token", "bpb", "lr", "grad_norm", "tokens")
                    record = {"split": "train", "step": self.step}
                    record.update({k: m[k] for k in keys if k in m})
                    record.update(tokens_per_s=tokens_per_step / dt, wall_time=wall)
                    if self.primary:
                        self.metrics.write({**record, "skipped_steps": self.skipped})
                if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                    self.last_val = self.evaluate(final=self.step == cfg.steps)
                    if self.primary:
                        self.metrics.write(
                            {"split": "val", "step": self.step, **self.last_val, "wall_time": wall}
                        )
                    say(f"step {self.step}: val loss {describe_loss(self.last_val)}")
                # Asked at every boundary, on every process: the processes agree here.
                preempted = self.preemption.requested() and self.step < cfg.steps
                if preempted or self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                    self.checkpointer.save(
                        self.step,
                        self.model,
                        self.opt_state,
                        self._meta(time.perf_counter() - start),
                    )
                if preempted:
                    status = "preempted"
                    break
        finally:
            self.preemption.close()  # a SIGTERM now has its usual effect again
            bar.close()
            self.checkpointer.wait()
        # Metrics are replicated results of the jitted step, so every process holds the
        # same values and process 0's file speaks for all: checked here once per run.
        agree("the last step's metrics", {"step": self.step, "last": last, "val": self.last_val})
        records = self.metrics.read() if self.primary else []
        if records:
            title = f"{cfg.model} {cfg.preset} on {cfg.data or 'stdlib'}"
            plot_metrics(records, self.plot_path, title=title)
        return self._result(status, time.perf_counter() - start)

    def _result(self, status: str, wall_time: float) -> TrainResult:
        return TrainResult(
            status=status,
            step=self.step,
            skipped_steps=self.skipped,
            wall_time=wall_time,
            val=self.last_val,
            model=self.model,
            opt_state=self.opt_state,
            metrics_path=self.metrics.path,
            plot_path=self.plot_path,
            checkpoint_dir=self.checkpointer.directory,
            checkpoint_steps=self.checkpointer.steps(),
        )

    def _stop_message(self, step: int, m: dict[str, Any]) -> str:
        last = self.checkpointer.latest_step()
        kept = (
            "no checkpoint was saved yet"
            if last is None
            else (
                f"the last good checkpoint (step {last}) in {self.checkpointer.directory} is intact"
            )
        )
        return (
            f"step {step}: loss is not finite (loss={m['loss']}, grad_norm="
            f"{m['grad_norm']}); stopping because on_nonfinite='stop'. The update was dropped and "
            f"{kept}. Lower --lr, or pass --on-nonfinite skip to drop such updates and continue."
        )

    def close(self) -> None:
        """Finish background saves, release the checkpoint manager, stop the data
        iterator's prefetch thread, and restore the SIGTERM handler the Trainer replaced."""
        self.preemption.close()
        self.checkpointer.close()
        self.batches.close()
