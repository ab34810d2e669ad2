"""Generation: ours against transformers' `generate`, the decode step on 8 devices, and the
MLA cache, side by side in one run.

Sections (all by default, pick with `--sections`):

- `a`: one device (a child process on one CPU device when `b` runs too), time to first
  token and time per new token of `eqx_longctx.generate`
  against transformers' `generate` (sdpa attention, its default dynamic cache, float32,
  `torch.no_grad`, torch threads = the machine's cores) on the same tiny random Llama
  (built in transformers, saved with `save_pretrained`, loaded with `models.llama.from_hf`,
  so the weights are identical), greedy. A warm-up run of each comes first, so the timed
  runs exclude compilation; ours' compile time (warm-up minus a timed run) is printed
  apart. The first token is the time until the caller receives it (our `on_token`,
  transformers' streamer); a token's time is the gap between consecutive tokens, the
  median over the steady steps of all repeats (ours and transformers' alternate, so both
  see the same load). The greedy tokens of the two must agree on the first `--check`
  tokens. The fastest single token of each is printed too: on a shared machine the
  medians carry the other processes' load (torch's threads suffer most from it). Target
  (issue 18): ours at most 0.5x transformers' time per token at 8K and 32K.
- `b`: the decode step of a small Llama under a (context 8) spec, ring, compiled from
  abstract arrays at 16K-128K tokens of cache: per-device argument, donated (cache) and
  temporary bytes from the compiled memory analysis against cache / 8, and the collectives
  of the compiled step (count and bytes received per device): only the `(out, lse)`
  partials and the logits move, whatever the cache length.
- `c`: DeepSeek-V3 shapes, from an abstract `init_cache` of the V3 preset: cached values
  per token per layer (the MLA latent and the shared RoPE key) against per-head K/V.

    python benchmarks/generate.py
    python benchmarks/generate.py --sections a --prompts 8192 32768 --repeats 3
    python benchmarks/generate.py --plot docs/img/benchmarks   # also writes generate.png
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqx_longctx as el
from eqx_longctx._hlo import collectives
from eqx_longctx.inference import lower_decode
from models.deepseek import DeepSeek, DeepSeekConfig
from models.llama import Llama, LlamaConfig, from_hf

MIB = 2**20


def _hf_model(args, max_len: int):
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=4 * args.dim,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=max_len,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,  # never stop early
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _ours_run(model, prompt, new: int) -> dict:
    stamps = []
    t0 = time.perf_counter()
    tokens = el.generate(model, prompt, max_new_tokens=new,
                         on_token=lambda step, tok: stamps.append(time.perf_counter()))  # fmt: skip
    total = time.perf_counter() - t0
    # The last token is only sampled (no decode after it): its gap is left out.
    return dict(tokens=np.asarray(tokens)[0], first=stamps[0] - t0,
                steps=list(np.diff(stamps[:-1])), total=total)  # fmt: skip


def _hf_run(hf, prompt, new: int) -> dict:
    import torch
    from transformers.generation.streamers import BaseStreamer

    stamps = []

    class Stamps(BaseStreamer):
        def put(self, value):
            stamps.append(time.perf_counter())

        def end(self):
            pass

    x = torch.as_tensor(prompt)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                          do_sample=False, streamer=Stamps())  # fmt: skip
    total = time.perf_counter() - t0
    # stamps[0] is the prompt itself; stamps[1] the first new token.
    return dict(tokens=out[0, prompt.shape[1]:].numpy(), first=stamps[1] - t0,
                steps=list(np.diff(stamps[1:])), total=total)  # fmt: skip


def _floor(model, args, seq: int) -> tuple[float, float]:
    """`(fixed, attention)`: our time per token after a 64-token prompt (everything but
    reading a long cache), and the bare attention of one new token over one layer's
    heads-major K/V of `seq` tokens (one product for the scores, softmax, one for the
    values; no masks, no merge, arrays handed over whole): what this machine's XLA can do
    at best, so `fixed + layers x attention` bounds our time per token from below."""
    short = np.zeros((1, 64), np.int32)
    _ours_run(model, short, args.new_tokens)  # warm-up (compiles this cache shape)
    fixed = float(np.median(_ours_run(model, short, args.new_tokens)["steps"]))
    kvh, hd = args.kv_heads, args.dim // args.heads
    k, v = (jax.random.normal(jax.random.key(i), (1, kvh, seq, hd)) for i in (1, 2))
    q = jax.random.normal(jax.random.key(3), (1, kvh, args.heads // kvh, hd))

    @jax.jit
    def bare(q, k, v):
        s = jnp.einsum("bkrd,bktd->bkrt", q, k)
        p = jnp.exp(s - s.max(-1, keepdims=True))
        return jnp.einsum("bkrt,bktv->bkrv", p, v) / p.sum(-1)[..., None]

    jax.block_until_ready(bare(q, k, v))
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        jax.block_until_ready(bare(q, k, v))
        times.append(time.perf_counter() - t0)
    return fixed, float(np.median(times))


def section_a(args) -> list[dict]:
    import torch

    torch.set_num_threads(args.torch_threads or os.cpu_count() or 1)
    max_len = max(args.prompts) + args.new_tokens
    hf = _hf_model(args, max_len)
    with tempfile.TemporaryDirectory() as path:
        hf.save_pretrained(path)
        model = from_hf(path)
    print(
        f"== a: one device, tiny random Llama (dim {args.dim}, {args.layers} layers, heads "
        f"{args.heads}/{args.kv_heads} kv, vocab {args.vocab}), float32, greedy, batch 1, "
        f"{args.new_tokens} new tokens, {args.repeats} timed runs each; torch "
        f"{torch.__version__} ({torch.get_num_threads()} threads, sdpa, dynamic cache), "
        f"jax {jax.__version__}; load average {os.getloadavg()[0]:.1f} at start"
    )
    rng = np.random.default_rng(0)
    rows = []
    for s in args.prompts:
        prompt = rng.integers(0, args.vocab, (1, s))
        before = el.inference.compile_counts()
        warm = _ours_run(model, prompt, args.new_tokens)
        after = el.inference.compile_counts()
        _hf_run(hf, prompt, args.new_tokens)  # warm-up
        ours, theirs = [], []
        for _ in range(args.repeats):  # alternate, so that both see the same load
            ours.append(_ours_run(model, prompt, args.new_tokens))
            theirs.append(_hf_run(hf, prompt, args.new_tokens))
        check = min(args.check, args.new_tokens)
        a, b = ours[0]["tokens"], theirs[0]["tokens"]
        if not np.array_equal(a[:check], b[:check]):
            raise SystemExit(f"greedy tokens differ at prompt {s}: ours {a[:check]}, "
                             f"transformers {b[:check]}")  # fmt: skip
        row = dict(
            seq=s,
            ours_first=float(np.median([r["first"] for r in ours])),
            hf_first=float(np.median([r["first"] for r in theirs])),
            ours_token=float(np.median(sum((r["steps"] for r in ours), []))),
            hf_token=float(np.median(sum((r["steps"] for r in theirs), []))),
            ours_best=float(np.min(sum((r["steps"] for r in ours), []))),
            hf_best=float(np.min(sum((r["steps"] for r in theirs), []))),
            compile=warm["total"] - float(np.median([r["total"] for r in ours])),
            traces={k: after[k] - before[k] for k in after},
            agree=int(np.cumprod(a == b).sum()),
        )
        fixed, attention = _floor(model, args, s)
        row["floor"] = fixed + args.layers * attention
        rows.append(row)
        print(f"  prompt {s}: done (load average {os.getloadavg()[0]:.1f})", flush=True)
    print(
        "| prompt | first token ours | first token transformers | ratio | per token ours | "
        "per token transformers | ratio | best token ours / transformers | ours' compile "
        "(prefill + decode traces) | greedy tokens equal | XLA floor per token (ratio) |"
    )
    print("|" + "---|" * 11)
    for r in rows:
        print(
            f"| {_k(r['seq'])} | {r['ours_first'] * 1e3:.0f} ms | {r['hf_first'] * 1e3:.0f} ms | "
            f"{r['ours_first'] / r['hf_first']:.2f}x | {r['ours_token'] * 1e3:.2f} ms | "
            f"{r['hf_token'] * 1e3:.2f} ms | **{r['ours_token'] / r['hf_token']:.2f}x** | "
            f"{r['ours_best'] * 1e3:.2f} / {r['hf_best'] * 1e3:.2f} ms = "
            f"{r['ours_best'] / r['hf_best']:.2f}x | "
            f"{r['compile']:.1f} s ({r['traces']['prefill']} + {r['traces']['decode']}) | "
            f"{r['agree']} of {args.new_tokens} | {r['floor'] * 1e3:.2f} ms "
            f"({r['floor'] / r['hf_token']:.2f}x) |"
        )
    print(
        "ratio = ours / transformers (lower is better; medians, and the fastest single token "
        f"of the {args.repeats} runs); target per token <= 0.5x at 8K, 32K; load average "
        f"{os.getloadavg()[0]:.1f} at the end. XLA floor = our decode step over a 64-token "
        f"cache + {args.layers} x the bare attention of one token over one layer's K/V "
        "(two products and a softmax on whole heads-major arrays): a lower bound on this "
        "machine's XLA\n"
    )
    return rows


def _is_array(x) -> bool:
    return isinstance(x, jax.Array | jax.ShapeDtypeStruct)


def _per_device(tree) -> int:
    """Bytes per device of abstract sharded arrays (their shard shapes)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += int(np.prod(shape)) * x.dtype.itemsize
    return total


