"""`python -m eqx_longctx.generate`: print a model's continuation of a prompt, token by token.

The model comes from a training run (`--run-dir`: the newest readable checkpoint of
`python -m eqx_longctx.train`, with the byte tokenizer it was trained with; neither
`--run-dir` nor `--hf`: the newest run under `runs/`, as the trainer's `--resume` picks it)
or from a Hugging Face checkpoint directory (`--hf`: read by the installed family whose
`from_hf` accepts it, with its `tokenizer.json` through the `tokenizers` package when both
are there, else the prompt is `--prompt-ids`). `--devices`, `--mesh`, `--fsdp-axes`,
`--strategy` and `--load-balance` are the trainer's flags (its `Placement`), except that
`--mesh` defaults to `context=DEVICES`: one prompt, its sequence and cache split over every
device.

    python -m eqx_longctx.generate --prompt "def main():" --max-new-tokens 200
    python -m eqx_longctx.generate --hf ./Llama-3.2-1B --prompt "The capital of France is"
    python -m eqx_longctx.generate --hf ./ckpt --prompt-ids 1,2,3 --devices 8 --strategy ring

As in the trainer's CLI, flags are parsed before anything touches JAX (`--devices` must set
the CPU device count first), and every bad flag is one line on stderr, exit status 2.
"""

import argparse
import json
import logging
import pathlib
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from .._checks import check_int, check_real
from .._family import family_names
from ..run import (
    DefaultsHelpFormatter,
    Parser,
    UsageError,
    add_placement_flags,
    error_line,
    mesh_shape,
    placement_from_flags,
)

PROG = "eqx-longctx-generate"
TOKENIZER_FILE = "tokenizer.json"


def _flag(convert: Callable[[str], Any], flag: str, check: Callable[[Any], Any]):
    """An argparse type: `convert` the text, then `check` it; a failure names `flag`."""

    def parse(text: str):
        try:
            return check(convert(text))
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e) or f"{flag} got {text!r}") from None

    return parse


def _seed(value: int) -> int:
    """`--seed`: a PRNG seed, `0 <= seed < 2**63` (what `jax.random.key` takes)."""
    check_int(value, "--seed", minimum=0)
    if value >= 2**63:
        raise ValueError(f"--seed must be below 2**63; got {value}. Use a smaller seed.")
    return value


