"""`python -m eqx_longctx.plan`: what a run will cost, per device, before it runs.

Three planners behind one command. The mesh is made of fake CPU devices, so any mesh can be
planned on a laptop.

- With `--model`, the whole train step (`eqx_longctx.plan_train_step`): parameters, gradients,
  AdamW state, activations under each remat policy, attention temporaries, logits and
  loss, per device, for every strategy the mesh can run; the step's time (every layer's
  matmuls and attention), its model FLOPs and the MFU they imply; and the fastest
  (strategy, remat) that fits `--memory-budget-gib`. `--chip v5p` (v5e, v6e, tpu7x, h100,
  h200) prices it at that chip's peak bfloat16 FLOP/s and link bandwidth, with its HBM as
  the budget; `--tflops`, `--gbps` and `--memory-budget-gib` win over it. The model config
  and the placement are the trainer's (`eqx_longctx.train`: `--override FIELD=VALUE`,
  `--mesh`, `--strategy`, `--load-balance`, `--fsdp-axes` mean what they mean to
  `python -m eqx_longctx.train`).
  `--compile` compiles the trainer's step under that placement on abstract arrays and
  prints XLA's memory analysis beside the prediction; `--json` prints one JSON object
  instead of the table.
- With `--model` and `--generate`, inference (`eqx_longctx.plan.plan_generate`): the KV
  cache of `--seq` tokens per row, the parameters, and the peaks of the prefill and of a
  decode step, per device; `--compile` compiles the real prefill and decode step on
  abstract arrays beside them.
- Without `--model`, one attention call (`eqx_longctx.explain`): every strategy's memory,
  communication, balance and time, and the one `"auto"` picks; `--check` compiles each.

    python -m eqx_longctx.plan --model llama --preset llama3.1-8b --seq 1048576 --batch 4 \\
        --mesh fsdp=4,context=16 --train --chip v5p
    python -m eqx_longctx.plan --model llama --preset tiny --seq 8192 --batch 2 \\
        --mesh fsdp=2,context=4 --train --remat full --compile --json
    python -m eqx_longctx.plan --model llama --preset llama3.1-8b --generate --seq 1048576 \\
        --mesh context=64 --cache-dtype bfloat16 --json
    python -m eqx_longctx.plan --mesh data=2,context=4 --strategy auto --load-balance zigzag \\
        --batch 2 --seq 32768 --heads 32 --kv-heads 8 --head-dim 128
    python -m eqx_longctx.plan --mesh ulysses=2,context=4 --strategy usp --seq 65536 --check
"""

import argparse
import dataclasses
import json
import math
import sys
from typing import Any

import jax
import jax.numpy as jnp

from .._hlo import collective_bytes
from .._sharding import ShardingSpec
from ..attention import STRATEGY_ORDER
from ..attention import plan_attention as plan
from ..run import parse_mesh, parse_override
from ._activations import REMATS
from ._chips import CHIPS, as_chip
from ._compile import compile_train_step, compiled_attention, compiled_bytes, trainer_run


def cpu_devices(n: int) -> None:
    """Make `n` CPU devices (fake ones: any mesh is planned on a laptop) with the trainer's
    `set_cpu_devices`, before JAX starts its backends.

    **Raises:** `ValueError` as the trainer's `check_device_count` when JAX already
    started with fewer devices (run the planner in a fresh process).
    """
    from ..run import check_device_count, set_cpu_devices

    try:
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:
        pass  # backends already exist (e.g. inside a test session): use what they have
    set_cpu_devices(n)
    check_device_count(n, len(jax.devices()), jax.process_count())


