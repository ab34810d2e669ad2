"""The figures of the benchmark scripts' `--plot DIR` option: one PNG per topic.

Each function takes the numbers a script measured in its run (plain lists and dicts, the same
ones it prints) and writes `DIR/<name>.png`, returning the paths. matplotlib runs headless
(Agg), so the scripts plot on a TPU VM or in CI as well as on a laptop.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

MIB, GIB = 2**20, 2**30
COLORS = {"all_gather": "C0", "ulysses": "C1", "ring": "C2", "usp": "C3"}


def _plain_log_labels(ax) -> None:
    """Label a log y axis 0.1, 1, 10 (not 10^-1), and its minor ticks only inside a decade."""
    low, high = ax.get_ylim()
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    if high / low >= 10:
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    else:
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))


def _save(fig, directory: str | Path, name: str) -> Path:
    for ax in fig.axes:
        if ax.get_yscale() == "log":
            _plain_log_labels(ax)
    path = Path(directory) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _seq_axis(ax, seqs) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(seqs), [_tokens(s) for s in seqs])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("sequence length (tokens)")


def attention_local(rows: list[dict], directory) -> list[Path]:
    """Time and compiled peak memory of ours and XLA against sequence length.

    `rows`: per length, `seq`, the times `ours_fwd`, `xla_fwd`, `ours_fb`, `xla_fb` (seconds,
    None where not run) and the peaks `mem_ours_fwd`, ... (bytes; compiled at every length).
    """
    seqs = [r["seq"] for r in rows]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label, style in (
        ("ours_fwd", "ours, forward", "C2-o"),
        ("ours_fb", "ours, forward + backward", "C2--s"),
        ("xla_fwd", "XLA, forward", "C7-o"),
        ("xla_fb", "XLA, forward + backward", "C7--s"),
    ):
        pts = [(r["seq"], r[key]) for r in rows if r[key] is not None]
        if pts:
            ax_t.plot(*zip(*pts, strict=True), style, label=label)
        ax_m.plot(seqs, [r["mem_" + key] / GIB for r in rows], style, label=label)
    ax_t.set(yscale="log", ylabel="seconds (best of the repeats)", title="wall time")
    ax_m.set(yscale="log", ylabel="GiB", title="compiled peak memory (all compiled, some not run)")
    for ax in (ax_t, ax_m):
        _seq_axis(ax, seqs)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle("Single-device causal attention, float32: ours against XLA")
    return [_save(fig, directory, "attention_local")]


def context_parallel(results: dict, directory) -> list[Path]:
    """One PNG per section that ran (keys of `results`, filled by context_parallel.py)."""
    paths = []
    if "memory" in results:
        paths.append(_cp_memory(results["memory"], results.get("weak"), directory))
    if "comm" in results:
        paths.append(_cp_comm(results["comm"], results.get("mla"), directory))
    elif "mla" in results:
        paths.append(_cp_comm([], results["mla"], directory))
    if "balance" in results:
        paths.append(_cp_balance(results["balance"], directory))
    if "time" in results or "window" in results:
        paths.append(_cp_time(results.get("time"), results.get("window"), directory))
    return paths


def _cp_memory(memory: dict, weak: dict | None, directory) -> Path:
    fig, axes = plt.subplots(1, 2 if weak else 1, figsize=(11 if weak else 6, 4), squeeze=False)
    ax = axes[0, 0]
    for strategy, pts in memory.items():
        seqs = [p[0] for p in pts]
        ax.plot(seqs, [p[1] / MIB for p in pts], "-o", color=COLORS[strategy], label=strategy)
        ax.plot(seqs, [p[2] / MIB for p in pts], ":", color=COLORS[strategy])
    _seq_axis(ax, seqs)
    ax.set(yscale="log", ylabel="MiB per device",
           title="forward + backward on 8 devices (dotted: cost model)")  # fmt: skip
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    if weak:
        ax = axes[0, 1]
        for strategy, pts in weak.items():
            ax.plot([p[0] for p in pts], [p[1] / MIB for p in pts], "-o",
                    color=COLORS[strategy], label=strategy)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        ax.set(xlabel="devices (sequence grows with them)", ylabel="MiB per device",
               title="fixed tokens per device: flat is good")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Per-device memory of the four strategies (compiled memory analysis)")
    return _save(fig, directory, "context_parallel_memory")


def _bars(ax, groups: list[str], series: dict[str, list[float]], colors=None) -> None:
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=name, color=None if colors is None else colors[i])
    ax.set_xticks(range(len(groups)), groups)
    ax.grid(alpha=0.3, axis="y")


def _cp_comm(comm: list, mla: list | None, directory) -> Path:
    fig, axes = plt.subplots(1, 2 if (comm and mla) else 1, figsize=(11, 4), squeeze=False)
    panels = list(axes[0])
    if comm:
        ax = panels.pop(0)
        seq = max(c[0] for c in comm)
        rows = [c for c in comm if c[0] == seq]
        strategies = list(dict.fromkeys(c[1] for c in rows))
        got = {(c[1], c[2]): c[3] / MIB for c in rows}
        least = {(c[1], c[2]): c[5] / MIB for c in rows}
        _bars(ax, strategies, {
            "forward": [got[s, False] for s in strategies],
            "forward + backward": [got[s, True] for s in strategies],
        })  # fmt: skip
        for j, backward in enumerate((False, True)):
            xs = [g + (j - 0.5) * 0.4 for g in range(len(strategies))]
            ax.plot(xs, [least[s, backward] for s in strategies], "k_", markersize=18,
                    label="theoretical minimum" if backward else None)  # fmt: skip
        ax.set(ylabel="MiB received per device per layer",
               title=f"collective bytes in the compiled HLO, seq {_tokens(seq)}")  # fmt: skip
        ax.legend(fontsize=8)
    if mla:
        ax = panels.pop(0)
        strategies = list(dict.fromkeys(m[0] for m in mla))
        by = {(m[0], m[1]): m[4] / MIB for m in mla}
        _bars(ax, strategies, {
            "MLA latent": [by[s, "latent"] for s in strategies],
            "per-head K/V": [by[s, "per-head"] for s in strategies],
        }, colors=["C4", "C7"])  # fmt: skip
        ax.set(ylabel="MiB per device, forward + backward",
               title="MLA (DeepSeek-V2-Lite shapes): latent vs per-head K/V")  # fmt: skip
        ax.legend(fontsize=8)
    fig.suptitle("What crosses the wire (8 devices, float32)")
    return _save(fig, directory, "context_parallel_comm")


def _cp_balance(balance: dict, directory) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.6))
    layouts = list(balance)
    strategies = list(next(iter(balance.values())))
    _bars(ax, layouts, {s: [balance[la][s] for la in layouts] for s in strategies},
          colors=[COLORS[s] for s in strategies])  # fmt: skip
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(xlabel="token layout", ylabel="max / mean causal work over devices",
           title="Causal balance on 8 devices (1.0 = every device equally busy)")  # fmt: skip
    ax.legend(fontsize=8)
    return _save(fig, directory, "context_parallel_balance")


def _cp_time(times: dict | None, window: dict | None, directory) -> Path:
    panels = [p for p in (times, window) if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, data in zip(axes[0], panels, strict=True):
        names = list(data)
        base = data[names[0]]
        _bars(ax, names, {
            "forward": [data[n][0] / base[0] for n in names],
            "forward + backward": [data[n][1] / base[1] for n in names],
        })  # fmt: skip
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel(f"time / {names[0]}")
        ax.tick_params(axis="x", labelsize=8, rotation=15)
        ax.legend(fontsize=8)
    if times:
        axes[0, 0].set_title("wall time on 8 fake CPU devices (overheads, not speed-up)")
    if window:
        axes[0, -1].set_title("sliding window on the ring")
    return _save(fig, directory, "context_parallel_time")


def fsdp(rows: list[dict], directory) -> list[Path]:
    """Per-device parameter + optimizer bytes and step time against the fsdp degree."""
    fs = [r["fsdp"] for r in rows]
    base = rows[0]
    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    state = [(r["param_bytes"] + r["opt_bytes"]) / MIB for r in rows]
    ideal = [state[0] * base["fsdp"] / f for f in fs]
    ax_b.plot(fs, state, "C2-o", label="params + AdamW state (measured)")
    ax_b.plot(fs, ideal, "k:", label="1 / fsdp of replicated")
    ax_b.plot(fs, [r["temp"] / MIB for r in rows], "C1--s", label="step temporaries")
    ax_b.set(yscale="log", ylabel="MiB per device", title="bytes per device")
    ax_t.bar(range(len(fs)), [r["step"] / base["step"] for r in rows], color="C2")
    ax_t.axhline(1.3, color="C3", ls="--", lw=1, label="target: at most 1.3x")
    ax_t.set_xticks(range(len(fs)), [str(f) for f in fs])
    ax_t.set(ylabel=f"step time / fsdp={base['fsdp']}", title="train step time (median)")
    for ax in (ax_b, ax_t):
        ax.set_xlabel("fsdp degree (mesh data=8/f x fsdp=f)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    ax_b.set_xscale("log", base=2)
    ax_b.set_xticks(fs, [str(f) for f in fs])
    fig.suptitle("FSDP on 8 devices: weights and optimizer state split, same batch")
    return [_save(fig, directory, "fsdp")]


def train_step(rows: list[dict], directory) -> list[Path]:
    """The trainer's step time split into the device step, data and other host work, and
    tokens/s, per configuration."""
    names = [r["name"] for r in rows]
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(rows))
    device = [r["device"] * 1e3 for r in rows]
    data = [r["data"] * 1e3 for r in rows]
    host = [r["host"] * 1e3 for r in rows]
    ax_t.bar(x, device, color="C2", label="device step")
    ax_t.bar(x, data, bottom=device, color="C1", label="data (fetch + place)")
    ax_t.bar(x, host, bottom=[a + b for a, b in zip(device, data, strict=True)], color="C7",
             label="other host work")  # fmt: skip
    ax_t.set_xticks(list(x), names)
    ax_t.set(ylabel="ms per step (median)", title="where a step's time goes")
    ax_r.bar(x, [r["tokens_per_s"] for r in rows], color="C0")
    ax_r.set_xticks(list(x), names)
    ax_r.set(ylabel="tokens / s", title="throughput (the loop's steps)")
    for ax in (ax_t, ax_r):
        ax.grid(alpha=0.3, axis="y")
    ax_t.legend(fontsize=8)
    fig.suptitle("The trainer's step on 8 fake CPU devices")
    return [_save(fig, directory, "train_step")]


def kernels(rows: list[dict], title: str, directory) -> list[Path]:
    """TFLOP/s of our kernel and splash attention against sequence length (on a TPU)."""
    seqs = [r["seq"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label, style in (
        ("ours_fwd", "ours, forward", "C2-o"),
        ("splash_fwd", "splash, forward", "C7-o"),
        ("ours_fb", "ours, forward + backward", "C2--s"),
        ("splash_fb", "splash, forward + backward", "C7--s"),
    ):
        ax.plot(seqs, [r[key] for r in rows], style, label=label)
    _seq_axis(ax, seqs)
    ax.set(ylabel="TFLOP/s (visible pairs only)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return [_save(fig, directory, "kernels")]


def generate(results: dict, directory) -> list[Path]:
    """Generation: time per token and to the first token against transformers (one
    device), the decode step's per-device bytes on 8 devices, and the MLA cache (the keys
    of `results` that are present: `time`, `decode`, `mla`, as generate.py fills them)."""
    draw = {"time": _gen_time, "decode": _gen_decode, "mla": _gen_mla}
    panels = [k for k in draw if k in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4), squeeze=False)
    for ax, key in zip(axes[0], panels, strict=True):
        draw[key](ax, results[key])
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle("Generation (float32 on CPU; V3 sizes abstract)")
    return [_save(fig, directory, "generate")]


def _lines(ax, rows: list[dict], x: str, series, scale: float, xlabel: str) -> None:
    """One line per `(key, label, style)` of `series`, `r[key] * scale` against `r[x]`."""
    xs = [r[x] for r in rows]
    for key, label, style in series:
        ax.plot(xs, [r[key] * scale for r in rows], style, label=label)
    _seq_axis(ax, xs)
    ax.set_xlabel(xlabel)


def _gen_time(ax, rows: list[dict]) -> None:
    _lines(ax, rows, "seq", (
        ("ours_token", "ours, per token", "C2-o"),
        ("hf_token", "transformers, per token", "C7-o"),
        ("ours_first", "ours, first token", "C2--s"),
        ("hf_first", "transformers, first token", "C7--s"),
    ), 1e3, "prompt length (tokens)")  # fmt: skip
    ax.set(yscale="log", ylabel="ms (median)", title="one device: greedy generation")


def _gen_decode(ax, rows: list[dict]) -> None:
    _lines(ax, rows, "cache", (
        ("cache_dev", "cache / 8", "k:o"),
        ("aliased", "donated (updated in place)", "C2-o"),
        ("temp", "temporaries", "C1--s"),
        ("moved", "collective bytes received", "C3-^"),
    ), 1 / MIB, "cache length (tokens)")  # fmt: skip
    ax.set(yscale="log", ylabel="MiB per device", title="decode step on 8 devices (ring)")


def _gen_mla(ax, mla: dict) -> None:
    _bars(ax, ["values per token per layer"], {
        "MLA latent + RoPE key": [mla["latent"]], "per-head K/V": [mla["per_head"]],
    }, colors=["C4", "C7"])  # fmt: skip
    ax.set(yscale="log", title="DeepSeek-V3 cache: latent vs per-head K/V")


def linear_attention(results: dict, directory) -> list[Path]:
    """One PNG per section of linear_attention.py that ran: `op` (rows of `seq`, `ours`,
    `torch` seconds, None where not run), `cp` (rows of `seq`, `name`, `time` or None,
    `total` collective bytes and `memory` bytes per device) and `hybrid` (rows of `seq`,
    `name`, `tokens_per_s`, `memory`)."""
    paths = []
    if results.get("op"):
        rows = results["op"]
        fig, ax = plt.subplots(figsize=(6.5, 4))
        series = (("ours", "ours (XLA, jitted)", "C2-o"),
                  ("torch", "transformers' torch chunked form", "C7-s"))  # fmt: skip
        for key, label, style in series:
            pts = [(r["seq"], r[key]) for r in rows if r[key] is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=label)
        _seq_axis(ax, [r["seq"] for r in rows])
        ax.set(yscale="log", ylabel="seconds (median)",
               title="Gated delta rule on one device, forward + backward")  # fmt: skip
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        paths.append(_save(fig, directory, "linear_attention_op"))
    if results.get("cp"):
        rows = results["cp"]
        names = list(dict.fromkeys(r["name"] for r in rows))
        seqs = sorted({r["seq"] for r in rows})
        timed = sorted({r["seq"] for r in rows if r["time"] is not None})
        fig, axes = plt.subplots(1, 3 if timed else 2, figsize=(15 if timed else 10, 4))
        for i, name in enumerate(names):
            mine = sorted((r for r in rows if r["name"] == name), key=lambda r: r["seq"])
            style = f"C{i}-o"
            axes[0].plot([r["seq"] for r in mine], [r["total"] / MIB for r in mine], style,
                         label=name)  # fmt: skip
            axes[1].plot([r["seq"] for r in mine], [r["memory"] / MIB for r in mine], style,
                         label=name)  # fmt: skip
        axes[0].set(yscale="log", ylabel="MiB received per device",
                    title="collective bytes, forward + backward")  # fmt: skip
        axes[1].set(yscale="log", ylabel="MiB per device", title="compiled memory per device")
        for ax in axes[:2]:
            _seq_axis(ax, seqs)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
        if timed:
            by = {(r["name"], r["seq"]): r["time"] for r in rows if r["time"] is not None}
            _bars(axes[2], [_tokens(s) for s in timed],
                  {name: [by[name, s] for s in timed] for name in names})  # fmt: skip
            axes[2].set(xlabel="sequence length (tokens)", ylabel="seconds (median)",
                        title="wall time, 8 fake devices on shared cores")  # fmt: skip
            axes[2].legend(fontsize=8)
        fig.suptitle("Gated delta rule over 8 devices: our sequence split against all-gathered")
        paths.append(_save(fig, directory, "linear_attention_cp"))
    if results.get("hybrid"):
        rows = results["hybrid"]
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
        for i, name in enumerate(dict.fromkeys(r["name"] for r in rows)):
            mine = sorted((r for r in rows if r["name"] == name), key=lambda r: r["seq"])
            timed = [r for r in mine if r.get("tokens_per_s") is not None]  # some: memory only
            ax_t.plot([r["seq"] for r in timed], [r["tokens_per_s"] for r in timed],
                      f"C{i}-o", label=name)  # fmt: skip
            ax_m.plot([r["seq"] for r in mine], [r["memory"] / MIB for r in mine],
                      f"C{i}-o", label=name)  # fmt: skip
        ax_t.set(yscale="log", ylabel="tokens / s (device step, median)", title="throughput")
        ax_m.set(yscale="log", ylabel="MiB per device", title="compiled memory of the step")
        for ax in (ax_t, ax_m):
            _seq_axis(ax, sorted({r["seq"] for r in rows}))
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
        fig.suptitle("Train step on 8 fake devices: hybrid Qwen3-Next tiny against all-softmax")
        paths.append(_save(fig, directory, "linear_attention_hybrid"))
    return paths
