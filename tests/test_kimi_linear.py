"""Kimi Linear: parity with transformers' `KimiLinearForCausalLM` (one device, and ring /
zig-zag, all-gather / striped and USP on 8 devices), the round trip through `to_hf`, NoPE
MLA, the layer stacks, preset sizes, config errors.

The references are tiny random-init transformers models (std 0.1) with randomised norm
scales and routing biases, in float32. transformers runs its torch fallbacks for KDA here
(no flash-linear-attention installed): the chunked rule in chunks of 64 and `F.conv1d`;
KDA alone is checked against them in `test_linear_layers.py`. MoE routing is
discontinuous, so the inputs are fixed; the context-parallel runs see the same tokens,
hence the same routing.
"""

import dataclasses
import json

import equinox as eqx
import hf_helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, make_mesh, need_devices, rel_err
from hf_helpers import copy_of, edit_config, forward, hf_logits, hf_modules

import eqx_longctx as el
from eqx_longctx.nn import MultiHeadLatentAttention
from models.kimi_linear import (
    PRESETS,
    KimiLinear,
    KimiLinearConfig,
    config_from_hf,
    from_hf,
    to_hf,
)

RTOL = 1e-4  # max abs logit difference / max abs reference logit, float32
BATCH, SEQ, VOCAB = 2, 64, 96
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=80,
    moe_intermediate_size=32,
    num_attention_heads=8,  # divisible by the 2-wide Ulysses axis of USP
    num_key_value_heads=8,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    v_head_dim=10,  # values narrower than the queries and keys
    num_local_experts=4,
    num_experts_per_tok=2,
    initializer_range=0.1,
    pad_token_id=None,  # transformers' defaults are Kimi's token ids, outside VOCAB
    bos_token_id=None,
    eos_token_id=None,
)
KDA = {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4}
# name -> (transformers config class, extra config fields, expected zoo layer kinds)
FAMILIES = {
    # Moonshot's form of the layer kinds (1-based lists), grouped routing, NoPE's unrotated
    # part 4 wide; the first layer dense.
    "kda-first": (
        "KimiLinearConfig",
        dict(num_hidden_layers=4, qk_rope_head_dim=4, q_lora_rank=None,
             n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
             linear_attn_config={**KDA, "kda_layers": [1, 2, 4], "full_attn_layers": [3]}),
        ("linear_attention/dense", "linear_attention/moe", "full_attention/moe",
         "linear_attention/moe"),
    ),
    # transformers' form (layer_types), a query latent, no unrotated part, two shared
    # experts, every layer MoE.
    "mla-first": (
        "KimiLinearConfig",
        dict(num_hidden_layers=3, qk_rope_head_dim=0, q_lora_rank=24, n_shared_experts=2,
             first_k_dense_replace=0, routed_scaling_factor=1.5, linear_attn_config=KDA,
             layer_types=["full_attention", "linear_attention", "linear_attention"]),
        ("full_attention/moe", "linear_attention/moe", "linear_attention/moe"),
    ),
}  # fmt: skip
# (strategy, mesh shape, axis names, layout, other axes of the spec)
CONTEXT_PARALLEL = [
    ("ring", (2, 4), ("data", "context"), "zigzag", {}),
    ("all_gather", (2, 4), ("data", "context"), "striped", {}),
    ("usp", (2, 4), ("ulysses", "context"), "zigzag", dict(ulysses_axis="ulysses")),
    # heads split over a tensor axis, routed experts over an expert axis
    ("ring", (2, 2, 2), ("expert", "tensor", "context"), "zigzag",
     dict(tensor_axis="tensor", expert_axis="expert")),
]  # fmt: skip

build_hf = hf_helpers.model_builder(FAMILIES, SMALL)
tokens, checkpoints = hf_helpers.checkpoint_fixtures(FAMILIES, build_hf, (BATCH, SEQ), VOCAB)


