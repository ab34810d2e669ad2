"""Bad Hugging Face checkpoints for the model zoo's `from_hf` / `to_hf`: damaged or missing
files, mis-typed config.json values, bad arguments; each raises a clear error naming the file
and the value. Integral floats in config.json (JSON has one number type) just work.

One table per kind of checkpoint; every row asserts the exception type and the key part of
the message.
"""

import json
import os

import equinox as eqx
import numpy as np
import pytest
from test_model_errors import KEY, TOKENS, deepseek_config, llama_config

from models import deepseek, llama
from models.deepseek import DeepSeek
from models.llama import Llama

# ---------------------------------------------------------------- Hugging Face files


@pytest.fixture
def hf_files():
    """Skips a checkpoint test without safetensors (extra: hf); the cases above need none."""
    pytest.importorskip("safetensors", reason="from_hf needs safetensors (extra: hf)")


@pytest.fixture(scope="module")
def llama_model():
    return Llama(llama_config(), key=KEY)


@pytest.fixture
def ckpt(hf_files, llama_model, tmp_path):
    path = tmp_path / "ckpt"
    llama.to_hf(llama_model, path)
    return path


def edit_json(file, **changes):
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


def edit_tensors(path, edit):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def truncate(file, keep):
    data = file.read_bytes()
    file.write_bytes(data[: keep if keep > 0 else len(data) + keep])


