"""`python -m eqx_longctx.train` / `eqx-longctx-train`: train a model from the shell (the
tiny Llama by default; `--model deepseek` for MLA + MoE).

Arguments are parsed before anything touches JAX: `--devices` must set the number of CPU
devices before the first array exists, so the model and data modules (which may build
arrays when imported) are imported inside `main`, after that.
"""

import argparse
import dataclasses
import sys
import traceback
from collections.abc import Sequence

from .._family import ENTRY_POINT_GROUP, family_names
from ..run import (
    EXIT_PREEMPTED,
    INIT_TIMEOUT,
    PEER_TIMEOUT,
    DefaultsHelpFormatter,
    Parser,
    UsageError,
    add_placement_flags,
    error_line,
    exit_now,
    parse_override,
    positive_int,
    preempted_line,
)
from ._config import TrainConfig
from ._recipes import RECIPES, recipe_help, recipe_stages

PROG = "eqx-longctx-train"


def build_parser() -> argparse.ArgumentParser:
    """**Returns:** the argument parser of the training CLI (a parse error raises
    `UsageError` rather than exiting)."""
    from eqx_longctx.nn import REMAT_POLICIES

    d = TrainConfig(run_dir="unused")
    p = Parser(
        prog=PROG,
        description="Train a model of any installed family (--model) on a text corpus (default: "
        "the tiny Llama on the Python standard library). Writes metrics.jsonl, loss.png and "
        "orbax checkpoints to --run-dir.",
        epilog="exit status: 0 completed (or nothing left to resume), 1 stopped at a "
        "non-finite loss, 2 invalid flags or nothing to resume from, 3 another process of "
        f"the run was lost, {EXIT_PREEMPTED} preempted by SIGTERM (every process saved a "
        "checkpoint at the same step: rerun with --resume), 130 Ctrl-C. " + recipe_help(),
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=d.model,
        choices=family_names(),
        help=f"model family (those installed under the entry-point group {ENTRY_POINT_GROUP!r})",
    )
    p.add_argument(
        "--preset",
        default=d.preset,
        help="a preset of --model (eqx_longctx.model_family(NAME).presets)",
    )
    p.add_argument(
        "--override",
        action="append",
        type=parse_override,
        default=[],
        metavar="FIELD=VALUE",
        help="replace a field of the model's config, e.g. n_layers=2 (repeatable); with "
        "--init-hf only fields that keep every weight's shape, e.g. rope_theta=40000",
    )
    p.add_argument(
        "--init-hf",
        default=None,
        metavar="DIR",
        help="fine-tune from this Hugging Face checkpoint of --model (config.json, "
        "safetensors, tokenizer.json tokenizes --data); --preset is then unused. On "
        "--resume it may be left out: the run's checkpoint wins",
    )
    p.add_argument(
        "--init-run",
        default=None,
        metavar="DIR",
        help="start from the weights of this run's newest checkpoint (fresh optimizer and "
        "steps): a longer --seq-len after a short run. The model flags must keep every "
        "weight's shape. On --resume it may be left out",
    )
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per row")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="rows per optimizer step")
    p.add_argument(
        "--grad-accum",
        type=int,
        default=d.grad_accum,
        metavar="K",
        help="run each step's rows as K micro-batches, gradients summed before one update",
    )
    p.add_argument(
        "--loss-chunk",
        type=int,
        default=d.loss_chunk,
        metavar="TOKENS",
        help="tokens per chunk of the loss on each device, its logits recomputed in the "
        "backward (default: 128 MiB of float32 logits per chunk; 0: the whole logits)",
    )
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="linear warmup, then cosine decay to lr/10 at --steps (below --steps; default: "
        "min(20, steps // 10))",
    )
    p.add_argument(
        "--weight-decay", type=float, default=d.weight_decay, help="AdamW decay of matrices"
    )
    p.add_argument("--clip-norm", type=float, default=d.clip_norm, help="global gradient norm")
    p.add_argument(
        "--data", default=d.data, help="text file or folder (default: the Python standard library)"
    )
    p.add_argument("--max-bytes", type=int, default=d.max_bytes, help="corpus bytes to read")
    p.add_argument(
        "--run-dir",
        default=None,
        help="metrics, plot and checkpoints (default: a new runs/DATE-TIME; with --resume the "
        "newest run under runs/)",
    )
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument(
        "--eval-batches",
        type=int,
        default=d.eval_batches,
        help="validation batches per evaluation (0: the whole split)",
    )
    p.add_argument(
        "--final-eval-batches",
        type=int,
        default=d.final_eval_batches or 0,
        help="validation batches after the last step (0: the whole split)",
    )
    p.add_argument("--log-every", type=int, default=d.log_every, help="metrics.jsonl stride")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run from its newest readable checkpoint; flags that change the run "
        "(recorded in RUN_DIR/flags.json) are refused, placement flags and strides may change",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete an earlier run's checkpoints and metrics in --run-dir",
    )
    add_placement_flags(
        p,
        devices=d.devices,
        default_mesh_help="data=2,context=DEVICES/2 from 4 devices, else context=DEVICES",
        strategy=d.strategy,
        load_balance=d.load_balance,
    )
    p.add_argument(
        "--synthetic",
        default=None,
        metavar="TASK[,TASK...]",
        help="mix generated retrieval documents of these eval tasks into the training rows, "
        "e.g. passkey,niah_multikey (see python -m eqx_longctx.eval --help)",
    )
    p.add_argument(
        "--synthetic-share",
        type=float,
        default=d.synthetic_share,
        help="the share of training rows that hold --synthetic documents",
    )
    p.add_argument(
        "--synthetic-loss",
        choices=("all", "answers"),
        default=d.synthetic_loss,
        help="what the loss counts in --synthetic documents: all their tokens, or the "
        "answers alone (the retrieval's gradient undiluted by the filler's)",
    )
    p.add_argument(
        "--synthetic-filler",
        type=int,
        default=d.synthetic_filler,
        metavar="N",
        help="train on drills instead of whole --synthetic prompts: each task's needles and "
        "question without the intro, in 0 to N filler tokens, several to a row (how a small "
        "model first learns to read a needle; see docs/recipes.md)",
    )
    p.add_argument(
        "--recipe",
        default=None,
        choices=sorted(RECIPES),
        help="take the flag defaults from a named recipe (your own flags still win); see the "
        "list below and docs/recipes.md",
    )
    p.add_argument(
        "--no-stages",
        action="store_true",
        help="train a staged recipe's last stage alone (your flags set it), from scratch or "
        "from --init-run / --init-hf, without the stages before it",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--on-nonfinite", choices=("stop", "skip"), default=d.on_nonfinite)
    p.add_argument(
        "--host-offload",
        default=None,
        metavar="WHAT",
        help="keep opt_state (AdamW's moments) and/or params in host memory between steps, "
        "streamed to the device inside each step, e.g. opt_state or opt_state,params",
    )
    p.add_argument(
        "--remat",
        choices=REMAT_POLICIES,
        default=None,
        help="rematerialisation policy (default: the preset's)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group(
        "multi-process runs (one process per host; on a Cloud TPU slice of several workers "
        "these are found automatically)"
    )
    g.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="process 0's host and a free port, the same on every process",
    )
    g.add_argument("--num-processes", type=int, default=None, help="processes in the run")
    g.add_argument("--process-id", type=int, default=None, help="this process: 0..N-1")
    g.add_argument(
        "--init-timeout",
        type=positive_int,
        default=INIT_TIMEOUT,
        metavar="SECONDS",
        help="wait at most this long for the coordinator and every process to join",
    )
    g.add_argument(
        "--peer-timeout",
        type=positive_int,
        default=PEER_TIMEOUT,
        metavar="SECONDS",
        help="exit (status 3) when another process has sent no heartbeat for this long",
    )
    return p