def _same_weights(a, b):
    la, lb = (jax.tree.leaves(eqx.filter(m, eqx.is_array)) for m in (a, b))
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(checkpoints, tokens, family):
    path, ref = checkpoints[family]
    model = from_hf(path)
    assert model.config.layer_kinds == FAMILIES[family][2]
    err = rel_err(forward(model, tokens), ref)
    print(f"{family}: relative error {err:.2e}")
    assert err <= RTOL


@pytest.mark.parametrize("strategy,shape,names,layout,axes", CONTEXT_PARALLEL)
def test_context_parallel_logits_match_transformers(
    checkpoints, tokens, strategy, shape, names, layout, axes
):
    need_devices(8)
    path, ref = checkpoints["kda-first"]
    spec = el.ShardingSpec(make_mesh(shape, names), strategy, layout, **axes)
    model = from_hf(path, spec=spec)
    logits = el.from_layout(forward(model, el.to_layout(tokens, spec)), spec)
    err = rel_err(logits, ref)
    print(f"{strategy}/{layout} on {names}: relative error {err:.2e}")
    assert err <= RTOL


def test_round_trip_through_transformers(checkpoints, tokens, tmp_path):
    """Ours -> Moonshot's layout (sharded) -> transformers: the same logits; ours read back:
    the same weights, bit for bit."""
    path, ref = checkpoints["kda-first"]
    model = from_hf(path)
    to_hf(model, tmp_path, max_shard_size=40_000)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors.index.json" in names and len(names) > 3
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.gate_proj.weight" in index  # Moonshot's dense layers
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in index
    _same_weights(from_hf(tmp_path), model)
    _, transformers = hf_modules()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded).__name__ == "KimiLinearForCausalLM"
    assert rel_err(hf_logits(reloaded, tokens), ref) <= RTOL


def test_generic_reader_and_transformers_aliases(checkpoints, tmp_path):
    """`eqx_longctx.from_hf` picks this family by `model_type`; transformers' spellings of
    Moonshot's keys read the same."""
    path = copy_of(checkpoints, "kda-first", tmp_path)
    model = el.from_hf(path)
    assert isinstance(model, KimiLinear)
    config = json.loads((path / "config.json").read_text())
    renames = {"num_experts": "num_local_experts", "num_experts_per_token": "num_experts_per_tok",
               "moe_renormalize": "norm_topk_prob", "num_expert_group": "n_group",
               "num_shared_experts": "n_shared_experts"}  # fmt: skip
    edit_config(path, **{new: config[old] for old, new in renames.items()})
    edit_config(path, **dict.fromkeys(renames))
    assert config_from_hf(path) == model.config


# ---------------------------------------------------------------- layers


def test_nope_mla_ignores_positions():
    """With `rope=None` MLA rotates nothing: the output is the same at any positions, and
    equals attention over the latent's keys with the unrotated part appended."""
    attn = MultiHeadLatentAttention(
        32, 4, kv_lora_rank=8, q_lora_rank=None, qk_nope_head_dim=4, qk_rope_head_dim=4,
        v_head_dim=6, rope=None, key=jax.random.key(0), init_std=0.3,
    )  # fmt: skip
    x = jax.random.normal(jax.random.key(1), (2, 16, 32))
    pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
    assert attn.rotary_tables(pos) is None
    out = attn(x, pos)
    assert_close(attn(x, pos + 1000), out, what="shifted positions")
    q = jnp.einsum("bse,ehd->bshd", x, attn.wq)
    compressed = x @ attn.wkv_a
    latent = attn.kv_norm(compressed[..., :8])
    kv = jnp.einsum("bsc,chn->bshn", latent, attn.wkv_b)
    k = jnp.concatenate(
        [kv[..., :4], jnp.broadcast_to(compressed[:, :, None, 8:], q.shape[:3] + (4,))], -1
    )
    o = el.reference_attention(q, k, kv[..., 4:], causal=True, scale=8**-0.5)
    assert_close(out, jnp.einsum("bshv,hve->bse", o, attn.wo), factor=5, what="NoPE MLA")


