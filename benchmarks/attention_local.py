"""Single-device attention: ours against `jax.nn.dot_product_attention`, side by side.

Prints, per sequence length, the time of our blockwise attention relative to XLA's
materialized attention (forward and forward+backward), the peak memory of each from the
compiled memory analysis, and our forward's useful FLOP/s (causal FLOPs only) as a fraction
of a large float32 matmul measured in the same run.

    python benchmarks/attention_local.py                 # seq 1K, 4K, 16K, 64K
    python benchmarks/attention_local.py --seqs 1024 4096 --repeats 5
    python benchmarks/attention_local.py --seqs 1024 4096 16384 --plot docs/img/benchmarks

XLA's version is compiled at every length (its memory analysis is printed) but only run
where its predicted peak fits `--max-xla-gib`; at 64K it would need ~128 GiB of scores.
"""

import argparse

import jax
import jax.numpy as jnp

from eqx_longctx import attention
from eqx_longctx._timing import best_seconds


def _matmul_flops_per_s(n: int = 4096, repeats: int = 3) -> float:
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    return 2 * n**3 / best_seconds(f, a, repeats=repeats)


def _compile(fn, *shapes):
    return jax.jit(fn).lower(*shapes).compile()


def _peak_gib(compiled) -> float:
    """Arguments + outputs + temporaries - aliases: CPU leaves `peak_memory_in_bytes` unset."""
    m = compiled.memory_analysis()
    if m is None:
        return float("nan")
    total = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )
    return total / 2**30


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-xla-gib", type=float, default=8.0)
    p.add_argument(
        "--max-ours-seconds",
        type=float,
        default=400.0,
        help="skip our fwd+bwd when the forward predicts more than this",
    )
    p.add_argument("--plot", metavar="DIR", help="also write DIR/attention_local.png")
    args = p.parse_args(argv)

    mm = _matmul_flops_per_s()
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; f32 matmul 4096^3: "
        f"{mm / 1e9:.1f} GFLOP/s"
    )
    print("batch 1, causal, float32, heads", args.heads, "head_dim", args.head_dim)
    header = (
        f"{'seq':>6} | {'fwd ours':>9} {'fwd xla':>9} {'ratio':>6} | {'f+b ours':>9} "
        f"{'f+b xla':>9} {'ratio':>6} | {'peak ours':>9} {'peak xla':>9} "
        f"{'f+b ours':>9} {'f+b xla':>9} | {'fwd %mm':>7}"
    )
    print(header)
    print("-" * len(header))

    def ours(q, k, v):
        return attention(q, k, v, causal=True)

    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    def fwd_bwd(f):
        def loss(q, k, v):
            return jnp.sum(f(q, k, v))

        return jax.grad(loss, argnums=(0, 1, 2))

    rows = []
    for s in args.seqs:
        shape = jax.ShapeDtypeStruct((1, s, args.heads, args.head_dim), jnp.float32)
        ks = jax.random.split(jax.random.PRNGKey(s), 3)
        q, k, v = (jax.random.normal(kk, shape.shape, jnp.float32) for kk in ks)
        c_of, c_xf = _compile(ours, shape, shape, shape), _compile(xla, shape, shape, shape)
        c_ob = _compile(fwd_bwd(ours), shape, shape, shape)
        c_xb = _compile(fwd_bwd(xla), shape, shape, shape)
        peaks = [_peak_gib(c) for c in (c_of, c_xf, c_ob, c_xb)]
        causal_flops = 4 * args.heads * args.head_dim * s * (s + 1) / 2

        t_of = best_seconds(c_of, q, k, v, repeats=args.repeats if s <= 16384 else 1)
        t_xf = (
            best_seconds(c_xf, q, k, v, repeats=args.repeats)
            if peaks[1] <= args.max_xla_gib
            else None
        )
        run_bwd = 3.5 * t_of <= args.max_ours_seconds
        t_ob = (
            best_seconds(c_ob, q, k, v, repeats=args.repeats if s <= 16384 else 1)
            if run_bwd
            else None
        )
        t_xb = (
            best_seconds(c_xb, q, k, v, repeats=args.repeats)
            if peaks[3] <= args.max_xla_gib
            else None
        )

        def t(x):
            return f"{x * 1e3:8.1f}ms" if x is not None else f"{'(skip)':>10}"

        def r(a, b):
            return f"{a / b:6.2f}" if a is not None and b is not None else f"{'-':>6}"

        print(
            f"{s:>6} | {t(t_of)}{t(t_xf)} {r(t_of, t_xf)} | {t(t_ob)}{t(t_xb)} {r(t_ob, t_xb)} | "
            + " ".join(f"{x:8.3f}G" for x in peaks)
            + f" | {causal_flops / t_of / mm:7.0%}"
        )
        times = dict(ours_fwd=t_of, xla_fwd=t_xf, ours_fb=t_ob, xla_fb=t_xb)
        rows.append(dict(seq=s, **times, **{
            f"mem_{k}": peak * 2**30 for k, peak in zip(times, peaks, strict=True)
        }))  # fmt: skip
    print(
        "ratio = ours / xla time (lower is better); peak = compiled peak memory (GiB);"
        " fwd %mm = our forward's causal FLOP/s over the matmul's"
    )
    if args.plot:
        import _plots

        _plots.attention_local(rows, args.plot)


if __name__ == "__main__":
    main()
