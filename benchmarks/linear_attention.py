"""Linear attention (the gated delta rule) side by side, measured in one run.

Sections (all by default, pick with `--sections`):

- `op`: the op on one device, forward + backward (the gradient of the summed outputs with
  respect to q, k, v, g, beta), batch 1, heads 4, `dk = dv = 128`, a GDN gate, float32:
  ours (`eqx_longctx.gated_delta_rule`, jitted) against transformers'
  `torch_chunk_gated_delta_rule` (Qwen3-Next's fallback without flash-linear-attention) on
  the same CPU with the same threads: torch gets `torch.set_num_threads(n)` with `n` the
  cores this process may run on (`os.sched_getaffinity`), the size XLA:CPU gives its
  intra-op thread pool. The two alternate in every round (median of `--repeats`), and
  their gradients are compared.
- `cp`: on 8 fake CPU devices (`context` 8), forward + backward: our sequence split (the
  spec's layout, contiguous and zig-zag; affine summaries composed across devices) against
  the same op all-gathered (q, k, v, g, beta gathered over the sequence and the whole
  sequence run on every device, each keeping its own outputs; the transpose of the gather
  reduce-scatters the gradients). Collective bytes received per device and per-device
  memory from the compiled programs at every length of `--cp-seqs`; wall time (medians of
  interleaved rounds) at `--cp-time-seqs`.
- `hybrid`: the trainer's step on 8 fake devices (`context=8`, ring, zig-zag, batch 1):
  `qwen3_next` preset `tiny` (3 Gated DeltaNet layers, 1 gated attention layer; MoE in 3),
  the same with every layer a dense SwiGLU (`n_experts=0`), and a Llama of the same width,
  depth, heads and MLP width, all softmax: the compiled step's memory per device at
  `--hybrid-seqs`, and tokens/s of the device step (medians of `--repeats` interleaved
  rounds, after one that compiles) at `--hybrid-time-seqs`.

    python benchmarks/linear_attention.py    # over an hour on 2 shared cores (torch at 32K)
    python benchmarks/linear_attention.py --torch-max-seq 8192 --long-seq 2048 \
        --hybrid-seqs 8192 16384 32768 --plot docs/img/benchmarks   # 38 min, docs' run
    python benchmarks/linear_attention.py --quick --sections op cp   # smoke run, < 1 min
    python benchmarks/linear_attention.py --sections op --seqs 2048 8192 --repeats 5
    python benchmarks/linear_attention.py --plot docs/img/benchmarks   # also the figures

The 8 fake devices share this machine's cores, so in `cp` wall time measures total work
(the all-gathered op does the whole sequence's work on each of the 8), not a speed-up;
compiled bytes and memory are exact.
"""

import argparse
import functools
import os
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import eqx_longctx as el  # noqa: E402
from eqx_longctx._hlo import collective_bytes  # noqa: E402
from eqx_longctx.plan import compiled_memory  # noqa: E402
from eqx_longctx.plan._compile import compile_train_step, trainer_run  # noqa: E402

MIB = 2**20


def _inputs(seq: int, heads: int, dk: int, dv: int, seed: int = 0) -> list[np.ndarray]:
    """As a GDN layer makes them: L2-normalised q and k, a GDN gate, beta in (0, 1)."""
    rng = np.random.default_rng(seed)
    q, k = (rng.normal(size=(1, seq, heads, dk)) for _ in range(2))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    v = rng.normal(size=(1, seq, heads, dv))
    g = np.log(rng.uniform(0.9, 1.0, size=(1, seq, heads)))
    beta = rng.uniform(0.05, 0.95, size=(1, seq, heads))
    return [x.astype(np.float32) for x in (q, k, v, g, beta)]


def _medians(calls: dict, repeats: int, warm: bool = True) -> dict:
    """Median wall time of each `name: fn` (blocking), over `repeats` rounds in which every
    call runs once, so the shared machine's slow phases fall on all of them alike. With
    `warm`, each runs once first (compilation, warm-up)."""
    for fn in calls.values() if warm else ():
        fn()
    times: dict = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _loss_grad(fn):
    return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1, 2, 3, 4)))


