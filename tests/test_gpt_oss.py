"""GPT-OSS checkpoints (`models.gpt_oss`) against transformers' `GptOssForCausalLM`.

The reference is a tiny random float32 model (eager attention) of two layers, sliding and
full, with a window of 8 over 64 tokens (so the sliding layer masks most of each row),
YaRN with its ramp bounds not rounded, random attention sinks, random biases everywhere
(q/k/v/o, router, experts) and a SwiGLU clamp of 1 that the experts' inputs often cross.
It is read by `eqx_longctx.from_hf` (the family picked by `model_type`). Errors are
relative: max abs difference / max abs reference.

The one-device forward runs the experts as CPUs do by default (a scan over row tiles);
the sharded cases run them as TPUs do (`ragged_dot`), so both paths meet transformers.
"""

import json

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import need_devices, rel_err
from hf_helpers import copy_of, edit_config, forward, hf_generate, hf_modules, load_tensors

torch, transformers = hf_modules()
from test_generate_hf import compared_steps  # noqa: E402

import eqx_longctx as el  # noqa: E402
from models.gpt_oss import GptOss, GptOssConfig, from_hf, to_hf  # noqa: E402

RTOL = 1e-4  # float32 logits, relative to the largest reference logit
BATCH, SEQ, VOCAB, WINDOW = 2, 64, 96, 8
PROMPT, NEW = 20, 8
LENGTHS = np.array([PROMPT, 13], np.int32)  # ragged rows, both longer than the window
SLIDE, FULL = "sliding_attention", "full_attention"
HF_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
    num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=256,
    initializer_range=0.1, swiglu_limit=1.0,
    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0,
                         beta_slow=1.0, truncate=False, original_max_position_embeddings=32),
)  # fmt: skip
RING = ("ring", "zigzag", dict(data=2, context=4))
ULYSSES = ("ulysses", "striped", dict(data=2, context=4))


def build_hf():
    config = transformers.GptOssConfig(**HF_CONFIG)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():  # biases and sinks start at 0 and norms at 1: randomise them all
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.normal_(0.0, 0.5 if name.endswith("sinks") else 0.1)
            elif "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    return model


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokens):
    """`(directory, reference model, its logits of tokens, its greedy runs of the prompts)`."""
    model = build_hf()
    path = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(path)
    with torch.no_grad():
        logits = model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    runs = [hf_generate(model, tokens[r, :n], NEW) for r, n in enumerate(LENGTHS)]
    return path, model, logits, runs


def sharded(path, strategy, layout, axes):
    """The checkpoint under a spec, its experts run by `ragged_dot`."""
    spec = el.ShardingSpec(jax.make_mesh(tuple(axes.values()), tuple(axes)), strategy, layout)
    return from_hf(path, spec=spec, grouped_matmul="ragged_dot"), spec


def test_logits_match_transformers(checkpoint, tokens):
    """On one device; with the sinks at zero the same weights miss the reference by far
    (sinks too small to count would pass either way)."""
    path, _, ref, _ = checkpoint
    model = el.from_hf(path)
    assert isinstance(model, GptOss)
    c = model.config
    assert c.layer_types == (SLIDE, FULL) and c.sliding_window == WINDOW
    assert c.rope_scaling is not None and not c.rope_scaling.truncate
    assert [s.layers.attn.window for s in model.layer_stacks()] == [WINDOW, None]
    err = rel_err(forward(model, tokens), ref)
    print(f"one device: relative error {err:.2e}")
    assert err <= RTOL
    no_sinks = eqx.tree_at(
        lambda m: [s.layers.attn.sinks for s in m.layers], model,
        [np.zeros_like(s.layers.attn.sinks) for s in model.layers],
    )  # fmt: skip
    assert rel_err(forward(no_sinks, tokens), ref) > 100 * RTOL


