"""Llama model and its building blocks: shapes, causality, packing, GQA, RoPE, remat, presets."""

import dataclasses
import math
import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CHILD_XLA_FLAGS, ROOT, assert_close, random_segment_ids

from eqx_longctx.nn import LayerStack, Llama3RopeScaling, RMSNorm, RoPE, SelfAttention
from models.llama import PRESETS, Llama, LlamaConfig

BATCH, SEQ = 2, 16
SMALL = LlamaConfig.from_preset(
    "tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, max_seq_len=64
)


@eqx.filter_jit
def run(model, tokens, positions=None, segment_ids=None):
    """Jitted forward shared by the tests: one compilation per config and shape."""
    return model(tokens, positions, segment_ids)


def make(cfg: LlamaConfig = SMALL, seed: int = 0) -> Llama:
    return Llama(cfg, key=jax.random.key(seed))


def random_tokens(seed: int = 1, batch: int = BATCH, seq: int = SEQ):
    return jax.random.randint(jax.random.key(seed), (batch, seq), 0, SMALL.vocab_size)


def arange_positions(batch: int = BATCH, seq: int = SEQ):
    return jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))


def positions_from_segments(segment_ids) -> jax.Array:
    """Positions that restart at 0 at every document boundary (what packing produces)."""
    seg = np.asarray(segment_ids)
    pos = np.zeros_like(seg)
    for b in range(seg.shape[0]):
        for s in range(1, seg.shape[1]):
            pos[b, s] = 0 if seg[b, s] != seg[b, s - 1] else pos[b, s - 1] + 1
    return jnp.asarray(pos, jnp.int32)


def packed_segments():
    row0 = np.array([0] * 5 + [1] * 6 + [2] * 5)
    row1 = np.asarray(random_segment_ids(jax.random.key(7), 1, SEQ)[0])
    return jnp.asarray(np.stack([row0, row1]), jnp.int32)


