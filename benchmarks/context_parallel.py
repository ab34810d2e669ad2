"""Context-parallel attention strategies on 8 fake CPU devices, side by side.

Sections (all by default, pick with `--sections`):

- `a`: per-device memory (compiled memory analysis: arguments + outputs + temporaries) of
  each strategy at seq 8K..128K on 8 devices, beside the cost model's prediction; then seq
  and devices grown together (seq / device fixed, meshes of 1, 2, 4, 8 devices), where memory
  should stay flat unless the strategy holds the whole sequence.
- `b`: collective bytes received per device per layer, counted in the compiled HLO, against
  the cost model and against each strategy's theoretical minimum (the K/V or q/k/v/out
  payload alone in the input dtype, no positions; see `_minimum`).
- `c`: causal work balance, max / mean of non-empty score elements over devices, for the
  token layouts none / zigzag / striped (from the layouts, at block granularity).
- `e`: MLA at DeepSeek-V2-Lite attention shapes (16 heads, kv_lora_rank 512, RoPE key 64,
  no-RoPE key 128, value 128): per-device memory and collective bytes per layer of
  `latent_attention` (the latent and the shared RoPE key cross the wire, 576 numbers per
  token) against the same attention fed per-head K/V (16 x (192 + 128) = 5120 per token).
- `w`: sliding window: the ring at seq 32K on 8 devices with `W = 2K` against full causal
  attention (zig-zag, its best layout), forward and forward + backward, with the window on
  the contiguous layout (the ring cut to the hops the window reaches) and on zig-zag; and
  what the cost model predicts for each. Target: at most 0.25x the time of full causal.
- `d`: wall time of each strategy on 8 fake devices against single-device
  `eqx_longctx.attention` (`spec=None`), forward and forward + backward; and the
  `ringattention` package when it is installed.

(a) and (b) only compile, from abstract sharded inputs: nothing big runs. The 8 fake devices
share this machine's cores, so (d) measures overheads, not speed-up.

    python benchmarks/context_parallel.py
    python benchmarks/context_parallel.py --sections a b --seqs 8192 32768
    python benchmarks/context_parallel.py --sections d --time-seq 4096 --repeats 3
    python benchmarks/context_parallel.py --sections w --window-seq 32768 --window 2048
"""

import argparse
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from eqx_longctx import ShardingSpec, attention, latent_attention  # noqa: E402
from eqx_longctx._hlo import collective_bytes  # noqa: E402
from eqx_longctx.attention._plan import plan  # noqa: E402
from eqx_longctx.plan import compiled_attention, compiled_memory  # noqa: E402

STRATEGIES = ("all_gather", "ulysses", "ring", "usp")
LAYOUTS = ("none", "zigzag", "striped")
MIB = 2**20


def _spec(strategy: str, n: int, layout: str = "zigzag") -> ShardingSpec | None:
    """`strategy` over the first `n` devices; usp splits them ulysses 2 x ring n/2."""
    devices = jax.devices()[:n]
    if strategy == "usp":
        if n < 2:
            return None
        mesh = jax.make_mesh((2, n // 2), ("ulysses", "context"), devices=devices)
        return ShardingSpec(mesh, strategy="usp", load_balance=layout, ulysses_axis="ulysses")
    mesh = jax.make_mesh((n,), ("context",), devices=devices)
    return ShardingSpec(mesh, strategy=strategy, load_balance=layout)


def _table(rows: list) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(x).rjust(w) for x, w in zip(r, widths, strict=True)))


class _Compiled:
    """Compile each (strategy, devices, seq, pass) once; keep its memory and collectives."""

    def __init__(self, shape: dict):
        self.shape, self.cache = shape, {}

    def __call__(self, strategy: str, n: int, seq: int, backward: bool):
        key = (strategy, n, seq, backward)
        if key not in self.cache:
            spec = _spec(strategy, n)
            if spec is None:
                self.cache[key] = None
            else:
                c = compiled_attention(spec, seq=seq, backward=backward, **self.shape)
                cost = plan(spec, seq=seq, **self.shape).costs[strategy]
                self.cache[key] = (compiled_memory(c), collective_bytes(c), cost)
        return self.cache[key]


