"""Context-parallel attention strategies on 8 fake CPU devices, side by side.

Sections (all but `h` and `v` by default, pick with `--sections`):

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
- `h`, `v` (`_variants_bench.py`, issue 47; ~6 min, so only when named): Gemma 3's window
  layers by neighbour exchange against today's windowed ring (collective bytes at 32K-128K,
  forward + backward time at 32K), and the cost of sinks and soft-cap over plain attention
  on one device and under the ring.
- `d`: wall time of each strategy on 8 fake devices against single-device
  `eqx_longctx.attention` (`spec=None`), forward and forward + backward; and the
  `ringattention` package when it is installed.

(a) and (b) only compile, from abstract sharded inputs: nothing big runs. The 8 fake devices
share this machine's cores, so (d) measures overheads, not speed-up.

    python benchmarks/context_parallel.py
    python benchmarks/context_parallel.py --sections a b --seqs 8192 32768
    python benchmarks/context_parallel.py --sections d --time-seq 4096 --repeats 3
    python benchmarks/context_parallel.py --sections w --window-seq 32768 --window 2048
    python benchmarks/context_parallel.py --sections h v --halo-heads 8 16 --halo-time-heads 8 16
    python benchmarks/context_parallel.py --plot docs/img/benchmarks   # also one PNG a topic
"""

import argparse
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import _variants_bench  # noqa: E402
import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _ringattention import ring_attention_package  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from eqx_longctx import ShardingSpec, attention, latent_attention  # noqa: E402
from eqx_longctx._hlo import collective_bytes  # noqa: E402
from eqx_longctx.attention._choose import plan  # noqa: E402
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


def memory_section(compiled: _Compiled, seqs: list, per_device: int) -> dict:
    """Prints (a) and (a'); returns the forward + backward bytes (compiled, model) for plots."""
    plot: dict = {"memory": {s: [] for s in STRATEGIES}, "weak": {s: [] for s in STRATEGIES}}
    print("\n(a) per-device memory, MiB: compiled (arguments + outputs + temporaries) / model")
    for backward in (False, True):
        head = ["seq"] + [f"{s} {'f+b' if backward else 'fwd'}" for s in STRATEGIES]
        rows = [head]
        for seq in seqs:
            row = [seq]
            for s in STRATEGIES:
                mem, _, cost = compiled(s, 8, seq, backward)
                pred = cost.memory_train if backward else cost.memory_forward
                if backward:
                    plot["memory"][s].append((seq, mem, pred))
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
            plot["weak"][s].append((n, mem, cost.memory_train))
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
    return plot


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


def comm_section(compiled: _Compiled, seqs: list, shape: dict) -> list:
    print(
        "\n(b) collective bytes per device per layer: compiled HLO, HLO / model, "
        "HLO / theoretical minimum"
    )
    rows = [["seq", "strategy", "pass", "HLO MiB", "/ model", "/ minimum", "by op (MiB)"]]
    plot = []  # (seq, strategy, backward, HLO bytes, model bytes, minimum bytes)
    for seq in seqs:
        for s in STRATEGIES:
            for backward in (False, True):
                _, comm, cost = compiled(s, 8, seq, backward)
                pred = sum((cost.comm_train if backward else cost.comm_forward).values())
                got = sum(comm.values())
                least = _minimum(s, seq, shape, backward)
                plot.append((seq, s, backward, got, pred, least))
                ops = ", ".join(f"{k} {v / MIB:.2f}" for k, v in comm.items() if v > 64)
                rows.append([
                    seq, s, "f+b" if backward else "fwd", f"{got / MIB:.2f}",
                    f"{got / pred:.3f}", f"{got / least:.3f}", ops,
                ])  # fmt: skip
    _table(rows)
    print(
        "(the all-reduce of a few bytes in f+b is the loss; above the minimum: int32 "
        "positions and segment ids)"
    )
    return plot


def balance_section(seq: int, shape: dict) -> dict:
    print(f"\n(c) causal work balance at seq {seq} on 8 devices: max / mean non-empty score")
    rows = [["layout"] + list(STRATEGIES)]
    plot = {layout: {} for layout in LAYOUTS}
    for layout in LAYOUTS:
        for s in STRATEGIES:
            plot[layout][s] = plan(_spec(s, 8, layout), seq=seq, **shape).costs[s].balance
        rows.append([layout] + [f"{plot[layout][s]:.3f}" for s in STRATEGIES])
    _table(rows)
    return plot


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