def section_b(args) -> list[dict]:
    mesh = jax.make_mesh((8,), ("context",))
    spec = el.ShardingSpec(mesh, strategy="ring")
    config = LlamaConfig.from_preset(
        "tiny", vocab_size=1024, dim=256, n_layers=args.b_layers, n_heads=8, n_kv_heads=2,
        head_dim=32, hidden_dim=512, max_seq_len=max(args.cache_lens) + 1024,
    )  # fmt: skip
    model = el.init_sharded(lambda: Llama(config, key=jax.random.key(0), spec=spec))
    h, dv = config.n_heads, config.head_dim
    partials = 8 * h * (dv + 1) * 4  # one layer's all-gathered (out, lse), batch 1, float32
    print(
        f"== b: decode step under a (context 8) spec, ring, Llama dim 256, {args.b_layers} "
        f"layers, heads 8 / 2 kv, head_dim 32, batch 1, float32; compiled from abstract "
        f"arrays (nothing runs). Expected partials per layer: 8 x {h} heads x ({dv} + 1) x 4 B "
        f"= {partials} B all-gathered."
    )
    rows = []
    for length in args.cache_lens:
        cache = eqx.filter_eval_shape(el.init_cache, model, 1, length)
        cache_arrays = eqx.filter(cache, _is_array)
        # The program decode_step runs (the spec's impl), compiled for abstract arrays.
        compiled = lower_decode(model, batch=1, max_len=length).compile()
        mem = compiled.memory_analysis()
        found = collectives(compiled)
        kv = cache.stacks[0].entries
        one_layer = _per_device(kv) // config.n_layers
        rows.append(dict(
            cache=length, cache_dev=_per_device(cache_arrays), layer_dev=one_layer,
            arguments=mem.argument_size_in_bytes, aliased=mem.alias_size_in_bytes,
            temp=mem.temp_size_in_bytes, ops=found,
            moved=sum(c.bytes for c in found),
        ))  # fmt: skip
    print(
        "| cache tokens | cache / 8 (MiB) | donated (aliased) MiB | temporaries MiB | "
        "temporaries / (cache / 8) | temporaries / one layer's K+V slice | "
        "collectives per step (kind x count: result bytes) | bytes received per device |"
    )
    print("|" + "---|" * 8)
    for r in rows:
        ops = ", ".join(f"{c.op} x{c.count}: {c.result_bytes} B" for c in r["ops"])
        print(
            f"| {_k(r['cache'])} | {r['cache_dev'] / MIB:.2f} | {r['aliased'] / MIB:.2f} | "
            f"{r['temp'] / MIB:.2f} | {r['temp'] / r['cache_dev']:.2f} | "
            f"{r['temp'] / r['layer_dev']:.2f} | {ops} | {r['moved'] / 1024:.1f} KiB |"
        )
    print()
    return rows