def _positive(text: str) -> float:
    """argparse type of the GiB, TFLOP/s and GB/s flags: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0; got {text}")
    return value


def main(argv=None) -> None:
    """Run the planner CLI (`python -m eqx_longctx.plan --help`): every invalid flag is one
    line on stderr and exit status 2."""

    p = argparse.ArgumentParser(
        prog="python -m eqx_longctx.plan", description=(__doc__ or "").splitlines()[0]
    )
    p.add_argument("--mesh", default="context=8", help="axis sizes, e.g. data=2,context=4")
    p.add_argument("--strategy", default="auto", choices=STRATEGY_ORDER + ("auto",))
    p.add_argument("--load-balance", default="zigzag", choices=("none", "zigzag", "striped"))
    p.add_argument("--batch", "--batch-size", type=int, default=1, help="global batch rows")
    p.add_argument(
        "--grad-accum", type=int, default=1, metavar="K",
        help="with --train: the batch runs as K micro-batches (the trainer's --grad-accum)",
    )  # fmt: skip
    p.add_argument(
        "--host-offload", default=None, metavar="WHAT",
        help="with --train: opt_state and/or params in host memory between steps (the "
        "trainer's --host-offload)",
    )  # fmt: skip
    p.add_argument(
        "--loss-chunk", type=int, default=None, metavar="TOKENS",
        help="with --train: tokens per chunk of the loss (the trainer's --loss-chunk; default "
        "automatic, 0: the whole logits)",
    )  # fmt: skip
    p.add_argument("--seq", "--seq-len", type=int, default=None,
                   help="sequence length (default 32768); --generate: cache tokens")  # fmt: skip
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--v-head-dim", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--window", type=int, default=None, help="sliding window (causal only)")
    p.add_argument("--segment-ids", action="store_true")
    p.add_argument("--forward-only", action="store_true", help="choose by forward cost only")
    p.add_argument("--memory-budget-gib", type=_positive, default=None)
    p.add_argument("--tflops", type=_positive, default=None, help="device FLOP/s / 1e12")
    p.add_argument("--gbps", type=_positive, default=None, help="link bytes/s / 1e9")
    p.add_argument(
        "--chip", default=None, metavar="NAME",
        help=f"price on a chip ({', '.join(CHIPS)}): its peak bf16 FLOP/s, link bytes/s and "
        "HBM (the default budget); --tflops, --gbps, --memory-budget-gib win over it",
    )  # fmt: skip
    p.add_argument("--context-axis", default="context")
    p.add_argument("--ulysses-axis", default=None, help="default: 'ulysses' under usp")
    p.add_argument("--tensor-axis", default=None)
    p.add_argument("--check", action="store_true", help="compile each strategy and compare")
    step = p.add_argument_group("whole train step (with --model)")
    step.add_argument("--model", default=None, help="an installed model family, e.g. llama")
    step.add_argument("--preset", default=None, help="a preset of the family, e.g. llama3.1-8b")
    step.add_argument("--train", action="store_true", help="plan a train step (AdamW)")
    step.add_argument("--fsdp-axes", default=None, help="axes the weights are split over")
    step.add_argument("--remat", default=None, choices=REMATS, help="default: all")
    step.add_argument("--override", action="append", default=[], type=parse_override,
                      metavar="FIELD=VALUE", help="model config field, e.g. n_layers=2 "
                      "(repeatable; as the trainer's --override)")  # fmt: skip
    step.add_argument("--compile", action="store_true", help="compile the step and compare")
    step.add_argument("--json", action="store_true", help="print one JSON object")
    gen = p.add_argument_group("inference (with --model and --generate)")
    gen.add_argument("--generate", action="store_true", help="plan the KV cache, prefill, decode")
    gen.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default --seq)")
    gen.add_argument("--cache-dtype", default=None, choices=("float32", "bfloat16"),
                     help="default: the compute dtype")  # fmt: skip
    args = p.parse_args(argv)
    try:
        _check_used(p, args)
        if args.chip is not None:
            as_chip(args.chip)  # an unknown name is one line, before any planning
        if args.generate:
            _run_generate(args)
            return
        if args.prompt_len is not None or args.cache_dtype is not None:
            raise ValueError("--prompt-len and --cache-dtype plan inference: add --generate.")
        if args.seq is None:
            args.seq = 32768
        if args.model is not None:
            _run_step(args)
        else:
            _run(args)
    except (ValueError, TypeError) as e:
        p.error(str(e))


# Flags only the attention planner reads (without --model the shapes are these flags'),
# and flags only the train-step planner reads (with --model; those of the trainer).
_ATTENTION_ONLY = (
    "heads", "kv_heads", "head_dim", "v_head_dim", "dtype", "no_causal", "window",
    "segment_ids", "forward_only", "check", "context_axis", "ulysses_axis", "tensor_axis",
)  # fmt: skip
_STEP_ONLY = (
    "preset", "train", "fsdp_axes", "remat", "override", "compile", "json", "grad_accum",
    "host_offload", "loss_chunk",
)  # fmt: skip


def _check_used(p: argparse.ArgumentParser, args) -> None:
    """**Raises:** `ValueError` for a flag the chosen planner would ignore (the attention
    planner, `--model`'s train step, or `--generate`), naming it and the mode."""

    def given(names) -> list[str]:
        return ["--" + n.replace("_", "-") for n in names if getattr(args, n) != p.get_default(n)]

    if args.generate:
        unused = given((*_ATTENTION_ONLY, "grad_accum", "host_offload", "loss_chunk",
                        "tflops", "gbps", "chip"))  # fmt: skip
        mode = "--generate plans inference of --model's config"
    elif args.model is None:
        unused = given(_STEP_ONLY)
        mode = "without --model the planner prices one attention call (add --model for a step)"
    else:
        unused = given(_ATTENTION_ONLY)
        mode = "with --model the attention's shapes come from the model's config"
    if unused:
        raise ValueError(f"{', '.join(unused)}: not used: {mode}. Drop them.")


def _run(args) -> None:
    axes = parse_mesh(args.mesh)
    cpu_devices(math.prod(axes.values()))
    mesh = jax.make_mesh(
        tuple(axes.values()), tuple(axes), devices=jax.devices()[: math.prod(axes.values())]
    )
    ulysses = args.ulysses_axis
    if ulysses is None and args.strategy == "usp" and "ulysses" in axes:
        ulysses = "ulysses"
    spec = ShardingSpec(
        mesh,
        strategy=args.strategy,
        load_balance=args.load_balance,
        context_axis=args.context_axis,
        ulysses_axis=ulysses,
        tensor_axis=args.tensor_axis,
    )
    shape = dict(
        batch=args.batch,
        seq=args.seq,
        q_heads=args.heads,
        kv_heads=args.kv_heads or args.heads,
        head_dim=args.head_dim,
        v_head_dim=args.v_head_dim,
        dtype=jnp.dtype(args.dtype),
        causal=not args.no_causal,
        window=args.window,
        segment_ids=args.segment_ids,
    )
    extra = {}
    chip = None if args.chip is None else as_chip(args.chip)
    if chip is not None:  # the flags below win over the chip's figures
        extra = dict(
            memory_budget_bytes=chip.device_hbm_bytes, flops_per_s=chip.device_flops_per_s,
            bytes_per_s=chip.hop_bytes_per_s(spec.context_parallel_size),
        )  # fmt: skip
    if args.memory_budget_gib is not None:
        extra["memory_budget_bytes"] = int(args.memory_budget_gib * 2**30)
    if args.tflops is not None:
        extra["flops_per_s"] = args.tflops * 1e12
    if args.gbps is not None:
        extra["bytes_per_s"] = args.gbps * 1e9
    result = plan(spec, backward=not args.forward_only, **shape, **extra)
    chosen = result.costs[result.strategy]
    if not (chosen.feasible and chosen.runnable):
        why: dict[str, list[str]] = {}
        for c in result.costs.values():
            if c.reason:
                why.setdefault(c.reason, []).append(c.strategy)
        reasons = "; ".join(f"{', '.join(names)}: {reason}" for reason, names in why.items())
        raise ValueError(
            f"no strategy can run these shapes (--batch {args.batch}, --seq {args.seq}, "
            f"--heads {args.heads}, --kv-heads {args.kv_heads or args.heads}) on --mesh "
            f"{args.mesh}: {reasons}."
        )
    print(result.explain())
    if args.strategy != "auto" and spec.ulysses_axis is None:
        auto = plan(
            ShardingSpec(
                mesh,
                strategy="auto",
                load_balance=args.load_balance,
                context_axis=args.context_axis,
                tensor_axis=args.tensor_axis,
            ),
            backward=not args.forward_only,
            **shape,
            **extra,
        )
        print(f"strategy='auto' on this mesh would pick: {auto.strategy} ({auto.reason})")
    if args.check:
        _check(spec, result, shape)


def _check(spec: ShardingSpec, result, shape: dict) -> None:
    """Compile the strategies this spec can run and print measured / predicted."""
    print("\ncompiled on fake CPU devices (measured / predicted):")
    print(f"{'strategy':10} {'pass':4} {'comm':>22} {'memory':>24}")
    for name, cost in result.costs.items():
        if not (cost.feasible and cost.runnable):
            continue
        s = spec if spec.strategy == name else _with_strategy(spec, name)
        for backward in (False, True):
            c = compiled_attention(s, backward=backward, **shape)
            comm, mem = sum(collective_bytes(c).values()), compiled_bytes(c).device
            pc = sum((cost.comm_train if backward else cost.comm_forward).values())
            pm = cost.memory_train if backward else cost.memory_forward
            print(
                f"{name:10} {'f+b' if backward else 'fwd':4} {comm:>10} / {pc:<10} "
                f"{mem / 2**20:>9.1f} / {pm / 2**20:<7.1f} MiB  ratio comm "
                f"{comm / max(pc, 1):.2f} mem {mem / max(pm, 1):.2f}"
            )
    sys.stdout.flush()


def _with_strategy(spec: ShardingSpec, name: str) -> ShardingSpec:
    return spec.replace(
        strategy=name, ulysses_axis=spec.ulysses_axis if name in ("usp", "auto") else None
    )


# ---- the whole train step ---------------------------------------------------------------


def step_settings(args) -> Any:
    """The `eqx_longctx.train.TrainConfig` of the run the flags describe: the trainer's
    checks of `--model`, `--preset`, `--override`, `--seq`, `--batch`, `--mesh`,
    `--strategy`, `--load-balance` and `--fsdp-axes` apply."""
    from ..train import TrainConfig

    return TrainConfig(
        model=args.model, preset=args.preset, model_overrides=dict(args.override),
        seq_len=args.seq, batch_size=args.batch, devices=math.prod(parse_mesh(args.mesh).values()),
        mesh=args.mesh, fsdp_axes=args.fsdp_axes, strategy=args.strategy,
        load_balance=args.load_balance, run_dir="unused", progress=False,
        grad_accum=args.grad_accum, loss_chunk=args.loss_chunk, host_offload=args.host_offload,
    )  # fmt: skip


def _run_generate(args) -> None:
    from .._family import model_family
    from ._generate_cli import check_generate_flags, run_generate

    check_generate_flags(args)
    model_family(args.model)  # an unknown family is reported as such, before its settings
    settings = step_settings(args)  # the trainer's checks of model, preset, mesh, batch
    cpu_devices(settings.devices)
    run_generate(args, trainer_run(settings))


def _run_step(args) -> None:
    from .._family import model_family
    from ..train import host_offload_of
    from ._explain import step_record
    from ._step_plan import plan_train_step

    if not args.train:
        raise ValueError(
            "--model plans a train step: pass --train (one attention call is planned without "
            "--model, from --heads/--kv-heads/--head-dim)."
        )
    if args.preset is None:
        raise ValueError(f"--model {args.model} needs --preset (e.g. --preset tiny).")
    model_family(args.model)  # an unknown family is reported as such, before its settings
    settings = step_settings(args)
    cpu_devices(settings.devices)
    run = trainer_run(settings)
    spec = run.placement.spec
    budget = None if args.memory_budget_gib is None else args.memory_budget_gib * 2**30
    extra = {}
    if args.tflops is not None:
        extra["flops_per_s"] = args.tflops * 1e12
    if args.gbps is not None:
        extra["bytes_per_s"] = args.gbps * 1e9
    remats = REMATS if args.remat is None else (args.remat,)
    result = plan_train_step(
        run.family, run.config, spec, batch=args.batch, seq=args.seq, remats=remats,
        memory_budget_bytes=budget, grad_accum=args.grad_accum, loss_chunk=args.loss_chunk,
        host_offload=host_offload_of(settings.host_offload), chip=args.chip, **extra,
    )  # fmt: skip
    result.problem["preset"] = args.preset
    row = result.chosen
    if row is None and len(result.rows) == 1:
        row = result.rows[0]  # one (strategy, remat) asked for: report it even if over budget
    compiled = None
    if args.compile and row is not None:  # the trainer's run with the row's choices
        chosen = dataclasses.replace(settings, strategy=row.strategy, remat=row.remat)
        compiled = compiled_bytes(compile_train_step(trainer_run(chosen)))
    if args.json:
        print(json.dumps(step_record(result, row, compiled)))
    else:
        print(result.explain())
        if compiled is not None and row is not None:
            print(
                f"compiled {row.strategy}, remat={row.remat!r} on {len(spec.mesh.devices.flat)} "
                f"fake CPU devices: {compiled.device / 2**20:.1f} MiB per device (arguments "
                f"{compiled.arguments / 2**20:.1f} + outputs {compiled.outputs / 2**20:.1f} + "
                f"temporaries {compiled.temporaries / 2**20:.1f} - donated "
                f"{compiled.aliased / 2**20:.1f}), host {compiled.host / 2**20:.1f} MiB; "
                f"predicted {row.device / 2**20:.1f} MiB, ratio {row.device / compiled.device:.2f}"
            )
    sys.stdout.flush()
    if result.chosen is None and result.problem["memory_budget_bytes"] is not None:
        raise ValueError(result.reason)  # the budget given, or the chip's HBM