def memory_section(compiled: _Compiled, seqs: list, per_device: int) -> None:
    print("\n(a) per-device memory, MiB: compiled (arguments + outputs + temporaries) / model")
    for backward in (False, True):
        head = ["seq"] + [f"{s} {'f+b' if backward else 'fwd'}" for s in STRATEGIES]
        rows = [head]
        for seq in seqs:
            row = [seq]
            for s in STRATEGIES:
                mem, _, cost = compiled(s, 8, seq, backward)
                pred = cost.memory_train if backward else cost.memory_forward
                row.append(f"{mem / MIB:.1f} / {pred / MIB:.1f} ({mem / pred:.2f})")
            rows.append(row)
        _table(rows)
    print(
        f"\n(a') seq and devices grown together ({per_device} tokens per device), fwd+bwd "
        "MiB: compiled / model (x1 = / one device; xc = / the smallest mesh that runs every "
        "collective of the strategy: 2 devices, usp 4 = ulysses 2 x ring 2)"
    )
    rows: list = [["devices", "seq"] + list(STRATEGIES)]
    one = compiled("ring", 1, per_device, True)[0]  # every strategy is local attention
    first = {}
    for n in (1, 2, 4, 8):
        row: list = [n, n * per_device]
        for s in STRATEGIES:
            got = compiled(s, n, n * per_device, True)
            if got is None:
                row.append("-")
                continue
            mem, _, cost = got
            if n >= (4 if s == "usp" else 2):
                first.setdefault(s, mem)
            xc = f", xc {mem / first[s]:.2f}" if s in first else ""
            row.append(f"{mem / MIB:.1f} / {cost.memory_train / MIB:.1f} (x1 {mem / one:.2f}{xc})")
        rows.append(row)
    _table(rows)
    print(
        "(one device runs no collective; the first context-parallel mesh adds each strategy's "
        "own buffers once, e.g. the ring's K/V shard in flight and its float32 dK/dV "
        "accumulators; after that growth is the gathered sequence (all_gather) or K/V heads "
        "repeated r = N / gcd(kv_heads, N) times (ulysses))"
    )