def section_c(args) -> dict:
    config = DeepSeekConfig.from_preset("deepseek-v3")
    model = eqx.filter_eval_shape(DeepSeek, config, key=jax.random.key(0))
    cache = eqx.filter_eval_shape(el.init_cache, model, 1, 4096)
    latent = {e.shape[2] * e.shape[-1] for s in cache.stacks for e in s.entries}
    assert len(latent) == 1, latent
    (per_token,) = latent
    per_head = config.n_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim
                                 + config.v_head_dim)  # fmt: skip
    layers = config.n_layers
    print(
        f"== c: DeepSeek-V3 shapes ({layers} layers, {config.n_heads} heads, kv_lora_rank "
        f"{config.kv_lora_rank}, RoPE key {config.qk_rope_head_dim}), from an abstract "
        "init_cache of the preset"
    )
    print("| tokens | MLA latent + RoPE key (bf16) | per-head K/V (bf16) | per device on 8 "
          "(latent) |")  # fmt: skip
    print("|---|---|---|---|")
    for n in (131072, 1048576):
        lat, full = n * layers * per_token * 2, n * layers * per_head * 2
        print(f"| {_k(n)} | {lat / 2**30:.1f} GiB | {full / 2**30:.0f} GiB | "
              f"{lat / 8 / 2**30:.2f} GiB |")  # fmt: skip
    print(
        f"values per token per layer: {per_token} (cache entries) against {config.n_heads} x "
        f"({config.qk_nope_head_dim + config.qk_rope_head_dim} + {config.v_head_dim}) = "
        f"{per_head} per-head K/V: {per_head / per_token:.1f}x fewer\n"
    )
    return dict(latent=per_token, per_head=per_head, layers=layers)


