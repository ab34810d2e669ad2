"""`python -m eqx_longctx.plan`: which context-parallel strategy, and what it will cost.

Prints the cost model's table (`eqx_longctx.attention._plan.plan`) for a mesh and an
attention shape, and the strategy `"auto"` would pick. The mesh is made of fake CPU devices,
so any mesh can be planned on a laptop; `--check` also compiles each strategy on that mesh
(abstract inputs, nothing runs) and prints the measured collective bytes and memory beside
the prediction.

    python -m eqx_longctx.plan --mesh data=2,context=4 --strategy auto --load-balance zigzag \\
        --batch 2 --seq 32768 --heads 32 --kv-heads 8 --head-dim 128
    python -m eqx_longctx.plan --mesh ulysses=2,context=4 --strategy usp --seq 65536 --check
"""

import argparse
import math
import sys

import jax
import jax.numpy as jnp

from ._hlo import collective_bytes
from ._mesh import parse_mesh
from ._sharding import ShardingSpec
from .attention import attention
from .attention._plan import STRATEGY_ORDER, plan


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
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # already initialised (e.g. inside a test session): use what exists
    if len(jax.devices()) < n:
        raise SystemExit(
            f"the mesh needs {n} devices but JAX already started with {len(jax.devices())}; "
            "run the planner in a fresh process."
        )


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
    p.add_argument("--memory-budget-gib", type=float, default=None)
    p.add_argument("--tflops", type=float, default=None, help="device FLOP/s / 1e12")
    p.add_argument("--gbps", type=float, default=None, help="link bytes/s / 1e9")
    p.add_argument("--context-axis", default="context")
    p.add_argument("--ulysses-axis", default=None, help="default: 'ulysses' under usp")
    p.add_argument("--tensor-axis", default=None)
    p.add_argument("--check", action="store_true", help="compile each strategy and compare")
    args = p.parse_args(argv)
    try:
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


if __name__ == "__main__":
    main()
