"""FSDP on 8 fake CPU devices: per-device parameter + optimizer bytes and train-step time as
the fsdp axis grows 1, 2, 4, 8, side by side in one run.

The model and the global batch are fixed; the mesh is `data=8/f, fsdp=f`, so every row of
the batch lands on its own device in every column and only the weights' placement changes:
`fsdp=1` is plain data parallelism with replicated weights (the baseline). A step is the
model's loss, its gradient and an AdamW update, jitted with the parameters and optimizer
state in their shards (donated), as a trainer runs it.

Targets (issue 10): bytes within 10% of 1/fsdp of the replicated bytes; step time at most
1.3x the replicated step. The 8 fake devices share this machine's cores, so the step time
measures FSDP's overhead (gathers, reduce-scatters, scheduling), not a speed-up.

    python benchmarks/fsdp.py
    python benchmarks/fsdp.py --dim 512 --layers 4 --seq 1024 --repeats 5
    python benchmarks/fsdp.py --plot docs/img/benchmarks      # also writes fsdp.png
"""

import argparse
import dataclasses
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import eqx_longctx as el  # noqa: E402
from models.llama import PRESETS, Llama  # noqa: E402

MIB = 2**20


def _device0_bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def _build(config, fsdp: int, batch: int, seq: int) -> dict:
    # Auto axes, as the trainer builds its mesh: jit propagates the shardings.
    grid = np.array(jax.devices()).reshape(8 // fsdp, fsdp, 1)
    mesh = jax.sharding.Mesh(grid, ("data", "fsdp", "context"))
    spec = el.ShardingSpec(mesh, strategy="ring", fsdp_axis="fsdp" if fsdp > 1 else ())
    model = el.init_sharded(lambda: Llama(config, key=jax.random.key(0), spec=spec))
    params, static = eqx.partition(model, eqx.is_array)
    optimizer = optax.adamw(1e-3)
    shardings = el.param_shardings(model)
    opt_state = jax.jit(optimizer.init)(params)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch, seq + 1))
    inputs = jax.device_put(tokens[:, :-1].astype(np.int32), spec.sharding(spec.token_pspec()))
    labels = jax.device_put(tokens[:, 1:].astype(np.int32), spec.sharding(spec.token_pspec()))

    def loss(p, x, y):
        logits = eqx.combine(p, static)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(p, s, x, y):
        value, grads = jax.value_and_grad(loss)(p, x, y)
        grads = jax.lax.with_sharding_constraint(grads, shardings)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    step = jax.jit(step, donate_argnums=(0, 1))
    compiled = step.lower(params, opt_state, inputs, labels).compile()
    state = dict(params=params, opt_state=opt_state)

    def run() -> float:
        t0 = time.perf_counter()
        state["params"], state["opt_state"], value = step(
            state["params"], state["opt_state"], inputs, labels
        )
        jax.block_until_ready(value)
        state["loss"] = float(value)
        return time.perf_counter() - t0

    # Warm up twice: the first call's outputs may come back in other shardings than `init`
    # gave (a scalar count, a propagated layout), and the second call compiles for those.
    run()
    run()
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    return dict(
        fsdp=fsdp,
        run=run,
        times=[],
        param_bytes=_device0_bytes(state["params"]),
        opt_bytes=_device0_bytes(state["opt_state"]),
        predicted=el.param_bytes_per_device(model),
        temp=mem.temp_size_in_bytes,
        state=state,
        gathers=text.count(" all-gather(") + text.count(" all-gather-start("),
        scatters=text.count(" reduce-scatter("),
        reduces=text.count(" all-reduce(") + text.count(" all-reduce-start("),
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--fsdp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--plot", metavar="DIR", help="also write DIR/fsdp.png")
    args = p.parse_args(argv)
    config = dataclasses.replace(
        PRESETS["tiny"], dim=args.dim, n_layers=args.layers, hidden_dim=args.hidden,
        n_heads=args.heads, n_kv_heads=args.heads, head_dim=args.dim // args.heads,
        vocab_size=args.vocab, max_seq_len=max(args.seq, 1024),
    )  # fmt: skip
    n = Llama(config, key=jax.random.key(0)).num_params()
    print(
        f"Llama: dim {args.dim}, {args.layers} layers, hidden {args.hidden}, vocab "
        f"{args.vocab}: {n / 1e6:.2f}M parameters ({n * 4 / MIB:.1f} MiB f32); batch "
        f"{args.batch} x {args.seq} tokens; mesh data=8/f x fsdp=f; AdamW; median of "
        f"{args.repeats} steps.\n"
    )
    rows = [_build(config, f, args.batch, args.seq) for f in args.fsdp]
    # Round-robin timing: every column sees the same phases of a shared machine.
    for _ in range(args.repeats):
        for r in rows:
            r["times"].append(r["run"]())
    for r in rows:
        r["step"] = float(np.median(r["times"]))
    base = rows[0]
    print(
        "| fsdp | params MiB/dev | opt state MiB/dev | (params+opt) x fsdp / replicated | "
        "predicted params MiB | temps MiB | step s | step / replicated | all-gathers | "
        "reduce-scatters | all-reduces | loss after the steps |"
    )
    print("|" + "---|" * 12)
    for r in rows:
        scaled = (r["param_bytes"] + r["opt_bytes"]) * r["fsdp"]
        ratio = scaled / (base["param_bytes"] + base["opt_bytes"]) * base["fsdp"]
        print(
            f"| {r['fsdp']} | {r['param_bytes'] / MIB:.2f} | {r['opt_bytes'] / MIB:.2f} | "
            f"{ratio:.3f} | {r['predicted'] / MIB:.2f} | {r['temp'] / MIB:.1f} | "
            f"{r['step']:.3f} | {r['step'] / base['step']:.2f}x | {r['gathers']} | "
            f"{r['scatters']} | {r['reduces']} | {r['state']['loss']:.5f} |"
        )
    if args.plot:
        import _plots

        _plots.fsdp(rows, args.plot)


if __name__ == "__main__":
    main()
