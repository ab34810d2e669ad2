"""`models.qwen3_next` without transformers' weights: the config (layer kinds as
transformers derives them, every documented error), the layer stacks, causality and the
pieces it adds to `eqx_longctx.nn`, the planner's questions of both families, and the
trainer (a fresh tiny model on a data x context mesh; `--init-hf` from a transformers
checkpoint under a context mesh, logits equal at the start).
"""

import dataclasses
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_longctx as el
from eqx_longctx.nn import MoE, RMSNorm, RoPE, SelfAttention
from models.qwen3_next import (
    PRESETS,
    QWEN3_5_PRESETS,
    Qwen3Next,
    Qwen3NextConfig,
    make_block,
)

TINY = Qwen3NextConfig.from_preset("tiny", dim=32, hidden_dim=48, head_dim=16, linear_head_dim=8,
                                   linear_v_head_dim=8, moe_hidden_dim=16, shared_hidden_dim=16,
                                   vocab_size=64)  # fmt: skip


def test_layer_kinds_follow_transformers():
    c = dataclasses.replace(TINY, n_layers=8, layer_types=None, full_attention_interval=4)
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",) + (
        "linear_attention",
    ) * 3 + ("full_attention",)
    # transformers: experts when n_experts > 0, (i + 1) % decoder_sparse_step == 0 and i is
    # not in mlp_only_layers.
    c = dataclasses.replace(c, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert c.moe_layers == (False, True, False, False, False, True, False, True)
    assert c.kinds[:4] == (
        "linear_attention/dense", "linear_attention/moe", "linear_attention/dense",
        "full_attention/dense",
    )  # fmt: skip
    model = eqx.filter_eval_shape(Qwen3Next, c, key=jax.random.key(0))
    assert [s.n_layers for s in model.layer_stacks()] == [1, 1, 1, 1, 1, 1, 1, 1]
    assert isinstance(model.layer_stacks()[3].layers.attn, SelfAttention)
    assert dataclasses.replace(c, n_experts=0).moe_layers == (False,) * 8
    assert Qwen3NextConfig.from_preset("tiny", n_layers=8).layer_types == c.layer_types


def test_tiny_model_is_causal_and_keeps_documents_apart():
    model = Qwen3Next(TINY, key=jax.random.key(0))
    assert [s.n_layers for s in model.layer_stacks()] == [1, 2, 1]  # dense, moe x2, attention
    assert model.norm.zero_centred and not np.any(np.asarray(model.norm.weight))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (1, 24)), jnp.int32)

    def logit(embeddings, i):
        positions = jnp.arange(24)[None]
        return model.forward_embeddings(embeddings, positions)[0, i].sum()

    x = model.embed_tokens(tokens)
    grad = jax.jit(jax.grad(logit), static_argnums=1)(x, 11)
    assert np.all(np.asarray(grad[0, 12:]) == 0) and np.any(np.asarray(grad[0, :12]))
    # Two packed documents: the second's logits are its own, whatever the first holds.
    seg = jnp.asarray([[1] * 10 + [2] * 14])
    pos = jnp.asarray([list(range(10)) + list(range(14))])
    other = tokens.at[0, :10].set((tokens[0, :10] + 7) % 64)
    run = eqx.filter_jit(lambda m, t: m(t, pos, seg))
    a, b = run(model, tokens), run(model, other)
    np.testing.assert_allclose(np.asarray(a[0, 10:]), np.asarray(b[0, 10:]), rtol=0, atol=1e-6)
    assert not np.allclose(np.asarray(a[0, :10]), np.asarray(b[0, :10]))