HF_ERRORS = [
    # (damage(path), load(path), exception, message): damaged files or bad arguments
    (lambda p: truncate(p / "model.safetensors", -10), None, ValueError,
     r"cannot read safetensors file .*ckpt/model\.safetensors: .*incomplete metadata"
     r".*damaged or incomplete"),
    (lambda p: truncate(p / "model.safetensors", 6), None, ValueError,
     r"cannot read safetensors file .*ckpt/model\.safetensors: .*header"),
    (lambda p: (p / "config.json").write_text('{"vocab_size": 64,'), None, ValueError,
     r"ckpt/config\.json is not valid JSON \(Expecting property name .* at line 1, column 19\)"),
    (lambda p: (p / "config.json").write_text("[1, 2]"), None, ValueError,
     r"ckpt/config\.json must hold a JSON object .*got a JSON list"),
    (lambda p: edit_json(p / "config.json", hidden_size="32"), None, TypeError,
     r"ckpt/config\.json: hidden_size must be an int; got '32' \(str\)\. "
     r"Correct it in config\.json"),
    (lambda p: edit_json(p / "config.json", num_attention_heads=4.5), None, TypeError,
     r"config\.json: num_attention_heads must be an int; got 4\.5"),
    (lambda p: edit_json(p / "config.json", num_attention_heads=0), None, ValueError,
     r"config\.json: num_attention_heads must be positive; got 0"),
    (lambda p: edit_json(p / "config.json", rms_norm_eps="1e-5"), None, TypeError,
     r"config\.json: rms_norm_eps must be a real number; got '1e-5'"),
    (lambda p: edit_json(p / "config.json", tie_word_embeddings="false"), None, TypeError,
     r"config\.json: tie_word_embeddings must be True or False; got 'false'"),
    (lambda p: (  # a Qwen3 checkpoint in place of the Llama one
        llama.to_hf(Llama(llama_config(qk_norm=True), key=KEY), p),
        edit_json(p / "config.json", layer_types="full_attention"),
    ), None, TypeError,
     r"config\.json: layer_types must be a JSON array or null; got 'full_attention'"),
    (lambda p: edit_json(p / "config.json", model_type=["llama"]), None, ValueError,
     r"models\.llama\.from_hf reads model_type .*got model_type=\['llama'\]"),
    (lambda p: edit_json(p / "config.json", rope_scaling="llama3"), None, TypeError,
     r"config\.json: rope_scaling must be a JSON object or null; got 'llama3'"),
    (lambda p: edit_json(p / "config.json", rope_scaling={
        "rope_type": "llama3", "factor": "8", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}), None, TypeError,
     r"config\.json: rope_scaling\.factor must be a real number; got '8'"),
    (lambda p: edit_json(p / "config.json", num_key_value_heads=3), None, ValueError,
     r"ckpt/config\.json: LlamaConfig needs n_heads to be a multiple of n_kv_heads"),
    (lambda p: (p / "config.json").unlink(), None, ValueError, r"no config\.json in .*ckpt"),
    (lambda p: (p / "model.safetensors").unlink(), None, ValueError,
     r"ckpt' has neither model\.safetensors nor model\.safetensors\.index\.json"),
    (None, lambda p: llama.from_hf(p / "config.json"), ValueError,
     r"models\.llama\.from_hf: .*ckpt/config\.json' is a file; point at a Hugging Face "
     r"checkpoint directory"),
    (None, lambda p: llama.from_hf(p / "nowhere"), ValueError, r"nowhere' does not exist"),
    (None, lambda p: llama.from_hf(None), TypeError,
     r"models\.llama\.from_hf needs path=a checkpoint directory .*got NoneType"),
    (lambda p: edit_tensors(p, lambda t: t.pop("model.norm.weight")), None, ValueError,
     r"ckpt/model\.safetensors lacks tensor\(s\) \['model\.norm\.weight'\]"),
    (lambda p: edit_tensors(p, lambda t: t.update({"model.norm.weight": np.ones(16, np.float32)})),
     None, ValueError, r"model\.norm\.weight: expected \(32,\), found \(16,\) in model\.safet"),
    (lambda p: edit_tensors(p, lambda t: t.update({"model.norm.weight": np.ones(32, np.int32)})),
     None, ValueError, r"not floating point: model\.norm\.weight: I32 in model\.safetensors"),
    (None, lambda p: llama.from_hf(p, dtype="bf16"), ValueError,
     r"models\.llama\.from_hf\(dtype=\.\.\.\) must be None \(the checkpoint's\) or one of "
     r".*got 'bf16'"),
    (None, lambda p: llama.from_hf(p, spec="ring"), TypeError,
     r"models\.llama\.from_hf needs spec=a ShardingSpec or None .*strategy='ring'"),
    (None, lambda p: llama.from_hf(p, n_layers=3), ValueError,
     r"from_hf: override\(s\) \{'n_layers': 3\} would change the weights .*layers\.layers\."),
    (None, lambda p: llama.from_hf(p, n_heads_typo=3), ValueError,
     r"from_hf overrides fields of the family's config; got unknown \['n_heads_typo'\]"),
    (None, lambda p: llama.from_hf(p, remat="sometimes"), ValueError,
     r"^LlamaConfig\.remat must be one of"),
    (None, lambda p: llama.from_hf(p, max_seq_len=64.0), TypeError,
     r"^LlamaConfig\.max_seq_len must be an int"),
    (None, lambda p: llama.to_hf(llama.from_hf(p), p / "config.json"), ValueError,
     r"to_hf writes a checkpoint directory, but .*config\.json' exists and is not a directory"),
    (lambda p: (p / "model.safetensors.index.json").write_text("{}"),
     lambda p: llama.to_hf(Llama(llama_config(), key=KEY), p),
     ValueError, r"already holds checkpoint file\(s\) \['model\.safetensors\.index\.json'\]"),
    (None, lambda p: llama.to_hf(Llama(llama_config(), key=KEY), p / "o", max_shard_size=0),
     ValueError, r"to_hf max_shard_size must be positive; got 0"),
    (None, lambda p: llama.to_hf(Llama(llama_config(), key=KEY), None), TypeError,
     r"to_hf needs path=an output directory .*got NoneType"),
    (None, lambda p: llama.to_hf(eqx.filter_eval_shape(Llama, llama_config(), key=KEY), p / "o"),
     ValueError, r"models\.llama\.to_hf needs parameter values, but the model holds abstract"),
    (None, lambda p: llama.to_hf(llama_config(), p / "out"), TypeError,
     r"models\.llama\.to_hf's model must be a Llama; got LlamaConfig"),
]  # fmt: skip


