"""Bad inputs to the model zoo's configs, constructors and calls: each raises a clear error
that names the value before any tracing; inputs with one obvious meaning (NumPy integers,
nested lists) just work.

One table per entry point; every row asserts the exception type and the key part of the
message. Damaged or mis-typed Hugging Face checkpoints: `test_hf_checkpoint_errors.py`.
"""

import dataclasses
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_longctx as el
from eqx_longctx._layout import layout_order
from eqx_longctx.nn import (
    DecoderBlock,
    Llama3RopeScaling,
    MoE,
    MultiHeadLatentAttention,
    RoPE,
    SelfAttention,
    SwiGLU,
    YarnRopeScaling,
)
from models.deepseek import DeepSeek, DeepSeekConfig
from models.llama import Llama, LlamaConfig
from tests.helpers import make_mesh

LLAMA = dict(
    vocab_size=64, dim=32, n_layers=1, n_heads=4, hidden_dim=48, n_kv_heads=2, max_seq_len=64,
    rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 16),
)  # fmt: skip
DEEPSEEK = dict(
    vocab_size=64, dim=32, n_layers=2, n_heads=2, hidden_dim=48, moe_hidden_dim=16,
    n_routed_experts=4, n_shared_experts=1, top_k=2, first_k_dense=1, kv_lora_rank=16,
    q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    topk_method="noaux_tc", n_group=2, topk_group=1, max_seq_len=64,
)  # fmt: skip
KEY = jax.random.key(0)
BATCH, SEQ = 2, 16


def llama_config(**changes) -> LlamaConfig:
    return LlamaConfig(**{**LLAMA, **changes})


def deepseek_config(**changes) -> DeepSeekConfig:
    return DeepSeekConfig(**{**DEEPSEEK, **changes})


# ---------------------------------------------------------------- configs