def test_ring_logits_and_gradients_match_torch(checkpoint, tokens, tmp_path):
    """Under ring / zig-zag on a 2x4 mesh: the logits, and every parameter's gradient of a
    weighted sum of them (written by `to_hf`) against torch's; the sinks' gradients are
    far from zero."""
    need_devices(8)
    path, reference, ref, _ = checkpoint
    weights = np.random.default_rng(1).normal(size=(BATCH, SEQ, VOCAB)).astype(np.float32)
    reference.zero_grad()
    logits = reference(torch.as_tensor(tokens, dtype=torch.long)).logits
    (logits * torch.as_tensor(weights)).sum().backward()
    model, spec = sharded(path, *RING)
    ours_tokens, ours_weights = el.to_layout(tokens, spec), el.to_layout(weights, spec)

    @eqx.filter_jit
    def grads_and_logits(model):
        def loss(model):
            out = model(ours_tokens)
            return (out * ours_weights).sum(), out

        return eqx.filter_grad(loss, has_aux=True)(model)

    grads, ours_logits = grads_and_logits(model)
    err = rel_err(el.from_layout(ours_logits, spec), ref)
    print(f"ring/zigzag: logits relative error {err:.2e}")
    assert err <= RTOL
    to_hf(grads, tmp_path)
    ours = load_tensors(tmp_path / "model.safetensors")
    theirs = {n: p.grad.numpy() for n, p in reference.named_parameters()}
    assert sorted(ours) == sorted(theirs)
    errs = {n: rel_err(ours[n], g) for n, g in theirs.items()}
    worst = max(errs, key=errs.__getitem__)
    print(f"ring/zigzag: worst gradient {worst}: relative error {errs[worst]:.2e}")
    assert errs[worst] <= 2e-5
    sinks = [n for n in theirs if n.endswith("sinks")]
    assert len(sinks) == 2 and all(np.min(np.abs(ours[n])) > 1e-3 for n in sinks)


def test_ulysses_striped_logits_match_transformers(checkpoint, tokens):
    need_devices(8)
    path, _, ref, _ = checkpoint
    model, spec = sharded(path, *ULYSSES)
    err = rel_err(el.from_layout(forward(model, el.to_layout(tokens, spec)), spec), ref)
    print(f"ulysses/striped: relative error {err:.2e}")
    assert err <= RTOL


def test_generate_matches_transformers(checkpoint, tokens):
    """Greedy generation under ring / zig-zag from ragged prompts longer than the window:
    the sliding layer's cache is a ring of the window (8 slots over the 4 context shards),
    the full layer's holds every token."""
    need_devices(8)
    path, _, _, runs = checkpoint
    model, _ = sharded(path, *RING)
    max_len = PROMPT + NEW
    layout = el.cache_layout(model, BATCH, max_len)
    assert [s.ring for s in layout.stacks] == [WINDOW, None]
    assert layout.stacks[0].slots == WINDOW < max_len <= layout.stacks[1].slots
    out, logits = el.generate(
        model, tokens[:, :PROMPT], lengths=LENGTHS, max_new_tokens=NEW, return_logits=True
    )
    out, logits = np.asarray(out), np.asarray(logits)
    for row, (ref_tokens, ref_logits) in enumerate(runs):
        n = compared_steps(out[row], ref_tokens, ref_logits)
        err = rel_err(logits[row, :n], ref_logits[:n])
        print(f"row {row}: {n}/{NEW} tokens equal, logits rel err {err:.1e}")
        assert err <= RTOL


def test_round_trip(checkpoint, tokens, tmp_path):
    """from_hf -> to_hf -> from_hf is exact, and transformers reads back the same model."""
    path, _, ref, _ = checkpoint
    model = from_hf(path)
    el.to_hf(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "gpt_oss" and written["layer_types"] == [SLIDE, FULL]
    again = from_hf(tmp_path)
    assert again.config == model.config
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = reloaded(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    assert rel_err(logits, ref) <= RTOL


@pytest.mark.parametrize(
    "edit,match",
    [
        (dict(quantization_config={"quant_method": "mxfp4"}),
         r"quantization_config=\{'quant_method': 'mxfp4'\} is not supported.*Dequantize"),
        (dict(attention_dropout=0.1), r"config\.json attention_dropout=0\.1 is not supported"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}),
         r"config\.json rope type='linear' is not supported"),
    ],
    ids=["mxfp4", "dropout", "rope-type"],
)  # fmt: skip
def test_unsupported_config_fields(checkpoint, tmp_path, edit, match):
    path = copy_of({"gpt_oss": (checkpoint[0],)}, "gpt_oss", tmp_path)
    edit_config(path, **edit)
    with pytest.raises(ValueError, match=match) as e:
        el.from_hf(path)
    assert "\n" not in str(e.value)


def test_presets():
    """gpt-oss-20b's parameter count: 20.9B, 3.6B of them active, as the model card states
    (gpt-oss-120b, 116.8B and 5.1B, differs only in depth and experts); tiny alternates."""
    family = el.model_family("gpt_oss")
    assert set(family.presets) == {"tiny", "gpt-oss-20b", "gpt-oss-120b"}
    config = GptOssConfig.from_preset("gpt-oss-20b")
    model = eqx.filter_eval_shape(GptOss, config, key=jax.random.key(0))
    assert round(sum(x.size for x in jax.tree.leaves(model)) / 1e8) == 209
    assert round(family.active_params(config) / 1e8) == 36
    assert GptOssConfig.from_preset("tiny", n_layers=3).layer_types == (SLIDE, FULL, SLIDE)