def op_section(seqs, heads, dk, repeats, torch_max_seq, long_seq) -> list[dict]:
    import torch
    from transformers.models.qwen3_next import modeling_qwen3_next

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    print(
        f"\n(op) one device, forward + backward, batch 1, heads {heads}, dk = dv = {dk}, GDN "
        f"gate, float32; torch threads = {torch.get_num_threads()} (= cores available, "
        f"XLA:CPU's pool); median of {repeats} alternating rounds (one round over {long_seq})"
    )
    ours = _loss_grad(el.gated_delta_rule)
    rows = []
    for seq in seqs:
        arrays = _inputs(seq, heads, dk, dk)
        args = [jax.device_put(x, jax.devices()[0]) for x in arrays]
        compiled = ours.lower(*args).compile()
        grads: dict = {}

        def run_ours(args=args, compiled=compiled, grads=grads):
            grads["ours"] = jax.block_until_ready(compiled(*args))

        calls: dict = {"ours": run_ours}
        if seq <= torch_max_seq:
            tensors = [torch.tensor(x, requires_grad=True) for x in arrays]

            def run_torch(tensors=tensors, grads=grads):
                for t in tensors:
                    t.grad = None
                out, _ = modeling_qwen3_next.torch_chunk_gated_delta_rule(*tensors)
                out.sum().backward()
                grads["torch"] = [np.asarray(t.grad) for t in tensors]

            calls["torch"] = run_torch
        long = seq > long_seq  # torch's backward grows faster than the sequence: run once
        t = _medians(calls, 1 if long else repeats, warm=not long)
        err = (
            max(_rel_err(a, b) for a, b in zip(grads["ours"], grads["torch"], strict=True))
            if "torch" in grads
            else None
        )
        mine, torch_s, memory = t["ours"], t.get("torch"), compiled_memory(compiled)
        rows.append(dict(seq=seq, ours=mine, torch=torch_s, err=err, mem_ours=memory))
        theirs = f"{torch_s:.3f} s" if torch_s is not None else "(not run)"
        ratio = f"{mine / torch_s:.3f}" if torch_s is not None else "-"
        print(
            f"| {_tokens(seq)} | {mine:.3f} s | {theirs} | {ratio} | "
            f"{'-' if err is None else f'{err:.1e}'} | {memory / MIB:.1f} MiB |",
            flush=True,
        )
    print("columns: seq | ours | torch | ours / torch | max rel. gradient difference | "
          "ours compiled memory (arguments + outputs + temporaries)")  # fmt: skip
    return rows


def _gathered(spec, q, k, v, g, beta):
    """The op all-gathered: every device gathers the inputs over the sequence, runs the whole
    sequence and keeps its own outputs (contiguous layout)."""
    axis = spec.sequence_axes[0]
    pspec = PartitionSpec(None, axis)

    def body(q, k, v, g, beta):
        local = q.shape[1]
        full = [lax.all_gather(x, axis, axis=1, tiled=True) for x in (q, k, v, g, beta)]
        out = el.gated_delta_rule(*full)
        start = lax.axis_index(axis) * local
        return lax.dynamic_slice_in_dim(out, start, local, axis=1)

    return jax.shard_map(
        body, mesh=spec.mesh, in_specs=(pspec,) * 5, out_specs=pspec, check_vma=False
    )(q, k, v, g, beta)


