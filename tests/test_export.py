"""`python -m eqx_longctx.export`: a run's newest checkpoint as a Hugging Face directory
that transformers loads with the same logits (both families, fine-tuned from `--init-hf`
and fresh), and the README's fine-tuning recipe run end to end at a small size."""

import importlib.util
import json
import shlex

import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="--init-hf tokenizes with tokenizers (extra: hf)")
import hf_helpers  # noqa: E402
from helpers import ROOT  # noqa: E402
from hf_helpers import forward  # noqa: E402
from test_doc_blocks import cli_commands, fenced_blocks  # noqa: E402
from test_init_hf import (  # noqa: E402
    CONTEXT,
    VOCAB,
    assert_close,
    checkpoints,  # noqa: F401 (a fixture)
    corpus,  # noqa: F401 (a fixture)
    train_config,
)

from eqx_longctx.train import Trainer, export_run  # noqa: E402
from eqx_longctx.train._cli import main as train_main  # noqa: E402
from eqx_longctx.train._export import main as export_main  # noqa: E402


def transformers_logits(path, tokens):
    _, transformers = hf_helpers.hf_modules()
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    return hf_helpers.hf_logits(model, tokens), model


def checkpoint_now(trainer):
    """Save the trainer's state as a checkpoint of step 0 (no step compiled or taken)."""
    trainer.checkpointer.save(0, trainer.model, trainer.opt_state, trainer._meta(0.0))
    trainer.checkpointer.wait()
    return trainer.model


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_export_after_init_hf(checkpoints, corpus, tmp_path, family):  # noqa: F811
    """The Llama after two steps of training (test_init_hf's settings: its compiled step
    is reused), the DeepSeek as loaded (a checkpoint of step 0: no MoE step to compile)."""
    path, _ = checkpoints[family]
    trainer = Trainer(train_config(family, path, corpus, tmp_path / "run"))
    try:
        if family == "llama":
            trainer.run(stop_at=2)  # checkpoints step 2
            model = trainer.model
        else:
            model = checkpoint_now(trainer)
    finally:
        trainer.close()
    out = tmp_path / "hf"
    assert export_run(tmp_path / "run", out) == (2 if family == "llama" else 0)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)
    tokens = np.random.default_rng(2).integers(0, VOCAB, (2, CONTEXT)).astype(np.int32)
    logits, _ = transformers_logits(out, tokens)
    assert_close(forward(model, tokens), logits)


def test_export_keeps_stop_tokens_and_chat_files(checkpoints, corpus, tmp_path):  # noqa: F811
    """A source with several stop tokens and no pad id (as Llama 3 instruct checkpoints),
    a chat template and a generation config: the export writes them back as they were."""
    import shutil

    source = tmp_path / "source"
    shutil.copytree(checkpoints["llama"][0], source)
    config = json.loads((source / "config.json").read_text())
    config.update(eos_token_id=[2, 3], pad_token_id=None)
    (source / "config.json").write_text(json.dumps(config))
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (source / "chat_template.jinja").write_text(template)
    generation = {"eos_token_id": [2, 3], "temperature": 0.6, "do_sample": True}
    (source / "generation_config.json").write_text(json.dumps(generation))
    trainer = Trainer(train_config("llama", source, corpus, tmp_path / "run"))
    try:
        checkpoint_now(trainer)
    finally:
        trainer.close()
    out = tmp_path / "hf"
    export_run(tmp_path / "run", out)
    written = json.loads((out / "config.json").read_text())
    assert written["eos_token_id"] == [2, 3] and "pad_token_id" not in written
    assert (out / "chat_template.jinja").read_text() == template
    assert json.loads((out / "generation_config.json").read_text()) == generation
    _, transformers = hf_helpers.hf_modules()
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == [2, 3]


