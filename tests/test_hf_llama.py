"""Hugging Face checkpoints: `from_hf` / `to_hf` against `transformers` (Llama, Qwen2, Qwen3).

Every reference is a tiny random-init `transformers` model built offline from a config, with
large weights (std 0.1) and randomised biases and norm scales, so that a transposed or
misplaced tensor cannot hide behind near-zero weights. References run in float32.
"""

import dataclasses
import json

import equinox as eqx
import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Hugging Face parity tests need torch (extra: hf)")
transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face parity tests need transformers (extra: hf)"
)
pytest.importorskip("safetensors", reason="from_hf needs safetensors (extra: hf)")
import hf_helpers  # noqa: E402
from hf_helpers import copy_of, edit_config, edit_tensors, forward, hf_logits, max_diff  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

import eqx_longctx as el  # noqa: E402
from models._hf import HFTensor  # noqa: E402
from models.llama import Llama, LlamaConfig, from_hf, to_hf  # noqa: E402

ATOL = 1e-4  # max abs logit difference against transformers, float32
BATCH, SEQ, VOCAB = 2, 64, 96
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=8,  # divisible by 8: Ulysses over 8 devices
    max_position_embeddings=128,
    initializer_range=0.1,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # short, so scaled and blended bands are used
}

# name -> (transformers config class, extra config fields, expected zoo config fields)
FAMILIES = {
    "llama-gqa-llama3-untied": (
        "LlamaConfig",
        dict(num_key_value_heads=2, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False),
        dict(n_kv_heads=2, tie_embeddings=False, attention_bias=False, qk_norm=False),
    ),
    "llama-mha-tied": (
        "LlamaConfig",
        dict(num_key_value_heads=8, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
             tie_word_embeddings=True),
        dict(n_kv_heads=8, tie_embeddings=True, rope_scaling=None, rope_theta=5e5),
    ),
    "qwen2-bias": (
        "Qwen2Config",
        dict(num_key_value_heads=4, tie_word_embeddings=False),
        dict(n_kv_heads=4, attention_bias=True, qk_norm=False),
    ),
    "qwen3-qknorm": (
        "Qwen3Config",
        dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
        dict(n_kv_heads=2, head_dim=16, attention_bias=False, qk_norm=True),
    ),
}  # fmt: skip
# (family, strategy, mesh shape): every family once, each strategy twice.
CONTEXT_PARALLEL = [
    ("llama-gqa-llama3-untied", "ring", (2, 4)),
    ("llama-mha-tied", "ulysses", (1, 8)),
    ("qwen2-bias", "ring", (2, 4)),
    ("qwen3-qknorm", "ulysses", (1, 8)),
]


build_hf = hf_helpers.model_builder(FAMILIES, SMALL)
tokens, checkpoints = hf_helpers.checkpoint_fixtures(FAMILIES, build_hf, (BATCH, SEQ), VOCAB)


@pytest.fixture
def llama_copy(checkpoints, tmp_path):
    """A writable copy of the Llama GQA checkpoint, for the error tests to corrupt."""
    return copy_of(checkpoints, "llama-gqa-llama3-untied", tmp_path)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(checkpoints, tokens, family):
    path, ref = checkpoints[family]
    model = from_hf(path)
    for field, value in FAMILIES[family][2].items():
        assert getattr(model.config, field) == value, field
    assert model.config.param_dtype == "float32"
    assert max_diff(forward(model, tokens), ref) <= ATOL


def test_sharded_checkpoint(tmp_path, tokens):
    model = build_hf("llama-gqa-llama3-untied")
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert max_diff(forward(from_hf(tmp_path), tokens), hf_logits(model, tokens)) <= ATOL


def test_one_file_wins_over_a_leftover_index(tmp_path, tokens):
    """As in transformers: saving a sharded checkpoint again as one file leaves its index
    behind (the shards go), and `model.safetensors` is what loads."""
    model = build_hf("llama-gqa-llama3-untied")
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert max_diff(forward(from_hf(tmp_path), tokens), hf_logits(model, tokens)) <= ATOL


