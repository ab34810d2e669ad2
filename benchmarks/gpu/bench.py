"""The zoo on one GPU, side by side in one run: the GPU kernels (`impl="pallas_gpu"`, what
`impl="auto"` picks on a GPU) against cuDNN and our XLA path, a ring emulated as hops, a
train step's MFU and decoding against transformers. `run.sh` beside it is the device call.

Sections, each timed (best of `--repeats` after a warm-up that compiles), each written to
`OUT/gpu_bench.json` as soon as it ends (a run cut short keeps what it measured):

- `selftest`: `python -m eqx_longctx.selftest --quick --no-ring` on the GPU (exit status
  and its table's last lines).
- `attention`: causal attention forward + backward at `--seqs` (bf16, head dim 128, GQA
  32/8, batch 1): TFLOP/s of ours, of `jax.nn.dot_product_attention(implementation=
  "cudnn")` and of our XLA path, and the ratio ours / cuDNN (target >= 0.7 at 16K).
  FLOPs are the causal half: forward `2 * 2 * s^2 * h * d / 2`, backward 2.5 times it.
- `ring`: `--ring-seq` tokens (128K) in `--ring-pieces` zig-zag pieces, each piece's
  queries against every piece's keys as a ring's hops would be (the block contract with
  positions; hops no query sees are skipped), the partials merged, forward + backward;
  the time per emulated device and the useful TFLOP/s.
- `train`: a train step (forward, backward, AdamW) of Llama 3.2 1B's shape at `--train-seqs`
  (8K, 32K), float32 weights, bf16 compute: tokens/s and MFU against the card's bf16 peak
  (target >= 35% at 8K).
- `generate`: greedy decoding after `--gen-contexts` tokens of context (8K, 32K) with the
  same shape in bf16: milliseconds per token (the median gap between tokens), ours and
  transformers' `generate` (sdpa) on the same GPU.

`--smoke` runs every section tiny, so that this script is tested on a CPU (the kernels
interpreted, cuDNN reported unavailable). `OUT/gpu_bench.png` plots the attention and
train rows.

    python benchmarks/gpu/bench.py --out /tmp/gpu            # on a GPU: the device call
    python benchmarks/gpu/bench.py --smoke --out /tmp/gpu    # anywhere: every section tiny
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import eqx_longctx as el
from eqx_longctx._timing import best_seconds

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense tensor-core FLOP/s


def peak_flops() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_BF16.items() if k in kind), None)


class Report:
    """The JSON file, rewritten after each section, and a deadline for the whole run."""

    def __init__(self, out: Path, budget_s: float):
        self.path = out / "gpu_bench.json"
        self.start = time.time()
        self.budget = budget_s
        d = jax.devices()[0]
        self.data = {"device": d.device_kind, "platform": d.platform, "jax": jax.__version__,
                     "peak_bf16_flops": peak_flops(), "sections": {}}  # fmt: skip

    def left(self) -> float:
        return self.budget - (time.time() - self.start)

    def section(self, name: str, fn, *args):
        if self.left() < 20:
            self.data["sections"][name] = {"skipped": "out of time"}
        else:
            t0 = time.time()
            try:
                result = fn(*args)
            except Exception as error:  # a section that breaks is reported, not fatal
                result = {"error": f"{type(error).__name__}: {str(error)[:600]}"}
            result["seconds"] = round(time.time() - t0, 1)
            self.data["sections"][name] = result
        self.path.write_text(json.dumps(self.data, indent=1))
        print(name, json.dumps(self.data["sections"][name])[:2000], flush=True)


# ---------------------------------------------------------------------------- sections


def selftest(args) -> dict:
    cmd = [sys.executable, "-m", "eqx_longctx.selftest", "--quick", "--no-ring"]
    if args.smoke:
        cmd += ["--case", "causal"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.selftest_timeout)
    return {"returncode": run.returncode, "tail": (run.stdout + run.stderr)[-1500:]}


def _qkv(seq: int, heads: int, kv_heads: int, dim: int, dtype):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, seq, heads, dim), dtype)
    k = jax.random.normal(keys[1], (1, seq, kv_heads, dim), dtype)
    v = jax.random.normal(keys[2], (1, seq, kv_heads, dim), dtype)
    return q, k, v, jax.random.normal(keys[3], (1, seq, heads, dim), dtype)


def _fwd_bwd(attend):
    def loss(q, k, v, ct):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * ct.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))


def attention_flops(seq: int, heads: int, dim: int, batch: int = 1) -> float:
    """Causal forward + backward FLOPs (the visible half; backward 2.5 times forward)."""
    return 3.5 * 2 * 2 * batch * seq * seq * heads * dim / 2


def attention_rows(args) -> dict:
    rows = []
    heads, kv_heads, dim = args.heads, args.kv_heads, args.head_dim
    impls = {
        "ours": lambda q, k, v: el.attention(q, k, v, impl=args.impl),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"
        ),
        "xla": lambda q, k, v: el.attention(q, k, v, impl="xla"),
    }
    for seq in args.seqs:
        q, k, v, ct = _qkv(seq, heads, kv_heads, dim, args.dtype)
        row = {"seq": seq}
        for name, fn in impls.items():
            try:
                seconds = best_seconds(_fwd_bwd(fn), q, k, v, ct, repeats=args.repeats)
                row[f"{name}_ms"] = round(seconds * 1e3, 3)
                row[f"{name}_tflops"] = round(attention_flops(seq, heads, dim) / seconds / 1e12, 2)
            except Exception as error:
                row[f"{name}_error"] = f"{type(error).__name__}: {str(error)[:200]}"
        if "ours_ms" in row and "cudnn_ms" in row:
            row["ours_vs_cudnn"] = round(row["cudnn_ms"] / row["ours_ms"], 3)
        rows.append(row)
        print("  attention", row, flush=True)
    return {"rows": rows, "heads": heads, "kv_heads": kv_heads, "head_dim": dim}


def ring_rows(args) -> dict:
    from eqx_longctx.attention import merge_partials, resolve_block_impl
    from eqx_longctx.attention._block import BlockOptions, block_attention

    seq, pieces = args.ring_seq, args.ring_pieces
    heads, kv_heads, dim = args.heads, args.kv_heads, args.head_dim
    impl = resolve_block_impl(args.impl, platform=jax.devices()[0].platform, lowering=False)
    options = BlockOptions.make(True, None, None, dim)
    q, k, v, ct = _qkv(seq, heads, kv_heads, dim, args.dtype)
    c = seq // (2 * pieces)  # zig-zag: device r holds chunks r and 2P - 1 - r
    own = [np.concatenate([np.arange(r * c, (r + 1) * c),
                           np.arange((2 * pieces - 1 - r) * c, (2 * pieces - r) * c)])
           for r in range(pieces)]  # fmt: skip
    visible = sum(int((own[r][:, None] >= own[j][None, :]).any()) for r in range(pieces)
                  for j in range(pieces))  # fmt: skip

    def ring(q, k, v):
        outs = []
        for r in range(pieces):
            qr, pr = q[:, own[r]], jnp.asarray(own[r])[None]
            out = jnp.zeros((*qr.shape[:-1], v.shape[-1]), jnp.float32)
            lse = jnp.full(qr.shape[:-1], -jnp.inf, jnp.float32)
            for j in range(pieces):
                if not (own[r][:, None] >= own[j][None, :]).any():
                    continue  # a hop no query sees: skipped, as the ring skips it
                pj = jnp.asarray(own[j])[None]
                o, l_ = block_attention(impl, qr, k[:, own[j]], v[:, own[j]], pr, pj, None,
                                        None, options)  # fmt: skip
                out, lse = merge_partials(out, lse, o, l_)
            outs.append(out.astype(q.dtype))
        return jnp.concatenate(outs, axis=1)

    seconds = best_seconds(_fwd_bwd(ring), q, k, v, ct[:, np.concatenate(own)], repeats=1)
    flops = attention_flops(seq, heads, dim)
    return {"seq": seq, "pieces": pieces, "hops_run": visible, "hops": pieces * pieces,
            "ms_all_devices": round(seconds * 1e3, 2),
            "ms_per_device": round(seconds * 1e3 / pieces, 2),
            "tflops": round(flops / seconds / 1e12, 2)}  # fmt: skip


def _llama_config(args, seq: int, param_dtype: str):
    import dataclasses

    from models import LLAMA

    base = LLAMA.presets["tiny" if args.smoke else "llama3.2-1b"]
    return dataclasses.replace(base, max_seq_len=seq + 64, param_dtype=param_dtype,
                               compute_dtype="bfloat16", remat=args.remat)  # fmt: skip


def _train_flops(model, config, seq: int) -> float:
    """Forward + backward FLOPs of one row: 6 x parameters x tokens (the embedding counts
    once, as the tied head; an untied input embedding is a lookup) and the causal half of
    attention's scores and values, `6 * s^2 * heads * head_dim` per layer."""
    import equinox as eqx

    params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    if not config.tie_embeddings:
        params -= config.vocab_size * config.dim
    head_dim = config.head_dim or config.dim // config.n_heads
    return 6 * params * seq + 6 * seq * seq * config.n_heads * head_dim * config.n_layers


