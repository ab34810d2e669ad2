"""The trainer's step: steady step time and tokens/s of the main job and of long rows, with
the host's share (data, placement, metrics) apart from the device step, and useful FLOP/s
against a large float32 matmul, all measured in one run.

Configurations (each is `python -m eqx_longctx.train` with these flags, 8 fake CPU devices):

- `main`: the main job's defaults (tiny Llama, `--seq-len 256 --batch-size 8`, ring,
  zig-zag, the default mesh);
- `4k-ring`, `4k-all_gather`: `--seq-len 4096 --batch-size 2` under each strategy;
- `vs-maxtext`: the configuration of `../shared/perf/maxtext/vs_maxtext.sh 256 8` (mesh
  `data=2,context=4`, all_gather, zig-zag, `--remat full`, 8 x 256).

With `--free-attention` each configuration runs a second time with the XLA block
implementation's arithmetic replaced by a stand-in of the same shapes and dependences (a
sum of the queries and a read of K and V; in the backward, of the output gradient): every
projection, collective, recomputation and the optimizer stay. That row is the step a local
attention that cost nothing would give, the floor of what attention work can win.

For each, a `Trainer` runs `--steps` steps; a *step* is the loop's own time per step (from
`metrics.jsonl`: fetching the batch, placing it, the jitted step and reading its metrics
back), the median after `--warmup` steps. The *device step* is the jitted step alone on one
placed batch, blocked on, median of `--repeats`. *Data* is fetching and placing one batch
alone. *Useful FLOP/s* counts the model's matmuls and causal attention, forward and
backward (6 x non-embedding parameters x tokens + 6 x the output head + 6 x batch x seq^2 x
heads x head_dim / 2 per layer x 2): no recomputation, no masked half. The reference is a
2048 x 2048 float32 matmul on one device in the same run.

    python benchmarks/train_step.py
    python benchmarks/train_step.py --configs main --steps 40
    python benchmarks/train_step.py --plot docs/img/benchmarks    # also writes train_step.png
    python benchmarks/train_step.py --configs vs-maxtext --free-attention --steps 25
"""

import argparse
import contextlib
import json
import os
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import eqx_longctx  # noqa: E402
from eqx_longctx.attention._local import XlaBlockImpl  # noqa: E402
from eqx_longctx.data import load_datasets, place_batch  # noqa: E402
from eqx_longctx.train import TrainConfig, Trainer  # noqa: E402

CONFIGS = {
    "main": dict(),
    "4k-ring": dict(seq_len=4096, batch_size=2, strategy="ring"),
    "4k-all_gather": dict(seq_len=4096, batch_size=2, strategy="all_gather"),
    "vs-maxtext": dict(
        mesh="data=2,context=4",
        strategy="all_gather",
        load_balance="zigzag",
        remat="full",
        seq_len=256,
        batch_size=8,
        model_overrides={"max_seq_len": 256},
    ),
}


@contextlib.contextmanager
def free_local_attention():
    """Within: the XLA block implementation returns arrays of its real shapes made from a sum
    of its inputs, so no scores are computed (see the module docstring). Compiled programs
    are dropped on entry and exit, so none is shared with the real attention's."""
    real_fwd, real_bwd = XlaBlockImpl.attend, XlaBlockImpl.attend_backward

    def attend(self, qt, k, v, kv_positions, kv_segment_ids):
        out, lse = eqx.filter_eval_shape(real_fwd, self, qt, k, v, kv_positions, kv_segment_ids)
        c = jnp.sum(qt.qb) + k.reshape(-1)[0] + v.reshape(-1)[0]
        return jnp.zeros(out.shape, out.dtype) + c, jnp.zeros(lse.shape, lse.dtype) + c

    def attend_backward(self, qt, k, v, kv_positions, kv_segment_ids, dout, lse, delta, dq):
        args = (self, qt, k, v, kv_positions, kv_segment_ids, dout, lse, delta, dq)
        dq_s, dk_s, dv_s = eqx.filter_eval_shape(real_bwd, *args)
        c = jnp.sum(dout) + lse.reshape(-1)[0] + delta.reshape(-1)[0]
        grads = [jnp.zeros(s.shape, s.dtype) + c for s in (dk_s, dv_s)]
        return (dq + c).astype(dq_s.dtype), *grads

    eqx_longctx.clear_caches()
    XlaBlockImpl.attend, XlaBlockImpl.attend_backward = attend, attend_backward
    try:
        yield
    finally:
        XlaBlockImpl.attend, XlaBlockImpl.attend_backward = real_fwd, real_bwd
        eqx_longctx.clear_caches()