def xent_loss(model, tokens):
    logits = model(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


# ---------------------------------------------------------------- forward pass


def test_output_shape_dtype_and_default_positions():
    model, tokens = make(), random_tokens()
    logits = run(model, tokens)
    assert logits.shape == (BATCH, SEQ, SMALL.vocab_size) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    assert_close(run(model, tokens, arange_positions()), logits, what="explicit positions")


def test_causality_and_document_isolation_gradients():
    """d logits[t] / d embedding[t'] is exactly zero unless t' <= t in the same document."""
    model = make()
    segment_ids = packed_segments()
    positions = positions_from_segments(segment_ids)
    x = model.embed_tokens(random_tokens())

    def logit_sum(x, t):
        return model.forward_embeddings(x, positions, segment_ids)[:, t].sum()

    jac = jax.jit(jax.vmap(lambda t: jax.grad(logit_sum)(x, t)))(jnp.arange(SEQ))  # [t,b,s,e]
    influence = np.asarray(jnp.abs(jac).sum(-1)).transpose(1, 0, 2)  # [b, t, s]
    seg = np.asarray(segment_ids)
    t_idx, s_idx = np.arange(SEQ)[:, None], np.arange(SEQ)[None, :]
    visible = (s_idx <= t_idx)[None] & (seg[:, :, None] == seg[:, None, :])
    assert np.all(influence[~visible] == 0.0), "a logit depends on a future or foreign token"
    assert np.all(influence[visible] > 0.0)


def test_packed_documents_isolated_and_equal_to_unpacked():
    model = make()
    segment_ids = packed_segments()
    positions = positions_from_segments(segment_ids)
    tokens = random_tokens()
    logits = run(model, tokens, positions, segment_ids)

    changed = tokens.at[0, :5].set((tokens[0, :5] + 17) % SMALL.vocab_size)  # document 0
    logits_changed = run(model, changed, positions, segment_ids)
    np.testing.assert_allclose(logits_changed[0, 5:], logits[0, 5:], atol=1e-6, rtol=0)
    np.testing.assert_allclose(logits_changed[1], logits[1], atol=1e-6, rtol=0)
    assert not np.allclose(logits_changed[0, :5], logits[0, :5])

    alone = run(model, tokens[:1, 5:11])  # document 1, run on its own from position 0
    assert_close(logits[:1, 5:11], alone, what="packed vs unpacked document")


@pytest.mark.parametrize("n_kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_grouped_kv_heads_equal_mha_with_repeated_kv(n_kv_heads):
    """Query head h reads kv head h // group: the same as MHA with each kv head repeated."""
    cfg = dataclasses.replace(SMALL, n_kv_heads=n_kv_heads)
    model, tokens = make(cfg), random_tokens()
    group = cfg.n_heads // n_kv_heads
    attn = model.layers.layers.attn
    mha_attn = make(dataclasses.replace(SMALL, n_kv_heads=cfg.n_heads)).layers.layers.attn
    mha_attn = eqx.tree_at(
        lambda a: (a.wq, a.wk, a.wv, a.wo),
        mha_attn,
        (attn.wq, jnp.repeat(attn.wk, group, axis=2), jnp.repeat(attn.wv, group, axis=2), attn.wo),
    )
    mha = eqx.tree_at(lambda m: m.layers.layers.attn, model, mha_attn)
    assert mha.layers.layers.attn.n_kv_heads == cfg.n_heads
    assert_close(run(mha, tokens), run(model, tokens), what=f"n_kv_heads={n_kv_heads} vs MHA")


def test_attention_bias_and_tied_embeddings():
    cfg = dataclasses.replace(SMALL, attention_bias=True, tie_embeddings=True)
    model = make(cfg)
    assert model.lm_head is None
    extra = cfg.n_layers * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    assert model.num_params() == make().num_params() + extra - cfg.vocab_size * cfg.dim
    assert run(model, random_tokens()).shape == (BATCH, SEQ, cfg.vocab_size)


def test_bfloat16_compute_close_to_float32():
    tokens = random_tokens()
    ref = run(make(), tokens)
    mixed = make(dataclasses.replace(SMALL, compute_dtype=jnp.bfloat16))  # same f32 params
    out = run(mixed, tokens)
    assert out.dtype == jnp.float32
    assert_close(out, ref, dtype=jnp.bfloat16, factor=2, what="bf16 compute")
    cfg = dataclasses.replace(SMALL, compute_dtype="bfloat16", param_dtype="bfloat16")
    pure = eqx.filter_eval_shape(Llama, cfg, key=jax.random.key(0))
    assert {leaf.dtype for leaf in jax.tree.leaves(pure)} == {jnp.dtype(jnp.bfloat16)}
    logits = eqx.filter_eval_shape(run, pure, tokens)
    assert (logits.shape, logits.dtype) == ((BATCH, SEQ, SMALL.vocab_size), jnp.float32)


# ---------------------------------------------------------------- layers


def test_scan_over_layers_equals_python_loop():
    model = make()
    segment_ids = packed_segments()
    positions = positions_from_segments(segment_ids)
    x = model.embed_tokens(random_tokens())

    @eqx.filter_jit
    def loop(stack, x):
        for i in range(stack.n_layers):
            x = stack.layer(i)(x, positions, segment_ids)
        return x

    scanned = eqx.filter_jit(lambda stack, x: stack(x, positions, segment_ids))(model.layers, x)
    looped = loop(model.layers, x)
    assert_close(scanned, looped, what="scan vs loop")


def test_remat_policies_give_same_loss_and_grads():
    """Bit for bit. XLA:CPU's default fusion emitters compile a rematerialized forward to
    the same code as the first; the older emitter the test processes use for speed
    (conftest.py, where this jaxlib has it) does not, so the comparison then runs in a
    child process with the default."""
    if "--xla_cpu_use_fusion_emitters=false" in os.environ["XLA_FLAGS"]:
        flags = CHILD_XLA_FLAGS.replace("fusion_emitters=false", "fusion_emitters=true")
        node = f"{__file__}::test_remat_policies_give_same_loss_and_grads"
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
            capture_output=True, text=True, timeout=600, cwd=ROOT,
            env=dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8"),
        )  # fmt: skip
        assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout + proc.stderr
        return
    tokens = random_tokens(seq=SEQ + 1)
    results = {}
    for remat in ("none", "full", "dots"):
        model = make(dataclasses.replace(SMALL, remat=remat))
        jaxpr = str(jax.make_jaxpr(lambda m: m(tokens))(model))
        assert ("remat" in jaxpr) == (remat != "none"), f"remat={remat} not applied"
        results[remat] = eqx.filter_jit(eqx.filter_value_and_grad(xent_loss))(model, tokens)
    loss0, grads0 = results["none"]
    for remat in ("full", "dots"):
        loss, grads = results[remat]
        np.testing.assert_array_equal(loss, loss0)
        for g, g0 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0), strict=True):
            np.testing.assert_array_equal(g, g0, err_msg=f"grads differ with remat={remat}")


