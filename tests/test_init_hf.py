"""Fine-tuning from a Hugging Face checkpoint (`--init-hf`): the trainer's model equals
transformers' at the start (one device, an fsdp x context mesh, a context mesh), the
checkpoint's tokenizer packs the data and its bits per byte count the text's bytes, resume
works as for a fresh run, and every bad input is one clear line.

The checkpoints are tiny float32 transformers models with a byte-level BPE tokenizer
trained here on the test corpus (ids 0, 1, 2: padding, BOS, EOS).
"""

import json
import math

import jax
import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="--init-hf tokenizes with tokenizers (extra: hf)")
import hf_helpers  # noqa: E402
from hf_helpers import forward, hf_logits, max_diff  # noqa: E402

import eqx_longctx as el  # noqa: E402
from eqx_longctx.data import HFTokenizer, load_corpus  # noqa: E402
from eqx_longctx.train import TrainConfig, Trainer, evaluate  # noqa: E402
from eqx_longctx.train._cli import main  # noqa: E402

RTOL = 1e-5  # float32, relative to the logits' scale
VOCAB, TOKENIZER_VOCAB, CONTEXT = 320, 300, 32
SPECIALS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
WORDS = (
    "the model reads long context and learns to predict the next token of every document "
    "café naïve über straße — 日本 ok"
).split()
# family -> (transformers config class, its fields)
CHECKPOINTS = {
    "llama": ("LlamaConfig", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        initializer_range=0.1, tie_word_embeddings=False, **SPECIALS,
    )),
    "deepseek": ("DeepseekV3Config", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=2, topk_group=1, max_position_embeddings=CONTEXT,
        initializer_range=0.1, **SPECIALS,
    )),
}  # fmt: skip


def write_corpus(folder, docs: int = 12, words: int = 60, seed: int = 0):
    """`docs` text files of random words (some multi-byte) in `folder`."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(docs):
        text = " ".join(rng.choice(WORDS, words)) + ".\n"
        (folder / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    return folder


def write_tokenizer(directory, texts, vocab_size: int = TOKENIZER_VOCAB):
    """A byte-level BPE `tokenizer.json` trained on `texts`, specials at ids 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(directory / "tokenizer.json"))


