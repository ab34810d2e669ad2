"""DeepSeek-V2/V3: parity with transformers (one device, ring, Ulysses, round trip), MoE
against a naive dense oracle, YaRN against transformers' frequencies, causality and packing,
preset sizes, errors.

The references are tiny random-init `transformers` models with large weights (std 0.1) and
randomised norm scales and routing biases, in float32. MoE routing is discontinuous, so the
inputs are fixed; the context-parallel runs see the same tokens, hence the same routing.
"""

import math

import equinox as eqx
import hf_helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close
from hf_helpers import (
    copy_of,
    edit_config,
    edit_tensors,
    forward,
    hf_logits,
    hf_modules,
    load_tensors,
    max_diff,
)

import eqx_longctx as el
from eqx_longctx.nn import MoE, RoPE, YarnRopeScaling
from models.deepseek import PRESETS, DeepSeek, DeepSeekConfig, from_hf, to_hf

ATOL = 1e-4  # max abs logit difference against transformers, float32
BATCH, SEQ, VOCAB = 2, 64, 96
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=80,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=8,  # divisible by 8: Ulysses over 8 devices
    num_key_value_heads=8,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=10,  # values narrower than the 12-wide queries and keys
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=128,
    initializer_range=0.1,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 16,  # short, so the blended band is used
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,  # != mscale: cos/sin and the softmax scale both change
}
# name -> (transformers config class, extra config fields, expected zoo config fields)
FAMILIES = {
    "v2-direct-q-group-limited": (
        "DeepseekV2Config",
        dict(q_lora_rank=None, topk_method="group_limited_greedy", n_group=2, topk_group=1,
             routed_scaling_factor=1.5, rope_parameters=YARN),
        dict(q_lora_rank=None, topk_method="group_limited_greedy", n_group=2,
             norm_topk_prob=False, routed_scaling_factor=1.5),
    ),
    "v3-q-lora-noaux": (
        "DeepseekV3Config",
        dict(q_lora_rank=24, n_group=2, topk_group=1, rope_parameters=YARN),
        dict(q_lora_rank=24, topk_method="noaux_tc", n_group=2, topk_group=1,
             norm_topk_prob=True, routed_scaling_factor=2.5),
    ),
}  # fmt: skip
# (family, strategy, mesh shape): every family under both strategies, zigzag layout.
CONTEXT_PARALLEL = [
    ("v2-direct-q-group-limited", "ring", (2, 4)),
    ("v2-direct-q-group-limited", "ulysses", (1, 8)),
    ("v3-q-lora-noaux", "ring", (2, 4)),
    ("v3-q-lora-noaux", "ulysses", (1, 8)),
]


build_hf = hf_helpers.model_builder(FAMILIES, SMALL)
tokens, checkpoints = hf_helpers.checkpoint_fixtures(FAMILIES, build_hf, (BATCH, SEQ), VOCAB)


@pytest.fixture
def v3_copy(checkpoints, tmp_path):
    """A writable copy of the V3 checkpoint, for the error tests to corrupt."""
    return copy_of(checkpoints, "v3-q-lora-noaux", tmp_path)


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(checkpoints, tokens, family):
    path, ref = checkpoints[family]
    model = from_hf(path)
    for field, value in FAMILIES[family][2].items():
        assert getattr(model.config, field) == value, field
    assert model.config.rope_scaling == YarnRopeScaling(8.0, 16, 32.0, 1.0, 0.707, 1.0)
    assert model.dense_layers is not None and model.dense_layers.n_layers == 1
    assert model.moe_layers is not None and model.moe_layers.n_layers == 2
    assert max_diff(forward(model, tokens), ref) <= ATOL


@pytest.mark.parametrize("family,strategy,shape", CONTEXT_PARALLEL)
def test_context_parallel_logits_match_transformers(checkpoints, tokens, family, strategy, shape):
    path, ref = checkpoints[family]
    spec = el.ShardingSpec(jax.make_mesh(shape, ("data", "context")), strategy, "zigzag")
    model = from_hf(path, spec=spec)
    logits = el.from_layout(forward(model, el.to_layout(tokens, spec)), spec)
    assert max_diff(logits, ref) <= ATOL


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_through_transformers(checkpoints, tokens, tmp_path, family):
    path, ref = checkpoints[family]
    to_hf(from_hf(path), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    _, transformers = hf_modules()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded).__name__ == FAMILIES[family][0].replace("Config", "ForCausalLM")
    assert max_diff(hf_logits(reloaded, tokens), ref) <= ATOL


