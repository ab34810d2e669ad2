"""Sections `h` and `v` of `context_parallel.py`: issue 47's local layers and softmax variants.

- `h`: Gemma 3's local layers (window 1024, head dim 256, 8/4 query/K/V heads as in Gemma 3
  4B; 16/8 as in 12B with `--halo-heads 16`) on 8 devices, forward + backward of one layer:
  the neighbour exchange (`_halo.py`, what a window layer on the contiguous or zig-zag
  layout now runs) against today's windowed ring (the ring cut to the hops the window
  reaches; `HALO_REPLACES = ()` while it is traced). Collective bytes per device from the
  compiled programs at every length of `--halo-byte-seqs` (compiling only); wall time at
  `--halo-seq`, both measured in the same run, interleaved. Targets: at most 0.5x the
  ring's time and 1/4 of its bytes.
- `v`: the cost of GPT-OSS's sinks and Gemma 2's soft-cap (50) over plain causal attention,
  forward + backward (the sinks' gradient included), on one device and under the
  ring on zig-zag over 8 devices. Target: within 10% (at most 1.10x).

Timings are medians of interleaved rounds after one untimed call of each program, so slow
phases of the shared machine fall on every variant alike. The 8 fake devices share the
machine's cores: time ratios measure work and overheads, not network.
"""

import contextlib
import statistics
import time

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from eqx_longctx import ShardingSpec, attention
from eqx_longctx._hlo import collective_bytes
from eqx_longctx.attention import _halo
from eqx_longctx.plan import compiled_attention

MIB = 2**20
KINDS = ("ring", "halo")  # today's windowed ring, the neighbour exchange
LAYOUTS = ("none", "zigzag")
VARIANTS = ("plain", "sinks", "softcap", "sinks + softcap")
SOFTCAP = 50.0  # Gemma 2's attention soft-cap


@contextlib.contextmanager
def _exchange(kind: str):
    """Trace local layers as `kind`: `"halo"` (the default) or `"ring"` (no exchange)."""
    saved = _halo.HALO_REPLACES
    _halo.HALO_REPLACES = saved if kind == "halo" else ()
    try:
        yield
    finally:
        _halo.HALO_REPLACES = saved


def _ring(layout: str, n: int = 8) -> ShardingSpec:
    mesh = jax.make_mesh((n,), ("context",), devices=jax.devices()[:n])
    return ShardingSpec(mesh, strategy="ring", load_balance=layout)


def _table(rows: list) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(x).rjust(w) for x, w in zip(r, widths, strict=True)))


def _medians(calls: dict, repeats: int) -> dict:
    """Median wall time of each `name: (compiled, args)` over `repeats` interleaved rounds,
    after one untimed call of each."""
    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))
    times: dict = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (fn, args) in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _inputs(seq: int, heads: int, kv_heads: int, head_dim: int):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (1, seq, heads, head_dim))
    k, v = (jax.random.normal(key, (1, seq, kv_heads, head_dim)) for key in keys[1:3])
    sinks = jax.random.normal(keys[3], (heads,))
    return q, k, v, sinks


def _compile_train(forward, args, argnums):
    """The value and gradient of `forward`'s summed output, compiled for `args`."""
    fn = jax.value_and_grad(lambda *a: jnp.sum(forward(*a)), argnums=argnums)
    return jax.jit(fn).lower(*args).compile()


