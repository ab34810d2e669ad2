"""Llama 4 text checkpoints: `from_hf` / `to_hf` and greedy generation against transformers.

The reference is a tiny random float32 `Llama4ForCausalLM` (eager attention) with the
family's every feature acting on 96 tokens: chunks of 32 on the two RoPE layers (with
Llama 3 RoPE scaling, both band factors 1 as Scout's), the q/k RMS norm there, a NoPE
layer whose query temperature changes every 8 positions, experts (top-1 sigmoid router
scaling the expert's input, plus the shared expert) in the RoPE layers and a dense MLP in
the NoPE one (two layer stacks, the second after an offset), random norm scales. Errors
are relative: max abs difference / max abs reference logit.
"""

import json

import jax
import numpy as np
import pytest
from helpers import need_devices, rel_err
from hf_helpers import edit_config, forward, hf_generate, hf_logits, hf_modules, load_tensors

torch, transformers = hf_modules()
# One thread: this tiny model's ops are microseconds, which torch's threads contending for a
# loaded machine's two cores turned into 0.2 s per forward.
torch.set_num_threads(1)
from hf_helpers import randomize_biases_and_norms  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

import eqx_longctx as el  # noqa: E402
from eqx_longctx.nn import Llama3RopeScaling  # noqa: E402
from models import llama4  # noqa: E402

RTOL = 1e-4  # float32, relative to the largest reference logit
VOCAB, SEQ, CHUNK = 96, 96, 32
PROMPT, NEW = 24, 16  # both rows' generations cross a chunk boundary (position 32)
LENGTHS = np.array([PROMPT, 20], np.int32)
SMALL = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=48,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_local_experts=4, num_experts_per_tok=1, moe_layers=[0, 1], no_rope_layer_interval=3,
    attention_chunk_size=CHUNK, floor_scale=8, attn_scale=0.5, max_position_embeddings=256,
    initializer_range=0.1,
    rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0,
                         high_freq_factor=1.0, original_max_position_embeddings=16),
)  # fmt: skip
SPECS = {  # ring / zig-zag and a second strategy and layout, on the 2x4 mesh
    "ring-zigzag": ("ring", "zigzag"),
    "ulysses-striped": ("ulysses", "striped"),
}


def make_spec(name: str) -> el.ShardingSpec:
    need_devices(8)
    return el.ShardingSpec(jax.make_mesh((2, 4), ("data", "context")), *SPECS[name])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """`(checkpoint directory, tokens, logits, prompts, [(tokens, logits)] per prompt)`."""
    config = transformers.Llama4TextConfig(**SMALL)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = randomize_biases_and_norms(transformers.Llama4ForCausalLM(config).eval())
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    path = tmp_path_factory.mktemp("llama4_text")
    model.save_pretrained(path)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (2, SEQ)).astype(np.int32)
    prompts = rng.integers(0, VOCAB, (2, PROMPT)).astype(np.int32)
    generated = [hf_generate(model, prompts[r, :n], NEW) for r, n in enumerate(LENGTHS)]
    return path, tokens, hf_logits(model, tokens), prompts, generated


@pytest.mark.parametrize("spec", [None, *SPECS])
def test_logits_match_transformers(reference, spec):
    path, tokens, ref, *_ = reference
    spec = None if spec is None else make_spec(spec)
    model = llama4.from_hf(path, spec=spec)
    c = model.config
    assert c.kinds == ("rope/chunked/moe",) * 2 + ("nope/full/dense",)
    assert c.rope_scaling == Llama3RopeScaling(4.0, 1.0, 1.0, 16)
    if spec is None:
        err = rel_err(forward(model, tokens), ref)
    else:
        err = rel_err(el.from_layout(forward(model, el.to_layout(tokens, spec)), spec), ref)
    print(f"llama4_text {spec}: relative error {err:.2e}")
    assert err <= RTOL


@pytest.mark.parametrize("spec", [None, "ring-zigzag"])
def test_generate_matches_transformers_past_a_chunk(reference, spec):
    """Greedy tokens equal transformers' through position 40, the chunked layers' caches a
    ring of CHUNK slots whatever `max_len` is."""
    path, *_, prompts, generated = reference
    model = llama4.from_hf(path, spec=None if spec is None else make_spec(spec))
    short, long = (el.cache_layout(model, 2, m) for m in (PROMPT + NEW, 4 * SEQ))
    for s, t in zip(short.stacks, long.stacks, strict=True):
        if s.chunk is None:  # the NoPE layer: a full cache
            assert s.ring is None and s.slots >= PROMPT + NEW and t.slots > s.slots
        else:
            assert s.chunk == CHUNK and s.ring == s.slots == t.slots == CHUNK
            assert short.stack_bytes_per_device(s) == long.stack_bytes_per_device(t)
    tokens, logits = el.generate(
        model, prompts, lengths=LENGTHS, max_new_tokens=NEW, return_logits=True
    )
    for row, (ref_tokens, ref_logits) in enumerate(generated):
        assert np.array_equal(np.asarray(tokens[row]), ref_tokens)
        err = rel_err(logits[row], ref_logits)
        print(f"{spec} row {row}: logits rel err {err:.1e}")
        assert err <= RTOL