def test_no_shared_experts_matches_transformers(tmp_path, tokens):
    """With `n_shared_experts=0` transformers writes the shared experts as `[dim, 0]`
    tensors: they hold no weights and are not refused as unknown."""
    reference = build_hf("v3-q-lora-noaux", n_shared_experts=0)
    reference.save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    assert model.config.n_shared_experts == 0
    assert max_diff(forward(model, tokens), hf_logits(reference, tokens)) <= ATOL


def test_multi_token_prediction_layers_are_skipped(v3_copy):
    """DeepSeek-V3 checkpoints carry `num_nextn_predict_layers` extra layers (MTP)."""
    extra = {"model.layers.3.eh_proj.weight": np.ones((64, 128), "f4")}
    edit_tensors(v3_copy, lambda t: t.update(extra))
    edit_config(v3_copy, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="model.layers.3.eh_proj.weight"):
        from_hf(v3_copy)
    edit_config(v3_copy, num_nextn_predict_layers=1)
    from_hf(v3_copy)


# ---------------------------------------------------------------- YaRN and RoPE


@pytest.mark.parametrize("mscale,mscale_all_dim", [(0.707, 0.707), (0.707, 1.0), (None, None)])
def test_yarn_matches_transformers(mscale, mscale_all_dim):
    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32,
              "beta_slow": 1, "original_max_position_embeddings": 4096}  # fmt: skip
    if mscale is not None:
        params.update(mscale=mscale, mscale_all_dim=mscale_all_dim)
    _, transformers = hf_modules()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.DeepseekV3Config(qk_rope_head_dim=64, rope_parameters=params)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    scaling = YarnRopeScaling(40.0, 4096, 32, 1, mscale, mscale_all_dim)
    np.testing.assert_allclose(scaling.frequencies(64, 10000.0), inv_freq.numpy(), rtol=1e-6)
    assert scaling.rotary_factor() == pytest.approx(attention_factor, rel=1e-12)
    expected = (0.1 * mscale_all_dim * math.log(40.0) + 1) ** 2 if mscale_all_dim else 1.0
    assert scaling.softmax_scale_factor() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("interleaved", [True, False])