CONFIG_ERRORS = [
    # (family, field changes, exception, message)
    ("llama", dict(dim=32.0), TypeError,
     r"LlamaConfig\.dim must be an int; got 32\.0 \(float\)\. Pass 32\."),
    ("llama", dict(n_kv_heads=2.5), TypeError,
     r"n_kv_heads must be an int; got 2\.5 .*whole number"),
    ("llama", dict(n_layers=True), TypeError,
     r"LlamaConfig\.n_layers must be an int; got True \(bool\)"),
    ("llama", dict(n_layers=np.bool_(True)), TypeError,
     r"LlamaConfig\.n_layers must be an int; got .*True_? \(bool_?\)"),
    ("llama", dict(rope_theta=10**400), ValueError, r"LlamaConfig\.rope_theta must be finite"),
    ("llama", dict(vocab_size="64"), TypeError,
     r"LlamaConfig\.vocab_size must be an int; got '64' \(str\)"),
    ("llama", dict(n_heads=0), ValueError, r"LlamaConfig\.n_heads must be positive; got 0"),
    ("llama", dict(max_seq_len=-8), ValueError,
     r"LlamaConfig\.max_seq_len must be positive; got -8"),
    ("llama", dict(head_dim=0), ValueError, r"LlamaConfig\.head_dim must be positive; got 0"),
    ("llama", dict(head_dim=5), ValueError, "positive even head_dim"),
    ("llama", dict(n_kv_heads=3), ValueError, "n_heads to be a multiple of n_kv_heads"),
    ("llama", dict(dim=30), ValueError, "dim must be divisible by n_heads"),
    ("llama", dict(norm_eps=float("nan")), ValueError,
     r"LlamaConfig\.norm_eps must be finite; got nan"),
    ("llama", dict(rope_theta=float("inf")), ValueError, r"LlamaConfig\.rope_theta must be finite"),
    ("llama", dict(init_std=-0.02), ValueError, r"LlamaConfig\.init_std must be > 0; got -0\.02"),
    ("llama", dict(norm_eps="1e-5"), TypeError,
     r"LlamaConfig\.norm_eps must be a real number; got '1e-5'"),
    ("llama", dict(tie_embeddings=1), TypeError,
     r"LlamaConfig\.tie_embeddings must be True or False; got 1"),
    ("llama", dict(qk_norm="yes"), TypeError, r"LlamaConfig\.qk_norm must be True or False"),
    ("llama", dict(attention_bias=None), TypeError,
     r"LlamaConfig\.attention_bias must be True or False"),
    ("llama", dict(remat=None), ValueError,
     r"LlamaConfig\.remat must be one of \('none', 'full', 'dots', 'offload'\)"),
    ("llama", dict(param_dtype="bf16"), ValueError, r"LlamaConfig\.param_dtype must be one of"),
    ("llama", dict(compute_dtype=jnp.int8), ValueError,
     r"LlamaConfig\.compute_dtype must be one of"),
    ("llama", dict(rope_scaling={"factor": 8.0}), TypeError,
     r"rope_scaling must be a AbstractRopeScaling or None; got \{'factor': 8\.0\} \(dict\)"
     r".*Llama3RopeScaling, YarnRopeScaling or LinearRopeScaling"),
    ("deepseek", dict(top_k=2.0), TypeError, r"DeepSeekConfig\.top_k must be an int; got 2\.0"),
    ("deepseek", dict(kv_lora_rank=np.float32(16)), TypeError,
     r"DeepSeekConfig\.kv_lora_rank must be an int"),
    ("deepseek", dict(n_shared_experts=-1), ValueError,
     r"DeepSeekConfig\.n_shared_experts must be >= 0; got -1"),
    ("deepseek", dict(first_k_dense=3), ValueError, "first_k_dense <= n_layers"),
    ("deepseek", dict(q_lora_rank=0), ValueError,
     r"DeepSeekConfig\.q_lora_rank must be positive; got 0\. Use None"),
    ("deepseek", dict(routed_scaling_factor=0), ValueError,
     r"routed_scaling_factor must be > 0; got 0\.0"),
    ("deepseek", dict(norm_topk_prob="true"), TypeError,
     r"DeepSeekConfig\.norm_topk_prob must be True or False"),
    ("deepseek", dict(rope_interleave=0), TypeError,
     r"DeepSeekConfig\.rope_interleave must be True or False"),
    ("deepseek", dict(topk_method="topk"), ValueError,
     r"DeepSeekConfig topk_method must be one of"),
    ("deepseek", dict(grouped_matmul="dense"), ValueError,
     r"DeepSeekConfig\.grouped_matmul must be one of"),
    ("deepseek", dict(top_k=5), ValueError,
     r"DeepSeekConfig needs 1 <= top_k <= n_experts; got top_k=5, n_experts=4"),
    ("deepseek", dict(n_group=3), ValueError, r"n_group equal groups; got n_experts=4, n_group=3"),
    ("deepseek", dict(n_group=4, topk_group=2), ValueError, "groups need >= 2 experts"),
    ("deepseek", dict(qk_rope_head_dim=3), ValueError, "even qk_rope_head_dim"),
    ("deepseek", dict(rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 16)), TypeError,
     r"DeepSeekConfig\.rope_scaling must be a YarnRopeScaling or None"),
]  # fmt: skip


@pytest.mark.parametrize("family, changes, error, match", CONFIG_ERRORS)
def test_config_errors(family, changes, error, match):
    build = llama_config if family == "llama" else deepseek_config
    with pytest.raises(error, match=match):
        build(**changes)


BUILDING_BLOCK_ERRORS = [
    (lambda: Llama3RopeScaling(8.0, 1.0, 4.0, 8192.0), TypeError,
     r"Llama3RopeScaling\.original_max_position_embeddings must be an int; got 8192\.0"),
    (lambda: Llama3RopeScaling("8", 1.0, 4.0, 8192), TypeError,
     r"Llama3RopeScaling\.factor must be a real number; got '8'"),
    (lambda: YarnRopeScaling(40.0, 4096, truncate="yes"), TypeError,
     r"YarnRopeScaling\.truncate must be True or False"),
    (lambda: YarnRopeScaling(40.0, 4096, mscale=float("nan")), ValueError,
     r"YarnRopeScaling\.mscale must be finite"),
    (lambda: YarnRopeScaling(40.0, 0), ValueError,
     r"YarnRopeScaling\.original_max_position_embeddings must be positive; got 0"),
    (lambda: LlamaConfig.from_preset("llama9"), ValueError,
     r"unknown Llama preset 'llama9'; choose one of \['llama2-7b', 'llama3\.1-8b'"),
    (lambda: DeepSeekConfig.from_preset(["tiny"]), ValueError,
     r"unknown DeepSeek preset \['tiny'\]"),
    (lambda: LlamaConfig.from_preset("tiny", hidden=64), TypeError,
     r"from_preset\('tiny'\) got override\(s\) \['hidden'\] that are not fields of LlamaConfig"),
    (lambda: DeepSeekConfig.from_preset("tiny", experts=8), TypeError,
     r"override\(s\) \['experts'\] that are not fields of DeepSeekConfig"),
]  # fmt: skip