def write_checkpoint(directory, family: str, texts, seed: int = 0):
    """A random float32 transformers model of `family` and a tokenizer, saved to
    `directory`; **returns** the transformers model."""
    torch, transformers = hf_helpers.hf_modules()
    cls_name, fields = CHECKPOINTS[family]
    config = getattr(transformers, cls_name)(**fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = hf_helpers.randomize_biases_and_norms(model.eval())
    model.save_pretrained(directory)
    write_tokenizer(directory, texts)
    return model


_BUILT: dict = {}  # corpus and checkpoints, built once per process (test_export shares them)


def _built(tmp_path_factory):
    if not _BUILT:
        folder = write_corpus(tmp_path_factory.mktemp("corpus"))
        texts = load_corpus(folder)
        _BUILT["corpus"] = folder
        _BUILT["checkpoints"] = {
            family: (path, write_checkpoint(path, family, texts))
            for family in CHECKPOINTS
            for path in [tmp_path_factory.mktemp(family)]
        }
    return _BUILT


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return _built(tmp_path_factory)["corpus"]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """`{family: (directory, transformers model)}`."""
    return _built(tmp_path_factory)["checkpoints"]


def train_config(family, path, corpus, run_dir, **kwargs) -> TrainConfig:
    flags = dict(
        model=family, init_hf=path, data=corpus, run_dir=run_dir, seq_len=CONTEXT,
        batch_size=2, steps=4, lr=1e-3, warmup_steps=1, eval_every=2, eval_batches=2,
        checkpoint_every=2, devices=1, progress=False, max_bytes=None,
    )  # fmt: skip
    return TrainConfig(**{**flags, **kwargs})


def assert_close(logits, ref):
    assert max_diff(logits, ref) <= RTOL * float(np.max(np.abs(ref)))


# (family, mesh, strategy): one device, FSDP with context parallelism, context only.
PLACEMENTS = [
    ("llama", None, "ring"),
    ("llama", "fsdp=2,context=4", "ring"),
    ("llama", "context=8", "all_gather"),
    ("deepseek", None, "ring"),
    ("deepseek", "fsdp=2,context=4", "ring"),
]


@pytest.mark.parametrize("family,mesh,strategy", PLACEMENTS)
def test_init_logits_match_transformers(checkpoints, corpus, tmp_path, family, mesh, strategy):
    path, reference = checkpoints[family]
    devices = 1 if mesh is None else 8
    config = train_config(family, path, corpus, tmp_path, mesh=mesh, devices=devices,
                          strategy=strategy)  # fmt: skip
    trainer = Trainer(config)
    try:
        tokens = np.random.default_rng(1).integers(0, VOCAB, (2, CONTEXT)).astype(np.int32)
        spec = trainer.parallel.spec
        if spec is None:
            logits = forward(trainer.model, tokens)
        else:
            logits = el.from_layout(forward(trainer.model, el.to_layout(tokens, spec)), spec)
        assert_close(logits, hf_logits(reference, tokens))
        assert trainer.model_config.param_dtype == "float32"
        assert isinstance(trainer.tokenizer, HFTokenizer)
    finally:
        trainer.close()


def test_token_bytes_count_the_text(checkpoints, corpus):
    """Bits per byte by hand: every byte of every validation document is a target once,
    so over the whole split the counted bytes are the documents' UTF-8 bytes and bpb is the
    summed loss in bits over them."""
    path, _ = checkpoints["llama"]
    tokenizer = HFTokenizer.from_checkpoint(path)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (1, 2, 0)
    assert tokenizer.token_bytes[:3].tolist() == [0, 0, 0]
    for doc in load_corpus(corpus):
        ids = tokenizer.encode(doc)
        assert tokenizer.token_bytes[ids].sum() == len(doc.encode("utf-8"))

    from models import llama

    model = llama.from_hf(path)
    train, val = el.data.load_datasets(corpus, seq_len=CONTEXT, tokenizer=tokenizer)
    del train
    docs = load_corpus(corpus)
    train_docs, val_docs = el.data.split_documents(docs)
    del train_docs
    scores = evaluate(model, val, 2, tokenizer=tokenizer)
    assert scores["bytes"] == sum(len(d.encode("utf-8")) for d in val_docs)
    total_bits = scores["loss"] * scores["tokens"] / math.log(2)
    assert scores["bpb"] == pytest.approx(total_bits / scores["bytes"], rel=1e-6)
    assert scores["bpb"] < scores["bits_per_token"]  # tokens hold more than one byte


def test_resume_after_init_hf(checkpoints, corpus, tmp_path):
    """An --init-hf run stopped after step 2 and resumed (without --init-hf) ends with the
    weights of the same run uninterrupted; flags.json records the source; metrics report
    bits per byte."""
    path, _ = checkpoints["llama"]
    whole = Trainer(train_config("llama", path, corpus, tmp_path / "whole"))
    try:
        result = whole.run()
    finally:
        whole.close()
    flags = json.loads((tmp_path / "whole" / "flags.json").read_text())
    assert flags["init_hf"] == str(path.resolve())
    copy = tmp_path / "whole" / "init_hf"
    assert sorted(p.name for p in copy.iterdir()) == [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
    ]
    records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").open()]
    assert all(r["bpb"] > 0 for r in records if "loss" in r)

    split = train_config("llama", path, corpus, tmp_path / "split")
    first = Trainer(split)
    try:
        first.run(stop_at=2)
    finally:
        first.close()
    resumed = Trainer(train_config("llama", None, corpus, tmp_path / "split", resume=True))
    try:
        assert resumed.step == 2
        again = resumed.run()
    finally:
        resumed.close()
    assert again.step == 4
    for a, b in zip(jax.tree.leaves(result.model), jax.tree.leaves(again.model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = checkpoints["deepseek"][0]
    with pytest.raises(ValueError, match=r"--resume must continue .*--init-hf: recorded"):
        Trainer(train_config("llama", other, corpus, tmp_path / "split", resume=True))


def cli_error(capsys, *flags) -> str:
    """The one stderr line of a CLI run that must fail with status 2."""
    assert main([*flags, "--devices", "1", "--no-progress", "--steps", "2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("eqx-longctx-train: error: ")
    return lines[0]


def test_bad_inputs_are_one_line_errors(checkpoints, corpus, tmp_path, capsys):
    llama_dir, deepseek_dir = checkpoints["llama"][0], checkpoints["deepseek"][0]
    base = ["--data", str(corpus), "--seq-len", str(CONTEXT), "--batch-size", "2"]

    def run(name, *flags):
        return cli_error(capsys, *base, "--run-dir", str(tmp_path / name), *flags)

    line = run("missing", "--init-hf", str(tmp_path / "nowhere"))
    assert "--init-hf" in line and "does not exist" in line
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{not json")
    line = run("corrupt", "--init-hf", str(corrupt))
    assert "is not valid JSON" in line
    line = run("family", "--model", "llama", "--init-hf", str(deepseek_dir))
    assert "is a checkpoint of the 'deepseek' family" in line and "Pass --model deepseek" in line
    line = run("shape", "--init-hf", str(llama_dir), "--override", "n_heads=8")
    assert "would change the weights" in line and "n_heads" in line
    line = run("notok", "--init-hf", str(_without_tokenizer(llama_dir, tmp_path)))
    assert "has no tokenizer.json" in line
    line = run("data", "--init-hf", str(_word_level(llama_dir, tmp_path)))
    assert line.startswith(f"eqx-longctx-train: error: --data {corpus}: the tokenizer")
    assert "cannot encode" in line
    weights = tmp_path / "damaged"
    _copy(llama_dir, weights)
    (weights / "model.safetensors").write_bytes(b"\0" * 64)
    line = run("damaged", "--init-hf", str(weights))
    assert "--init-hf" in line and "cannot read safetensors file" in line


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _without_tokenizer(src, tmp_path):
    path = _copy(src, tmp_path / "no_tokenizer")
    (path / "tokenizer.json").unlink()
    return path


def _word_level(src, tmp_path):
    """The checkpoint with a word-level tokenizer that knows three words and has no
    unknown token in its vocabulary: it cannot encode the corpus."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    path = _copy(src, tmp_path / "word_level")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "the": 3, "model": 4}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path