def _minimum(strategy: str, seq: int, shape: dict, backward: bool) -> float:
    """Payload-only bytes each device must receive per layer, at the least.

    K/V, q and outputs in the input dtype; no positions or segment ids. Under Ulysses a
    device must see, for the whole sequence, every K/V head one of its query heads reads:
    with fewer K/V heads than the degree that is one whole head, not `kv_heads / degree`.
    The backward moves the same payloads again (dout in; dq, dK, dV back) and, in a ring,
    sends the K/V around again and the dK/dV accumulators home (`N-1` hops each).
    """
    b, hq, hk, d = shape["batch"], shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    dv, e = shape["v_head_dim"] or d, jnp.dtype(shape["dtype"]).itemsize
    nu, nr = {"all_gather": (1, 8), "ulysses": (8, 1), "ring": (1, 8), "usp": (2, 4)}[strategy]
    if strategy == "all_gather":
        fwd = b * seq * hk * (d + dv) * e * 7 / 8
        return 2 * fwd if backward else fwd
    per_device_q = hq // nu  # query heads on one device after the all-to-all
    group = hq // hk  # query heads per K/V head
    kv_needed = max(  # K/V heads the busiest device's query heads read
        len({h // group for h in range(i * per_device_q, (i + 1) * per_device_q)})
        for i in range(nu)
    )
    a2a = b * seq / nr / nu * (hq * d + nu * kv_needed * (d + dv) + hq * dv) * e * (nu - 1) / nu
    ring = (nr - 1) * b * seq / nr * kv_needed * (d + dv) * e
    return (2 * a2a + 3 * ring) if backward else (a2a + ring)


def comm_section(compiled: _Compiled, seqs: list, shape: dict) -> None:
    print(
        "\n(b) collective bytes per device per layer: compiled HLO, HLO / model, "
        "HLO / theoretical minimum"
    )
    rows = [["seq", "strategy", "pass", "HLO MiB", "/ model", "/ minimum", "by op (MiB)"]]
    for seq in seqs:
        for s in STRATEGIES:
            for backward in (False, True):
                _, comm, cost = compiled(s, 8, seq, backward)
                pred = sum((cost.comm_train if backward else cost.comm_forward).values())
                got = sum(comm.values())
                ops = ", ".join(f"{k} {v / MIB:.2f}" for k, v in comm.items() if v > 64)
                rows.append([
                    seq, s, "f+b" if backward else "fwd", f"{got / MIB:.2f}",
                    f"{got / pred:.3f}", f"{got / _minimum(s, seq, shape, backward):.3f}", ops,
                ])  # fmt: skip
    _table(rows)
    print(
        "(the all-reduce of a few bytes in f+b is the loss; above the minimum: int32 "
        "positions and segment ids)"
    )


def balance_section(seq: int, shape: dict) -> None:
    print(f"\n(c) causal work balance at seq {seq} on 8 devices: max / mean non-empty score")
    rows = [["layout"] + list(STRATEGIES)]
    for layout in LAYOUTS:
        row = [layout]
        for s in STRATEGIES:
            spec = _spec(s, 8, layout)
            row.append(f"{plan(spec, seq=seq, **shape).costs[s].balance:.3f}")
        rows.append(row)
    _table(rows)


class _UpProject(eqx.Module):
    """DeepSeek's MLA up-projection: latent (c_kv, k_rope) -> per-head (k, v)."""

    w: jax.Array  # [kv_lora_rank, heads, nope + v]
    nope: int = eqx.field(static=True)

    def __call__(self, latent):
        c, k_rope = latent
        kv = jnp.einsum("bsc,chn->bshn", c, self.w)
        k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
        k_rope = jnp.broadcast_to(k_rope[:, :, None], (*k_nope.shape[:3], k_rope.shape[-1]))
        return jnp.concatenate([k_nope, k_rope], axis=-1), v


def mla_section(seq: int) -> None:
    heads, rank, rope, nope, dv = 16, 512, 64, 128, 128
    print(
        f"\n(e) MLA, DeepSeek-V2-Lite attention shapes (heads {heads}, kv_lora_rank {rank}, "
        f"rope {rope}, nope {nope}, v {dv}), batch 1, seq {seq}, 8 devices, float32: latent "
        "communication vs per-head K/V (both compiled, forward + backward)"
    )
    f32 = jnp.float32
    rows = [["strategy", "K/V kind", "memory MiB", "comm fwd MiB", "comm f+b MiB", "f+b ratio"]]
    for strategy in STRATEGIES:
        spec = _spec(strategy, 8)
        if spec is None:
            continue
        mesh = spec.mesh
        heads_sh = NamedSharding(mesh, spec.heads_pspec())
        tokens = NamedSharding(mesh, PartitionSpec(None, spec.sequence_axes, None))
        q = jax.ShapeDtypeStruct((1, seq, heads, nope + rope), f32, sharding=heads_sh)
        latent = (
            jax.ShapeDtypeStruct((1, seq, rank), f32, sharding=tokens),
            jax.ShapeDtypeStruct((1, seq, rope), f32, sharding=tokens),
        )
        w = jax.ShapeDtypeStruct(
            (rank, heads, nope + dv), f32, sharding=NamedSharding(mesh, PartitionSpec())
        )

        def latent_loss(q, latent, w, spec=spec):
            out = latent_attention(q, latent, _UpProject(w, nope), spec=spec)
            return jnp.sum(out)

        def dense_loss(q, latent, w, spec=spec):
            k, v = _UpProject(w, nope)(latent)  # up-projected before: per-head K/V travel
            return jnp.sum(attention(q, k, v, spec=spec))

        results = {}
        for kind, loss in (("latent", latent_loss), ("per-head", dense_loss)):
            fwd = jax.jit(loss).lower(q, latent, w).compile()
            train = (
                jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, latent, w).compile()
            )
            results[kind] = (
                compiled_memory(train),
                sum(collective_bytes(fwd).values()),
                sum(collective_bytes(train).values()),
            )
        for kind, (mem, cf, ct) in results.items():
            ratio = ct / results["per-head"][2]
            rows.append(
                [
                    strategy,
                    kind,
                    f"{mem / MIB:.1f}",
                    f"{cf / MIB:.2f}",
                    f"{ct / MIB:.2f}",
                    f"{ratio:.3f}",
                ]
            )
    _table(rows)
    print(
        "(all_gather and ring move the latent; ulysses and usp up-project locally first and "
        "split heads as usual, so their bytes match per-head K/V up to the latent's own "
        "gradient reduction)"
    )


def _interleaved(calls: dict, repeats: int) -> dict:
    """Best wall time of each `name: (fn, args)`, timed in `repeats` interleaved rounds.

    Every call is compiled and run once first; then each round times every call once, so
    slow phases of the shared machine (other processes, allocator state after a big
    backward) fall on all of them alike instead of on whichever ran last.
    """
    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for name, (fn, args) in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def _loss(fn):
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1, 2)))