def test_causality_and_document_isolation():
    """A token changes no earlier logit, and a packed document's logits are its logits run
    alone (KDA's convolutions and state restart at each document, MLA masks across them)."""
    model = KimiLinear(KimiLinearConfig.from_preset("tiny", init_std=0.2), key=jax.random.key(0))
    lengths = [7, 9, 8]
    segment_ids = jnp.asarray(np.repeat(np.arange(3), lengths)[None], jnp.int32)
    positions = jnp.asarray(np.concatenate([np.arange(n) for n in lengths])[None], jnp.int32)
    tokens = jax.random.randint(jax.random.key(1), (1, 24), 0, 259)
    packed = forward(model, tokens, positions, segment_ids)
    alone = forward(model, tokens[:, 7:16])
    assert_close(packed[:, 7:16], alone, factor=5, what="packed vs unpacked document")
    changed = forward(model, tokens.at[:, 12].set((tokens[0, 12] + 1) % 259))
    whole = forward(model, tokens)
    np.testing.assert_array_equal(np.asarray(changed[:, :12]), np.asarray(whole[:, :12]))
    assert float(jnp.abs(changed[:, 12:] - whole[:, 12:]).max()) > 1e-3


def test_layer_stacks_follow_the_layer_kinds():
    config = KimiLinearConfig.from_preset("kimi-linear-48b-a3b")
    model = eqx.filter_eval_shape(KimiLinear, config, key=jax.random.key(0))
    stacks = model.layer_stacks()
    assert sum(s.n_layers for s in stacks) == 27
    kinds = [(type(s.layers.attn).__name__, type(s.layers.mlp).__name__, s.n_layers)
             for s in stacks]  # fmt: skip
    kda, mla = "KimiDeltaAttention", "MultiHeadLatentAttention"
    assert kinds[:4] == [(kda, "SwiGLU", 1), (kda, "MoE", 2), (mla, "MoE", 1), (kda, "MoE", 3)]
    assert [k[0] for k in kinds].count("MultiHeadLatentAttention") == 7
    assert kinds[-1] == ("MultiHeadLatentAttention", "MoE", 1)
    assert (
        config.attention_types
        == KimiLinearConfig.from_preset("kimi-linear-48b-a3b", layer_types=None).attention_types
    )  # the default pattern is Kimi-Linear-48B's


def _expected_params(c: KimiLinearConfig) -> int:
    """The parameter count from the architecture, written out independently."""
    h, d, r = c.linear_n_heads, c.linear_head_dim, c.linear_head_dim
    kda = (3 * c.dim * h * d + 3 * h * d * c.conv_size + 2 * (c.dim * r + r * h * d)
           + h * d + h + c.dim * h + d + h * d * c.dim)  # fmt: skip
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    mla = (c.dim * c.n_heads * qk + c.dim * (c.kv_lora_rank + c.qk_rope_head_dim)
           + c.kv_lora_rank + c.kv_lora_rank * c.n_heads * (c.qk_nope_head_dim + c.v_head_dim)
           + c.n_heads * c.v_head_dim * c.dim)  # fmt: skip
    dense = 3 * c.dim * c.hidden_dim
    moe = (c.dim * c.n_routed_experts + c.n_routed_experts
           + (c.n_routed_experts + c.n_shared_experts) * 3 * c.dim * c.moe_hidden_dim)  # fmt: skip
    n_mla = c.attention_types.count("full_attention")
    return (2 * c.vocab_size * c.dim + c.dim + c.n_layers * 2 * c.dim + n_mla * mla
            + (c.n_layers - n_mla) * kda + c.first_k_dense * dense
            + c.n_moe_layers * moe)  # fmt: skip