def mla_section(seq: int) -> list:
    heads, rank, rope, nope, dv = 16, 512, 64, 128, 128
    print(
        f"\n(e) MLA, DeepSeek-V2-Lite attention shapes (heads {heads}, kv_lora_rank {rank}, "
        f"rope {rope}, nope {nope}, v {dv}), batch 1, seq {seq}, 8 devices, float32: latent "
        "communication vs per-head K/V (both compiled, forward + backward)"
    )
    f32 = jnp.float32
    rows = [["strategy", "K/V kind", "memory MiB", "comm fwd MiB", "comm f+b MiB", "f+b ratio"]]
    plot = []  # (strategy, kind, memory, comm fwd, comm f+b) in bytes
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
            plot.append((strategy, kind, mem, cf, ct))
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
    return plot


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


def time_section(seq: int, heads: int, kv_heads: int, head_dim: int, repeats: int) -> dict:
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
    theirs = ring_attention_package(q, k, v, calls)
    best = _interleaved(calls, repeats)
    names = ("single device",) + STRATEGIES
    base = best[("single device", "fwd")], best[("single device", "f+b")]
    rows = [["", "fwd s", "x", "fwd+bwd s", "x"]]
    for name in names:
        f, t = best[(name, "fwd")], best[(name, "f+b")]
        rows.append([name, f"{f:.3f}", f"{f / base[0]:.2f}", f"{t:.3f}", f"{t / base[1]:.2f}"])
    _table(rows)
    plot = {name: (best[(name, "fwd")], best[(name, "f+b")]) for name in names}
    if theirs is None:
        return plot
    t_fwd, t_bwd = best[("theirs", "fwd")], best[("theirs", "f+b")]
    print(f"ringattention package (max |theirs - single device| = {theirs:.1e}):")
    rows = [["", "fwd s", "ours/theirs", "fwd+bwd s", "ours/theirs"]]
    rows.append(["theirs (contiguous)", f"{t_fwd:.3f}", "", f"{t_bwd:.3f}", ""])
    for label, name in (("ours ring, contiguous", "ring none"), ("ours ring, zigzag", "ring")):
        f, t = best[(name, "fwd")], best[(name, "f+b")]
        rows.append([label, f"{f:.3f}", f"{f / t_fwd:.2f}", f"{t:.3f}", f"{t / t_bwd:.2f}"])
    _table(rows)
    plot["ringattention pkg"] = (t_fwd, t_bwd)
    return plot


def window_section(seq: int, window: int, heads: int, head_dim: int, repeats: int) -> dict:
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
    return {label: (best[(label, "fwd")], best[(label, "f+b")]) for label in cases}


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
    p.add_argument("--halo-byte-seqs", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument("--halo-seq", type=int, default=32768, help="the timed length in (h)")
    p.add_argument("--halo-window", type=int, default=1024)
    p.add_argument("--halo-heads", type=int, nargs="+", default=[8], help="K/V heads: half")
    p.add_argument("--halo-time-heads", type=int, nargs="+", default=[8])
    p.add_argument("--halo-head-dim", type=int, default=256)
    p.add_argument("--halo-repeats", type=int, default=3)
    p.add_argument("--halo-layouts", nargs="+", default=["none", "zigzag"])
    p.add_argument("--variants-seq", type=int, default=8192)
    p.add_argument("--variants-heads", type=int, default=8)
    p.add_argument("--variants-head-dim", type=int, default=64)
    p.add_argument("--variants-repeats", type=int, default=5)
    p.add_argument("--variants-on", nargs="+", choices=["one", "ring"], default=["one", "ring"])
    p.add_argument("--plot", metavar="DIR", help="also write one PNG per topic into DIR")
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
    results: dict = {}
    if "a" in args.sections:
        results.update(memory_section(compiled, args.seqs, args.per_device))
    if "b" in args.sections:
        results["comm"] = comm_section(compiled, args.comm_seqs, shape)
    if "c" in args.sections:
        results["balance"] = balance_section(args.balance_seq, shape)
    if "e" in args.sections:
        results["mla"] = mla_section(args.mla_seq)
    if "w" in args.sections:
        results["window"] = window_section(
            args.window_seq, args.window, args.time_heads, args.time_head_dim, args.repeats
        )
    if "h" in args.sections:
        results["halo"] = _variants_bench.halo_section(
            args.halo_byte_seqs, args.halo_seq, args.halo_window, args.halo_heads,
            args.halo_time_heads, args.halo_head_dim, args.halo_repeats, tuple(args.halo_layouts),
        )  # fmt: skip
    if "v" in args.sections:
        results["variants"] = _variants_bench.variants_section(
            args.variants_seq, args.variants_heads, args.variants_head_dim, args.variants_repeats,
            tuple(args.variants_on),
        )  # fmt: skip
    if "d" in args.sections:
        results["time"] = time_section(
            args.time_seq, args.time_heads, args.time_kv_heads, args.time_head_dim, args.repeats
        )
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.plot:
        import _plots

        _plots.context_parallel(results, args.plot)
        _variants_bench.plot(results, args.plot)


if __name__ == "__main__":
    main()