def time_section(seq: int, heads: int, kv_heads: int, head_dim: int, repeats: int) -> None:
    print(
        f"\n(d) wall time, batch 1, seq {seq}, heads {heads}/{kv_heads}, head_dim {head_dim}, "
        f"causal, f32; best of {repeats} interleaved rounds; x = / single device"
    )
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (1, seq, heads, head_dim))
    k, v = (jax.random.normal(key, (1, seq, kv_heads, head_dim)) for key in keys[1:])
    calls = {}
    for name in ("single device",) + STRATEGIES:
        spec = None if name == "single device" else _spec(name, 8)
        if spec is None:
            args = tuple(jax.device_put(x, jax.devices()[0]) for x in (q, k, v))
        else:
            args = tuple(jax.device_put(x, spec.sharding(spec.heads_pspec())) for x in (q, k, v))

        def fwd(q, k, v, spec=spec):
            return attention(q, k, v, spec=spec)

        calls[(name, "fwd")] = (jax.jit(fwd), args)
        calls[(name, "f+b")] = (_loss(fwd), args)
    theirs = _ring_attention_package(q, k, v, calls)
    best = _interleaved(calls, repeats)
    names = ("single device",) + STRATEGIES
    base = best[("single device", "fwd")], best[("single device", "f+b")]
    rows = [["", "fwd s", "x", "fwd+bwd s", "x"]]
    for name in names:
        f, t = best[(name, "fwd")], best[(name, "f+b")]
        rows.append([name, f"{f:.3f}", f"{f / base[0]:.2f}", f"{t:.3f}", f"{t / base[1]:.2f}"])
    _table(rows)
    if theirs is None:
        return
    t_fwd, t_bwd = best[("theirs", "fwd")], best[("theirs", "f+b")]
    print(f"ringattention package (max |theirs - single device| = {theirs:.1e}):")
    rows = [["", "fwd s", "ours/theirs", "fwd+bwd s", "ours/theirs"]]
    rows.append(["theirs (contiguous)", f"{t_fwd:.3f}", "", f"{t_bwd:.3f}", ""])
    for label, name in (("ours ring, contiguous", "ring none"), ("ours ring, zigzag", "ring")):
        f, t = best[(name, "fwd")], best[(name, "f+b")]
        rows.append([label, f"{f:.3f}", f"{f / t_fwd:.2f}", f"{t:.3f}", f"{t / t_bwd:.2f}"])
    _table(rows)


def window_section(seq: int, window: int, heads: int, head_dim: int, repeats: int) -> None:
    print(
        f"\n(w) sliding window: ring on 8 devices, batch 1, seq {seq}, heads {heads}, head_dim "
        f"{head_dim}, f32; W = {window} against full causal; best of {repeats} interleaved rounds"
    )
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (1, seq, heads, head_dim)) for key in keys)
    cases = {  # label: (layout, window)
        "full causal, zigzag": ("zigzag", None),
        f"W={window}, contiguous": ("none", window),
        f"W={window}, zigzag": ("zigzag", window),
    }
    calls, predicted = {}, {}
    for label, (layout, w) in cases.items():
        spec = _spec("ring", 8, layout)
        assert spec is not None
        args = tuple(jax.device_put(x, spec.sharding(spec.heads_pspec())) for x in (q, k, v))

        def fwd(q, k, v, spec=spec, w=w):
            return attention(q, k, v, spec=spec, window=w)

        calls[(label, "fwd")] = (jax.jit(fwd), args)
        calls[(label, "f+b")] = (_loss(fwd), args)
        cost = plan(spec, batch=1, seq=seq, q_heads=heads, kv_heads=heads, head_dim=head_dim,
                    window=w).costs["ring"]  # fmt: skip
        predicted[label] = (cost.time_s, cost.comm_train["collective-permute"])
    best = _interleaved(calls, repeats)
    base = [best[("full causal, zigzag", p)] for p in ("fwd", "f+b")]
    rows = [["", "fwd s", "x full", "fwd+bwd s", "x full", "ring MiB f+b", "model x full"]]
    for label in cases:
        f, t = best[(label, "fwd")], best[(label, "f+b")]
        model = predicted[label][0] / predicted["full causal, zigzag"][0]
        rows.append([
            label, f"{f:.3f}", f"{f / base[0]:.2f}", f"{t:.3f}", f"{t / base[1]:.2f}",
            f"{predicted[label][1] / MIB:.1f}", f"{model:.2f}",
        ])  # fmt: skip
    _table(rows)


