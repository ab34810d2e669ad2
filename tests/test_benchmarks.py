"""The benchmark scripts run end to end at toy sizes, and `--plot DIR` writes their figures.

Timings are never asserted (the scripts print ratios); what is checked is that each script
still runs against the current API and that every PNG it promises is written and not blank.
"""

import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "benchmarks"))  # after site-packages: never shadows a package

import _plots  # noqa: E402

NEEDS = {
    "generate": ("torch", "transformers"),
    "linear_attention": ("torch", "transformers"),
}  # modules a script imports beyond the library
SCRIPTS = {  # script: (toy arguments, the PNGs its --plot must write)
    "attention_local": (["--seqs", "128", "256", "--repeats", "1"], ["attention_local"]),
    "context_parallel": (
        ["--sections", "b", "c", "--comm-seqs", "1024", "--balance-seq", "4096"],
        ["context_parallel_comm", "context_parallel_balance"],
    ),
    "generate": (
        "--prompts 64 --new-tokens 5 --repeats 1 --cache-lens 1024 2048 --b-layers 1".split(),
        ["generate"],
    ),
    "train_step": ("--configs main --steps 2 --warmup 1 --repeats 1".split(), ["train_step"]),
    # The same with the stand-in attention's second run of each configuration (~30 s more;
    # the full tier's, tests/full_tier.txt). The script is the name before "-".
    "train_step-free-attention": (
        "--configs main --free-attention --steps 2 --warmup 1 --repeats 1".split(),
        ["train_step"],
    ),
    "linear_attention": (
        "--quick --sections op cp".split(),
        ["linear_attention_op", "linear_attention_cp"],
    ),
    "passkey_probe": (
        "--seq 160 --batch 2 --steps 2 --every 1 --dim 32 --heads 2 --hidden 64 "
        "--drills 20".split(),
        ["passkey_probe"],
    ),
    "fsdp": (
        "--dim 32 --layers 1 --hidden 64 --heads 2 --vocab 128 --seq 32 --repeats 1 "
        "--fsdp 1 2".split(),
        ["fsdp"],
    ),
}


def _check_png(path: Path) -> None:
    image = matplotlib.image.imread(path)
    assert image.shape[0] >= 300 and image.shape[1] >= 500, (path, image.shape)
    assert float(image[..., :3].std()) > 0.02, f"{path} looks blank"


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_script_plots(script: str, tmp_path: Path) -> None:
    args, names = SCRIPTS[script]
    script = script.split("-")[0]
    for module in NEEDS.get(script, ()):
        pytest.importorskip(module)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{script}.py", *args, "--plot", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.stem for p in tmp_path.glob("*.png")) == sorted(names), proc.stdout
    for name in names:
        _check_png(tmp_path / f"{name}.png")