@pytest.mark.parametrize("family,strategy,shape", CONTEXT_PARALLEL)
def test_context_parallel_logits_match_transformers(checkpoints, tokens, family, strategy, shape):
    path, ref = checkpoints[family]
    spec = el.ShardingSpec(jax.make_mesh(shape, ("data", "context")), strategy, "zigzag")
    model = from_hf(path, spec=spec)
    for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_array)):
        assert leaf.sharding.is_equivalent_to(
            spec.sharding(jax.sharding.PartitionSpec()), leaf.ndim
        )
    logits = el.from_layout(forward(model, el.to_layout(tokens, spec)), spec)
    assert max_diff(logits, ref) <= ATOL


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_through_transformers(checkpoints, tokens, tmp_path, family):
    path, ref = checkpoints[family]
    model = from_hf(path)
    to_hf(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert (
        type(reloaded).__name__
        == json.loads((path / "config.json").read_text())["architectures"][0]
    )
    assert max_diff(hf_logits(reloaded, tokens), ref) <= ATOL


def test_round_trip_sharded_and_bfloat16(checkpoints, tokens, tmp_path):
    path, ref = checkpoints["qwen2-bias"]
    model = from_hf(path, dtype="bfloat16", compute_dtype="float32")
    assert model.config.param_dtype == "bfloat16"
    assert {leaf.dtype.name for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_array))} == {
        "bfloat16"
    }
    assert max_diff(forward(model, tokens), ref) <= 0.1  # bf16 weights, f32 compute
    to_hf(model, tmp_path, max_shard_size=20_000)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    again = from_hf(tmp_path)  # dtype from config.json
    assert again.config == dataclasses.replace(model.config, compute_dtype="bfloat16")
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_old_style_config_and_rotary_buffers(llama_copy, checkpoints, tokens):
    """Configs written by transformers 4 (`rope_theta` + `rope_scaling`), and the derived
    `rotary_emb.inv_freq` buffers of old conversions, load too."""
    rope = dict(LLAMA3_ROPE)
    theta = rope.pop("rope_theta")
    edit_config(llama_copy, rope_parameters=None, rope_theta=theta, rope_scaling=rope)
    edit_tensors(
        llama_copy,
        lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, "f4")}),
    )
    ref = checkpoints["llama-gqa-llama3-untied"][1]
    assert max_diff(forward(from_hf(llama_copy), tokens), ref) <= ATOL


CONFIG_ERRORS = [
    (dict(model_type="gemma"), "model_type.*'llama', 'mistral', 'qwen2', 'qwen3'"),
    (dict(architectures=["LlamaModel"]), "architectures"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(attention_dropout=0.1), "attention_dropout"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope type.*'yarn'"),
    (dict(rope_parameters={**LLAMA3_ROPE, "attention_factor": 2.0}), "attention_factor"),
    (dict(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    (dict(hidden_size=None), "lacks.*hidden_size"),
    (dict(intermediate_size=96), r"gate_proj.weight: expected \(96, 64\), found \(80, 64\)"),
]


@pytest.mark.parametrize("changes,match", CONFIG_ERRORS)
def test_config_errors(llama_copy, changes, match):
    edit_config(llama_copy, **changes)
    with pytest.raises(ValueError, match=match):
        from_hf(llama_copy)


def test_tensor_errors(llama_copy):
    name = "model.layers.1.mlp.up_proj.weight"
    original = load_file(llama_copy / "model.safetensors")
    edit_tensors(llama_copy, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"lacks tensor.*{name}"):
        from_hf(llama_copy)
    edit_tensors(llama_copy, lambda t: t.update({name: original[name], "extra.w": np.ones(2)}))
    with pytest.raises(ValueError, match=r"\[.extra\.w.\] that the model .* does not use"):
        from_hf(llama_copy)
    edit_tensors(
        llama_copy, lambda t: (t.pop("extra.w"), t.update({name: original[name].T.copy()}))
    )
    with pytest.raises(ValueError, match=rf"{name}: expected \(80, 64\), found \(64, 80\)"):
        from_hf(llama_copy)


def test_tied_embeddings_must_match(checkpoints, tmp_path):
    path = copy_of(checkpoints, "llama-mha-tied", tmp_path)
    embed = load_file(path / "model.safetensors")["model.embed_tokens.weight"]
    edit_tensors(path, lambda t: t.update({"lm_head.weight": embed.copy()}))
    from_hf(path)  # an explicit copy of a tied weight is fine
    edit_tensors(path, lambda t: t.update({"lm_head.weight": embed + 1}))
    with pytest.raises(ValueError, match="ties 'lm_head.weight'"):
        from_hf(path)


def test_missing_files_and_bad_arguments(llama_copy, tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        from_hf(tmp_path)
    (llama_copy / "model.safetensors").rename(llama_copy / "weights.safetensors")
    with pytest.raises(ValueError, match="neither model.safetensors"):
        from_hf(llama_copy)
    with pytest.raises(ValueError, match="would change the weights"):
        from_hf(llama_copy, n_layers=3)
    config = LlamaConfig(64, 32, 1, 4, 48, qk_norm=True, attention_bias=True)
    abstract = eqx.filter_eval_shape(Llama, config, key=jax.random.key(0))
    with pytest.raises(ValueError, match="both q/k norm and q/k/v-only biases"):
        to_hf(abstract, tmp_path / "out")


def test_hf_tensor_stacks_and_layouts():
    """The generic mapping other families use: several stacking fields, offsets, layouts."""
    entry = HFTensor("layers.{layer}.experts.{expert}.w", "linear", n_in=2, offsets=(("layer", 3),))
    shape = (2, 3, 4, 5, 6)  # [layer, expert, in, in, out]
    names = entry.names(shape)
    assert names[0] == ((0, 0), "layers.3.experts.0.w")
    assert names[-1] == ((1, 2), "layers.4.experts.2.w")
    assert entry.hf_shape(shape[2:]) == (6, 20)
    x = np.random.default_rng(0).normal(size=shape[2:])
    np.testing.assert_array_equal(entry.to_hf(x), x.reshape(20, 6).T)
    np.testing.assert_array_equal(entry.to_zoo(entry.to_hf(x), shape[2:]), x)
    with pytest.raises(ValueError, match="offsets for"):
        HFTensor("a.{layer}.w", offsets=(("expert", 1),))
