"""Pallas flash attention (`eqx_longctx.kernels`) against JAX's splash attention, one chip.

On a TPU: for each sequence length (8K to 128K tokens on one chip, causal, bfloat16), the
TFLOP/s of the forward and of forward+backward of ours and of splash attention
(`jax.experimental.pallas.ops.tpu.splash_attention`) on the same shapes, and their ratio;
and tokamax's Mosaic attention where `tokamax` is installed.
FLOPs count only the visible pairs (the causal half, or the window): forward
`4 * h * pairs * d` (two matmuls), forward+backward 3.5x that (FlashAttention-2's count,
arXiv:2307.08691). With `--window`, ours gets the `max_live_blocks` bound that window
implies and splash a `LocalMask`. Nothing is asserted: it prints.

Anywhere else it says it needs a TPU and runs a smoke test in Pallas interpret mode: one
small shape, ours against splash, and prints the max error of `out` and `lse`.

On a Cloud TPU VM (v5p, or v6e; v5e: `--accelerator-type=v5litepod-1 --version
v2-alpha-tpuv5-lite`):

    gcloud compute tpus tpu-vm create eqx-bench --zone=us-east5-a \\
        --accelerator-type=v5p-8 --version=v2-alpha-tpuv5
    gcloud compute tpus tpu-vm create eqx-bench --zone=us-east5-b \\
        --accelerator-type=v6e-1 --version=v2-alpha-tpuv6e
    gcloud compute tpus tpu-vm scp --recurse . eqx-bench:~/eqx_longctx --zone=us-east5-a
    gcloud compute tpus tpu-vm ssh eqx-bench --zone=us-east5-a
    cd eqx_longctx && pip install -e ".[tpu]"
    python benchmarks/pallas_kernels.py                        # 8K .. 128K tokens
    python benchmarks/pallas_kernels.py --seqs 8192 32768 --heads 16 --block-q 512 --block-k 1024
    python benchmarks/pallas_kernels.py --window 4096          # sliding window (splash: LocalMask)
    python benchmarks/pallas_kernels.py --plot docs/img/benchmarks   # also writes kernels.png
    gcloud compute tpus tpu-vm delete eqx-bench --zone=us-east5-a

A v5p-8 VM has 4 chips; the script uses `jax.devices()[0]` only.
"""

import argparse

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from eqx_longctx import flash_attention
from eqx_longctx._timing import best_seconds
from eqx_longctx.kernels import PallasBlockImpl, default_block_sizes, pallas_flash_forward


def _inputs(seq: int, heads: int, head_dim: int, dtype):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    shape = (1, seq, heads, head_dim)
    q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys)
    pos = jnp.arange(seq, dtype=jnp.int32)[None]
    return q, k, v, pos


def _live_bound(window, block_q, block_k):
    """Non-empty partner blocks of any block under a window over contiguous positions."""
    if window is None:
        return None
    per_q = -(-(block_q + window - 1) // block_k) + 1
    per_k = -(-(block_k + window - 1) // block_q) + 1
    return max(per_q, per_k)


def _ours(seq, heads, head_dim, block_q, block_k, interpret, window=None):
    """`(forward, forward+backward)` callables of ours on `[1, seq, heads, head_dim]`."""
    kw = dict(causal=True, window=window, block_q=block_q, block_k=block_k, interpret=interpret,
              max_live_blocks=_live_bound(window, block_q, block_k))  # fmt: skip

    @jax.jit
    def fwd(q, k, v, pos):
        return pallas_flash_forward(q, k, v, pos, pos, **kw)

    @jax.jit
    def fwd_bwd(q, k, v, pos):
        def loss(q, k, v):
            impl = PallasBlockImpl(block_q, block_k, interpret, kw["max_live_blocks"])
            out, _ = flash_attention(
                q, k, v, q_positions=pos, kv_positions=pos, causal=True, window=window,
                impl=impl,
            )  # fmt: skip
            return jnp.sum(out.astype(jnp.float32))

        return jax.grad(loss, (0, 1, 2))(q, k, v)

    return fwd, fwd_bwd


def _splash(seq, heads, head_dim, block_q, block_k, interpret, window=None):
    """Splash attention on the same `[1, seq, heads, head_dim]` inputs (it takes
    `[heads, seq, dim]` and does not scale the queries, so both are done here)."""
    if window is None:
        one = splash.CausalMask((seq, seq))
    else:  # ours: q - k < window, i.e. up to window - 1 keys back
        one = splash.LocalMask((seq, seq), window_size=(window - 1, 0), offset=0)
    mask = splash.MultiHeadMask([one] * heads)
    sizes = splash.BlockSizes(
        block_q=block_q, block_kv=block_k, block_kv_compute=block_k, block_q_dkv=block_q,
        block_kv_dkv=block_k, block_kv_dkv_compute=block_k, block_q_dq=block_q,
        block_kv_dq=block_k,
    )  # fmt: skip
    kernel = splash.make_splash_mha_single_device(
        mask, block_sizes=sizes, save_residuals=False, interpret=interpret
    )
    with_lse = splash.make_splash_mha_single_device(
        mask, block_sizes=sizes, save_residuals=True, interpret=interpret
    )
    scale = head_dim**-0.5

    def heads_major(x):
        return jnp.swapaxes(x[0], 0, 1)

    @jax.jit
    def fwd(q, k, v, pos):
        out, (lse,) = with_lse(heads_major(q) * scale, heads_major(k), heads_major(v))
        return jnp.swapaxes(out, 0, 1)[None], jnp.swapaxes(lse, 0, 1)[None]

    @jax.jit
    def fwd_bwd(q, k, v, pos):
        def loss(q, k, v):
            out = kernel(heads_major(q) * scale, heads_major(k), heads_major(v))
            return jnp.sum(out.astype(jnp.float32))

        return jax.grad(loss, (0, 1, 2))(q, k, v)

    return fwd, fwd_bwd


def _tokamax(seq, heads, head_dim, block_q, block_k, interpret, window=None):
    """tokamax's Mosaic TPU attention on the same inputs, or None where tokamax is not
    installed (`pip install tokamax`). Its `local_window_size=(W - 1, 0)` is our window."""
    try:
        import tokamax
    except ImportError:
        return None
    local = None if window is None else (window - 1, 0)

    def attend(q, k, v):
        return tokamax.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=local, implementation="mosaic"
        )

    @jax.jit
    def fwd(q, k, v, pos):
        return attend(q, k, v)

    @jax.jit
    def fwd_bwd(q, k, v, pos):
        return jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)), (0, 1, 2))(
            q, k, v
        )

    return fwd, fwd_bwd