def test_export_of_a_fresh_run_and_errors(tmp_path, corpus, capsys):  # noqa: F811
    """A fresh (byte-tokenized) run exports too, without tokenizer files; bad flags and
    runs without checkpoints are one line."""
    from eqx_longctx.train import TrainConfig

    config = TrainConfig(
        model="llama", preset="tiny", model_overrides={"n_layers": 1, "dim": 32, "n_heads": 2,
        "n_kv_heads": 1, "hidden_dim": 48}, data=corpus, run_dir=tmp_path / "run", seq_len=32,
        batch_size=2, steps=1, warmup_steps=0, devices=1, progress=False,
    )  # fmt: skip
    trainer = Trainer(config)
    try:
        model = checkpoint_now(trainer)
    finally:
        trainer.close()
    assert export_main(["--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert names == ["config.json", "model.safetensors"]
    tokens = np.random.default_rng(3).integers(0, 259, (1, 32)).astype(np.int32)
    assert_close(forward(model, tokens), transformers_logits(tmp_path / "hf", tokens)[0])
    capsys.readouterr()
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "tokenizer.json").write_text("{}")  # another model's: AutoTokenizer would load it
    for flags, match in [
        (["--run-dir", str(tmp_path / "run"), "--out", str(stale)],
         "already holds tokenizer.json, which this export would not replace"),
        (["--run-dir", str(tmp_path / "none"), "--out", str(tmp_path / "x")], "does not exist"),
        (["--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "y"), "--step", "7"],
         "--step must be a saved step"),
        (["--out", str(tmp_path / "z")], "the following arguments are required: --run-dir"),
    ]:  # fmt: skip
        assert export_main(flags) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("eqx-longctx-export: error: "), lines
        assert match in lines[0]
    assert sorted(p.name for p in stale.iterdir()) == ["tokenizer.json"]  # nothing written


def recipe() -> tuple[list[str], list[str]]:
    """The train and export flags of the README's fine-tuning recipe."""
    (block,) = [
        b for b in fenced_blocks(ROOT / "README.md") if "--init-hf" in b.code and b.lang == "bash"
    ]
    ((_, *train),) = [c for c in cli_commands(block) if c[0] == "eqx_longctx.train"]
    line = next(x for x in block.code.splitlines() if "eqx_longctx.export" in x)
    export = shlex.split(line.split("eqx_longctx.export", 1)[1].split("#")[0])
    return train, export


def test_readme_recipe(tmp_path, corpus):  # noqa: F811
    """The README's commands with their flags, at a smaller size: fewer steps, a small
    corpus, a smaller context; the loss falls and transformers reads the export."""
    spec = importlib.util.spec_from_file_location("tiny", ROOT / "examples" / "tiny_hf_llama.py")
    tiny = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(tiny)
    from eqx_longctx.data import load_corpus

    train, export = recipe()
    flags = dict(zip(train[::2], train[1::2], strict=True))
    source, run_dir, out = tmp_path / "tiny", tmp_path / "run", tmp_path / "exported"
    tiny.write_tiny_llama(source, load_corpus(corpus), context=16)
    assert int(flags["--seq-len"]) == 4 * 64  # the README's context: 4x the checkpoint's
    flags.update({"--init-hf": str(source), "--run-dir": str(run_dir), "--seq-len": "64",
                  "--steps": "8", "--batch-size": "4", "--eval-every": "8", "--eval-batches": "1",
                  "--lr": "3e-3"})  # fmt: skip
    argv = [x for kv in flags.items() for x in kv] + ["--data", str(corpus), "--no-progress"]
    assert train_main(argv) == 0
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["split"] == "train"]
    assert losses[-1] < losses[0] - 0.5, losses
    assert export == ["--run-dir", "runs/finetune", "--out", "/tmp/tiny-llama-256"]
    assert export_main(["--run-dir", str(run_dir), "--out", str(out)]) == 0
    tokens = np.random.default_rng(4).integers(0, 512, (1, 64)).astype(np.int32)
    logits, model = transformers_logits(out, tokens)
    rope = getattr(model.config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(model.config, "rope_theta", None))
    assert model.config.max_position_embeddings == 64 and theta == 40000
    from models import llama

    assert_close(forward(llama.from_hf(out), tokens), logits)