def _train_step(opt, y, mask):
    """A jitted step: chunked cross-entropy, its gradient, one AdamW update (donated)."""
    import equinox as eqx

    from eqx_longctx.nn import chunked_cross_entropy

    @eqx.filter_jit(donate="all-except-first")
    def step(x, model, state):
        def loss(m):
            total, count = chunked_cross_entropy(m.hidden_states(x), m.head_weight(), y, mask)
            return total / count

        value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return value, eqx.apply_updates(model, updates), state

    return step


def train_rows(args) -> dict:
    import equinox as eqx
    import optax

    from models import LLAMA

    rows = []
    for seq in args.train_seqs:
        config = _llama_config(args, seq, "float32")
        model = LLAMA.model(config, key=jax.random.key(0))
        opt = optax.adamw(1e-4)
        state = opt.init(eqx.filter(model, eqx.is_array))
        tokens = jax.random.randint(jax.random.key(1), (1, seq + 1), 0, config.vocab_size)
        x, y, mask = tokens[:, :-1], tokens[:, 1:], jnp.ones((1, seq), jnp.float32)
        step = _train_step(opt, y, mask)
        value, model, state = step(x, model, state)  # compiles
        jax.block_until_ready(value)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            value, model, state = step(x, model, state)
            jax.block_until_ready(value)
            times.append(time.perf_counter() - t0)
        seconds = min(times)
        flops = _train_flops(model, config, seq)
        peak = peak_flops()
        rows.append({"seq": seq, "ms": round(seconds * 1e3, 1),
                     "tokens_per_s": round(seq / seconds),
                     "tflops": round(flops / seconds / 1e12, 1),
                     "mfu": None if peak is None else round(flops / seconds / peak, 3),
                     "loss": float(value)})  # fmt: skip
        print("  train", rows[-1], flush=True)
        del model, state
    return {"rows": rows, "remat": args.remat}


