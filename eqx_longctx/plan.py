"""`python -m eqx_longctx.plan`: what a run will cost, per device, before it runs.

Two planners behind one command. The mesh is made of fake CPU devices, so any mesh can be
planned on a laptop.

- With `--model`, the whole train step (`eqx_longctx._step_plan`): parameters, gradients,
  AdamW state, activations under each remat policy, attention temporaries, logits and
  loss, per device, for every strategy the mesh can run; and the fastest (strategy,
  remat) that fits `--memory-budget-gib`. `--compile` compiles the real train step on
  abstract arrays and prints XLA's memory analysis beside the prediction; `--json` prints
  one JSON object instead of the table.
- Without it, one attention call (`eqx_longctx.attention.plan`): every strategy's memory,
  communication, balance and time, and the one `"auto"` picks; `--check` compiles each.

    python -m eqx_longctx.plan --model llama --preset llama3.1-8b --seq 1048576 --batch 4 \\
        --mesh fsdp=4,context=16 --train --memory-budget-gib 95
    python -m eqx_longctx.plan --model llama --preset tiny --seq 8192 --batch 2 \\
        --mesh fsdp=2,context=4 --train --remat full --compile --json
    python -m eqx_longctx.plan --mesh data=2,context=4 --strategy auto --load-balance zigzag \\
        --batch 2 --seq 32768 --heads 32 --kv-heads 8 --head-dim 128
    python -m eqx_longctx.plan --mesh ulysses=2,context=4 --strategy usp --seq 65536 --check
"""

import argparse
import ast
import dataclasses
import json
import math
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._hlo import collective_bytes
from ._mesh import parse_mesh
from ._sharding import ShardingSpec
from .attention import attention
from .attention._plan import STRATEGY_ORDER, plan

REMAT_CHOICES = ("none", "dots", "offload", "full")


def compiled_attention(
    spec: ShardingSpec,
    *,
    batch: int,
    seq: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    v_head_dim: int | None = None,
    dtype=jnp.float32,
    causal: bool = True,
    window: int | None = None,
    segment_ids: bool = False,
    backward: bool = False,
):
    """Compile (never run) `attention` under `spec` for abstract sharded inputs.

    With `backward`, the program is `jax.value_and_grad` of the summed output with respect
    to q, k, v: the forward output stays live, as it would inside a model.

    **Returns:** the `jax.stages.Compiled` program.
    """
    dv = head_dim if v_head_dim is None else v_head_dim
    heads, tokens = spec.sharding(spec.heads_pspec()), spec.sharding(spec.token_pspec())
    q = jax.ShapeDtypeStruct((batch, seq, q_heads, head_dim), dtype, sharding=heads)
    k = jax.ShapeDtypeStruct((batch, seq, kv_heads, head_dim), dtype, sharding=heads)
    v = jax.ShapeDtypeStruct((batch, seq, kv_heads, dv), dtype, sharding=heads)
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=tokens)

    def forward(q, k, v, ids):
        return attention(
            q, k, v, spec=spec, causal=causal, window=window,
            segment_ids=ids if segment_ids else None,
        )  # fmt: skip

    fn = forward
    if backward:
        loss = lambda q, k, v, ids: jnp.sum(forward(q, k, v, ids).astype(jnp.float32))  # noqa: E731
        fn = jax.value_and_grad(loss, argnums=(0, 1, 2))
    return jax.jit(fn).lower(q, k, v, ids).compile()


def compiled_memory(compiled) -> int:
    """Per-device bytes of a compiled program: arguments + outputs + temporaries - aliases.

    (XLA:CPU leaves `peak_memory_in_bytes` at 0, so this is the comparable number.)
    """
    m = compiled.memory_analysis()
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def _fake_devices(n: int) -> None:
    """Ask for `n` CPU devices; works only before JAX has initialised a backend."""
    try:
        jax.config.update("jax_platforms", "cpu")
        if jax.config.jax_num_cpu_devices < n:  # pyright: ignore[reportAttributeAccessIssue]
            jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # already initialised (e.g. inside a test session): use what exists
    if len(jax.devices()) < n:
        raise SystemExit(
            f"the mesh needs {n} devices but JAX already started with {len(jax.devices())}; "
            "run the planner in a fresh process."
        )


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
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--mesh", default="context=8", help="axis sizes, e.g. data=2,context=4")
    p.add_argument("--strategy", default="auto", choices=STRATEGY_ORDER + ("auto",))
    p.add_argument("--load-balance", default="zigzag", choices=("none", "zigzag", "striped"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=32768)
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
    p.add_argument("--context-axis", default="context")
    p.add_argument("--ulysses-axis", default=None, help="default: 'ulysses' under usp")
    p.add_argument("--tensor-axis", default=None)
    p.add_argument("--check", action="store_true", help="compile each strategy and compare")
    step = p.add_argument_group("whole train step (with --model)")
    step.add_argument("--model", default=None, help="model family: llama or deepseek")
    step.add_argument("--preset", default=None, help="a preset of the family, e.g. llama3.1-8b")
    step.add_argument("--train", action="store_true", help="plan a train step (AdamW)")
    step.add_argument("--fsdp-axes", default=None, help="axes the weights are split over")
    step.add_argument("--remat", default=None, choices=REMAT_CHOICES, help="default: all")
    step.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="config override, e.g. n_layers=2 (repeatable)")  # fmt: skip
    step.add_argument("--compile", action="store_true", help="compile the step and compare")
    step.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    try:
        if args.model is not None:
            _run_step(args)
        else:
            _run(args)
    except (ValueError, TypeError) as e:
        p.error(str(e))