def test_library_pieces():
    """The zero-centred norm scales by 1 + weight; partial RoPE passes the features past
    `rope.head_dim` through; the output gate and the shared-expert gate multiply by a
    sigmoid (0 at weight -inf-like values: the gated path vanishes)."""
    x = jax.random.normal(jax.random.key(1), (2, 5, 8))
    norm = eqx.tree_at(lambda n: n.weight, RMSNorm(8, zero_centred=True), jnp.full(8, 0.5))
    rms = jnp.sqrt(jnp.mean(x**2, -1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(norm(x), 1.5 * x / rms, rtol=1e-6)
    attn = SelfAttention(8, 2, 1, 8, rope=RoPE(4, 1e4), key=jax.random.key(0), output_gate=True)
    q = jax.random.normal(jax.random.key(2), (2, 5, 2, 8))
    rotated = attn._rotate(q, attn.rope.tables(jnp.broadcast_to(jnp.arange(5), (2, 5))))
    np.testing.assert_array_equal(rotated[..., 4:], q[..., 4:])
    assert not np.allclose(rotated[:, 1:, :, :4], q[:, 1:, :, :4])
    assert attn.wg is not None
    closed = eqx.tree_at(lambda a: a.wg, attn, jnp.full(attn.wg.shape, -1e4))
    positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
    x1 = jnp.abs(x) + 0.1  # positive, so every gate logit is very negative
    assert np.abs(np.asarray(closed(x1, positions))).max() < 1e-6
    moe = MoE(8, 4, 4, 2, key=jax.random.key(0), n_shared=1, shared_hidden_dim=6,
              shared_gate=True, norm_topk_prob=True)  # fmt: skip
    assert moe.shared is not None and moe.shared.w_up.shape == (8, 6)
    no_shared = eqx.tree_at(lambda m: m.shared_gate, moe, jnp.full(8, -1e4))
    routed_only = eqx.tree_at(
        lambda m: (m.shared, m.shared_gate), moe, (None, None), is_leaf=lambda v: v is None
    )
    np.testing.assert_allclose(no_shared(x1), routed_only(x1), atol=1e-6)


CONFIG_ERRORS = [
    (dict(n_kv_heads=3), "n_heads to be a multiple of n_kv_heads"),
    (dict(linear_n_heads=3), "linear_n_heads to be a multiple of linear_n_key_heads"),
    (dict(partial_rotary_factor=0.01), "rotates int.*must be even and in \\[2, head_dim\\]"),
    (dict(partial_rotary_factor=2.0), "rotates int"),
    (dict(layer_types=("linear_attention", "sliding_attention") * 2), "layer_types needs one"),
    (dict(layer_types=("full_attention",) * 3), "layer_types needs one"),
    (dict(mlp_only_layers=(4,)), "mlp_only_layers must list layer indices in \\[0, 4\\)"),
    (dict(rope_scaling=object()), "plain \\(partial\\) RoPE only"),
    (dict(top_k=9), "1 <= top_k <= n_experts"),
    (dict(checkpoint_format="qwen4"), "checkpoint_format must be one of"),
    (dict(grouped_matmul="dense"), "grouped_matmul must be one of"),
    (dict(dim=0), "dim"),
]


@pytest.mark.parametrize("changes,match", CONFIG_ERRORS)
def test_config_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TINY, **changes)


def test_constructor_errors():
    with pytest.raises(ValueError, match="unknown Qwen3-Next preset"):
        Qwen3NextConfig.from_preset("qwen9")
    with pytest.raises(ValueError, match="unknown Qwen3-Next layer kind"):
        make_block(TINY, "mamba/dense", key=jax.random.key(0))
    with pytest.raises(TypeError, match="Qwen3NextConfig"):
        Qwen3Next({"dim": 4}, key=jax.random.key(0))
    with pytest.raises(ValueError, match="rotate the whole head or its leading features"):
        SelfAttention(16, 4, 2, 4, rope=RoPE(8, 1e4), key=jax.random.key(0))


def test_planner_questions():
    """Both families answer the planner: sizes of the real presets (80B total, about 3B
    active; 27B), the attention and expert shapes, and local configs that build."""
    fam, fam35 = el.model_family("qwen3_next"), el.model_family("qwen3_5")
    assert fam.model_types == ("qwen3_next",) and "qwen3_5" in fam35.model_types
    assert set(fam.presets) == set(PRESETS) and set(fam35.presets) == set(QWEN3_5_PRESETS)
    big = fam.presets["qwen3-next-80b-a3b"]
    total = eqx.filter_eval_shape(Qwen3Next, big, key=jax.random.key(0)).num_params()
    assert 79e9 < total < 81e9
    assert 3.0e9 < fam.active_params(big) < 4.0e9
    assert fam.attention_shape(big) == el.AttentionShape(16, 2, 256, 256)
    assert fam.moe_shape(big) == el.MoEShape(512, 10, None, 48, 512)
    local = fam.local_config(big, tensor=2, expert=4)
    assert set(local.kinds) == set(big.kinds) and local.n_layers <= 24
    assert local.n_heads == 8 and local.linear_n_heads == 16
    assert local.n_experts == 128 and local.top_k == 40 and local.shared_hidden_dim == 256
    eqx.filter_eval_shape(Qwen3Next, local, key=jax.random.key(0))
    q35 = fam35.presets["qwen3.5-27b"]
    assert 26e9 < eqx.filter_eval_shape(Qwen3Next, q35, key=jax.random.key(0)).num_params() < 28e9
    assert fam35.moe_shape(q35) is None
    assert set(fam35.local_config(q35, tensor=4).kinds) == {
        "linear_attention/dense", "full_attention/dense",
    }  # fmt: skip


def test_train_cli_on_a_mesh(tmp_path):
    """A fresh tiny model trains two steps on a (data 2, context 4) mesh, ring over the
    zig-zag layout: the DeltaNet's rule and convolution split over the sequence."""
    from eqx_longctx.train._cli import main

    run_dir = tmp_path / "run"
    flags = [
        "--model", "qwen3_next", "--preset", "tiny", "--override=dim=64",
        "--override=n_experts=4", "--seq-len", "64", "--batch-size", "4", "--steps", "2",
        "--max-bytes", "30000", "--eval-every", "2", "--eval-batches", "1",
        "--final-eval-batches", "1", "--checkpoint-every", "2", "--warmup-steps", "1",
        "--devices", "8", "--mesh",
        "data=2,context=4", "--strategy", "ring", "--load-balance", "zigzag",
        "--run-dir", str(run_dir), "--no-progress",
    ]  # fmt: skip
    assert main(flags) == 0
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in records)