def _gaps_ms(stamps: list[float]) -> float:
    return float(np.median(np.diff(stamps[1:]))) * 1e3  # the first gap holds a compile


def generate_rows(args) -> dict:
    from models import LLAMA

    rows = []
    for context in args.gen_contexts:
        config = _llama_config(args, context + args.new_tokens, "bfloat16")
        model = LLAMA.model(config, key=jax.random.key(0))
        prompt = np.random.default_rng(0).integers(0, config.vocab_size, (1, context))
        stamps: list[float] = []
        el.generate(model, prompt, max_new_tokens=args.new_tokens, impl=args.impl,
                    on_token=lambda t, tok, s=stamps: s.append(time.perf_counter()))  # fmt: skip
        row = {"context": context, "ours_ms_per_token": round(_gaps_ms(stamps), 3)}
        del model
        try:
            row["transformers_ms_per_token"] = round(_hf_ms_per_token(config, prompt, args), 3)
        except Exception as error:
            row["transformers_error"] = f"{type(error).__name__}: {str(error)[:300]}"
        rows.append(row)
        print("  generate", row, flush=True)
    return {"rows": rows, "new_tokens": args.new_tokens}


def _hf_ms_per_token(config, prompt, args) -> float:
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    head_dim = config.head_dim or config.dim // config.n_heads
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.hidden_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads, head_dim=head_dim, rope_theta=config.rope_theta,
        max_position_embeddings=config.max_seq_len, tie_word_embeddings=config.tie_embeddings,
    )  # fmt: skip
    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_config).to(torch.bfloat16).eval()
    stamps: list[float] = []

    class Stamps(transformers.generation.streamers.BaseStreamer):
        def put(self, value):
            if device == "cuda":
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())

        def end(self):
            pass

    ids = torch.tensor(prompt, device=device)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                       do_sample=False, streamer=Stamps(), pad_token_id=0)  # fmt: skip
    return _gaps_ms(stamps[1:])  # the first put is the prompt