def _ring_attention_package(q, k, v, calls: dict) -> float | None:
    """Add the Ring Attention authors' pure-JAX ring (`pip install ringattention flax`) to
    `calls`, on the same shapes and 8 fake devices, in the contiguous layout its causal mask
    assumes, beside our ring in that layout. Returns its max error against one device."""
    import types

    import jax.extend
    import jax.lib

    if not hasattr(jax.lib, "xla_bridge"):  # removed from JAX; the package still imports it
        backend = types.SimpleNamespace(get_backend=jax.extend.backend.get_backend)
        jax.lib.xla_bridge = backend  # pyright: ignore[reportAttributeAccessIssue]
    try:
        from ringattention import ringattention as their_ring
    except ImportError as e:
        print(f"ringattention is not installed ({e}): skipped (pip install ringattention flax).")
        return None
    mesh = jax.make_mesh((8,), ("context",))
    chunk = min(512, q.shape[1] // 8)
    blockwise = dict(
        causal_block_size=1, query_chunk_size=chunk, key_chunk_size=chunk, deterministic=True,
        dropout_rng=None, attn_pdrop=0.0, dtype=jnp.float32, precision=None, prevent_cse=True,
        policy=jax.checkpoint_policies.nothing_saveable,
    )  # fmt: skip
    pspec = PartitionSpec(None, "context", None, None)

    def theirs(q, k, v):
        def local(q, k, v):
            bias = jnp.zeros((q.shape[0], 1, 1, k.shape[1]), jnp.float32)
            return their_ring(q, k, v, bias, None, None, "context", True, blockwise)

        return jax.shard_map(
            local, mesh=mesh, in_specs=(pspec,) * 3, out_specs=pspec, check_vma=False
        )(q, k, v)

    contiguous = ShardingSpec(mesh, strategy="ring", load_balance="none")

    def ours_none(q, k, v):
        return attention(q, k, v, spec=contiguous)

    args = tuple(jax.device_put(x, NamedSharding(mesh, pspec)) for x in (q, k, v))
    calls[("theirs", "fwd")] = (jax.jit(theirs), args)
    calls[("theirs", "f+b")] = (_loss(theirs), args)
    calls[("ring none", "fwd")] = (jax.jit(ours_none), args)
    calls[("ring none", "f+b")] = (_loss(ours_none), args)
    return float(jnp.max(jnp.abs(jax.jit(theirs)(*args) - attention(q, k, v))))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--sections", nargs="+", default=["a", "b", "c", "e", "w", "d"])
    p.add_argument("--mla-seq", type=int, default=32768)
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    p.add_argument("--per-device", type=int, default=8192, help="tokens per device in (a')")
    p.add_argument("--comm-seqs", type=int, nargs="+", default=[32768])
    p.add_argument("--balance-seq", type=int, default=131072)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--time-seq", type=int, default=8192)
    p.add_argument("--time-heads", type=int, default=8)
    p.add_argument("--time-kv-heads", type=int, default=8)
    p.add_argument("--time-head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--window-seq", type=int, default=32768)
    p.add_argument("--window", type=int, default=2048)
    args = p.parse_args(argv)

    shape = dict(
        batch=1, q_heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        v_head_dim=None, dtype=jnp.float32,
    )  # fmt: skip
    print(
        f"jax {jax.__version__}, {len(jax.devices())} fake {jax.devices()[0].platform} devices; "
        f"batch 1, heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, float32, "
        "causal, zigzag; usp = ulysses 2 x ring N/2"
    )
    t0 = time.perf_counter()
    compiled = _Compiled(shape)
    if "a" in args.sections:
        memory_section(compiled, args.seqs, args.per_device)
    if "b" in args.sections:
        comm_section(compiled, args.comm_seqs, shape)
    if "c" in args.sections:
        balance_section(args.balance_seq, shape)
    if "e" in args.sections:
        mla_section(args.mla_seq)
    if "w" in args.sections:
        window_section(
            args.window_seq, args.window, args.time_heads, args.time_head_dim, args.repeats
        )
    if "d" in args.sections:
        time_section(
            args.time_seq, args.time_heads, args.time_kv_heads, args.time_head_dim, args.repeats
        )
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