def test_init_hf_on_a_context_mesh(tmp_path_factory, tmp_path):
    """`--init-hf` from a transformers Qwen3-Next checkpoint: the trainer's model, placed
    on a context mesh (all-gather, striped), gives transformers' logits."""
    pytest.importorskip("tokenizers", reason="--init-hf tokenizes with tokenizers (extra: hf)")
    import hf_helpers
    from test_init_hf import CONTEXT, SPECIALS, VOCAB, train_config, write_corpus, write_tokenizer

    from eqx_longctx.data import load_corpus
    from eqx_longctx.train import Trainer

    torch, transformers = hf_helpers.hf_modules()
    corpus = write_corpus(tmp_path_factory.mktemp("corpus"))
    path = tmp_path_factory.mktemp("qwen3_next")
    config = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        max_position_embeddings=CONTEXT, initializer_range=0.1, **SPECIALS,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(path)
    write_tokenizer(path, load_corpus(corpus))
    trainer = Trainer(train_config("qwen3_next", path, corpus, tmp_path, mesh="context=8",
                                   devices=8, strategy="all_gather", load_balance="striped",
                                   steps=2))  # fmt: skip
    try:
        tokens = np.random.default_rng(1).integers(0, VOCAB, (2, CONTEXT)).astype(np.int32)
        spec = trainer.parallel.spec
        logits = el.from_layout(hf_helpers.forward(trainer.model, el.to_layout(tokens, spec)), spec)
        ref = hf_helpers.hf_logits(hf, tokens)
        err = hf_helpers.max_diff(logits, ref) / float(np.max(np.abs(ref)))
        print(f"--init-hf, all_gather/striped on context=8: relative error {err:.2e}")
        assert err <= 1e-4
    finally:
        trainer.close()