def test_rmsnorm_matches_formula():
    x = jax.random.normal(jax.random.key(0), (2, 3, 8))
    norm = RMSNorm(8, eps=1e-6)
    expected = np.asarray(x) / np.sqrt(np.mean(np.asarray(x) ** 2, -1, keepdims=True) + 1e-6)
    assert_close(norm(x), expected, what="rmsnorm")


# ---------------------------------------------------------------- RoPE


def _numpy_llama3_frequencies(head_dim, theta, factor, low, high, old_len):
    """The Llama 3.1 reference loop, one frequency at a time, in plain Python."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(freq)
        elif wavelen > old_len / low:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


@pytest.mark.parametrize("preset", ["llama3.1-8b", "llama3.2-1b"])
def test_llama3_rope_scaling_matches_numpy(preset):
    cfg = PRESETS[preset]
    s = cfg.rope_scaling
    assert s is not None and cfg.head_dim is not None
    rope = RoPE(cfg.head_dim, cfg.rope_theta, s)
    expected = _numpy_llama3_frequencies(
        cfg.head_dim,
        cfg.rope_theta,
        s.factor,
        s.low_freq_factor,
        s.high_freq_factor,
        s.original_max_position_embeddings,
    )
    np.testing.assert_allclose(rope.frequencies(), expected, rtol=1e-12)
    plain = RoPE(cfg.head_dim, cfg.rope_theta).frequencies()
    assert rope.frequencies()[0] == plain[0]  # high frequencies untouched
    np.testing.assert_allclose(rope.frequencies()[-1], plain[-1] / s.factor, rtol=1e-12)
    band = (rope.frequencies() != plain) & (rope.frequencies() != plain / s.factor)
    assert band.any()  # some frequencies fall in the blended band


def _trig_in_and_out_of_scans(jaxpr, inside=False, counts=None):
    """`{(inside a scan?, primitive): count}` of the `sin` and `cos` equations of a jaxpr,
    walking every sub-jaxpr (scans, checkpoints, jits, custom derivatives, conds)."""
    counts = {} if counts is None else counts
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("sin", "cos"):
            key = (inside, eqn.primitive.name)
            counts[key] = counts.get(key, 0) + 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _trig_in_and_out_of_scans(sub, inside or eqn.primitive.name == "scan", counts)
    return counts


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_rope_tables_are_computed_once_per_stack_not_per_layer(family):
    """A layer stack computes its RoPE tables once, outside the scan over layers, for the
    forward and the backward's recomputation alike (`remat="full"`): no `sin` or `cos`
    runs per layer. Each stack has one `sin` and one `cos`."""
    if family == "llama":
        model = make(dataclasses.replace(SMALL, remat="full"))
        stacks = 1
    else:
        from models.deepseek import DeepSeek, DeepSeekConfig

        config = DeepSeekConfig.from_preset("tiny", remat="full")
        model = DeepSeek(config, key=jax.random.key(0))
        stacks = len(model.layer_stacks())
    tokens = random_tokens()
    grad = eqx.filter_grad(lambda m: jnp.mean(m(tokens) ** 2))
    counts = _trig_in_and_out_of_scans(jax.make_jaxpr(grad)(model).jaxpr)
    assert counts == {(False, "sin"): stacks, (False, "cos"): stacks}, counts


def test_rope_rotates_first_half_against_second_half():
    d = 8
    rope = RoPE(d, 10000.0)
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, d))
    pos = jax.random.randint(jax.random.key(1), (2, 5), 0, 500)
    xn, pn = np.asarray(x, np.float64), np.asarray(pos, np.float64)
    freqs = 10000.0 ** (-np.arange(0, d, 2) / d)
    angle = pn[:, :, None, None] * freqs  # [b, s, 1, d/2]
    x1, x2 = xn[..., : d // 2], xn[..., d // 2 :]
    expected = np.concatenate(
        [x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], -1
    )
    assert_close(rope(x, pos), expected, factor=5, what="rotate_half convention")


@pytest.mark.parametrize("scaling", [None, Llama3RopeScaling(8.0, 1.0, 4.0, 64)])
def test_rope_is_a_relative_rotation(scaling):
    d = 16
    rope = RoPE(d, 10000.0, scaling)
    q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, d))
    norms = jnp.linalg.norm(rope(jnp.tile(q, (1, 4, 1, 1)), jnp.array([[0, 3, 50, 999]])), axis=-1)
    np.testing.assert_allclose(norms, jnp.linalg.norm(q) * jnp.ones_like(norms), rtol=1e-5)

    def score(m, n):
        return float(jnp.sum(rope(q, jnp.array([[m]])) * rope(k, jnp.array([[n]]))))

    for offset in (0, 3, -7):
        base = score(10 + offset, 10)
        for shift in (1, 37, 500):
            np.testing.assert_allclose(score(10 + offset + shift, 10 + shift), base, atol=1e-4)


# ---------------------------------------------------------------- presets


@pytest.mark.parametrize(
    "name, expected",
    [
        ("tiny", 3_034_880),
        ("llama2-7b", 6_738_415_616),
        ("llama3.2-1b", 1_235_814_400),
        ("llama3.1-8b", 8_030_261_248),
        ("mistral-7b", 7_241_732_096),
    ],
)
def test_preset_parameter_counts(name, expected):
    model = eqx.filter_eval_shape(Llama, PRESETS[name], key=jax.random.key(0))
    assert model.num_params() == expected


def test_preset_shapes():
    assert PRESETS["llama3.1-8b"].head_dim == 128 and not PRESETS["llama3.1-8b"].tie_embeddings
    assert PRESETS["llama3.2-1b"].head_dim == 64 and PRESETS["llama3.2-1b"].tie_embeddings
    assert PRESETS["llama2-7b"].n_kv_heads == 32 and PRESETS["llama2-7b"].rope_scaling is None
    assert PRESETS["mistral-7b"].windows == (4096,) * 32
    tiny = LlamaConfig.from_preset("tiny", vocab_size=512, dim=128)
    assert (tiny.vocab_size, tiny.head_dim, tiny.n_kv_heads) == (512, 16, 4)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(n_kv_heads=3), "n_heads to be a multiple of n_kv_heads"),
        (dict(dim=60), "dim must be divisible by n_heads"),
        (dict(head_dim=15), "positive even head_dim"),
        (dict(remat="some"), "remat must be one of"),
        (dict(compute_dtype="int8"), "compute_dtype must be one of"),
        (dict(vocab_size=0), "vocab_size must be positive"),
        (dict(norm_eps=0.0), r"LlamaConfig.norm_eps must be > 0; got 0.0"),
    ],
)
def test_config_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_preset("tiny", **overrides)


def test_building_block_errors():
    with pytest.raises(ValueError, match="unknown Llama preset"):
        LlamaConfig.from_preset("llama9")
    with pytest.raises(ValueError, match="low_freq_factor <= high_freq_factor"):
        Llama3RopeScaling(8.0, 4.0, 1.0, 8192)
    with pytest.raises(ValueError, match="factor >= 1"):
        Llama3RopeScaling(0.5, 1.0, 4.0, 8192)
    with pytest.raises(ValueError, match="positive even number"):
        RoPE(7, 10000.0)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        SelfAttention(16, 4, 3, 4, rope=RoPE(4, 1e4), key=jax.random.key(0))
    with pytest.raises(ValueError, match="rotate the whole head"):
        SelfAttention(16, 4, 2, 4, rope=RoPE(8, 1e4), key=jax.random.key(0))
    with pytest.raises(ValueError, match="remat must be one of"):
        LayerStack(lambda k: RMSNorm(4), 2, key=jax.random.key(0), remat="all")
    with pytest.raises(ValueError, match="eps > 0"):
        RMSNorm(4, eps=0.0)


def test_call_errors():
    model, tokens = make(), random_tokens()
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, vocab_size=259\)"):
        model(tokens.at[0, 3].set(259))
    with pytest.raises(ValueError, match="token ids must lie in"):
        model(tokens.at[1, 0].set(-1))
    with pytest.raises(ValueError, match="tokens must be integer ids"):
        model(tokens.astype(jnp.float32))
    with pytest.raises(ValueError, match="positions must be integers"):
        model(tokens, positions=arange_positions().astype(jnp.float32))
    with pytest.raises(ValueError, match="tokens must have rank 2"):
        model(tokens[0])
    with pytest.raises(ValueError, match="max_seq_len=64"):
        model(jnp.zeros((1, 65), jnp.int32))
    with pytest.raises(ValueError, match="max_seq_len=64"):
        eqx.filter_jit(model)(jnp.zeros((1, 65), jnp.int32))  # static shape check under jit
    with pytest.raises(ValueError, match=r"positions must have the \[batch, seq\] shape"):
        model(tokens, positions=arange_positions(seq=SEQ - 1))
    with pytest.raises(ValueError, match=r"segment_ids must have the \[batch, seq\] shape"):
        model(tokens, segment_ids=jnp.zeros((BATCH + 1, SEQ), jnp.int32))
    with pytest.raises(ValueError, match="check_tokens needs concrete token ids"):
        jax.jit(lambda t: model.check_tokens(t))(tokens)