@pytest.mark.parametrize(
    "name, expected", [("tiny", 807_928), ("kimi-linear-48b-a3b", 49_122_681_728)]
)
def test_preset_parameter_counts(name, expected):
    """Kimi-Linear-48B-A3B: 49.1B parameters, about 3B of them active per token."""
    model = eqx.filter_eval_shape(KimiLinear, PRESETS[name], key=jax.random.key(0))
    assert model.num_params() == _expected_params(PRESETS[name]) == expected
    if name != "tiny":
        active = el.model_family("kimi_linear").active_params(PRESETS[name])
        assert 2.5e9 < active < 3.5e9


# ---------------------------------------------------------------- errors

CONFIG_ERRORS = [
    (dict(model_type="kimi_k2"), "model_type.*'kimi_linear'"),
    (dict(mla_use_nope=False), "mla_use_nope=False.*NoPE"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    (dict(moe_router_activation_func="softmax"), "moe_router_activation_func"),
    (dict(use_grouped_topk=False), "use_grouped_topk"),
    (dict(moe_layer_freq=2), "moe_layer_freq"),
    (dict(num_key_value_heads=1), "num_key_value_heads"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(num_nextn_predict_layers=1), "num_nextn_predict_layers"),
    (dict(num_experts=8, num_local_experts=4), "num_experts=8 and its transformers alias"),
    (dict(layer_types=["full_attention"] * 4), "layer_types.*disagrees"),
    (dict(mlp_layer_types=["dense", "sparse", "dense", "sparse"]), "mlp_layer_types"),
    (dict(first_k_dense_replace=2), "first_k_dense_replace=2.*mlp_layer_types has 1"),
    (dict(linear_attn_config={**KDA, "kda_layers": [1, 2], "full_attn_layers": [3]}),
     "kda_layers/full_attn_layers.*exactly once"),
    (dict(linear_attn_config={**KDA, "gate_lower_bound": -5.0, "kda_layers": [1, 2, 4],
                              "full_attn_layers": [3]}), "gate_lower_bound"),
    (dict(linear_num_heads=4), "linear_attn_config.num_heads/linear_num_heads.*agree"),
    (dict(rms_norm_eps=None), "lacks.*rms_norm_eps"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(num_experts=6), r"experts.\d.w1.weight|n_group equal groups|num_experts"),
]  # fmt: skip


@pytest.mark.parametrize("changes,match", CONFIG_ERRORS)
def test_config_errors(checkpoints, tmp_path, changes, match):
    path = copy_of(checkpoints, "kda-first", tmp_path)
    edit_config(path, **changes)
    with pytest.raises(ValueError, match=match) as e:
        from_hf(path)
    assert "\n" not in str(e.value)


def test_layer_kinds_must_be_stated(checkpoints, tmp_path):
    """Without `layer_types` or the 1-based lists, transformers and Moonshot's code build
    different models: the zoo refuses to guess; likewise the dense layers."""
    path = copy_of(checkpoints, "kda-first", tmp_path)
    edit_config(path, layer_types=None, linear_attn_config=KDA)
    with pytest.raises(ValueError, match="neither layer_types nor linear_attn_config"):
        from_hf(path)
    path = copy_of(checkpoints, "mla-first", tmp_path / "b")
    edit_config(path, mlp_layer_types=None, first_k_dense_replace=None)
    with pytest.raises(ValueError, match="neither first_k_dense_replace nor mlp_layer_types"):
        from_hf(path)


def test_building_block_errors():
    with pytest.raises(ValueError, match="unknown Kimi Linear preset"):
        KimiLinearConfig.from_preset("kimi-linear-9t")
    with pytest.raises(ValueError, match="layer_types must be n_layers=4 entries"):
        KimiLinearConfig.from_preset("kimi-linear-48b-a3b", n_layers=4)
    with pytest.raises(ValueError, match="layer_types must be n_layers=3 entries"):
        KimiLinearConfig.from_preset("tiny", layer_types=("linear_attention", "mamba", "x"))
    with pytest.raises(ValueError, match="first_k_dense <= n_layers"):
        KimiLinearConfig.from_preset("tiny", first_k_dense=4)
    with pytest.raises(ValueError, match="groups need >= 2 experts"):
        KimiLinearConfig.from_preset("tiny", n_group=8, topk_group=2)
    with pytest.raises(ValueError, match="qk_rope_head_dim >= 0"):
        MultiHeadLatentAttention(8, 2, kv_lora_rank=4, q_lora_rank=None, qk_nope_head_dim=4,
                                 qk_rope_head_dim=-2, v_head_dim=4, rope=None,
                                 key=jax.random.key(0))  # fmt: skip
    assert (
        dataclasses.replace(PRESETS["tiny"], layer_types=["full_attention"] * 3).layer_types
        == ("full_attention",) * 3
    )  # a JSON list (--override) becomes a tuple


# ---------------------------------------------------------------- the trainer and planner


@pytest.mark.slow
def test_train_cli_runs_context_parallel(tmp_path, capsys):
    """`python -m eqx_longctx.train --model kimi_linear --preset tiny` (trimmed to two
    short steps): KDA, NoPE MLA and MoE on a ring over context=4, zig-zag."""
    need_devices(8)
    from eqx_longctx.train._cli import main

    flags = ["--model", "kimi_linear", "--preset", "tiny", "--mesh", "data=2,context=4"]
    flags += ["--devices", "8", "--steps", "2", "--seq-len", "64", "--batch-size", "8"]
    flags += ["--max-bytes", "200000", "--eval-batches", "1", "--final-eval-batches", "1"]
    flags += ["--override", "n_layers=2"]  # KDA + SwiGLU, then MLA + MoE
    flags += ["--run-dir", str(tmp_path), "--no-progress"]
    assert main(flags) == 0
    out = capsys.readouterr().out
    assert "training kimi_linear tiny" in out and "strategy=ring, load_balance=zigzag" in out
    assert "status:        completed" in out and "bits/byte" in out


def test_planner_runs_on_the_real_size(capsys):
    """`python -m eqx_longctx.plan --model kimi_linear --preset kimi-linear-48b-a3b`: every
    layer stack priced by its kind (KDA by `eqx_longctx.linear.linear_attention_cost`, MLA
    by the attention cost model), 3.1B active parameters."""
    need_devices(8)
    from eqx_longctx.plan import main

    main(["--model", "kimi_linear", "--preset", "kimi-linear-48b-a3b", "--seq", "32768",
          "--batch", "2", "--mesh", "data=2,context=4", "--fsdp-axes", "context", "--train",
          "--strategy", "ring", "--remat", "full", "--json"])  # fmt: skip
    record = json.loads(capsys.readouterr().out)
    assert record["strategy"] == "ring" and record["remat"] == "full"
    assert record["predicted_bytes_per_device"] > 49e9 * 16 / 8  # params, grads, Adam


# moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json (without auto_map).
KIMI_48B_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"], "bos_token_id": 163584, "dtype": "bfloat16",
    "eos_token_id": 163586, "first_k_dense_replace": 1, "head_dim": 72, "hidden_act": "silu",
    "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216,
    "kv_lora_rank": 512,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "num_heads": 32, "short_conv_kernel_size": 4,
    },
    "mla_use_nope": True, "model_max_length": 1048576, "model_type": "kimi_linear",
    "moe_intermediate_size": 1024, "moe_layer_freq": 1, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "num_attention_heads": 32, "num_expert_group": 1,
    "num_experts": 256, "num_experts_per_token": 8, "num_hidden_layers": 27,
    "num_key_value_heads": 32, "num_nextn_predict_layers": 0, "num_shared_experts": 1,
    "pad_token_id": 163839, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
    "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
    "use_cache": True, "use_grouped_topk": True, "v_head_dim": 128, "vocab_size": 163840,
}  # fmt: skip


def test_the_real_config_reads_as_the_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(KIMI_48B_CONFIG))
    config = config_from_hf(tmp_path, dtype="float32")
    assert config == PRESETS["kimi-linear-48b-a3b"]