def test_decoupled_rope_layouts(interleaved):
    d = 8
    rope = RoPE(d, 10000.0, interleaved=interleaved)
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, d))
    pos = jax.random.randint(jax.random.key(1), (2, 5), 0, 500)
    xn, angle = np.asarray(x, np.float64), np.asarray(pos, np.float64)[:, :, None, None]
    angle = angle * 10000.0 ** (-np.arange(0, d, 2) / d)
    pair = [xn[..., 0::2], xn[..., 1::2]] if interleaved else [xn[..., : d // 2], xn[..., d // 2 :]]
    a = pair[0] * np.cos(angle) - pair[1] * np.sin(angle)
    b = pair[1] * np.cos(angle) + pair[0] * np.sin(angle)
    expected = np.stack([a, b], -1).reshape(xn.shape) if interleaved else np.concatenate([a, b], -1)
    assert_close(rope(x, pos), expected, factor=5, what=f"interleaved={interleaved}")


# ---------------------------------------------------------------- MoE


def naive_moe(moe: MoE, x: np.ndarray) -> np.ndarray:
    """Every expert on every token (a [tokens, experts, embed] tensor), routing in float64."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), eqx.filter(moe, eqx.is_array))
    t = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    logits = t @ p.router
    if moe.topk_method == "noaux_tc":
        scores = 1 / (1 + np.exp(-logits))
        choice = scores + p.score_bias
    else:
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        choice = scores.copy()
    gates = np.zeros_like(scores)
    for i in range(len(t)):
        c = choice[i].copy()
        if moe.topk_method != "greedy":
            groups = c.reshape(moe.n_group, -1)
            if moe.topk_method == "noaux_tc":
                rating = np.sort(groups, -1)[:, -2:].sum(-1)
            else:
                rating = groups.max(-1)
            dropped = np.argsort(-rating)[moe.topk_group :]
            groups[dropped] = -np.inf if moe.topk_method == "noaux_tc" else 0.0
            c = groups.reshape(-1)
        chosen = np.argsort(-c)[: moe.top_k]
        w = (scores[i] if moe.topk_method == "noaux_tc" else c)[chosen]
        if moe.norm_topk_prob:
            w = w / w.sum()
        gates[i, chosen] = w * moe.routed_scaling_factor

    def swiglu(h, wg, wu, wd):
        g = h @ wg
        return (g / (1 + np.exp(-g)) * (h @ wu)) @ wd

    every = np.stack([swiglu(t, *(w[j] for w in (p.w_gate, p.w_up, p.w_down)))
                      for j in range(moe.n_experts)], axis=1)  # fmt: skip
    out = np.einsum("txe,tx->te", every, gates)
    if moe.shared is not None:
        out += swiglu(t, p.shared.w_gate, p.shared.w_up, p.shared.w_down)
    return out.reshape(x.shape)


def _avals(jaxpr):
    for eqn in jaxpr.eqns:
        yield from (v.aval for v in eqn.outvars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _avals(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _avals(sub)


MOE_CASES = [
    dict(topk_method="greedy", n_shared=2),
    dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=16.0),
    dict(topk_method="noaux_tc", n_group=2, topk_group=1, norm_topk_prob=True, n_shared=1,
         routed_scaling_factor=2.5),
]  # fmt: skip


@pytest.mark.parametrize("grouped_matmul", ["scan", "ragged_dot"])
@pytest.mark.parametrize("case", MOE_CASES, ids=[c["topk_method"] for c in MOE_CASES])
def test_moe_matches_naive_dense_reference(case, grouped_matmul):
    b, s, e, n_experts = 2, 32, 32, 8
    moe = MoE(e, 16, n_experts, 2, key=jax.random.key(0), init_std=0.3,
              grouped_matmul=grouped_matmul, **case)  # fmt: skip
    if moe.score_bias is not None:
        moe = eqx.tree_at(lambda m: m.score_bias, moe, 0.1 * jax.random.normal(
            jax.random.key(1), (n_experts,)))  # fmt: skip
    x = jax.random.normal(jax.random.key(2), (b, s, e))
    out = eqx.filter_jit(lambda m, x: m(x))(moe, x)
    assert_close(out, naive_moe(moe, np.asarray(x)), factor=5, what=str(case))
    if grouped_matmul == "scan":  # nothing as large as tokens x experts x embed
        biggest = max(math.prod(a.shape) for a in _avals(jax.make_jaxpr(moe)(x).jaxpr))
        assert biggest < b * s * n_experts * e
    grads = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(moe)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert float(jnp.abs(grads.w_down).sum()) > 0


def test_moe_weights_follow_the_routing():
    """Experts a token does not choose get no gradient from it."""
    moe = MoE(16, 8, 4, 1, key=jax.random.key(0), grouped_matmul="scan")
    x = jax.random.normal(jax.random.key(1), (1, 1, 16))
    (expert,), _ = moe.route(x[0])
    grads = eqx.filter_grad(lambda m: jnp.sum(m(x)))(moe)
    used = np.asarray(jnp.abs(grads.w_up).sum((1, 2)) > 0)
    assert used.tolist() == [i == int(expert[0]) for i in range(4)]


# ---------------------------------------------------------------- model behaviour

CAUSAL = DeepSeekConfig.from_preset(
    "tiny", dim=32, n_heads=2, hidden_dim=48, moe_hidden_dim=16, kv_lora_rank=8, q_lora_rank=12,
    qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6, n_layers=2, init_std=0.2,
    rope_scaling=YarnRopeScaling(4.0, 8, mscale=1.0, mscale_all_dim=1.0), max_seq_len=64,
)  # fmt: skip


def test_causality_and_document_isolation():
    """d logits[t] / d embedding[t'] is exactly zero unless t' <= t in the same document; a
    packed document equals the same document run alone."""
    seq = 16
    model = DeepSeek(CAUSAL, key=jax.random.key(0))
    segment_ids = jnp.asarray([[0] * 5 + [1] * 6 + [2] * 5, [0] * 9 + [1] * 7], jnp.int32)
    positions = jnp.asarray([list(range(5)) + list(range(6)) + list(range(5)),
                             list(range(9)) + list(range(7))], jnp.int32)  # fmt: skip
    tokens = jax.random.randint(jax.random.key(1), (2, seq), 0, CAUSAL.vocab_size)
    x = model.embed_tokens(tokens)

    def logit_sum(x, t):
        return model.forward_embeddings(x, positions, segment_ids)[:, t].sum()

    jac = jax.jit(jax.vmap(lambda t: jax.grad(logit_sum)(x, t)))(jnp.arange(seq))  # [t,b,s,e]
    influence = np.asarray(jnp.abs(jac).sum(-1)).transpose(1, 0, 2)  # [b, t, s]
    seg = np.asarray(segment_ids)
    t_idx, s_idx = np.arange(seq)[:, None], np.arange(seq)[None, :]
    visible = (s_idx <= t_idx)[None] & (seg[:, :, None] == seg[:, None, :])
    assert np.all(influence[~visible] == 0.0), "a logit depends on a future or foreign token"
    assert np.all(influence[visible] > 0.0)

    packed = forward(model, tokens, positions, segment_ids)
    alone = forward(model, tokens[:1, 5:11])
    assert_close(packed[:1, 5:11], alone, factor=5, what="packed vs unpacked document")


def test_latent_and_up_projection_compose_to_the_layer():
    model = DeepSeek(CAUSAL, key=jax.random.key(0))
    attn = model.moe_layers.layer(0).attn
    x = jax.random.normal(jax.random.key(1), (2, 16, CAUSAL.dim))
    pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
    latent, k_rope = attn.latent(x, pos)
    assert latent.shape == (2, 16, CAUSAL.kv_lora_rank)
    assert k_rope.shape == (2, 16, CAUSAL.qk_rope_head_dim)
    k, v = attn.up_project((latent, k_rope))
    assert k.shape == (2, 16, CAUSAL.n_heads, 8) and v.shape == (2, 16, CAUSAL.n_heads, 6)
    q = attn.queries(x, pos)
    out = el.reference_attention(q, k, v, causal=True, scale=attn.softmax_scale)
    expected = jnp.einsum("bshv,hve->bse", out, attn.wo)
    assert_close(attn(x, pos), expected, factor=5, what="latent -> up_project -> attention")


# ---------------------------------------------------------------- presets


def _expected_params(c: DeepSeekConfig) -> int:
    """The parameter count from the architecture, written out independently."""
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    q = c.dim * c.n_heads * qk if c.q_lora_rank is None else (
        c.dim * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * c.n_heads * qk)  # fmt: skip
    attn = (q + c.dim * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
            + c.kv_lora_rank * c.n_heads * (c.qk_nope_head_dim + c.v_head_dim)
            + c.n_heads * c.v_head_dim * c.dim)  # fmt: skip
    dense = 3 * c.dim * c.hidden_dim
    moe = (c.dim * c.n_routed_experts + (c.n_routed_experts if c.topk_method == "noaux_tc" else 0)
           + (c.n_routed_experts + c.n_shared_experts) * 3 * c.dim * c.moe_hidden_dim)  # fmt: skip
    per_layer = attn + 2 * c.dim
    return (2 * c.vocab_size * c.dim + c.dim + c.n_layers * per_layer
            + c.first_k_dense * dense + (c.n_layers - c.first_k_dense) * moe)  # fmt: skip


@pytest.mark.parametrize(
    "name, expected",
    [("tiny", 694_656), ("deepseek-v2-lite", 15_706_484_224), ("deepseek-v3", 671_026_419_200)],
)
def test_preset_parameter_counts(name, expected):
    model = eqx.filter_eval_shape(DeepSeek, PRESETS[name], key=jax.random.key(0))
    assert model.num_params() == _expected_params(PRESETS[name]) == expected


# ---------------------------------------------------------------- errors

CONFIG_ERRORS = [
    (dict(model_type="deepseek_v4"), "model_type.*'deepseek_v2', 'deepseek_v3'"),
    (dict(architectures=["DeepseekV3Model"]), "architectures"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(attention_dropout=0.1), "attention_dropout"),
    (dict(num_key_value_heads=1), "num_key_value_heads"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(topk_method="greedy"), "topk_method"),
    (dict(moe_layer_freq=2), "moe_layer_freq"),
    (dict(first_k_dense_replace=5), "first_k_dense_replace"),
    (dict(n_group=None), "n_group/topk_group"),
    (dict(n_group=3), "n_group equal groups"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope type.*'linear'"),
    (dict(rope_parameters={**YARN, "low_freq_factor": 1.0}), "low_freq_factor"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "lack.*original_max"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(q_lora_rank=8), r"q_a_proj.weight: expected \(8, 64\), found \(24, 64\)"),
    (dict(kv_lora_rank=None), "lacks.*kv_lora_rank"),
    (dict(moe_intermediate_size=40), r"experts.0.gate_proj.weight: expected \(40, 64\)"),
]


@pytest.mark.parametrize("changes,match", CONFIG_ERRORS)
def test_config_errors(v3_copy, changes, match):
    edit_config(v3_copy, **changes)
    with pytest.raises(ValueError, match=match):
        from_hf(v3_copy)


def test_v2_only_errors(checkpoints, tmp_path):
    path = copy_of(checkpoints, "v2-direct-q-group-limited", tmp_path)
    edit_config(path, norm_topk_prob=True)
    with pytest.raises(ValueError, match="norm_topk_prob.*disagree"):
        from_hf(path)
    edit_config(path, norm_topk_prob=False, mlp_bias=True)
    with pytest.raises(ValueError, match="mlp_bias"):
        from_hf(path)
    edit_config(path, mlp_bias=False, rope_interleave=False)
    with pytest.raises(ValueError, match="rope_interleave"):
        from_hf(path)  # a V3-only key


def test_tensor_errors(v3_copy):
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    original = load_tensors(v3_copy / "model.safetensors")
    edit_tensors(v3_copy, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"lacks tensor.*{name}"):
        from_hf(v3_copy)
    edit_tensors(v3_copy, lambda t: t.update({name: original[name], "extra.w": np.ones(2)}))
    with pytest.raises(ValueError, match=r"\[.extra\.w.\] that the model .* does not use"):
        from_hf(v3_copy)
    edit_tensors(v3_copy, lambda t: (t.pop("extra.w"), t.update({name: original[name].T.copy()})))
    with pytest.raises(ValueError, match=rf"{name}: expected \(32, 64\), found \(64, 32\)"):
        from_hf(v3_copy)


def test_from_hf_refuses_a_shape_changing_override(tmp_path):
    pytest.importorskip("safetensors")
    written = tmp_path / "tiny"
    to_hf(DeepSeek(DeepSeekConfig.from_preset("tiny"), key=jax.random.key(0)), written)
    with pytest.raises(ValueError, match="would change the weights"):
        from_hf(written, n_layers=4)


def test_building_block_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown DeepSeek preset"):
        DeepSeekConfig.from_preset("deepseek-v9")
    with pytest.raises(ValueError, match="first_k_dense <= n_layers"):
        DeepSeekConfig.from_preset("tiny", first_k_dense=4)
    with pytest.raises(ValueError, match="topk_method must be one of"):
        DeepSeekConfig.from_preset("tiny", topk_method="sinkhorn")
    with pytest.raises(ValueError, match="even qk_rope_head_dim"):
        DeepSeekConfig.from_preset("tiny", qk_rope_head_dim=5)
    with pytest.raises(ValueError, match="top_k <= n_experts"):
        MoE(8, 4, 4, 5, key=jax.random.key(0))
    with pytest.raises(ValueError, match="top_k <= topk_group"):
        MoE(8, 4, 8, 3, key=jax.random.key(0), topk_method="group_limited_greedy", n_group=4)
    with pytest.raises(ValueError, match="groups need >= 2 experts"):
        MoE(8, 4, 4, 1, key=jax.random.key(0), topk_method="noaux_tc", n_group=4)
    with pytest.raises(ValueError, match="beta_slow < beta_fast"):
        YarnRopeScaling(40.0, 4096, beta_fast=1.0, beta_slow=32.0)
    with pytest.raises(ValueError, match="factor >= 1"):
        YarnRopeScaling(0.5, 4096)
    with pytest.raises(ValueError, match="positive even number"):
        RoPE(7, 1e4, interleaved=True)
    config = DeepSeekConfig.from_preset("tiny", topk_method="greedy", norm_topk_prob=True)
    abstract = eqx.filter_eval_shape(DeepSeek, config, key=jax.random.key(0))
    with pytest.raises(ValueError, match="written as DeepSeek-V2|writes topk_method='greedy'"):
        to_hf(abstract, tmp_path / "out")
