"""The eval's prefill: tokens/s of one long prompt through `eqx_longctx.inference.prefill` on
8 fake CPU devices under each context-parallel strategy (zig-zag layout), against one device.

The evals (`python -m eqx_longctx.eval`) spend their time prefilling prompts of 8K-32K
tokens; this times that prefill for the tiny Llama (`models.LLAMA.presets["tiny"]`, byte
vocabulary 259, `max_seq_len` 32768), one row, float32, from a fresh `init_cache` each call
(the cache is donated). Every placement's first call compiles: its compile time is what
JAX reports for tracing, lowering and compiling during that call (`jax.monitoring`), and
the compiled program's memory per device (arguments + outputs + temporaries) comes from
`lower_prefill` (skipped by `--quick`). Then `--repeats` interleaved rounds time every
placement once each, so all see the same load: the median is reported.
Each placement's last-token logits must match one device's within `--rtol` of the largest
logit (the script exits non-zero otherwise).

The 8 fake devices share this machine's cores, so no speed-up is expected: the ratio to one
device prices each strategy's communication and layout bookkeeping.

    python benchmarks/evals.py
    python benchmarks/evals.py --lengths 8192 --repeats 5
    python benchmarks/evals.py --quick   # seconds: 1K tokens, one layer, one round
"""

import argparse
import dataclasses
import os
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from eqx_longctx.inference import init_cache, lower_prefill, prefill  # noqa: E402
from eqx_longctx.plan import compiled_memory  # noqa: E402
from eqx_longctx.run import Placement  # noqa: E402
from models import LLAMA  # noqa: E402

PLACEMENTS = (  # (label, mesh, strategy); None: one device
    ("one device", None, None),
    ("all_gather", {"context": 8}, "all_gather"),
    ("ulysses", {"context": 8}, "ulysses"),
    ("ring", {"context": 8}, "ring"),
    ("usp", {"ulysses": 2, "context": 4}, "usp"),
)


def _mesh_text(mesh: dict | None) -> str:
    return "-" if mesh is None else ",".join(f"{k}={v}" for k, v in mesh.items())


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _model(config, mesh: dict | None, strategy: str | None):
    if mesh is None:
        return LLAMA.model(config, key=jax.random.key(0))
    placement = Placement(8, mesh, strategy or "ring", "zigzag")
    return LLAMA.model(config, key=jax.random.key(0), spec=placement.spec)


COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


def _prefill(model, prompt: np.ndarray) -> tuple[float, float, np.ndarray]:
    """Seconds for one prefill of `prompt` (from a fresh cache, made before the clock
    starts), the seconds JAX spent compiling during it, and its last-token logits."""
    cache = jax.block_until_ready(init_cache(model, prompt.shape[0], prompt.shape[1]))
    compiling: list[float] = []

    def listen(event: str, duration_secs: float, **_: str | int) -> None:
        if event in COMPILE_EVENTS:
            compiling.append(duration_secs)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        start = time.perf_counter()
        logits, cache = prefill(model, cache, prompt)
        logits = jax.block_until_ready(logits)
        seconds = time.perf_counter() - start
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    del cache
    return seconds, sum(compiling), np.asarray(logits)


def _memory(model, seq: int) -> int:
    """The compiled prefill's bytes per device for one `seq`-token row."""
    return compiled_memory(lower_prefill(model, batch=1, max_len=seq).compile())


def run(args) -> list[dict]:
    """Time every placement at every length; **returns** one row per (length, placement)."""
    config = dataclasses.replace(
        LLAMA.presets["tiny"], vocab_size=259, max_seq_len=max(args.lengths),
        **({} if args.layers is None else {"n_layers": args.layers}),
    )  # fmt: skip
    print(
        f"tiny Llama (dim {config.dim}, {config.n_layers} layers, heads {config.n_heads}/"
        f"{config.n_kv_heads} kv, vocab {config.vocab_size}), float32, batch 1, zig-zag; "
        f"{len(jax.devices())} fake CPU devices on {os.cpu_count()} cores, jax "
        f"{jax.__version__}; median of {args.repeats} interleaved rounds; load average "
        f"{os.getloadavg()[0]:.1f} at start",
        flush=True,
    )
    rng = np.random.default_rng(0)
    rows, failures = [], []
    for seq in args.lengths:
        prompt = rng.integers(0, config.vocab_size, (1, seq)).astype(np.int32)
        models = {label: _model(config, mesh, s) for label, mesh, s in PLACEMENTS}
        compiles, memory, logits = {}, {}, {}
        for label, model in models.items():
            _, compiles[label], logits[label] = _prefill(model, prompt)
            memory[label] = _memory(model, seq) if args.memory else None
        times: dict[str, list[float]] = {label: [] for label in models}
        for _ in range(args.repeats):
            for label, model in models.items():
                times[label].append(_prefill(model, prompt)[0])
        scale = float(np.abs(logits["one device"]).max())
        base = statistics.median(times["one device"])
        for label, mesh, _ in PLACEMENTS:
            t = statistics.median(times[label])
            err = float(np.abs(logits[label] - logits["one device"]).max()) / scale
            if err > args.rtol:
                failures.append(f"{label} at {seq}: max |logit - one device's| / max |logit| "
                                f"= {err:.1e} > {args.rtol:.0e}")  # fmt: skip
            rows.append(dict(seq=seq, label=label, mesh=_mesh_text(mesh), seconds=t,
                             compile=compiles[label], memory=memory[label],
                             tokens_per_s=seq / t, ratio=base / t, err=err))  # fmt: skip
        print(f"  {_k(seq)} done (load average {os.getloadavg()[0]:.1f})", flush=True)
    print(
        "\n| tokens | strategy | mesh | prefill | tokens/s | / one device | compile | "
        "memory per device | max logit difference |"
    )
    print("|" + "---|" * 9)
    for r in rows:
        print(
            f"| {_k(r['seq'])} | {r['label']} | {r['mesh']} | {r['seconds']:.2f} s | "
            f"{r['tokens_per_s']:,.0f} | **{r['ratio']:.2f}x** | {r['compile']:.1f} s | "
            f"{'-' if r['memory'] is None else format(r['memory'] / 2**20, ',.0f') + ' MiB'} | "
            f"{r['err']:.0e} |"
        )
    print(
        "\n/ one device: tokens/s against one device's at the same length (the 8 fake "
        "devices share the cores, so this is no speed-up: it prices each strategy's "
        "collectives and layout bookkeeping); "
        "compile: JAX's tracing, lowering and compiling in the first call; memory: the "
        "compiled program's "
        "arguments + outputs + temporaries on one device; max logit difference: of the "
        f"last token's logits, relative to one device's largest. Load average "
        f"{os.getloadavg()[0]:.1f} at the end."
    )
    if failures:
        raise SystemExit("logits differ from one device's:\n" + "\n".join(failures))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--repeats", type=int, default=3, help="interleaved timed rounds")
    p.add_argument("--layers", type=int, default=None, help="default: the tiny preset's")
    p.add_argument("--rtol", type=float, default=1e-4, help="logits against one device")
    p.add_argument(
        "--quick", action="store_true", help="--lengths 1024 --repeats 1 --layers 1, no memory"
    )
    args = p.parse_args(argv)
    args.memory = not args.quick
    if args.quick:
        args.lengths, args.repeats, args.layers = [1024], 1, 1
    run(args)


if __name__ == "__main__":
    main()