@pytest.mark.parametrize("build, error, match", BUILDING_BLOCK_ERRORS)
def test_scaling_and_preset_errors(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_config_accepts_numpy_numbers():
    """NumPy integers and floats (e.g. from arithmetic on shapes) are plain Python values in
    the config, so it stays hashable, equal to the literal one and JSON-serialisable."""
    numpy_kw = dict(dim=np.int64(32), n_heads=jnp.int32(4), norm_eps=np.float32(1e-5))
    config = llama_config(**numpy_kw)
    assert config == llama_config(dim=32, n_heads=4, norm_eps=float(np.float32(1e-5)))
    assert type(config.dim) is int and type(config.norm_eps) is float
    json.dumps(dataclasses.asdict(config))


# ---------------------------------------------------------------- constructors

MESH_SHAPE = ((2, 4), ("data", "context"))

CONSTRUCTOR_ERRORS = [
    # (model class, config, key, spec, exception, message); spec "mesh" = a bare mesh
    (Llama, "llama", 0, None, TypeError,
     r"Llama needs key=a JAX PRNG key .*got 0 \(int\)\. Pass key=jax\.random\.key\(0\)"),
    (Llama, "llama", np.zeros(3), None, TypeError,
     r"Llama needs key=a JAX PRNG key .*of shape \(3,\)"),
    (Llama, "llama", KEY, "ring", TypeError,
     r"Llama needs spec=a ShardingSpec or None .*got 'ring' \(str\)\. Build one with "
     r"ShardingSpec\(mesh, strategy='ring'\)"),
    (Llama, "llama", KEY, "mesh", TypeError, r"Llama needs spec=.*mesh goes inside the spec"),
    (Llama, dict(LLAMA), KEY, None, TypeError,
     r"Llama's config must be a LlamaConfig; got \{.*\(dict\)\. "
     r"Build one with LlamaConfig\(\.\.\.\)"),
    (Llama, "deepseek", KEY, None, TypeError,
     r"Llama's config must be a LlamaConfig; got DeepSeekConfig"),
    (DeepSeek, "deepseek", 1, None, TypeError, r"DeepSeek needs key=a JAX PRNG key"),
    (DeepSeek, "deepseek", KEY, "ulysses", TypeError, r"ShardingSpec\(mesh, strategy='ulysses'\)"),
    (DeepSeek, "llama", KEY, None, TypeError, r"DeepSeek's config must be a DeepSeekConfig"),
]  # fmt: skip


@pytest.mark.parametrize("cls, config, key, spec, error, match", CONSTRUCTOR_ERRORS)
def test_constructor_errors(cls, config, key, spec, error, match):
    if isinstance(config, str):
        config = {"llama": llama_config, "deepseek": deepseek_config}[config]()
    if spec == "mesh":
        spec = make_mesh(*MESH_SHAPE)
    with pytest.raises(error, match=match):
        cls(config, key=key, spec=spec)


BLOCKS = {
    "SelfAttention": lambda spec: SelfAttention(16, 4, 2, 4, rope=RoPE(4, 1e4), key=KEY, spec=spec),
    "MultiHeadLatentAttention": lambda spec: MultiHeadLatentAttention(
        16, 2, kv_lora_rank=8, q_lora_rank=None, qk_nope_head_dim=4, qk_rope_head_dim=4,
        v_head_dim=4, rope=RoPE(4, 1e4, interleaved=True), key=KEY, spec=spec,
    ),
    "SwiGLU": lambda spec: SwiGLU(16, 24, key=KEY, spec=spec),
    "MoE": lambda spec: MoE(16, 8, 4, 2, key=KEY, spec=spec),
}  # fmt: skip


@pytest.mark.parametrize("name", BLOCKS)
def test_building_blocks_check_their_spec(name):
    with pytest.raises(TypeError, match=rf"{name} needs spec=a ShardingSpec or None .*'usp'"):
        BLOCKS[name]("usp")


def test_decoder_block_checks_its_sublayers():
    """The block holds no spec (its sublayers do); it checks that they are modules."""
    attn, mlp = BLOCKS["SelfAttention"](None), BLOCKS["SwiGLU"](None)
    assert isinstance(DecoderBlock(attn, mlp, dim=16).mlp, SwiGLU)
    with pytest.raises(TypeError, match=r"DecoderBlock's attn must be a callable Equinox module"):
        DecoderBlock(lambda x, p, s: x, mlp, dim=16)
    # Under pytest, beartype checks the annotation (a callable) before the block's own check.
    with pytest.raises(TypeError, match=r"DecoderBlock's mlp must be .* got ndarray|'mlp'"):
        DecoderBlock(attn, np.zeros(3), dim=16)


# ---------------------------------------------------------------- calls


@pytest.fixture(scope="module")
def models():
    spec = el.ShardingSpec(make_mesh(*MESH_SHAPE), strategy="ring")  # zigzag over 4 shards
    return Llama(llama_config(), key=KEY), Llama(llama_config(), key=KEY, spec=spec)


TOKENS = np.random.default_rng(0).integers(0, 64, (BATCH, SEQ)).astype(np.int32)

CALL_ERRORS = [
    # (sharded model?, call arguments, exception, message)
    (False, dict(tokens="abc"), TypeError,
     r"tokens must be a \[batch, seq\] array of integers .*got str"),
    (False, dict(tokens=TOKENS, positions=np.zeros((BATCH, SEQ), bool)), ValueError,
     "positions must be integers; got dtype bool"),
    (False, dict(tokens=TOKENS, positions=[[0.5] * SEQ] * BATCH), ValueError,
     "positions must be integers; got dtype float32"),
    (False, dict(tokens=TOKENS, segment_ids=np.zeros((BATCH, SEQ, 1), np.int32)), ValueError,
     r"segment_ids must have the \[batch, seq\] shape of the tokens, \(2, 16\); got \(2, 16, 1\)"),
    (False, dict(tokens=TOKENS, segment_ids={"a": 1}), TypeError,
     r"segment_ids must be a \[batch, seq\] array of integers .*got dict"),
    (False, dict(tokens=TOKENS, segment_ids=np.full((BATCH, SEQ), 2**32, np.int64)), ValueError,
     r"segment_ids must fit int32 .*got ids in \[4294967296, 4294967296\]"),
    (True, dict(tokens=TOKENS[:1]), ValueError,
     r"the batch is split over 'data' \(2\): 2 devices, so the batch of the tokens must be "
     r"divisible by 2; got batch=1\. Use a batch of 2"),
    (True, dict(tokens=np.concatenate([TOKENS, TOKENS[:1]])), ValueError,
     r"must be divisible by 2; got batch=3"),
    (True, dict(tokens=TOKENS[:, :12]), ValueError,
     r"load_balance='zigzag' over N=4 sequence shards .*divisible by 8; got seq=12\. Use seq=16"),
    (True, dict(tokens=TOKENS[:, :12], positions=np.zeros((BATCH, 12), np.int32)), ValueError,
     r"divisible by 8; got seq=12"),
]  # fmt: skip


@pytest.mark.parametrize("sharded, args, error, match", CALL_ERRORS)
def test_call_errors(models, sharded, args, error, match):
    with pytest.raises(error, match=match):
        models[sharded](**args)


def test_spec_rules_hold_under_jit(models):
    """The checks read static shapes, so they also raise while tracing, before XLA's
    IndivisibleError."""
    with pytest.raises(ValueError, match=r"must be divisible by 2; got batch=1"):
        eqx.filter_jit(models[True])(jnp.asarray(TOKENS[:1]))


def test_forward_embeddings_errors(models):
    x = jnp.zeros((3, SEQ, 32))
    positions = jnp.zeros((3, SEQ), jnp.int32)
    with pytest.raises(ValueError, match=r"the batch of the x must be divisible by 2; got batch=3"):
        models[True].forward_embeddings(x, positions)
    with pytest.raises(
        ValueError, match=r"x must be \[batch, seq, embed=32\] .*got shape \(3, 16, 31\)"
    ):
        models[False].forward_embeddings(jnp.zeros((3, SEQ, 31)), positions)


def test_tokens_as_numpy_or_lists_just_work(models):
    single, sharded = models
    expected = single(jnp.asarray(TOKENS))
    np.testing.assert_array_equal(single(TOKENS.astype(np.int64)), expected)
    np.testing.assert_array_equal(single(TOKENS.tolist()), expected)
    order = layout_order(sharded.spec, SEQ)  # a sharded model takes tokens in layout order
    np.testing.assert_allclose(sharded(TOKENS[:, order]), expected[:, order], atol=1e-5)