# ---------------------------------------------------------------------------- the plot


def plot(report: Report, out: Path) -> None:
    from matplotlib.figure import Figure

    sections = report.data["sections"]
    fig = Figure(figsize=(11, 4))
    ax1, ax2 = fig.subplots(1, 2)
    rows = sections.get("attention", {}).get("rows", [])
    for name in ("ours", "cudnn", "xla"):
        pts = [(r["seq"], r[f"{name}_tflops"]) for r in rows if f"{name}_tflops" in r]
        if pts:
            ax1.plot(*zip(*pts, strict=True), marker="o", label=name)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("sequence length (tokens)")
    ax1.set_ylabel("TFLOP/s, causal fwd + bwd")
    ax1.set_title(f"attention, {report.data['device']}")
    ax1.legend()
    train = sections.get("train", {}).get("rows", [])
    if train:
        ax2.bar([str(r["seq"]) for r in train], [100 * (r["mfu"] or 0) for r in train])
        ax2.set_xlabel("train step, tokens per row")
        ax2.set_ylabel("MFU (% of bf16 peak)")
        ax2.set_title("Llama 3.2 1B shape, one GPU")
    fig.tight_layout()
    fig.savefig(out / "gpu_bench.png", dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_bench")))
    p.add_argument("--smoke", action="store_true", help="every section tiny (any host)")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run")
    p.add_argument("--sections", default="selftest,attention,ring,train,generate")
    p.add_argument("--impl", default="pallas_gpu")
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--ring-seq", type=int, default=131072)
    p.add_argument("--ring-pieces", type=int, default=8)
    p.add_argument("--train-seqs", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--remat", default="none")
    p.add_argument("--gen-contexts", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--selftest-timeout", type=float, default=150.0)
    args = p.parse_args(argv)
    args.dtype = jnp.bfloat16
    if args.smoke:
        args.seqs, args.heads, args.kv_heads, args.head_dim = [256], 4, 2, 32
        args.ring_seq, args.ring_pieces = 512, 4
        args.train_seqs, args.gen_contexts, args.new_tokens, args.repeats = [128], [64], 4, 1
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out, args.budget)
    jobs = {"selftest": selftest, "attention": attention_rows, "ring": ring_rows,
            "train": train_rows, "generate": generate_rows}  # fmt: skip
    for name in args.sections.split(","):
        report.section(name, jobs[name], args)
    plot(report, args.out)
    print(f"wrote {report.path} and {args.out / 'gpu_bench.png'} in "
          f"{math.ceil(time.time() - report.start)} s")  # fmt: skip


if __name__ == "__main__":
    main()
