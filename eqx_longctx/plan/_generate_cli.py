"""`python -m eqx_longctx.plan --model M --preset P --generate --seq S ...`: the inference
planner's command (`plan_generate`, and with `--compile` the real prefill and decode step
compiled for abstract arrays)."""

import json
import sys
from typing import Any

import equinox as eqx
import jax

from .._units import gib

# Flags of the train-step planner that mean nothing to inference.
_TRAIN_ONLY = {"train": "--train", "remat": "--remat", "memory_budget_gib": "--memory-budget-gib"}


def check_generate_flags(args: Any) -> None:
    """**Raises:** `ValueError` for a flag of the train-step planner, or a missing
    `--model`, `--preset` or `--seq`."""
    given = [flag for name, flag in _TRAIN_ONLY.items() if getattr(args, name) not in (None, False)]
    if given:
        what = "is a flag" if len(given) == 1 else "are flags"
        raise ValueError(
            f"--generate plans inference (no backward, no optimizer); {', '.join(given)} "
            f"{what} of the train-step planner: drop it, or drop --generate and pass --train."
        )
    if args.model is None or args.preset is None:
        raise ValueError(
            "--generate needs --model and --preset (e.g. --model llama --preset tiny)."
        )
    if args.seq is None:
        raise ValueError(
            "--generate needs --seq, the tokens per row the KV cache holds (prompt and new "
            "tokens), e.g. --seq 131072."
        )


def run_generate(args: Any, run: Any) -> None:
    """Plan (and with `args.compile` compile) inference for the CLI's flags and print it.

    **Arguments:** `args`, the parsed flags; `run`, the trainer's `TrainerRun` of them.

    **Raises:** `ValueError` as `plan_generate`.
    """
    from ._compile import compile_generate, compiled_bytes
    from ._generate_plan import plan_generate

    spec = run.placement.spec
    plan = plan_generate(
        run.family, run.config, spec, batch=args.batch, seq=args.seq,
        prompt_len=args.prompt_len, cache_dtype=args.cache_dtype,
    )  # fmt: skip
    plan.problem["preset"] = args.preset
    compiled = None
    if args.compile:
        key = jax.random.key(0)
        model = eqx.filter_eval_shape(run.family.model, run.config, key=key, spec=spec)
        first, step = compile_generate(
            model, batch=args.batch, seq=args.seq, prompt_len=args.prompt_len,
            cache_dtype=args.cache_dtype,
        )  # fmt: skip
        compiled = {"prefill": compiled_bytes(first), "decode": compiled_bytes(step)}
    if args.json:
        print(json.dumps(generate_record(plan, compiled)))
    else:
        print(plan.explain())
        for name, c in (compiled or {}).items():
            predicted = getattr(plan.memory, name)
            print(
                f"compiled {name} on fake CPU devices: {gib(c.device)} per device (arguments "
                f"{gib(c.arguments)} + outputs {gib(c.outputs)} + temporaries "
                f"{gib(c.temporaries)} - donated {gib(c.aliased)}); predicted {gib(predicted)}, "
                f"ratio {predicted / c.device:.2f}"
            )
    sys.stdout.flush()


def generate_record(plan: Any, compiled: dict | None = None) -> dict:
    """One JSON-able record: the problem, the breakdown, the cache per stack and a row per
    phase (`prefill`, `decode`) with the predicted and, when compiled, XLA's bytes."""
    record = dict(plan.problem)
    m = plan.memory
    record.update(
        cache_bytes_per_device=m.cache,
        params_bytes_per_device=m.params,
        breakdown=m.breakdown(),
        stacks=[s._asdict() for s in plan.stacks],
        rows=[
            dict(
                phase=name,
                predicted_bytes_per_device=getattr(m, name),
                compiled_bytes_per_device=None if compiled is None else compiled[name].device,
                compiled=None if compiled is None else compiled[name]._asdict(),
            )
            for name in ("prefill", "decode")
        ],
    )
    return record