def test_to_hf_round_trip(reference, tmp_path):
    """`to_hf` writes the checkpoint's tensors bit for bit (`gate_up_proj` joined again) and
    a config transformers loads to the same logits; the text part of a `llama4`
    vision-language checkpoint reads as the text model."""
    path, tokens, ref, *_ = reference
    model = llama4.from_hf(path)
    out = tmp_path / "out"
    llama4.to_hf(model, out)
    ours, theirs = (load_tensors(p / "model.safetensors") for p in (out, path))
    assert sorted(ours) == sorted(theirs)
    for name, x in theirs.items():
        np.testing.assert_array_equal(ours[name], x, err_msg=name)
    assert llama4.config_from_hf(out) == model.config
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    back.config._attn_implementation = "eager"
    assert rel_err(hf_logits(back, tokens), ref) <= RTOL

    wrapped = tmp_path / "llama4"  # as Llama4ForConditionalGeneration saves it
    wrapped.mkdir()
    text = json.loads((path / "config.json").read_text())
    config = dict(model_type="llama4", architectures=["Llama4ForConditionalGeneration"],
                  text_config=text, vision_config={}, image_token_index=3)  # fmt: skip
    (wrapped / "config.json").write_text(json.dumps(config))
    tensors = {"language_model." + k: v for k, v in theirs.items()}
    tensors["vision_model.patch_embedding.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, wrapped / "model.safetensors", metadata={"format": "pt"})
    assert rel_err(forward(llama4.from_hf(wrapped), tokens), ref) <= RTOL
    assert el.family_for_model_type("llama4") is el.model_family("llama4_text")


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(attention_bias=True), r"attention_bias=True is not supported"),
        (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
         r"rope_parameters=.*'yarn'.* is not supported"),
        (dict(no_rope_layers=[1, 1, 2, 0]), r"no_rope_layers=\[1, 1, 2, 0\] is not supported"),
        (dict(moe_router_bias=True), r"key\(s\) \['moe_router_bias'\]"),
    ],
)  # fmt: skip
def test_unsupported_checkpoint_fields(reference, tmp_path, changes, match):
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text((reference[0] / "config.json").read_text())
    edit_config(path, **changes)
    with pytest.raises(ValueError, match=match) as e:
        llama4.config_from_hf(path)
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


def test_presets_and_the_planners_questions():
    """Scout's preset has Scout's size (109B parameters, 17B active); the family answers the
    planner at one layer per kind; bad configs name the field."""
    scout = llama4.Llama4Config.from_preset("llama-4-scout")
    family = el.model_family("llama4_text")
    shapes = jax.eval_shape(lambda: llama4.Llama4(scout, key=jax.random.key(0)))
    total = sum(np.prod(x.shape) for x in jax.tree.leaves(shapes)) / 1e9
    active = family.active_params(scout) / 1e9
    print(f"llama-4-scout: {total:.1f}B parameters, {active:.1f}B active")
    assert 107 < total < 110 and 16 < active < 18
    assert scout.kinds.count("nope/full/moe") == 12 and len(scout.moe_layers or ()) == 48
    local = family.local_config(scout, tensor=2, expert=4)
    assert local.kinds == ("rope/chunked/moe", "nope/full/moe") and local.n_heads == 20
    assert family.moe_shape(scout) == el.MoEShape(16, 1, None, 48, 8192)
    tiny = llama4.Llama4Config.from_preset("tiny", n_layers=8)
    assert tiny.kinds.count("nope/full/moe") == 2 and tiny.moe_layers == (1, 3, 5, 7)
    with pytest.raises(ValueError, match=r"layer_types.*attention_chunk_size=None"):
        llama4.Llama4Config.from_preset("tiny", attention_chunk_size=None,
                                        layer_types=("chunked_attention",) * 4)  # fmt: skip
    with pytest.raises(ValueError, match=r"no_rope_layers needs 1 \(RoPE\) or 0"):
        llama4.Llama4Config.from_preset("tiny", no_rope_layers=(1, 1, 1))