def cp_section(seqs, time_seqs, heads, dk, repeats) -> list[dict]:
    n = 8
    mesh = jax.make_mesh((n,), ("context",), devices=jax.devices()[:n])
    print(
        f"\n(cp) {n} fake devices (context {n}), forward + backward, batch 1, heads {heads}, "
        f"dk = dv = {dk}, GDN gate, float32; bytes received per device and compiled memory "
        f"per device (arguments + outputs + temporaries); time: median of {repeats} "
        "interleaved rounds"
    )
    variants = {  # name: (layout, function of (spec, q, k, v, g, beta))
        "ours, contiguous": ("none", None),
        "ours, zigzag": ("zigzag", None),
        "all-gathered": ("none", _gathered),
    }
    rows = []
    for seq in sorted(set(seqs) | set(time_seqs)):
        arrays = None
        compiled, placed = {}, {}
        for name, (layout, fn) in variants.items():
            spec = el.ShardingSpec(mesh, load_balance=layout)
            if fn is None:
                fn = functools.partial(_spec_op, spec)
            else:
                fn = functools.partial(fn, spec)
            sharding = NamedSharding(mesh, PartitionSpec(None, "context"))
            shapes = [
                jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding)
                for s in ((1, seq, heads, dk),) * 3 + ((1, seq, heads),) * 2
            ]
            c = _loss_grad(fn).lower(*shapes).compile()
            compiled[name] = c
            if seq in time_seqs:
                if arrays is None:
                    arrays = _inputs(seq, heads, dk, dk)
                placed[name] = [jax.device_put(x, sharding) for x in arrays]
        times = {}
        if seq in time_seqs:
            calls = {
                name: (lambda c=c, a=placed[name]: jax.block_until_ready(c(*a)))
                for name, c in compiled.items()
            }
            times = _medians(calls, repeats)
        for name, c in compiled.items():
            comm = {op: b for op, b in collective_bytes(c).items() if b}
            seconds, memory, total = times.get(name), compiled_memory(c), sum(comm.values())
            rows.append(dict(seq=seq, name=name, time=seconds, memory=memory, comm=comm,
                             total=total))  # fmt: skip
            t = f"{seconds:.2f} s" if seconds is not None else "-"
            detail = ", ".join(f"{op} {b / MIB:.2f}" for op, b in comm.items())
            print(
                f"| {_tokens(seq)} | {name} | {t} | {total / MIB:.2f} MiB ({detail}) | "
                f"{memory / MIB:.1f} MiB |",
                flush=True,
            )
    print("columns: seq | variant | time | collective bytes received per device "
          "(MiB, by kind) | compiled memory per device")  # fmt: skip
    return rows


# The Llama has Qwen3-Next tiny's width, depth, attention heads and dense MLP width, every
# layer softmax attention; Qwen3-Next tiny has 3 Gated DeltaNet layers and 1 gated
# attention layer, experts in all but the first.
HYBRID = {
    "qwen3_next tiny": dict(model="qwen3_next", preset="tiny"),
    # Like for like with the Llama: every layer a dense SwiGLU of the same width.
    "qwen3_next tiny, dense": dict(model="qwen3_next", preset="tiny",
                                   model_overrides=dict(n_experts=0, mlp_only_layers=())),
    "llama, same size": dict(model="llama", preset="tiny", model_overrides=dict(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=256)),
}  # fmt: skip


def hybrid_section(seqs, time_seqs, repeats) -> list[dict]:
    import tempfile

    from eqx_longctx.data import load_datasets, place_batch
    from eqx_longctx.plan import compiled_bytes
    from eqx_longctx.train import TrainConfig, Trainer

    print(
        "\n(hybrid) the trainer's step on 8 fake devices (context 8: ring, zig-zag), batch 1; "
        f"at {time_seqs}, device step median of {repeats} interleaved rounds (after one that "
        "compiles); memory per device from the compiled step (arguments + outputs + "
        "temporaries - donated), with its arguments and temporaries"
    )
    rows = []
    for seq in seqs:
        timed = seq in time_seqs
        with tempfile.TemporaryDirectory() as tmp:
            max_bytes = max(4 * 2**20, 8 * seq)
            data = load_datasets(None, seq_len=seq, max_bytes=max_bytes) if timed else None
            steps, found, trainers = {}, {}, []
            for name, changes in HYBRID.items():
                config = TrainConfig(
                    run_dir=os.path.join(tmp, name.replace(" ", "_")), steps=1,
                    progress=False, eval_every=10**6, checkpoint_every=10**6, eval_batches=1,
                    final_eval_batches=1, seq_len=seq, batch_size=1, mesh="context=8",
                    max_bytes=max_bytes, **changes,
                )  # fmt: skip
                run = trainer_run(config)
                memory = compiled_bytes(compile_train_step(run))
                shapes = eqx.filter_eval_shape(run.family.model, run.config, key=jax.random.key(0))
                params = sum(x.size for x in jax.tree.leaves(shapes) if hasattr(x, "size"))
                found[name] = (memory, params)
                if not timed:
                    continue
                trainer = Trainer(config, datasets=data)
                trainers.append(trainer)
                batch = place_batch(data[0].batch(0, 1), trainer.parallel.spec)
                state = {"model": trainer.model, "opt": trainer.opt_state}

                def step(state=state, trainer=trainer, batch=batch):
                    model, opt, metrics = trainer.train_step(state["model"], state["opt"], batch)
                    state.update(model=model, opt=opt)
                    jax.block_until_ready(metrics)

                steps[name] = step
            seconds = _medians(steps, repeats) if timed else {}
            for trainer in trainers:
                trainer.close()
        for name, (memory, params) in found.items():
            step_s = seconds.get(name)
            rows.append(dict(seq=seq, name=name, step=step_s, params=params,
                             tokens_per_s=None if step_s is None else seq / step_s,
                             memory=memory.device, arguments=memory.arguments,
                             temporaries=memory.temporaries))  # fmt: skip
            timing = "-" if step_s is None else f"{step_s:.2f} s | {seq / step_s:,.0f}"
            print(
                f"| {_tokens(seq)} | {name} ({params / 1e6:.2f} M parameters) | {timing} | "
                f"{memory.device / MIB:.0f} MiB (arguments {memory.arguments / MIB:.1f}, "
                f"temporaries {memory.temporaries / MIB:.0f}) |",
                flush=True,
            )
    print("columns: seq | model | device step | tokens/s | compiled memory per device")
    return rows