def _section_a_alone(args) -> list[dict]:
    """Section a in a child process on one CPU device, as a user runs `generate` (section b
    needs 8 fake devices, and splitting the CPU into 8 devices slows a one-device program:
    9-10 ms per token at 32K here against 6.3-6.9 ms on one device)."""
    env = dict(os.environ)
    flags = env.pop("XLA_FLAGS", "")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", flags).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    with tempfile.TemporaryDirectory() as tmp:
        rows = os.path.join(tmp, "rows.json")
        argv = [sys.executable, __file__, "--sections", "a", "--rows-json", rows]
        for name in ("prompts", "new_tokens", "repeats", "check", "dim", "layers", "heads",
                     "kv_heads", "vocab", "torch_threads"):  # fmt: skip
            value = getattr(args, name)
            if value is not None:
                values = value if isinstance(value, list) else [value]
                argv += ["--" + name.replace("_", "-"), *map(str, values)]
        subprocess.run(argv, check=True, env=env)
        with open(rows) as f:
            return json.load(f)


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--sections", nargs="+", default=["a", "b", "c"], choices=["a", "b", "c"])
    p.add_argument("--prompts", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--check", type=int, default=4, help="greedy tokens that must agree")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--torch-threads", type=int, help="default: the machine's cores")
    p.add_argument("--cache-lens", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    p.add_argument("--b-layers", type=int, default=4)
    p.add_argument("--plot", metavar="DIR", help="also write DIR/generate.png")
    p.add_argument("--rows-json", help=argparse.SUPPRESS)  # section a's rows, for a parent
    args = p.parse_args(argv)
    results = {}
    if "a" in args.sections and "b" in args.sections:
        results["time"] = _section_a_alone(args)
    elif "a" in args.sections:
        results["time"] = section_a(args)
        if args.rows_json:
            with open(args.rows_json, "w") as f:
                json.dump(results["time"], f)
    if "b" in args.sections:
        jax.config.update("jax_num_cpu_devices", 8)
        results["decode"] = section_b(args)
    if "c" in args.sections:
        results["mla"] = section_c(args)
    if args.plot:
        import _plots

        _plots.generate(results, args.plot)


if __name__ == "__main__":
    main()