def halo_section(
    byte_seqs: list, time_seq: int, window: int, heads: list, time_heads: list,
    head_dim: int, repeats: int, layouts: tuple = LAYOUTS,
) -> dict:  # fmt: skip
    """Prints (h); returns `{"bytes": [...], "time": {...}, "seq": time_seq}` for the plot.

    The programs timed are the ones whose bytes are counted (`compiled_attention`, compiled
    from abstract inputs with the shardings the timed arrays get)."""
    print(
        f"\n(h) Gemma 3 local layers: W = {window}, head_dim {head_dim}, heads h/(h/2), batch 1, "
        "f32, 8 devices: neighbour exchange (halo) vs today's windowed ring"
    )
    print(
        "collective bytes per device (compiled HLO, MiB); window K/V = (W-1) tokens' K and V "
        "per piece of a shard (1 contiguous, 2 zig-zag)"
    )
    rows = [["seq", "heads", "layout", "pass", "ring MiB", "halo MiB", "halo/ring",
             "halo/window K/V"]]  # fmt: skip
    byte_rows = []  # (seq, heads, layout, backward, ring bytes, halo bytes)
    programs = {}  # (heads, layout, kind) -> compiled forward + backward, at the timed length
    for seq in sorted({*byte_seqs, time_seq}):
        for h in sorted({*heads, *time_heads}):
            for layout in layouts:
                pieces = 1 if layout == "none" else 2
                window_kv = pieces * (window - 1) * (h // 2) * 2 * head_dim * 4
                for backward in (False, True):
                    got = {}
                    for kind in KINDS:
                        with _exchange(kind):
                            c = compiled_attention(
                                _ring(layout), batch=1, seq=seq, q_heads=h, kv_heads=h // 2,
                                head_dim=head_dim, window=window, backward=backward,
                            )  # fmt: skip
                        got[kind] = sum(collective_bytes(c).values())
                        if seq == time_seq and h in time_heads and backward:
                            programs[(h, layout, kind)] = c
                    if seq not in byte_seqs or h not in heads:
                        continue
                    byte_rows.append((seq, h, layout, backward, got["ring"], got["halo"]))
                    rows.append([
                        seq, f"{h}/{h // 2}", layout, "f+b" if backward else "fwd",
                        f"{got['ring'] / MIB:.2f}", f"{got['halo'] / MIB:.2f}",
                        f"{got['halo'] / got['ring']:.3f}", f"{got['halo'] / window_kv:.2f}",
                    ])  # fmt: skip
    _table(rows)
    print("(target: halo/ring <= 0.25; f+b counts the halo's gradients sent back)")

    print(
        f"\nforward + backward wall time at seq {time_seq}, median of {repeats} interleaved "
        "rounds (target: halo/ring <= 0.5)"
    )
    calls = {}
    for h in time_heads:
        q, k, v, _ = _inputs(time_seq, h, h // 2, head_dim)
        ids = jnp.zeros((1, time_seq), jnp.int32)  # compiled_attention's unused segment ids
        for layout in layouts:
            spec = _ring(layout)
            args = tuple(jax.device_put(x, spec.sharding(spec.heads_pspec())) for x in (q, k, v))
            args = (*args, jax.device_put(ids, spec.sharding(spec.token_pspec())))
            for kind in KINDS:
                calls[(h, layout, kind)] = (programs[(h, layout, kind)], args)
    best = _medians(calls, repeats)
    rows = [["heads", "layout", "ring f+b s", "halo f+b s", "halo/ring"]]
    times = {}
    for h in time_heads:
        for layout in layouts:
            ring, halo = (best[(h, layout, kind)] for kind in KINDS)
            times[(h, layout)] = (ring, halo)
            rows.append(
                [f"{h}/{h // 2}", layout, f"{ring:.3f}", f"{halo:.3f}", f"{halo / ring:.2f}"]
            )
    _table(rows)
    return {"bytes": byte_rows, "time": times, "seq": time_seq}


def variants_section(
    seq: int, heads: int, head_dim: int, repeats: int, on: tuple = ("one", "ring")
) -> dict:
    """Prints (v); returns `{placement: {variant: f+b s}}` for the plot."""
    print(
        f"\n(v) sinks and soft-cap ({SOFTCAP:g}) over plain causal attention: batch 1, seq "
        f"{seq}, heads {heads}, head_dim {head_dim}, f32; median of {repeats} interleaved rounds "
        "(target: <= 1.10x plain)"
    )
    q, k, v, sinks = _inputs(seq, heads, heads, head_dim)
    choices = {"one": ("one device", None), "ring": ("ring, zigzag, 8 dev.", _ring("zigzag"))}
    placements = dict(choices[name] for name in on)
    calls = {}
    for where, spec in placements.items():
        if spec is None:
            args = tuple(jax.device_put(x, jax.devices()[0]) for x in (q, k, v, sinks))
        else:
            placed = (jax.device_put(x, spec.sharding(spec.heads_pspec())) for x in (q, k, v))
            args = (*placed, jax.device_put(sinks, spec.sharding(PartitionSpec())))
        for name in VARIANTS:
            cap = SOFTCAP if "softcap" in name else None

            def fwd(q, k, v, s, spec=spec, cap=cap, with_sinks="sinks" in name):
                sinks = s if with_sinks else None
                return attention(q, k, v, spec=spec, softcap=cap, sinks=sinks)

            grads = (0, 1, 2, 3) if "sinks" in name else (0, 1, 2)
            calls[(where, name)] = (_compile_train(fwd, args, grads), args)
    best = _medians(calls, repeats)
    rows = [["placement", "variant", "f+b s", "x plain"]]
    out: dict = {}
    for where in placements:
        out[where] = {name: best[(where, name)] for name in VARIANTS}
        for name in VARIANTS:
            t = best[(where, name)]
            rows.append([where, name, f"{t:.3f}", f"{t / best[(where, 'plain')]:.3f}"])
    _table(rows)
    return out


def plot(results: dict, directory) -> list:
    """`context_parallel_variants.png`: the halo's bytes and time against the ring's, and
    the variants' time over plain attention, for the sections that ran."""
    if "halo" not in results and "variants" not in results:
        return []
    import _plots
    import matplotlib.pyplot as plt

    halo, variants = results.get("halo"), results.get("variants")
    n = 2 * (halo is not None) + (variants is not None)
    fig, axes = plt.subplots(1, n, figsize=(5.2 * n, 4.2), squeeze=False)
    panels = list(axes[0])
    if halo:
        ax = panels.pop(0)
        h = halo["bytes"][0][1]
        seqs = sorted({r[0] for r in halo["bytes"]})
        for layout, marker in zip(LAYOUTS, "os", strict=True):
            name = "contiguous" if layout == "none" else layout
            pts = [r for r in halo["bytes"] if r[1] == h and r[2] == layout and r[3]]
            if not pts:
                continue
            for kind, style, color, index in (("ring", "--", "C2", 4), ("halo", "-", "C4", 5)):
                ax.plot([r[0] for r in pts], [r[index] / MIB for r in pts], style + marker,
                        color=color, label=f"{kind}, {name}")  # fmt: skip
        _plots._seq_axis(ax, seqs)
        ax.set(yscale="log", ylabel="MiB per device, forward + backward",
               title=f"collective bytes, heads {h}/{h // 2}")  # fmt: skip
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        ax = panels.pop(0)
        keys = list(halo["time"])
        labels = [f"{h}/{h // 2}, {'contiguous' if lay == 'none' else lay}" for h, lay in keys]
        ring = [halo["time"][key][0] for key in keys]
        ours = [halo["time"][key][1] for key in keys]
        _plots._bars(ax, labels, {"ring": ring, "halo": ours}, colors=["C2", "C4"])
        for i, (r, o) in enumerate(zip(ring, ours, strict=True)):
            ax.annotate(f"{o / r:.2f}x", (i + 0.2, o), ha="center", va="bottom", fontsize=8)
        title = f"wall time at {_plots._tokens(halo['seq'])} tokens (label: halo / ring)"
        ax.set(ylabel="seconds, forward + backward", title=title)
        ax.legend(fontsize=8)
    if variants:
        ax = panels.pop(0)
        where = list(variants)
        _plots._bars(ax, where, {
            name: [variants[w][name] / variants[w]["plain"] for w in where]
            for name in VARIANTS[1:]
        })  # fmt: skip
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1.1, color="r", lw=0.8, ls=":", label="target 1.10")
        ax.set_ylim(0, max(1.4, *(variants[w][n] / variants[w]["plain"] * 1.2
                                  for w in where for n in VARIANTS)))  # fmt: skip
        ax.set(ylabel="forward + backward time / plain causal",
               title="sinks and soft-cap over plain attention")  # fmt: skip
        ax.legend(fontsize=8, loc="upper center", ncol=2)
    fig.suptitle("Issue 47's local layers and softmax variants on 8 fake CPU devices")
    return [_plots._save(fig, directory, "context_parallel_variants")]