def _spec_op(spec, q, k, v, g, beta):
    return el.gated_delta_rule(q, k, v, g, beta, spec=spec)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--sections", nargs="+", default=["op", "cp", "hybrid"],
                   choices=["op", "cp", "hybrid"])  # fmt: skip
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--torch-max-seq", type=int, default=32768,
                   help="run torch only up to this length")  # fmt: skip
    p.add_argument("--long-seq", type=int, default=8192,
                   help="longer rows run once each in (op), with no warm-up run")  # fmt: skip
    p.add_argument("--cp-seqs", type=int, nargs="+", default=[32768, 65536, 131072],
                   help="lengths compiled on 8 devices (bytes, memory)")  # fmt: skip
    p.add_argument("--cp-time-seqs", type=int, nargs="+", default=[32768],
                   help="lengths also timed on 8 devices")  # fmt: skip
    p.add_argument("--hybrid-seqs", type=int, nargs="+", default=[8192, 32768, 65536],
                   help="lengths compiled for the hybrid step's memory")  # fmt: skip
    p.add_argument("--hybrid-time-seqs", type=int, nargs="+", default=[8192, 32768],
                   help="lengths also timed")  # fmt: skip
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true",
                   help="toy sizes: a smoke run in under a minute")  # fmt: skip
    p.add_argument("--plot", metavar="DIR", help="also write DIR/linear_attention*.png")
    args = p.parse_args(argv)
    if args.quick:
        args.seqs, args.cp_seqs, args.cp_time_seqs = [256], [1024], [1024]
        args.hybrid_seqs = args.hybrid_time_seqs = [512]
        args.heads, args.head_dim, args.repeats = 2, 32, 1
    print(
        f"jax {jax.__version__}, {len(jax.devices())} fake {jax.devices()[0].platform} devices, "
        f"{len(os.sched_getaffinity(0))} cores; load average {os.getloadavg()[0]:.1f}"
    )
    t0 = time.perf_counter()
    results: dict = {}
    if "op" in args.sections:
        results["op"] = op_section(
            args.seqs, args.heads, args.head_dim, args.repeats, args.torch_max_seq, args.long_seq
        )
    if "cp" in args.sections:
        results["cp"] = cp_section(
            args.cp_seqs, args.cp_time_seqs, args.heads, args.head_dim, args.repeats
        )
    if "hybrid" in args.sections:
        results["hybrid"] = hybrid_section(args.hybrid_seqs, args.hybrid_time_seqs, args.repeats)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; load average {os.getloadavg()[0]:.1f}")
    if args.plot:
        import _plots

        _plots.linear_attention(results, args.plot)


if __name__ == "__main__":
    main()