def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def matmul_flops_per_s(n: int = 2048, repeats: int = 20) -> float:
    a = jax.device_put(jnp.ones((n, n), jnp.float32), jax.devices()[0])
    f = jax.jit(lambda a: a @ a)
    return 2 * n**3 / _median_time(lambda: f(a).block_until_ready(), repeats)


def useful_flops(config, batch: int, seq: int) -> float:
    """Matmul and causal-attention FLOPs of one step, forward and backward."""
    tokens = batch * seq
    d, h, kvh = config.dim, config.n_heads, config.n_kv_heads
    hd = config.head_dim or d // h
    per_layer = d * h * hd + 2 * d * kvh * hd + h * hd * d + 3 * d * config.hidden_dim
    dense = 6 * (config.n_layers * per_layer + d * config.vocab_size) * tokens
    attention = 6 * config.n_layers * batch * seq * seq * h * hd  # 2 products, half masked
    return float(dense + attention)


def run_config(name: str, changes: dict, args) -> dict:
    settings = dict(
        steps=args.warmup + args.steps, progress=False, eval_every=10**6,
        checkpoint_every=10**6, eval_batches=1, final_eval_batches=1, **changes,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        config = TrainConfig(run_dir=os.path.join(tmp, "run"), **settings)
        data = load_datasets(None, seq_len=config.seq_len, max_bytes=config.max_bytes)
        trainer = Trainer(config, datasets=data)
        trainer.run()
        records = [json.loads(line) for line in open(os.path.join(tmp, "run", "metrics.jsonl"))]
        tokens = config.batch_size * config.seq_len
        steps = [tokens / r["tokens_per_s"] for r in records if r.get("split") == "train"]
        step = float(np.median(steps[args.warmup :]))
        placement, model, opt = trainer.parallel, trainer.model, trainer.opt_state
        batch = place_batch(data[0].batch(0, config.batch_size), placement.spec)
        state = {"model": model, "opt": opt}

        def device_step():
            model, opt, metrics = trainer.train_step(state["model"], state["opt"], batch)
            state.update(model=model, opt=opt)
            jax.block_until_ready(metrics)

        device = _median_time(device_step, args.repeats)
        host_batch = data[0].batch(1, config.batch_size)
        fetch = _median_time(
            lambda: jax.block_until_ready(place_batch(host_batch, placement.spec)), args.repeats
        )
        flops = useful_flops(trainer.model_config, config.batch_size, config.seq_len)
        trainer.close()
    return dict(name=name, seq=config.seq_len, batch=config.batch_size,
                strategy=config.strategy, step=step, device=device, data=fetch,
                host=max(step - device - fetch, 0.0), tokens_per_s=tokens / step,
                flops=flops)  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument(
        "--configs", nargs="+", default=["main", "4k-ring", "4k-all_gather"], choices=list(CONFIGS)
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=3, help="steps left out (compilation)")
    p.add_argument("--repeats", type=int, default=10, help="device-step and data repeats")
    p.add_argument("--plot", metavar="DIR", help="also write DIR/train_step.png")
    p.add_argument("--free-attention", action="store_true",
                   help="also run each configuration with the local attention's arithmetic "
                   "taken out (the floor of what attention work can win)")  # fmt: skip
    args = p.parse_args(argv)
    peak = matmul_flops_per_s()
    print(f"== float32 matmul 2048^3 on one device: {peak / 1e9:.1f} GFLOP/s; load average "
          f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    rows = []
    for name in args.configs:
        rows.append(run_config(name, CONFIGS[name], args))
        if args.free_attention:
            with free_local_attention():
                rows.append(run_config(f"{name}, free attention", CONFIGS[name], args))
    print("| config | batch x seq | step (median) | tokens/s | device step | data | other host "
          "| useful GFLOP/s (device step) | / matmul |")  # fmt: skip
    print("|" + "---|" * 9)
    for r in rows:
        rate = r["flops"] / r["device"]
        print(f"| {r['name']} | {r['batch']}x{r['seq']} | {r['step'] * 1e3:.0f} ms | "
              f"{r['tokens_per_s']:,.0f} | {r['device'] * 1e3:.0f} ms | {r['data'] * 1e3:.1f} ms "
              f"| {r['host'] * 1e3:.0f} ms | {rate / 1e9:.1f} | {rate / peak:.2f} |")  # fmt: skip
    if args.free_attention:
        for real, free in zip(rows[::2], rows[1::2], strict=True):
            print(f"{real['name']}: free attention / real, step "
                  f"{free['step'] / real['step']:.2f}, device step "
                  f"{free['device'] / real['device']:.2f}")  # fmt: skip
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    if args.plot:
        import _plots

        _plots.train_step(rows, args.plot)


if __name__ == "__main__":
    main()