def _prompt_ids(text: str) -> list[int]:
    """`--prompt-ids 1,2,3`: token ids, comma-separated, each an integer >= 0."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids takes token ids >= 0 joined by commas, e.g. --prompt-ids 1,2,3; "
            f"got {text!r}"
        )
    return ids


def _top_p(value: float) -> float:
    value = check_real(value, "--top-p", positive=True)
    if value > 1:
        raise ValueError(f"--top-p must lie in (0, 1]; got {value}. Pass e.g. --top-p 0.9")
    return value


def build_parser() -> argparse.ArgumentParser:
    """**Returns:** the argument parser of the generation CLI (a parse error raises
    `eqx_longctx.run.UsageError` rather than exiting)."""
    p = Parser(
        prog=PROG,
        description="Print a model's continuation of a prompt as it is generated: from a "
        "training run's newest checkpoint (--run-dir) or a Hugging Face checkpoint (--hf).",
        formatter_class=DefaultsHelpFormatter,
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--run-dir",
        default=None,
        help="a run of python -m eqx_longctx.train: its newest readable checkpoint and byte "
        "tokenizer (default, without --hf: the newest run under runs/ with checkpoints)",
    )
    source.add_argument(
        "--hf",
        default=None,
        metavar="DIR",
        help="a Hugging Face checkpoint directory (config.json, safetensors; tokenizer.json "
        "for --prompt)",
    )
    p.add_argument(
        "--model",
        default=None,
        choices=family_names(),
        help="with --hf: the family that reads it (default: the first installed one that can)",
    )
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", default=None, help="the prompt text")
    prompt.add_argument(
        "--prompt-ids",
        type=_prompt_ids,
        default=None,
        metavar="ID,ID,...",
        help="the prompt as token ids; without a tokenizer the continuation prints as ids",
    )
    p.add_argument(
        "--max-new-tokens",
        type=_flag(int, "--max-new-tokens", lambda v: check_int(v, "--max-new-tokens")),
        default=200,
        help="tokens to generate",
    )
    p.add_argument(
        "--max-len",
        type=_flag(int, "--max-len", lambda v: check_int(v, "--max-len")),
        default=None,
        help="the KV cache's length in tokens (default: the prompt plus --max-new-tokens; at "
        "most the model's max_seq_len)",
    )
    p.add_argument(
        "--temperature",
        type=_flag(float, "--temperature", lambda v: check_real(v, "--temperature", minimum=0.0)),
        default=0.0,
        help="0: greedy; otherwise sample from the logits divided by it",
    )
    p.add_argument(
        "--top-k",
        type=_flag(int, "--top-k", lambda v: check_int(v, "--top-k")),
        default=None,
        help="sample only among the K most likely tokens",
    )
    p.add_argument(
        "--top-p",
        type=_flag(float, "--top-p", _top_p),
        default=None,
        help="sample only in the smallest set of tokens whose probability reaches P",
    )
    p.add_argument(
        "--seed",
        type=_flag(int, "--seed", _seed),
        default=0,
        help="the sampling key (with --temperature > 0)",
    )
    add_placement_flags(
        p,
        devices=1,
        default_mesh_help="context=DEVICES: the prompt and its cache split over every device",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags, load the model, stream its continuation of the prompt to stdout.

    Every invalid flag (unparsable, out of range, inconsistent with the mesh, the model or
    its vocabulary), a run without a readable checkpoint, and a checkpoint that cannot be
    read is reported as one line on stderr, `eqx-longctx-generate: error: <rule, values,
    fix>`, with no traceback.

    **Arguments:**

    - `argv`: the flags (default `sys.argv[1:]`).

    **Returns:** the exit status: 0 when the continuation was printed, 2 on an error above,
    130 on Ctrl-C.
    """
    try:
        args = build_parser().parse_args(argv)
        placement_flags(args)
    except (UsageError, ValueError, TypeError) as e:
        print(error_line(f"{e} (see --help)", PROG), file=sys.stderr)
        return 2
    from ..run import set_cpu_devices

    set_cpu_devices(args.devices)
    absl = logging.getLogger("absl")
    level = absl.level
    try:
        # Not the user's concern: CPU cannot reuse donated buffers; orbax notes read-only mode.
        absl.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            _generate(args)
    except (ValueError, TypeError) as e:
        sys.stdout.flush()
        print(error_line(e, PROG), file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        absl.setLevel(level)
    return 0


def placement_flags(args: argparse.Namespace) -> tuple[int, str | None]:
    """Check `--devices` and `--mesh` before JAX starts; **returns** `(devices, mesh)` with
    the mesh resolved (`context=DEVICES` by default on several devices, `None` on one).

    **Raises:** `ValueError` and `TypeError` as `eqx_longctx.run.mesh_shape`.
    """
    devices = check_int(args.devices, "--devices")
    mesh = args.mesh
    if mesh is None and devices > 1:
        mesh = f"context={devices}"
    if mesh is not None:
        mesh_shape(mesh, devices)
    return devices, mesh


def _placement(args: argparse.Namespace, vocab_size: int | None):
    devices, mesh = placement_flags(args)
    return placement_from_flags(
        devices, mesh, args.strategy, args.load_balance, args.fsdp_axes, vocab_size=vocab_size
    )


def _generate(args: argparse.Namespace) -> None:
    import jax
    import numpy as np

    from ._generate import generate

    if args.hf is not None:
        model, tokenizer, eos = _load_hf(args)
    else:
        if args.model is not None:
            raise ValueError(
                f"--model picks the family of an --hf checkpoint; a run records its own "
                f"model. Drop --model {args.model}."
            )
        model, tokenizer, eos = _load_run(args)
    vocab = model.config.vocab_size
    if args.prompt_ids is not None:
        ids = list(args.prompt_ids)
        if max(ids) >= vocab:
            raise ValueError(
                f"--prompt-ids must be token ids below the model's vocab_size={vocab}; got "
                f"{max(ids)}. Pass ids in [0, {vocab})."
            )
    elif tokenizer is None:
        raise ValueError(
            f"--prompt needs a tokenizer, and {args.hf} has no {TOKENIZER_FILE} (or the "
            "tokenizers package is not installed: pip install tokenizers). Pass the prompt "
            "as --prompt-ids 1,2,3."
        )
    else:
        ids = tokenizer.encode(args.prompt)
    key = jax.random.key(args.seed) if args.temperature > 0 else None
    printer = _Printer(None if tokenizer is None else tokenizer.decode, stop=eos)
    generate(
        model,
        np.asarray([ids], np.int32),
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        key=key,
        eos_id=sorted(eos),
        max_len=args.max_len,
        on_token=printer,
    )
    printer.finish()


class _Printer:
    """`generate`'s `on_token`: writes each new token of row 0 as it comes (text decoded
    from every token so far, holding back a character whose bytes are not all there yet;
    or the ids, space-separated), and nothing after a stop token."""

    def __init__(self, decode: Callable[[list[int]], str] | None, stop: frozenset[int]):
        self.decode, self.stop = decode, stop
        self.ids: list[int] = []
        self.shown = ""
        self.done = False

    def __call__(self, step: int, tokens) -> None:
        token = int(tokens[0])
        if self.done or token in self.stop:
            self.done = True
            return
        self.ids.append(token)
        if self.decode is None:
            sys.stdout.write(("" if len(self.ids) == 1 else " ") + str(token))
        else:
            self._show(self.decode(self.ids).rstrip("\ufffd"))
        sys.stdout.flush()

    def _show(self, text: str) -> None:
        if text.startswith(self.shown):
            sys.stdout.write(text[len(self.shown) :])
            self.shown = text

    def finish(self) -> None:
        """Write what was held back, and end the line."""
        if self.decode is not None and self.ids:
            self._show(self.decode(self.ids))
        sys.stdout.write("\n")
        sys.stdout.flush()


class _Text:
    """A tokenizer as the CLI uses it: `encode` a prompt, `decode` a continuation.

    A `--hf` checkpoint's tokenizer encodes a prompt with its own template (e.g. a leading
    BOS); a run's tokenizer (`ByteTokenizer`, or the `HFTokenizer` of a run started with
    `--init-hf`) opens it with BOS, as every training document was.
    """

    def __init__(self, tok, *, template: bool = False):
        self.tok, self.template = tok, template

    def encode(self, text: str) -> list[int]:
        if self.template:
            return self.tok.encode_prompt(text)
        return [int(i) for i in self.tok.encode(text, bos=True)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def _load_hf(args: argparse.Namespace):
    """**Returns:** `(model, tokenizer or None, eos ids)` of the `--hf` checkpoint."""
    from .._family import model_family
    from ..data import HFTokenizer

    path = pathlib.Path(args.hf)
    config_file = path / "config.json"
    hf: dict[str, Any] = {}
    if config_file.is_file():
        try:
            hf = json.loads(config_file.read_text())
        except (OSError, ValueError):
            hf = {}  # the family's reader reports what is wrong with it
    hf = hf if isinstance(hf, dict) else {}
    vocab = hf.get("vocab_size") if isinstance(hf.get("vocab_size"), int) else None
    placement = _placement(args, vocab)
    names = [args.model] if args.model is not None else list(family_names())
    errors = []
    for name in names:
        family = model_family(name)
        try:
            model = family.from_hf(path, spec=placement.spec)
        except (ValueError, TypeError) as e:
            errors.append(f"{name}: {e}")
            continue
        placement.check_run(1, 2 * _shards(placement), model.config, family=family)
        break
    else:
        raise ValueError(
            f"--hf {args.hf}: no installed model family reads it ({'; '.join(errors)})"
        )
    tokenizer = None
    if (path / TOKENIZER_FILE).is_file():
        try:
            tokenizer = _Text(HFTokenizer(path / TOKENIZER_FILE), template=True)
        except ValueError:  # tokenizers is not installed, or the file is damaged
            tokenizer = None
    eos = hf.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    return model, tokenizer, frozenset(i for i in eos if isinstance(i, int))


def _shards(placement) -> int:
    """The sequence shards of a placement (1 without a mesh)."""
    return 1 if placement.spec is None else placement.spec.context_parallel_size


def _load_run(args: argparse.Namespace):
    """**Returns:** `(model, byte tokenizer, eos ids)` of the newest readable checkpoint of
    `--run-dir` (default: the newest run under `runs/`)."""
    from ..run import default_run_dir, read_run_model

    if args.run_dir is None:
        try:
            run_dir = default_run_dir(resume=True)
        except ValueError:
            raise ValueError(
                "without --run-dir or --hf the model is the newest run under runs/ with "
                "checkpoints, and there is none. Pass --run-dir of a run of python -m "
                "eqx_longctx.train, or --hf DIR."
            ) from None
    else:
        run_dir = pathlib.Path(args.run_dir)

    def placement_of(config, family):
        placement = _placement(args, config.vocab_size)
        placement.check_run(1, 2 * _shards(placement), config, family=family)
        return placement

    run = read_run_model(run_dir, placement_of, reader="generate")
    text = _Text(run.tokenizer)
    return run.model, text, frozenset({text.tok.eos_id})