def _run(args) -> None:
    axes = parse_mesh(args.mesh)
    _fake_devices(math.prod(axes.values()))
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
    if args.memory_budget_gib is not None:
        extra["memory_budget_bytes"] = int(args.memory_budget_gib * 2**30)
    if args.tflops is not None:
        extra["flops_per_s"] = args.tflops * 1e12
    if args.gbps is not None:
        extra["bytes_per_s"] = args.gbps * 1e9
    result = plan(spec, backward=not args.forward_only, **shape, **extra)
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
            comm, mem = sum(collective_bytes(c).values()), compiled_memory(c)
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


def step_spec(axes: dict, *, strategy: str, load_balance: str, fsdp_axes: str | None):
    """The `ShardingSpec` of a train step on a mesh of fake CPU devices: the batch over
    `data` (and the fsdp axes that are not sequence axes), the sequence over `context`
    (and `ulysses`), `tensor` and `expert` axes as their roles, the weights over
    `fsdp_axes` (default: the `fsdp` axis when the mesh has one), checked as the trainer's
    `--fsdp-axes` is."""
    from .train._config import fsdp_axes_of  # the trainer's rules for the same flag

    fsdp = fsdp_axes_of(fsdp_axes, axes, ",".join(f"{k}={v}" for k, v in axes.items()))
    n = math.prod(axes.values())
    _fake_devices(n)
    # Auto axes, as the trainer's mesh (`eqx_longctx.train.Placement`): jit propagates the
    # shardings of the model and optimizer state.
    grid = np.array(jax.devices()[:n]).reshape(tuple(axes.values()))
    mesh = jax.sharding.Mesh(grid, tuple(axes))
    ulysses = "ulysses" if "ulysses" in axes and strategy in ("usp", "auto") else None
    return ShardingSpec(
        mesh, strategy=strategy, load_balance=load_balance, ulysses_axis=ulysses,
        tensor_axis="tensor" if "tensor" in axes else None, fsdp_axis=fsdp,
        expert_axis="expert" if "expert" in axes else None,
    )  # fmt: skip


def step_config(model: str, preset: str | None, seq: int, sets: list[str]):
    """The family's preset with `max_seq_len` raised to `seq` and the `--set` overrides."""
    from models import family

    fam = family(model)
    if preset not in fam.presets:
        raise ValueError(
            f"unknown {model} preset {preset!r} (--preset); choose one of {sorted(fam.presets)}."
        )
    overrides: dict[str, Any] = {"max_seq_len": max(seq, fam.presets[preset].max_seq_len)}
    fields = {f.name for f in dataclasses.fields(fam.presets[preset])}
    for item in sets:
        name, sep, text = item.partition("=")
        if not sep or name.strip() not in fields:
            raise ValueError(
                f"--set takes FIELD=VALUE with a field of {type(fam.presets[preset]).__name__}; "
                f"got {item!r}. The fields are {sorted(fields)}."
            )
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            value = text.strip()  # a string such as bfloat16
        overrides[name.strip()] = value
    return fam.config.from_preset(preset, **overrides)


def _run_step(args) -> None:
    from ._step_compile import compile_train_step, compiled_step_bytes
    from ._step_explain import step_record
    from ._step_plan import plan_train_step

    if not args.train:
        raise ValueError(
            "--model plans a train step: pass --train (one attention call is planned without "
            "--model, from --heads/--kv-heads/--head-dim)."
        )
    if args.preset is None:
        raise ValueError(f"--model {args.model} needs --preset (e.g. --preset tiny).")
    axes = parse_mesh(args.mesh)
    config = step_config(args.model, args.preset, args.seq, args.set)
    spec = step_spec(
        axes, strategy=args.strategy, load_balance=args.load_balance, fsdp_axes=args.fsdp_axes
    )
    budget = None if args.memory_budget_gib is None else args.memory_budget_gib * 2**30
    extra = {}
    if args.tflops is not None:
        extra["flops_per_s"] = args.tflops * 1e12
    if args.gbps is not None:
        extra["bytes_per_s"] = args.gbps * 1e9
    remats = REMAT_CHOICES if args.remat is None else (args.remat,)
    result = plan_train_step(
        args.model, config, spec, batch=args.batch, seq=args.seq, remats=remats,
        memory_budget_bytes=budget, **extra,
    )  # fmt: skip
    result.problem["preset"] = args.preset
    row = result.chosen
    if row is None and len(result.rows) == 1:
        row = result.rows[0]  # one (strategy, remat) asked for: report it even if over budget
    compiled = None
    if args.compile and row is not None:
        s = spec if spec.strategy == row.strategy else _with_strategy(spec, row.strategy)
        c = dataclasses.replace(config, remat=row.remat)
        compiled = compiled_step_bytes(
            compile_train_step(args.model, c, s, batch=args.batch, seq=args.seq)
        )
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
    if result.chosen is None and budget is not None:
        raise ValueError(result.reason)


if __name__ == "__main__":
    main()
