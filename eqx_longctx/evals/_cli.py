"""`python -m eqx_longctx.eval` / `eqx-longctx-eval`: score a model on the long-context
tasks and draw their heatmaps.

    python -m eqx_longctx.eval --run-dir runs/X --task passkey,niah_multikey \\
        --lengths 1024,2048 --out evals/X

Flags are checked before JAX starts (`--devices` sets the fake CPU devices first).
"""

import argparse
import logging
import math
import pathlib
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from .._family import family_names
from ..run import (
    DefaultsHelpFormatter,
    Parser,
    UsageError,
    add_placement_flags,
    error_line,
    parse_override,
)
from ._tasks import TASKS

PROG = "eqx-longctx-eval"
ALL_TASKS = (*TASKS, "position_loss")
"""What `--task` takes: the generation tasks (`TASKS`) and the `position_loss` curve."""
EXIT_MISMATCH = 1


def _tasks(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in ALL_TASKS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"--task takes comma-separated tasks among {', '.join(ALL_TASKS)}; got unknown "
            f"{bad or [text]}"
        )
    return list(dict.fromkeys(names))


def _lengths(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(
            f"--lengths takes comma-separated token counts >= 2, e.g. 1024,4096; got {text!r}"
        )
    return sorted(set(values))


def _depths(text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(
            f"--depths takes comma-separated fractions in [0, 1] (0: the needle at the start, "
            f"1: at the end), e.g. 0,0.5,1; got {text!r}"
        )
    return sorted(set(values))


def _count(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be a whole number >= 1; got {text!r}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    """**Returns:** the eval CLI's parser (parse errors raise `UsageError`)."""
    p = Parser(
        prog=PROG,
        description="Score a model on synthetic long-context tasks (passkey, RULER-style "
        "needles, variable tracking, associative recall) and loss by position; write "
        "results.json, samples.jsonl and one heatmap per task to --out.",
        epilog="exit status: 0 done, 1 --check-strategies found outputs that differ, 2 "
        "invalid flags or model, 130 Ctrl-C",
        formatter_class=DefaultsHelpFormatter,
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--run-dir",
        default=None,
        help="a run of python -m eqx_longctx.train (default, without --hf: the newest run "
        "under runs/ with checkpoints)",
    )
    source.add_argument(
        "--hf", default=None, metavar="DIR", help="a Hugging Face checkpoint with tokenizer.json"
    )
    p.add_argument(
        "--model", default=None, choices=family_names(), help="with --hf: the family that reads it"
    )
    p.add_argument(
        "--task",
        type=_tasks,
        default=["passkey"],
        metavar="TASK[,TASK...]",
        help=f"tasks among {', '.join(ALL_TASKS)} (default: passkey)",
    )
    p.add_argument(
        "--lengths",
        type=_lengths,
        default=None,
        metavar="N[,N...]",
        help="context lengths in tokens, prompt and answer together (default: the model's "
        "max_seq_len)",
    )
    p.add_argument(
        "--depths",
        type=_depths,
        default=[0.0, 0.25, 0.5, 0.75, 1.0],
        metavar="D[,D...]",
        help="needle depths in [0, 1] (default: 0,0.25,0.5,0.75,1)",
    )
    p.add_argument("--samples", type=_count("--samples"), default=10, help="per length and depth")
    p.add_argument("--seed", type=int, default=0, help="the samples' seed")
    p.add_argument(
        "--batch-size", type=_count("--batch-size"), default=16, help="prompts per generate call"
    )
    p.add_argument(
        "--out", default=None, help="output directory (default: RUN_DIR/eval; required with --hf)"
    )
    p.add_argument(
        "--override",
        action="append",
        type=parse_override,
        default=[],
        metavar="FIELD=VALUE",
        help="replace a field of the model's config that keeps its weights, e.g. "
        'max_seq_len=8192 or rope_scaling=\'{"rope_type": "yarn", "factor": 4, '
        '"original_max_position_embeddings": 2048}\' (repeatable)',
    )
    p.add_argument(
        "--check-strategies",
        action="store_true",
        help="also run the samples under every strategy and layout the mesh allows, and on "
        "one device; fail (exit 1) unless every greedy output is identical",
    )
    p.add_argument(
        "--data",
        default=None,
        help="position_loss: the text to hold out from (default: the run's held-out split; "
        "with --hf the standard library's)",
    )
    p.add_argument(
        "--position-rows", type=_count("--position-rows"), default=8, help="position_loss rows"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_placement_flags(
        p,
        devices=1,
        default_mesh_help="context=DEVICES: each prompt split over every device",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags, load the model, run the tasks, write the results.

    Every invalid flag (an unknown task, a depth outside [0, 1], zero samples, `--out`
    naming a file, a length above the model's `max_seq_len`, ...) is one line on stderr,
    `eqx-longctx-eval: error: <rule, values, fix>`, and exit status 2.

    **Returns:** the exit status: 0 done; 1 when `--check-strategies` found a strategy or
    layout whose greedy outputs differ; 2 on an error above; 130 on Ctrl-C.
    """
    try:
        args = build_parser().parse_args(argv)
        _check_out(args)
        from ..inference import cli_placement_flags as placement_flags

        placement_flags(args)
    except (UsageError, ValueError, TypeError) as e:
        print(error_line(f"{e} (see --help)", PROG), file=sys.stderr)
        return 2
    from ..run import set_cpu_devices

    set_cpu_devices(args.devices)
    absl = logging.getLogger("absl")
    level = absl.level
    try:
        absl.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            return _run(args)
    except (ValueError, TypeError) as e:
        print(error_line(e, PROG), file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        absl.setLevel(level)


def _check_out(args: argparse.Namespace) -> None:
    if args.out is None and args.hf is not None:
        raise ValueError("--out is required with --hf (where to write results.json)")
    if args.out is not None:
        for path in (pathlib.Path(args.out), *pathlib.Path(args.out).parents):
            if path.exists() and not path.is_dir():
                raise ValueError(
                    f"--out must be a directory; got --out {args.out}, and {path} is a file. "
                    "Pass another --out."
                )


def _run(args: argparse.Namespace) -> int:
    from ._load import load_eval_model
    from ._report import evaluate_and_write

    em = load_eval_model(args)
    out = pathlib.Path(args.out) if args.out is not None else _default_out(args)
    result = evaluate_and_write(
        em, out, tasks=args.task, lengths=args.lengths or [em.max_seq_len], depths=args.depths,
        samples=args.samples, seed=args.seed, batch_size=args.batch_size,
        documents=lambda: _held_out(args), position_rows=args.position_rows,
        progress=not args.no_progress, check=(lambda **kw: load_eval_model(args, **kw))
        if args.check_strategies else None,
    )  # fmt: skip
    return EXIT_MISMATCH if result.get("check_strategies", {}).get("identical") is False else 0


def _default_out(args: argparse.Namespace) -> pathlib.Path:
    from ..run import default_run_dir

    run_dir = pathlib.Path(args.run_dir) if args.run_dir else default_run_dir(resume=True)
    return run_dir / "eval"


def _held_out(args: argparse.Namespace) -> list[str]:
    """position_loss's documents: `--data`'s held-out split, else the run's, else the
    standard library's."""
    from ..data import load_corpus, split_documents
    from ..run import read_flags

    data, max_bytes, seed, fraction = args.data, None, 0, 0.05
    if args.data is None and args.hf is None:
        from ..run import default_run_dir

        run_dir = pathlib.Path(args.run_dir) if args.run_dir else default_run_dir(resume=True)
        flags: dict[str, Any] = read_flags(run_dir) or {}
        data, max_bytes = flags.get("data"), flags.get("max_bytes")
        seed, fraction = flags.get("seed", 0), flags.get("val_fraction", 0.05)
    kwargs = {} if max_bytes is None else {"max_bytes": max_bytes}
    docs = load_corpus(data, **kwargs)
    return split_documents(docs, val_fraction=fraction, seed=seed)[1]
