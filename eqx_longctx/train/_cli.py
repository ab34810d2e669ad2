"""`python -m eqx_longctx.train` / `eqx-longctx-train`: train a model from the shell (the
tiny Llama by default; `--model deepseek` for MLA + MoE).

Arguments are parsed before anything touches JAX: `--devices` must set the number of CPU
devices before the first array exists, so the model and data modules (which may build
arrays when imported) are imported inside `main`, after that.
"""

import argparse
import os
import sys
from collections.abc import Sequence

from models import FAMILY_NAMES

from ._config import TrainConfig


def _override(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(
            f"--override takes FIELD=VALUE (a field of the model's config, e.g. LlamaConfig); "
            f"got {text!r}. "
            "Example: --override n_layers=2"
        )
    return key, value


PROG = "eqx-longctx-train"


class UsageError(Exception):
    """A flag argparse could not parse (raised instead of printing usage and exiting)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # pyright: ignore[reportIncompatibleMethodOverride]
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """**Returns:** the argument parser of the training CLI (a parse error raises
    `UsageError` rather than exiting)."""
    from eqx_longctx.nn import REMAT_POLICIES

    d = TrainConfig(run_dir="unused")
    p = _Parser(
        prog=PROG,
        description="Train a Llama or a DeepSeek on a text corpus (default: the tiny Llama on "
        "the Python standard library). Writes metrics.jsonl, loss.png and orbax checkpoints to "
        "--run-dir.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=d.model, choices=FAMILY_NAMES, help="model family")
    p.add_argument(
        "--preset", default=d.preset, help="a preset of --model (models.family(NAME).presets)"
    )
    p.add_argument(
        "--override",
        action="append",
        type=_override,
        default=[],
        metavar="FIELD=VALUE",
        help="replace a field of the model's config, e.g. n_layers=2 (repeatable)",
    )
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per row")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="rows per step")
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
    p.add_argument(
        "--devices",
        type=int,
        default=d.devices,
        help="devices to run on (on CPU: fake devices; 1 = no mesh)",
    )
    p.add_argument(
        "--mesh",
        default=d.mesh,
        help="mesh axis sizes, AXIS=SIZE with axes data, fsdp, expert, ulysses, context, "
        "tensor, e.g. data=2,context=4 or fsdp=2,context=4 (default: data=2,context=DEVICES/2 "
        "from 4 devices, else context=DEVICES)",
    )
    p.add_argument(
        "--fsdp-axes",
        default=d.fsdp_axes,
        help="mesh axes the parameters, gradients and optimizer state are split over, "
        "comma-separated, e.g. fsdp,context (default: fsdp when --mesh has it, else none)",
    )
    p.add_argument(
        "--strategy",
        default=d.strategy,
        choices=("all_gather", "ulysses", "ring", "usp", "auto"),
        help="context-parallel attention strategy",
    )
    p.add_argument(
        "--load-balance",
        default=d.load_balance,
        choices=("none", "zigzag", "striped"),
        help="token layout that balances causal work over the context axis",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--on-nonfinite", choices=("stop", "skip"), default=d.on_nonfinite)
    p.add_argument(
        "--remat",
        choices=REMAT_POLICIES,
        default=None,
        help="rematerialisation policy (default: the preset's)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _set_cpu_devices(n: int) -> None:
    """Ask for `n` CPU devices; possible only before JAX creates its backends."""
    import jax

    current = jax.config.jax_num_cpu_devices  # pyright: ignore[reportAttributeAccessIssue]
    if n <= 1 or current >= n:
        return
    flag = f"--xla_force_host_platform_device_count={n}"
    os.environ["XLA_FLAGS"] = " ".join(
        [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f] + [flag]
    )
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # backends already exist (e.g. inside a notebook); the Trainer checks the count


def error_line(error: BaseException | str) -> str:
    """**Returns:** the CLI's one-line report of `error`: `eqx-longctx-train: error: ...`."""
    return f"{PROG}: error: {' '.join(str(error).split())}"


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, train, print a summary.

    Every invalid flag (unparsable, out of range, inconsistent with the mesh, or changing a
    resumed run) and every checkpoint that cannot be resumed from is reported as one line on
    stderr, `eqx-longctx-train: error: <rule, values, fix>`, with no traceback.

    **Arguments:**

    - `argv`: the flags (default `sys.argv[1:]`).

    **Returns:** the exit status: 0 when training completed, and also when `--resume` finds
    the run already at or past `--steps` (it says there is nothing left to do and trains
    nothing); 1 when it stopped at a non-finite loss; 2 on invalid flags or when no
    checkpoint can be resumed from; 130 on Ctrl-C (background checkpoint writes are
    finished first).
    """
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        print(error_line(f"{e} (see --help)"), file=sys.stderr)
        return 2
    _set_cpu_devices(args.devices)

    from ._loop import Trainer

    try:
        config = TrainConfig(
            model=args.model,
            preset=args.preset,
            model_overrides=dict(args.override),
            seq_len=args.seq_len,
            batch_size=args.batch_size,
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
            progress=not args.no_progress,
        )
        trainer = Trainer(config)
        if trainer.nothing_to_do is not None:
            trainer.close()
            print(trainer.nothing_to_do, flush=True)
            return 0
        print(
            f"training {config.model} {config.preset} ({trainer.model.num_params():,} "
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
            return 130
        finally:
            trainer.close()
    except ValueError as e:
        print(error_line(e), file=sys.stderr)
        return 2
    print(result.summary(), flush=True)
    return 0 if result.status == "completed" else 1
