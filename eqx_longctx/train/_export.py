"""`python -m eqx_longctx.export` / `eqx-longctx-export`: write the newest checkpoint of a
training run as a Hugging Face checkpoint directory.

The run's family writes the weights and `config.json` (its `to_hf`; the library never
names a family). A run started with `--init-hf` also gets the tokenizer, generation-config and
chat-template files of its source checkpoint (the run's copy of them) and that
checkpoint's special token ids, so
`transformers.AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`
both load the result.
"""

import argparse
import json
import pathlib
import shutil
import sys
from collections.abc import Sequence

from ..run import SOURCE_COPY, SOURCE_EXTRAS, Parser, UsageError, error_line

PROG = "eqx-longctx-export"


def export_run(
    run_dir: str | pathlib.Path, out: str | pathlib.Path, *, step: int | None = None
) -> int:
    """Write a run's checkpoint as a Hugging Face checkpoint directory.

    **Arguments:**

    - `run_dir`: a run of `python -m eqx_longctx.train` (fresh or `--init-hf`).
    - `out`: the directory to write (`config.json`, `model.safetensors`, and the tokenizer
      files of an `--init-hf` run); it must not hold another checkpoint's files.
    - `step`: the checkpoint to write (`None`: the newest readable one; each unreadable
      newer one is reported on stderr).

    **Returns:** the step written.

    **Raises:** `ValueError` when `run_dir` has no readable checkpoint (or not `step`),
    records no flags, or its family cannot write Hugging Face checkpoints; and as the
    family's `to_hf` for `out`.
    """
    from .._family import model_family
    from ..run import Placement, read_run_model

    run_dir, out = pathlib.Path(run_dir), pathlib.Path(out)
    # Read on one device, whatever the mesh that trained it.
    run = read_run_model(
        run_dir, lambda config, _: Placement(1, vocab_size=config.vocab_size), reader="export",
        step=step,
    )  # fmt: skip
    copy = None if run.start is None else run_dir / SOURCE_COPY
    _check_no_stale_files(out, copy)  # before anything is written
    model_family(run.flags["model"]).to_hf(run.model, out)
    _add_tokenizer(out, run.tokenizer, copy)
    return run.step


_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _source_files() -> tuple[str, ...]:
    from ..data import TOKENIZER_FILES

    return (*TOKENIZER_FILES, *SOURCE_EXTRAS)


def _check_no_stale_files(out: pathlib.Path, copy: pathlib.Path | None) -> None:
    """**Raises:** `ValueError` when `out` holds tokenizer or generation files that the
    export would not replace: transformers would load them beside the exported model."""
    if not out.is_dir():
        return
    ours = {n for n in _source_files() if copy is not None and (copy / n).is_file()}
    stale = sorted(n for n in _source_files() if (out / n).exists() and n not in ours)
    if stale:
        raise ValueError(
            f"--out {out} already holds {', '.join(stale)}, which this export would not "
            "replace: transformers would load them with the exported model (another "
            "tokenizer, other stop tokens). Export to an empty directory or remove them."
        )


def _add_tokenizer(out: pathlib.Path, tokenizer, copy: pathlib.Path | None) -> None:
    """Write the special token ids into `config.json`: an `--init-hf` run's source
    checkpoint's, as that checkpoint wrote them (a list of stop tokens, no pad id), else the
    tokenizer's; and copy an `--init-hf` run's tokenizer, generation and chat-template
    files."""
    file = out / "config.json"
    config = json.loads(file.read_text())
    if copy is not None and (copy / "config.json").is_file():
        source = json.loads((copy / "config.json").read_text())
        for key in _SPECIAL_IDS:
            if source.get(key) is not None:
                config[key] = source[key]
            else:
                config.pop(key, None)
    else:
        for key, value in zip(_SPECIAL_IDS, (tokenizer.bos_id, tokenizer.eos_id,
                                             tokenizer.pad_id), strict=True):  # fmt: skip
            if value is not None:
                config[key] = int(value)
    file.write_text(json.dumps(config, indent=2, sort_keys=True))
    if copy is None:
        return
    for name in _source_files():
        if (copy / name).is_file():
            shutil.copyfile(copy / name, out / name)


def build_parser() -> argparse.ArgumentParser:
    """**Returns:** the argument parser of the export CLI."""
    p = Parser(
        prog=PROG,
        description="Write the newest checkpoint of a training run (python -m "
        "eqx_longctx.train) as a Hugging Face checkpoint directory: config.json, "
        "model.safetensors, and the tokenizer files of a run started with --init-hf.",
    )
    p.add_argument("--run-dir", required=True, help="the run directory")
    p.add_argument("--out", required=True, help="the Hugging Face directory to write")
    p.add_argument("--step", type=int, default=None, help="a saved step (default: the newest)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags and export; every error is one line on stderr,
    `eqx-longctx-export: error: <rule, values, fix>`.

    **Returns:** the exit status: 0 when written, 2 on invalid flags or a run that cannot be
    exported.
    """
    try:
        args = build_parser().parse_args(argv)
        step = export_run(args.run_dir, args.out, step=args.step)
    except (UsageError, ValueError, TypeError) as e:
        print(error_line(e, PROG), file=sys.stderr)
        return 2
    print(f"wrote step {step} of {args.run_dir} to {args.out}")
    return 0