@pytest.mark.parametrize("damage, load, error, match", HF_ERRORS)
def test_llama_checkpoint_errors(ckpt, damage, load, error, match):
    if damage is not None:
        damage(ckpt)
    with pytest.raises(error, match=match):
        (load or llama.from_hf)(ckpt)


def edit_index(path, edit):
    file = path / "model.safetensors.index.json"
    index = json.loads(file.read_text())
    edit(index["weight_map"])
    file.write_text(json.dumps(index))


FIRST, LAST = "model-00001-of-00009.safetensors", "model-00009-of-00009.safetensors"

SHARDED_ERRORS = [
    (lambda p: (p / "model.safetensors.index.json").write_text('{"weight_map": {'), ValueError,
     r"model\.safetensors\.index\.json is not valid JSON .*the shard index is damaged"),
    (lambda p: edit_index(p, lambda m: m.update({"model.norm.weight": 3})), ValueError,
     r"index\.json maps tensor\(s\) \['model\.norm\.weight'\] to something other than a shard"),
    (lambda p: edit_index(p, lambda m: m.update({"model.norm.weight": FIRST})), ValueError,
     rf"cannot read tensor 'model\.norm\.weight' from .*{FIRST}"),
    (lambda p: truncate(p / LAST, -10), ValueError, rf"cannot read safetensors file .*{LAST}"),
    (lambda p: (p / LAST).unlink(), ValueError, rf"lists shard file\(s\) that are not in .*{LAST}"),
]  # fmt: skip


@pytest.mark.usefixtures("hf_files")
@pytest.mark.parametrize("damage, error, match", SHARDED_ERRORS)
def test_sharded_checkpoint_errors(llama_model, tmp_path, damage, error, match):
    path = tmp_path / "sharded"
    llama.to_hf(llama_model, path, max_shard_size=6000)
    files = sorted(os.listdir(path))
    assert (files[1], files[-2], files[-1]) == (FIRST, LAST, "model.safetensors.index.json")
    damage(path)
    with pytest.raises(error, match=match):
        llama.from_hf(path)


@pytest.fixture(scope="module")
def deepseek_model():
    return DeepSeek(deepseek_config(), key=KEY)


DEEPSEEK_HF_ERRORS = [
    (dict(n_routed_experts="4"), TypeError,
     r"config\.json: n_routed_experts must be an int; got '4'"),
    (dict(first_k_dense_replace=-1), ValueError,
     r"config\.json: first_k_dense_replace must be >= 0"),
    (dict(routed_scaling_factor="2.5"), TypeError,
     r"config\.json: routed_scaling_factor must be a real"),
    (dict(norm_topk_prob=1), TypeError, r"config\.json: norm_topk_prob must be True or False"),
    (dict(n_group=3), ValueError,
     r"ckpt/config\.json: DeepSeekConfig topk_method='noaux_tc' splits"),
]  # fmt: skip


@pytest.mark.usefixtures("hf_files")
@pytest.mark.parametrize("changes, error, match", DEEPSEEK_HF_ERRORS)
def test_deepseek_checkpoint_errors(deepseek_model, tmp_path, changes, error, match):
    path = tmp_path / "ckpt"
    deepseek.to_hf(deepseek_model, path)
    edit_json(path / "config.json", **changes)
    with pytest.raises(error, match=match):
        deepseek.from_hf(path)


@pytest.mark.usefixtures("hf_files")
def test_integral_floats_in_config_json_just_work(llama_model, deepseek_model, tmp_path):
    """JSON has one number type: `4096.0` where an int belongs is read as `4096`."""
    for module, model in ((llama, llama_model), (deepseek, deepseek_model)):
        path = tmp_path / type(model).__name__
        module.to_hf(model, path)
        config = json.loads((path / "config.json").read_text())
        ints = {k: float(v) for k, v in config.items() if type(v) is int}
        assert "hidden_size" in ints and "num_hidden_layers" in ints
        edit_json(path / "config.json", **ints)
        loaded = module.from_hf(path)
        assert loaded.config == model.config
        np.testing.assert_array_equal(loaded(TOKENS), model(TOKENS))
