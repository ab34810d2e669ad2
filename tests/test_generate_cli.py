"""`python -m eqx_longctx.generate`: a continuation from a training run and from a Hugging
Face checkpoint, printed as it is generated, equal to `eqx_longctx.generate` in-process on
a model restored by another path; every bad flag one line on stderr, exit status 2."""

import ast
import dataclasses
import importlib
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import CHILD_XLA_FLAGS, ROOT

import eqx_longctx
from eqx_longctx.data import ByteTokenizer
from eqx_longctx.inference._cli import main
from eqx_longctx.run import placement_from_flags
from eqx_longctx.train._checkpoint import Checkpointer
from eqx_longctx.train._config import TrainConfig, build_model_config
from eqx_longctx.train._step import make_optimizer

SMALL = {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "hidden_dim": 64}
NEW = 12


def _run(module: str, *flags: str, cwd=None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(
        PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", MPLBACKEND="Agg", XLA_FLAGS=CHILD_XLA_FLAGS
    )
    return subprocess.run(
        [sys.executable, "-m", module, *flags],
        env=env,
        cwd=cwd or ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A two-step training run of a tiny Llama on one device."""
    path = tmp_path_factory.mktemp("gen") / "run"
    overrides = [f"--override={k}={v}" for k, v in SMALL.items()]
    result = _run(
        "eqx_longctx.train", *overrides, "--seq-len", "32", "--batch-size", "2", "--steps",
        "2", "--warmup-steps", "1", "--max-bytes", "20000", "--eval-batches", "1",
        "--final-eval-batches", "1", "--devices", "1", "--run-dir", str(path), "--no-progress",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return path


def _restored(run_dir):
    """The run's newest model, restored as the trainer resumes it (with the optimizer
    state), not through the CLI's read-only reader."""
    flags = json.loads((run_dir / "flags.json").read_text())
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    config = TrainConfig(**{k: v for k, v in flags.items() if k in names}, run_dir=str(run_dir))
    model_config = build_model_config(config, ByteTokenizer.vocab_size)
    placement = placement_from_flags(1)
    family = eqx_longctx.model_family(config.model)
    model = placement.abstract_model(
        lambda spec: family.model(model_config, key=jax.random.key(0), spec=spec)
    )
    optimizer = make_optimizer(
        config.lr, config.warmup_steps, config.steps, config.weight_decay, config.clip_norm
    )
    checkpointer = Checkpointer(run_dir / "checkpoints")
    try:
        model, _, _ = checkpointer.restore(model, placement.abstract_opt_state(optimizer, model))
    finally:
        checkpointer.close()
    return model


def test_run_dir_continuation_equals_generate(run_dir):
    prompt = "def main():"
    result = _run("eqx_longctx.generate", "--run-dir", str(run_dir), "--prompt", prompt,
                  "--max-new-tokens", str(NEW))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    tok = ByteTokenizer()
    ids = tok.encode(prompt, bos=True)[None]
    model = _restored(run_dir)
    tokens = np.asarray(eqx_longctx.generate(model, ids, max_new_tokens=NEW))[0]
    if tok.eos_id in tokens:
        tokens = tokens[: list(tokens).index(tok.eos_id)]
    assert result.stdout == tok.decode(tokens) + "\n"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random Llama written as a Hugging Face checkpoint (no tokenizer.json)."""
    pytest.importorskip("safetensors")
    from models.llama import Llama, LlamaConfig, to_hf

    config = LlamaConfig.from_preset("tiny", vocab_size=97, max_seq_len=128, **SMALL)
    path = tmp_path_factory.mktemp("hf") / "llama"
    to_hf(Llama(config, key=jax.random.key(3)), path)
    return path


def _hf_expected(path, prompt: list[int]) -> str:
    from models.llama import from_hf

    eos = json.loads((path / "config.json").read_text()).get("eos_token_id")
    tokens = list(np.asarray(eqx_longctx.generate(from_hf(path), np.asarray([prompt]),
                                                  max_new_tokens=NEW, eos_id=eos))[0])  # fmt: skip
    if eos in tokens:
        tokens = tokens[: tokens.index(eos)]
    return " ".join(map(str, tokens)) + "\n"


def test_hf_prompt_ids_print_the_generated_ids(hf_dir):
    result = _run("eqx_longctx.generate", "--hf", str(hf_dir), "--prompt-ids", "5,17,3,60,2",
                  "--max-new-tokens", str(NEW))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == _hf_expected(hf_dir, [5, 17, 3, 60, 2])


def test_hf_tokenizer_json_encodes_the_prompt_and_decodes_the_stream(hf_dir, tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    path = tmp_path / "with_tokenizer"
    shutil.copytree(hf_dir, path)
    vocab = {f"w{i}": i for i in range(97)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    assert main(["--hf", str(path), "--prompt", "w5 w17 w3 w60 w2", "--max-new-tokens",
                 str(NEW)]) == 0  # fmt: skip
    ids = _hf_expected(hf_dir, [5, 17, 3, 60, 2]).split()
    assert capsys.readouterr().out == " ".join(f"w{i}" for i in ids) + "\n"


def test_hf_under_ring_on_eight_devices_gives_the_same_tokens(hf_dir):
    result = _run("eqx_longctx.generate", "--hf", str(hf_dir), "--prompt-ids", "5,17,3,60,2",
                  "--max-new-tokens", str(NEW), "--devices", "8", "--strategy", "ring")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == _hf_expected(hf_dir, [5, 17, 3, 60, 2])


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--run-dir", "r", "--hf", "h", "--prompt", "x"], "not allowed with"),
        (["--prompt", "x"], "without --run-dir or --hf"),
        (["--run-dir", "r"], "one of the arguments --prompt --prompt-ids is required"),
        (["--run-dir", "r", "--prompt", "x", "--prompt-ids", "1"], "not allowed with"),
        (["--run-dir", "r", "--prompt-ids", "1,x"], "--prompt-ids takes token ids"),
        (["--run-dir", "r", "--prompt-ids", "1,-2"], "--prompt-ids takes token ids"),
        (["--run-dir", "r", "--prompt", "x", "--temperature", "-1"], "--temperature must be"),
        (["--run-dir", "r", "--prompt", "x", "--top-p", "1.5"], r"--top-p must lie in \(0, 1\]"),
        (["--run-dir", "r", "--prompt", "x", "--top-p", "0"], "--top-p must be > 0"),
        (["--run-dir", "r", "--prompt", "x", "--top-k", "0"], "--top-k must be"),
        (["--run-dir", "r", "--prompt", "x", "--seed", str(2**64)], "--seed must be below"),
        (["--run-dir", "r", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["--run-dir", "r", "--prompt", "x", "--max-len", "0"], "--max-len"),
        (["--run-dir", "r", "--prompt", "x", "--devices", "2", "--mesh", "context=4"], "--mesh"),
        (["--run-dir", "r", "--prompt", "x", "--strategy", "spiral"], "--strategy"),
        (["--run-dir", "missing", "--prompt", "x"], "does not exist"),
        (["--run-dir", "EMPTY", "--prompt", "x"], "holds no checkpoint"),
    ],
)
def test_bad_flags_are_one_line_exit_2(flags, says, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no runs/ here
    (tmp_path / "EMPTY" / "checkpoints").mkdir(parents=True)
    assert main(flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("eqx-longctx-generate: error: "), err
    assert re.search(says, err), err


def test_hf_without_tokenizer_refuses_a_text_prompt(hf_dir, capsys):
    assert main(["--hf", str(hf_dir), "--prompt", "hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--prompt needs a tokenizer" in err, err
    assert main(["--hf", str(hf_dir), "--prompt-ids", "5,97"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "below the model's vocab_size=97" in err, err


def test_max_len_sizes_the_cache_and_the_binding_limit_is_named(hf_dir, capsys):
    """`--max-len` is `generate`'s `max_len`; too short a cache, or a model whose
    `max_seq_len` (128) binds, is one line that names the limit."""
    ids = ["--hf", str(hf_dir), "--prompt-ids", "5,17,3,60,2"]
    assert main([*ids, "--max-new-tokens", "4", "--max-len", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "must fit max_len=8, the cache's length" in err, err
    assert "at least 9" in err
    assert main([*ids, "--max-new-tokens", "200"]) == 2
    err = capsys.readouterr().err.strip()
    assert "the model's max_seq_len=128" in err and "Generate at most 123" in err, err
    assert main([*ids, "--max-new-tokens", "4", "--max-len", "9"]) == 0
    capsys.readouterr()


def test_generate_is_the_function_and_the_module_runs():
    assert eqx_longctx.generate is eqx_longctx.inference.generate
    assert callable(eqx_longctx.generate) and not isinstance(eqx_longctx.generate, type(os))
    result = _run("eqx_longctx.generate", "--help", timeout=120)
    assert result.returncode == 0 and "--prompt-ids" in result.stdout, result.stderr[-2000:]


def test_importing_the_generate_module_keeps_the_function():
    """What a docs tool or `resolve_dotted("eqx_longctx.generate")` does in-process."""
    module = importlib.import_module("eqx_longctx.generate")
    assert module is not eqx_longctx.inference.generate
    assert eqx_longctx.generate is eqx_longctx.inference.generate
    from eqx_longctx import generate

    assert generate is eqx_longctx.inference.generate


def test_nothing_imports_the_generate_module():
    """Importing `eqx_longctx.generate` as a module would replace the function attribute."""
    offenders = []
    for path in sorted(ROOT.glob("**/*.py")):
        if ".venv" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]  # `from eqx_longctx import generate`: the function
            else:
                continue
            offenders += [f"{path}:{node.lineno}" for n in names if n == "eqx_longctx.generate"]
    assert offenders == []