def test_cp_shard_attention_prints_its_table() -> None:
    # No figure: a table of four attentions. The script exits non-zero when ours, one call or the
    # plain masked softmax it times differs from `reference_attention` by over 1e-5.
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    args = "--seq 64 --batch 1 --devices 2 --heads 4 --kv-heads 2 --repeats 1".split()
    proc = subprocess.run(
        [sys.executable, "benchmarks/cp_shard_attention.py", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    rows = [line.split("|")[1].strip() for line in lines if line.startswith("| ")]
    assert rows == ["attention", "ours", "one call", "plain", "8 keys"], proc.stdout
    assert "causal pairs kept: " in proc.stdout, proc.stdout


def test_evals_prints_its_table() -> None:
    # No figure: the eval's prefill under each strategy against one device, here 1K tokens
    # through a one-layer tiny Llama (~15 s). The script exits non-zero when a strategy's
    # last-token logits differ from one device's.
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "benchmarks/evals.py", "--quick"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split("|")[2].strip() for line in proc.stdout.splitlines()
            if line.startswith("| 1K |")]  # fmt: skip
    assert rows == ["one device", "all_gather", "ulysses", "ring", "usp"], proc.stdout


def test_kernel_plot(tmp_path: Path) -> None:
    # The kernel timings exist only on a TPU; the figure is drawn from a table of that shape.
    rows = [
        dict(seq=s, ours_fwd=f, splash_fwd=0.9 * f, ratio_fwd=0.9, ours_fb=0.7 * f,
             splash_fb=0.6 * f, ratio_fb=0.86)
        for s, f in ((8192, 120.0), (16384, 150.0), (32768, 170.0))
    ]  # fmt: skip
    (path,) = _plots.kernels(rows, "TPU v5p: causal, bfloat16, heads 8", tmp_path)
    _check_png(path)


def test_no_script_shadows_an_installed_module():
    """A script runs with `benchmarks/` first on its path, so a script named like a module
    a dependency imports replaces it there (`kernels.py` did, once transformers 5.25 began
    importing the `kernels` package: every Hugging Face import in a benchmark failed)."""
    elsewhere = [p for p in sys.path if Path(p).resolve() != (ROOT / "benchmarks").resolve()]
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        spec = importlib.machinery.PathFinder.find_spec(script.stem, elsewhere)
        assert spec is None, f"benchmarks/{script.name} shadows {spec.origin}: rename it"


def test_linear_attention_hybrid_plot(tmp_path: Path) -> None:
    # The hybrid train step runs the trainer twice per length (minutes): its figure is drawn
    # from a table of that shape.
    rows = [
        dict(seq=s, name=name, tokens_per_s=t / s**0.5 if s < 65536 else None, memory=m * s)
        for s in (8192, 16384, 32768, 65536)  # the longest compiled for memory only
        for name, t, m in (("qwen3_next tiny", 9e4, 3e3), ("llama, same size", 6e4, 2e3))
    ]
    (path,) = _plots.linear_attention({"hybrid": rows}, tmp_path)
    _check_png(path)


def test_context_parallel_variants_sections(tmp_path: Path) -> None:
    # Issue 47's sections of context_parallel.py (`_variants_bench.py`), one layout and one
    # placement each (the zig-zag halo, sinks under the ring) so the run stays ~10 s.
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    args = (
        "--sections h v --halo-byte-seqs 512 --halo-seq 512 --halo-window 32 --halo-heads 2 "
        "--halo-time-heads 2 --halo-head-dim 8 --halo-repeats 1 --halo-layouts zigzag "
        "--variants-seq 128 --variants-heads 2 --variants-head-dim 8 --variants-repeats 1 "
        "--variants-on ring"
    ).split()
    proc = subprocess.run(
        [sys.executable, "benchmarks/context_parallel.py", *args, "--plot", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert ["512", "2/1", "zigzag", "f+b"] in [r[:4] for r in rows], proc.stdout
    assert ["2/1", "zigzag"] in [r[:2] for r in rows], proc.stdout  # the timed row
    variants = [" ".join(r[4:-2]) for r in rows if r[:4] == ["ring,", "zigzag,", "8", "dev."]]
    assert variants == ["plain", "sinks", "softcap", "sinks + softcap"], proc.stdout
    assert [p.name for p in tmp_path.glob("*.png")] == ["context_parallel_variants.png"]
    _check_png(tmp_path / "context_parallel_variants.png")


def test_gpu_bench_smoke_writes_its_json_and_png(tmp_path: Path) -> None:
    # The device benchmark's every section at toy sizes on this CPU (the GPU kernels
    # interpreted): each section ends without an error (cuDNN's column says it is absent),
    # the JSON holds the rows `docs/benchmarks.md` reads, and the PNG is drawn. `run.sh`
    # (the device call) parses as bash and runs this script.
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu/bench.py", "--smoke", "--out", str(tmp_path),
         "--sections", "attention,ring,train,generate"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    data = json.loads((tmp_path / "gpu_bench.json").read_text())
    sections = data["sections"]
    assert not [k for k, v in sections.items() if "error" in v], sections
    (row,) = sections["attention"]["rows"]
    assert row["ours_ms"] > 0 and row["xla_ms"] > 0 and "cudnn_error" in row
    assert sections["ring"]["hops_run"] == sections["ring"]["hops"] == 16
    assert sections["train"]["rows"][0]["tokens_per_s"] > 0
    gen = sections["generate"]["rows"][0]
    assert gen["ours_ms_per_token"] > 0 and gen["transformers_ms_per_token"] > 0
    _check_png(tmp_path / "gpu_bench.png")
    run_sh = ROOT / "benchmarks" / "gpu" / "run.sh"
    assert subprocess.run(["bash", "-n", str(run_sh)]).returncode == 0
    assert "benchmarks/gpu/bench.py" in run_sh.read_text()
