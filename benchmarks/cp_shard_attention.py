"""One context-parallel device's local attention at short sequences, on one thread.

Under the all-gather strategy with the zig-zag layout, each of `--devices` devices attends
its `seq / devices` queries (chunks `i` and `2N-1-i`) to all `seq` gathered keys. This
script times that block for device 0, forward and forward+backward, four ways, in one run:

- *ours*: what the all-gather strategy runs at these lengths, zig-zag's causal halves
  (`attention/_halves.py`: the early chunk's queries over the early keys, the late one's
  over all, 3/4 of the block's pairs);
- *one call*: the XLA block attention over the whole block (what it ran before);
- *plain*: a masked softmax over the whole block, as MaxText's `attention=dot_product`;
- *8 keys*: one call on only 8 of the keys, the same calls with almost no scores: what
  the block costs beyond its arithmetic.

It also prints the share of the block's (query, key) pairs that the causal mask keeps and
that ours computes, how long the block's float32 products (QK^T and PV) would take at the
rate of a 2048^3 matmul measured in the same run, and the bound a block-sparse attention
would meet: ours at its cost per computed pair, scaled to the kept ones.
The process runs on one core (its CPU affinity, on Linux, and
`--xla_cpu_multi_thread_eigen=false` unless `XLA_FLAGS` is set), as each of 8 fake devices
gets about a quarter of two cores; the matmul is measured on that core too.

    python benchmarks/cp_shard_attention.py                     # the vs_maxtext 8 x 256 shard
    python benchmarks/cp_shard_attention.py --seq 512 --batch 2 # the 16 x 512 one

Ours, one call and the plain softmax are all checked against `reference_attention` (device 0's rows
of the whole sequence, float32); the script exits non-zero if either is off by over 1e-5.
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
if hasattr(os, "sched_setaffinity"):  # before JAX starts its threads: they inherit it
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from attention_local import _matmul_flops_per_s  # noqa: E402

from eqx_longctx import reference_attention  # noqa: E402
from eqx_longctx._layout import _order  # noqa: E402
from eqx_longctx._timing import best_seconds  # noqa: E402
from eqx_longctx.attention._block import BlockOptions, block_attention  # noqa: E402
from eqx_longctx.attention._halves import zigzag_attention  # noqa: E402
from eqx_longctx.attention._local import XlaBlockImpl  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=4, help="rows per device")
    p.add_argument("--devices", type=int, default=4, help="context-axis size")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args(argv)
    if args.seq % (2 * args.devices) or args.heads % args.kv_heads:
        raise SystemExit(
            f"--seq must split into 2 x --devices chunks and --heads into --kv-heads groups; "
            f"got seq={args.seq}, devices={args.devices}, heads={args.heads}, "
            f"kv_heads={args.kv_heads}."
        )
    b, s, h, kvh, d = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    kpos = _order("zigzag", args.devices, s)  # the gathered keys: every device's tokens
    sq = s // args.devices
    qpos = kpos[:sq]  # device 0's: chunks 0 and 2N-1
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (b, sq, h, d), jnp.float32)
    k, v = (jax.random.normal(kk, (b, s, kvh, d), jnp.float32) for kk in keys[1:3])
    dout = jax.random.normal(keys[3], (b, sq, h, d), jnp.float32)
    qp = jnp.broadcast_to(jnp.asarray(qpos, jnp.int32), (b, sq))
    kp = jnp.broadcast_to(jnp.asarray(kpos, jnp.int32), (b, s))
    options = BlockOptions.make(True, None, None, d)
    impl = XlaBlockImpl()

    def ours(q, k, v):  # as the all-gather strategy calls it: one shard's queries, N shards' keys
        return zigzag_attention(
            impl, q, k, v, qp, kp, None, None, options, q_shards=1, kv_shards=args.devices
        )[0]

    def one_call(q, k, v):
        return block_attention(impl, q, k, v, qp, kp, None, None, options)[0]

    def eight_keys(q, k, v):
        return block_attention(impl, q, k[:, :8], v[:, :8], qp, kp[:, :8], None, None, options)[0]

    def plain(q, k, v):
        qg = q.reshape(b, sq, kvh, h // kvh, d)
        scores = jnp.einsum("bskgd,btkd->bkgst", qg, k) * options.scale
        visible = qp[:, None, None, :, None] >= kp[:, None, None, None, :]
        scores = jnp.where(visible, scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        return jnp.einsum("bkgst,btkd->bskgd", probs, v).reshape(b, sq, h, d)

    def fwd_bwd(f):
        return jax.jit(lambda q, k, v: jax.vjp(f, q, k, v)[1](dout))

    mm = _matmul_flops_per_s(2048, repeats=5)
    # Both against the float32 oracle: device 0's rows of the whole sequence's attention.
    rows = jnp.asarray(qpos)
    whole = jnp.zeros((b, s, h, d), jnp.float32).at[:, rows].set(q)
    want = reference_attention(whole, k[:, np.argsort(kpos)], v[:, np.argsort(kpos)])[:, rows]
    variants = {"ours": ours, "one call": one_call, "plain": plain, "8 keys": eight_keys}
    checked = [variants[n] for n in ("ours", "one call", "plain")]
    err = max(float(jnp.abs(jax.jit(f)(q, k, v) - want).max()) for f in checked)
    if not err <= 1e-5:  # a bug, not a timing
        raise SystemExit(
            f"ours, one call or the plain softmax differs from the oracle by {err:.2e}"
        )
    times = {}
    for name, f in variants.items():
        times[name] = (
            best_seconds(jax.jit(f), q, k, v, repeats=args.repeats),
            best_seconds(fwd_bwd(f), q, k, v, repeats=args.repeats),
        )
    kept = float(np.mean(qpos[:, None] >= kpos[None, :]))
    computed = 0.75  # the early half's queries over half of the keys, the late half's over all
    products = 2 * 2 * b * h * sq * s * d  # QK^T and PV, the whole block
    print(
        f"device 0 of {args.devices} (zig-zag): {b} x {sq} queries, {s} keys, {h} heads / "
        f"{kvh} K/V, head_dim {d}, float32, one thread; max error against the oracle {err:.1e}"
    )
    print(
        f"2048^3 matmul: {mm / 1e9:.1f} GFLOP/s; causal pairs kept: {kept:.0%} of the block, "
        f"computed by ours: {computed:.0%}"
    )
    print("| attention | forward | forward + backward | / ours (f+b) |")
    print("|---|---|---|---|")
    for name, (tf, tb) in times.items():
        print(f"| {name} | {tf * 1e3:.3f} ms | {tb * 1e3:.3f} ms | {tb / times['ours'][1]:.2f} |")
    tf, tb = times["ours"]
    ours_products = products * computed
    sparse = kept / computed  # a block-sparse attention at ours' cost per computed pair
    print(
        f"ours' forward: its products alone at the matmul's rate would take "
        f"{ours_products / mm * 1e3:.3f} ms ({ours_products / mm / tf:.0%} of it); a "
        f"block-sparse attention at ours' cost per computed pair: forward "
        f"{tf * sparse * 1e3:.3f} ms, forward + backward {tb * sparse * 1e3:.3f} ms"
    )


if __name__ == "__main__":
    main()