def benchmark(args) -> list[dict]:
    kind = jax.devices()[0].device_kind
    bq, bk = default_block_sizes(kind)
    bq, bk = args.block_q or bq, args.block_k or bk
    print(f"{kind}: causal, window={args.window}, bfloat16, heads={args.heads}, "
          f"head_dim={args.head_dim}, block_q={bq}, block_k={bk}")  # fmt: skip
    print(f"{'tokens':>8} | {'fwd TFLOP/s ours':>16} {'splash':>7} {'ratio':>6} | "
          f"{'fwd+bwd ours':>12} {'splash':>7} {'ratio':>6}")  # fmt: skip
    rows = []
    for seq in args.seqs:
        inputs = _inputs(seq, args.heads, args.head_dim, jnp.bfloat16)
        w = seq if args.window is None else min(args.window, seq)
        pairs = seq * w - w * (w - 1) / 2  # visible (query, key) pairs
        flops = 4 * args.heads * pairs * args.head_dim
        row, extra = [], []
        for which, factor in ((0, 1.0), (1, 3.5)):
            shape = (seq, args.heads, args.head_dim, bq, bk, False, args.window)
            ours, ref = _ours(*shape)[which], _splash(*shape)[which]
            t_ours = best_seconds(ours, *inputs, repeats=args.repeats)
            t_ref = best_seconds(ref, *inputs, repeats=args.repeats)
            row += [factor * flops / t_ours / 1e12, factor * flops / t_ref / 1e12, t_ref / t_ours]
            tk = _tokamax(*shape)
            if tk is not None:
                t_tk = best_seconds(tk[which], *inputs, repeats=args.repeats)
                extra.append(f"tokamax {'fwd' if which == 0 else 'f+b'} "
                             f"{factor * flops / t_tk / 1e12:.1f} TFLOP/s")  # fmt: skip
        print(f"{seq:>8} | {row[0]:>16.1f} {row[1]:>7.1f} {row[2]:>6.2f} | "
              f"{row[3]:>12.1f} {row[4]:>7.1f} {row[5]:>6.2f}"
              + ("  (" + ", ".join(extra) + ")" if extra else ""))  # fmt: skip
        keys = ("ours_fwd", "splash_fwd", "ratio_fwd", "ours_fb", "splash_fb", "ratio_fb")
        rows.append(dict(seq=seq, **dict(zip(keys, row, strict=True))))
    return rows


def smoke() -> None:
    """Interpret mode on CPU: one small shape, causal and windowed, ours against splash."""
    seq, heads, head_dim = 512, 2, 128
    inputs = _inputs(seq, heads, head_dim, jnp.float32)
    for window in (None, 100):
        shape = (seq, heads, head_dim, 128, 128, True, window)
        out, lse = _ours(*shape)[0](*inputs)
        ref_out, ref_lse = _splash(*shape)[0](*inputs)
        print(f"interpret-mode smoke (seq={seq}, heads={heads}, head_dim={head_dim}, float32, "
              f"causal, window={window}): "
              f"max |out - splash| = {float(jnp.max(jnp.abs(out - ref_out))):.2e}, "
              f"max |lse - splash| = {float(jnp.max(jnp.abs(lse - ref_lse))):.2e}")  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-q", type=int, default=None)
    p.add_argument("--block-k", type=int, default=None)
    p.add_argument("--window", type=int, default=None, help="sliding window (tokens)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--plot", metavar="DIR", help="on a TPU, also write DIR/kernels.png")
    args = p.parse_args(argv)
    if jax.devices()[0].platform != "tpu":
        print(f"benchmarks/pallas_kernels.py needs a TPU for timings (found {jax.devices()[0]}); "
              "running the interpret-mode smoke test instead.")  # fmt: skip
        smoke()
        if args.plot:
            print("--plot: no TFLOP/s to plot without a TPU (the smoke test only checks values)")
        return
    rows = benchmark(args)
    if args.plot:
        import _plots

        kind = jax.devices()[0].device_kind
        window = "causal" if args.window is None else f"causal, window {args.window}"
        _plots.kernels(rows, f"{kind}: {window}, bfloat16, heads {args.heads}", args.plot)


if __name__ == "__main__":
    main()