def parse_flags(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The training flags of `argv`, a `--recipe`'s values as the defaults of the flags
    it sets (the flags given still win; its `--override`s come before the given ones).

    **Raises:** `UsageError` for flags argparse cannot parse.
    """
    p = build_parser()
    known, _ = p.parse_known_args(argv)
    if known.recipe is not None:
        p.set_defaults(**RECIPES[known.recipe].flags)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, join the other processes of a multi-process run, train, print a summary.

    Every invalid flag (unparsable, out of range, inconsistent with the mesh, or changing a
    resumed run) and every checkpoint that cannot be resumed from is reported as one line on
    stderr, `eqx-longctx-train: error: <rule, values, fix>`, with no traceback.

    A multi-process run (`--coordinator`, `--num-processes`, `--process-id`, or a Cloud TPU
    slice of several workers) starts `jax.distributed` first (see
    `eqx_longctx.run`), checks that every process got the same flags, and
    takes process 0's run directory; only process 0 prints progress and the summary and
    writes the run's files.

    **Arguments:**

    - `argv`: the flags (default `sys.argv[1:]`).

    **Returns:** the exit status: 0 when training completed, and also when `--resume` finds
    the run already at or past `--steps` (it says there is nothing left to do and trains
    nothing); 1 when it stopped at a non-finite loss (or, in a multi-process run, on an
    unexpected error); 2 on invalid flags, when no checkpoint can be resumed from, or when
    the processes cannot all join within `--init-timeout`; 3 when another process of the
    run died, hung or failed (see `--peer-timeout`); 75 (`EXIT_PREEMPTED`) on SIGTERM, on
    every process, after saving a checkpoint at a step boundary they all agreed on (process
    0 prints `eqx-longctx-train: preempted: saved step N to DIR; resume with --resume`);
    130 on Ctrl-C (background checkpoint writes are finished first). A multi-process run
    that fails does not wait for its peers: it tells them why (they exit with 3) and ends
    at once.
    """
    try:
        args = parse_flags(argv)
    except UsageError as e:
        print(error_line(f"{e} (see --help)"), file=sys.stderr)
        return 2
    from ..run import cluster_from_flags, set_cpu_devices, start_processes

    try:
        cluster = cluster_from_flags(
            args.coordinator, args.num_processes, args.process_id, args.devices
        )
    except ValueError as e:
        print(error_line(e), file=sys.stderr)
        return 2
    if cluster is None:
        set_cpu_devices(args.devices)
        return _train(args, None, {})
    runtime = start_processes(
        cluster,
        devices=args.devices,
        init_timeout=args.init_timeout,
        peer_timeout=args.peer_timeout,
    )
    failure: dict[str, str] = {}
    try:
        code = _train(args, runtime, failure)
    except BaseException as e:  # tell the peers, then leave without waiting for them
        traceback.print_exc()
        failure["message"], code = f"{type(e).__name__}: {e}", 1
    if code in (0, EXIT_PREEMPTED):  # every process ends so: no peer is lost
        runtime.finish()
        return code
    runtime.fail(failure.get("message", f"it stopped with exit status {code}"))
    exit_now(code)
    return code  # not reached


def config_from_flags(args: argparse.Namespace, *, progress: bool = False) -> TrainConfig:
    """The run's `TrainConfig` from parsed flags (`parse_flags`), before a recipe's stages.

    **Raises:** `ValueError` as `TrainConfig` for values it refuses.
    """
    return TrainConfig(
        model=args.model,
        preset=args.preset,
        model_overrides=dict(args.override),
        init_hf=args.init_hf,
        init_run=args.init_run,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        loss_chunk=args.loss_chunk,
        steps=args.steps,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        clip_norm=args.clip_norm,
        data=args.data,
        max_bytes=args.max_bytes,
        run_dir=args.run_dir,
        checkpoint_every=args.checkpoint_every,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches or None,
        final_eval_batches=args.final_eval_batches or None,
        log_every=args.log_every,
        resume=args.resume,
        overwrite=args.overwrite,
        devices=args.devices,
        mesh=args.mesh,
        fsdp_axes=args.fsdp_axes,
        strategy=args.strategy,
        load_balance=args.load_balance,
        seed=args.seed,
        on_nonfinite=args.on_nonfinite,
        remat=args.remat,
        host_offload=args.host_offload,
        synthetic=args.synthetic,
        synthetic_share=args.synthetic_share,
        synthetic_loss=args.synthetic_loss,
        synthetic_filler=args.synthetic_filler,
        progress=progress,
    )


def _train(args: argparse.Namespace, runtime, failure: dict[str, str]) -> int:
    """The run itself; `runtime` is `None` for one process. Error messages go to stderr
    and into `failure["message"]`."""
    from ..run import primary_value

    primary = runtime is None or runtime.process_id == 0

    def fail(error: BaseException | str, code: int) -> int:
        text = str(error)
        if runtime is not None:
            text = f"process {runtime.process_id} of {runtime.num_processes}: {text}"
        print(error_line(text), file=sys.stderr, flush=True)
        failure["message"] = str(error)
        return code

    try:
        if runtime is not None:
            runtime.check_same_flags({k: v for k, v in vars(args).items() if k != "process_id"})
        config = config_from_flags(args, progress=not args.no_progress and primary)
        if runtime is not None:  # a default run dir is stamped with the time: take process 0's
            run_dir = primary_value("run_dir", str(config.run_dir), runtime.timeout)
            config = dataclasses.replace(config, run_dir=run_dir)
        recipe = RECIPES[args.recipe] if args.recipe is not None else None
        staged = recipe is not None and not args.no_stages
        stages = recipe_stages(recipe, config) if staged and recipe else [config]
    except ValueError as e:
        return fail(e, 2)
    for number, stage in enumerate(stages, start=1):
        if primary and len(stages) > 1:
            print(f"stage {number} of {len(stages)} of the {recipe and recipe.name} recipe: "
                  f"{stage.seq_len}-token rows in {stage.run_dir}", flush=True)  # fmt: skip
        code, trainer = _run_stage(stage, primary, failure, fail)
        if code is not None:
            return code
    if recipe is not None and recipe.eval_task is not None and trainer is not None:
        from ._recipe_eval import recipe_eval

        if runtime is None:  # one process; eval a multi-process run with eqx_longctx.eval
            recipe_eval(recipe, trainer)
    return 0


def _run_stage(config: TrainConfig, primary: bool, failure: dict[str, str], fail):
    """Train `config` to its end. **Returns:** `(None, trainer)` when it completed (or had
    nothing left to do: then `trainer` is `None`), else `(exit status, None)`."""
    from ._loop import Trainer

    try:
        trainer = Trainer(config)
        if trainer.nothing_to_do is not None:
            trainer.close()
            if primary:
                print(trainer.nothing_to_do, flush=True)
            return None, None
        if primary:
            print(
                f"training {config.model} {_start_of(config)} ({trainer.model.num_params():,} "
                "parameters) for "
                f"{config.steps} steps of {config.batch_size}x{config.seq_len} tokens on "
                f"{trainer.parallel.describe()}, "
                f"{'resuming at step ' + str(trainer.step) if config.resume else 'fresh run'} "
                f"in {trainer.run_dir}",
                flush=True,
            )
        try:
            result = trainer.run()
        except KeyboardInterrupt:
            last = trainer.checkpointer.latest_step()
            print(
                f"\ninterrupted at step {trainer.step}; the newest checkpoint is step {last}. "
                f"Continue with the same flags plus --resume (run dir {trainer.run_dir}).",
                file=sys.stderr,
            )
            failure["message"] = f"interrupted at step {trainer.step}"
            return 130, None
        finally:
            trainer.close()
    except ValueError as e:
        return fail(e, 2), None
    if result.status == "preempted":
        if primary:
            print(preempted_line(result.step, result.checkpoint_dir), file=sys.stderr, flush=True)
        return EXIT_PREEMPTED, None
    if primary:
        print(result.summary(), flush=True)
    if result.status == "completed":
        return None, trainer
    failure["message"] = f"the run stopped ({result.status}) at step {result.step + 1}"
    return 1, None


def _start_of(config: TrainConfig) -> str:
    if config.init_hf is not None:
        return f"from {config.init_hf}"
    if config.init_run is not None:
        return f"{config.preset} from the run {config.init_run}"
    return config.preset
