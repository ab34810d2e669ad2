"""Sliding-window Llama-family models: Mistral and Qwen2/Qwen3 windows against
`transformers`, on one device and under context parallelism; `from_hf`/`to_hf` round trips;
the window at the model level (gradients); config and `config.json` errors.

References are tiny random float32 `transformers` models (eager attention) with a window of
8 over 32 tokens, so every sliding layer masks most of each row.
"""

import dataclasses
import json

import equinox as eqx
import hf_helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mesh
from hf_helpers import copy_of, edit_config, forward, hf_logits, hf_modules, load_tensors, max_diff

import eqx_longctx as el
from eqx_longctx.nn import RoPE, SelfAttention
from models.llama import Llama, LlamaConfig, from_hf, to_hf

ATOL = 1e-4  # max abs logit difference against transformers, float32
BATCH, SEQ, VOCAB, WINDOW = 2, 32, 96, 8
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=80,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.1,
)
SLIDE, FULL = "sliding_attention", "full_attention"

# name -> (transformers config class, extra config fields, expected (sliding_window, layer_types))
FAMILIES = {
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=WINDOW), (WINDOW, None)),
    "qwen2-max-window-layers": (
        "Qwen2Config",
        dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
             max_window_layers=1),
        (WINDOW, (FULL, SLIDE, SLIDE)),  # layers >= max_window_layers slide
    ),
    "qwen3-layer-types": (
        "Qwen3Config",
        dict(num_hidden_layers=4, head_dim=16, use_sliding_window=True, sliding_window=WINDOW,
             max_window_layers=3, layer_types=[SLIDE, FULL, SLIDE, SLIDE]),
        (WINDOW, (SLIDE, FULL, SLIDE, SLIDE)),  # layer_types wins over max_window_layers
    ),
}  # fmt: skip
# (family, strategy, layout, mesh axes): each family under a spec; every strategy once.
CONTEXT_PARALLEL = [
    ("mistral", "ring", "zigzag", {"data": 1, "context": 4}),
    ("mistral", "all_gather", "none", {"data": 2, "context": 4}),
    ("qwen2-max-window-layers", "ulysses", "zigzag", {"data": 2, "context": 4}),
    ("qwen3-layer-types", "ring", "striped", {"data": 2, "context": 4}),
    ("qwen3-layer-types", "usp", "zigzag", {"ulysses": 2, "context": 4}),
]


build_hf = hf_helpers.model_builder(FAMILIES, SMALL, _attn_implementation="eager")
tokens, checkpoints = hf_helpers.checkpoint_fixtures(FAMILIES, build_hf, (BATCH, SEQ), VOCAB)


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(checkpoints, tokens, family):
    path, ref = checkpoints[family]
    model = from_hf(path)
    assert (model.config.sliding_window, model.config.layer_types) == FAMILIES[family][2]
    diff = max_diff(forward(model, tokens), ref)
    print(f"{family}: max |logits - transformers| = {diff:.2e}")
    assert diff <= ATOL


# config.json edits that turn every window off
NO_WINDOWS = {
    "mistral": dict(null=["sliding_window"]),
    "qwen2-max-window-layers": dict(use_sliding_window=False, layer_types=None),
    "qwen3-layer-types": dict(use_sliding_window=False, layer_types=None),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_windows_matter(checkpoints, tokens, tmp_path, family):
    """The same weights without windows miss the reference by far: the parity above is no
    accident of windows wider than the sequence."""
    path = copy_of(checkpoints, family, tmp_path)
    edit_config(path, **NO_WINDOWS[family])
    model = from_hf(path)
    assert model.config.windows == (None,) * model.config.n_layers
    assert max_diff(forward(model, tokens), checkpoints[family][1]) > 100 * ATOL


@pytest.mark.parametrize("family,strategy,layout,axes", CONTEXT_PARALLEL)
def test_context_parallel_logits_match_transformers(
    checkpoints, tokens, family, strategy, layout, axes
):
    path, ref = checkpoints[family]
    mesh = make_mesh(tuple(axes.values()), tuple(axes))
    extra = dict(batch_axis=None, ulysses_axis="ulysses") if strategy == "usp" else {}
    spec = el.ShardingSpec(mesh, strategy, layout, **extra)
    model = from_hf(path, spec=spec)
    logits = el.from_layout(forward(model, el.to_layout(tokens, spec)), spec)
    diff = max_diff(logits, ref)
    print(f"{family} {strategy}/{layout} {axes}: max |logits - transformers| = {diff:.2e}")
    assert diff <= ATOL


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip(checkpoints, tokens, tmp_path, family):
    """from_hf -> to_hf -> from_hf is exact, and transformers reads the same model back."""
    path, ref = checkpoints[family]
    model = from_hf(path)
    to_hf(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == json.loads((path / "config.json").read_text())["model_type"]
    again = from_hf(tmp_path)
    assert again.config == model.config
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _, transformers = hf_modules()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    assert max_diff(hf_logits(reloaded, tokens), ref) <= ATOL


def test_uniform_models_keep_one_stack():
    """No windows or one window everywhere: one LayerStack, as before; mixed: one per run."""
    base = LlamaConfig(64, 32, 3, 4, 48)
    for config in (base, dataclasses.replace(base, sliding_window=4)):
        model = Llama(config, key=jax.random.key(0))
        assert model.layers.layers.attn.wq.shape == (3, 32, 4, 8)
        assert model.layers.layers.attn.window == config.sliding_window
    mixed = dataclasses.replace(base, sliding_window=4, layer_types=(FULL, SLIDE, SLIDE))
    stacks = Llama(mixed, key=jax.random.key(0)).layers
    assert isinstance(stacks, tuple)
    assert [(s.n_layers, s.layers.attn.window) for s in stacks] == [(1, None), (2, 4)]


# ---------------------------------------------------------------- the window, by gradients


@pytest.mark.parametrize("n_layers", [1, 2])
@pytest.mark.parametrize("sharded", [False, True])
def test_gradients_vanish_outside_the_window(n_layers, sharded):
    """d logits[i] / d embedding[j] is exactly zero unless j is within the receptive field
    (`0 <= i - j < n_layers * (W - 1) + 1`) and in the same document; nonzero inside."""
    window, seq = 4, 16
    config = LlamaConfig(64, 32, n_layers, 4, 48, n_kv_heads=2, sliding_window=window)
    spec = None
    if sharded:
        spec = el.ShardingSpec(make_mesh((1, 4), ("data", "context")), "ring", "zigzag")
    model = Llama(config, key=jax.random.key(1), spec=spec)
    segment_ids = jnp.repeat(
        jnp.array([[0, 1]], jnp.int32), jnp.array([11, 5]), axis=1, total_repeat_length=seq
    )
    positions = jnp.concatenate([jnp.arange(11), jnp.arange(5)])[None]
    x = model.embed_tokens(jnp.asarray(np.arange(seq)[None] % 64, jnp.int32))
    order = np.arange(seq) if spec is None else el.layout_order(spec, seq)  # layout -> token
    if spec is not None:
        x, positions, segment_ids = (el.to_layout(a, spec) for a in (x, positions, segment_ids))

    def logit_sum(x, t):
        logits = model.forward_embeddings(x, positions, segment_ids)  # no indexing: sharded
        return jnp.where((jnp.arange(seq) == t)[None, :, None], logits, 0.0).sum()

    jac = jax.jit(jax.vmap(lambda t: jax.grad(logit_sum)(x, t)))(jnp.arange(seq))  # [t,1,s,e]
    influence = np.zeros((seq, seq))
    influence[np.ix_(order, order)] = np.asarray(jnp.abs(jac[:, 0]).sum(-1))
    seg = np.repeat([0, 1], [11, 5])
    lag = np.arange(seq)[:, None] - np.arange(seq)[None, :]
    visible = (lag >= 0) & (lag < n_layers * (window - 1) + 1) & (seg[:, None] == seg[None, :])
    assert np.all(influence[~visible] == 0.0), "a logit depends on a token outside its window"
    assert np.all(influence[visible] > 0.0)


# ---------------------------------------------------------------- errors


CONFIG_ERRORS = [
    (dict(sliding_window=0), ValueError, "sliding_window must be positive; got 0"),
    (dict(sliding_window=2.5), TypeError, "sliding_window must be an int"),
    (dict(sliding_window=4, layer_types=(SLIDE,) * 2), ValueError,
     "one entry per layer; got 2 for n_layers=3"),
    (dict(sliding_window=4, layer_types=(SLIDE, "chunked_attention", FULL)), ValueError,
     r"layer_types\[1\] must be one of \('full_attention', 'sliding_attention'\)"),
    (dict(sliding_window=4, layer_types=SLIDE), TypeError, "must be None or a tuple"),
    (dict(layer_types=(FULL, SLIDE, FULL)), ValueError,
     "marks 1 layer.* 'sliding_attention' but sliding_window=None"),
    (dict(sliding_window=4, layer_types=(FULL,) * 3), ValueError,
     "sliding_window=4 is used by no layer"),
]  # fmt: skip


@pytest.mark.parametrize("changes,error,match", CONFIG_ERRORS)
def test_config_errors(changes, error, match):
    with pytest.raises(error, match=match):
        LlamaConfig(64, 32, 3, 4, 48, **changes)


def test_config_normalises_layer_types():
    config = LlamaConfig(64, 32, 3, 4, 48, sliding_window=4, layer_types=[SLIDE, FULL, SLIDE])
    assert config.layer_types == (SLIDE, FULL, SLIDE) and config.windows == (4, None, 4)
    uniform = LlamaConfig(64, 32, 3, 4, 48, sliding_window=4, layer_types=[SLIDE] * 3)
    assert uniform == LlamaConfig(64, 32, 3, 4, 48, sliding_window=4)
    assert uniform.layer_types is None and uniform.windows == (4, 4, 4)
    assert LlamaConfig(64, 32, 3, 4, 48, layer_types=(FULL,) * 3).layer_types is None


def test_self_attention_window_needs_causal():
    with pytest.raises(ValueError, match="sliding window needs causal=True"):
        SelfAttention(32, 4, 4, 8, rope=RoPE(8, 1e4), key=jax.random.key(0), causal=False, window=4)


def test_hf_window_semantics(checkpoints, tmp_path):
    """transformers' rules: Qwen's window needs use_sliding_window; no layer at or above
    max_window_layers means no window; Mistral's window defaults to 4096 and null is full."""
    qwen = copy_of(checkpoints, "qwen2-max-window-layers", tmp_path)
    edit_config(qwen, use_sliding_window=False, layer_types=None)
    assert from_hf(qwen).config.windows == (None,) * 3
    edit_config(qwen, use_sliding_window=True, max_window_layers=3)
    assert from_hf(qwen).config.windows == (None,) * 3
    edit_config(qwen, max_window_layers=0, sliding_window=None)  # absent: 4096
    assert from_hf(qwen).config.windows == (4096,) * 3
    edit_config(qwen, null=["max_window_layers"])  # null: 28, above every layer
    assert from_hf(qwen).config.windows == (None,) * 3
    mistral = copy_of(checkpoints, "mistral", tmp_path)
    edit_config(mistral, sliding_window=None)
    assert from_hf(mistral).config.sliding_window == 4096
    edit_config(mistral, null=["sliding_window"])
    model = from_hf(mistral)
    assert model.config.sliding_window is None
    to_hf(model, tmp_path / "llama")  # no window left: written as Llama
    assert json.loads((tmp_path / "llama" / "config.json").read_text())["model_type"] == "llama"


HF_ERRORS = [
    ("mistral", dict(layer_types=[SLIDE, SLIDE]), "MistralForCausalLM ignores it"),
    ("mistral", dict(sliding_window=0), "sliding_window must be positive; got 0"),
    ("qwen2-max-window-layers", dict(use_sliding_window=False, layer_types=[FULL, SLIDE, SLIDE]),
     "layer_types marks sliding layers but use_sliding_window=False"),
    ("qwen2-max-window-layers", dict(max_window_layers=-1), "max_window_layers must be >= 0"),
    ("qwen3-layer-types", dict(layer_types=[SLIDE, FULL]), "one entry per layer; got 2"),
    ("qwen3-layer-types", dict(layer_types=SLIDE), "layer_types must be a JSON array"),
]  # fmt: skip


@pytest.mark.parametrize("family,changes,match", HF_ERRORS)
def test_hf_config_errors(checkpoints, tmp_path, family, changes, match):
    path = copy_of(checkpoints, family, tmp_path)
    edit_config(path, **changes)
    with pytest.raises((ValueError, TypeError), match=f"config.json: .*{match}"):
        from_hf(path)


def test_to_hf_needs_a_family_for_mixed_windows(tmp_path):
    config = LlamaConfig(64, 32, 2, 4, 48, sliding_window=4, layer_types=(FULL, SLIDE))
    abstract = eqx.filter_eval_shape(Llama, config, key=jax.random.key(0))
    with pytest.raises(ValueError, match="neither mixes sliding and full layers"):
        to_hf(abstract, tmp_path / "out")


@pytest.mark.parametrize("sharded", [False, True])
def test_gradients_match_transformers(checkpoints, tokens, tmp_path, sharded):
    """Backward through mixed runs of sliding and full layers: the parameter gradients of a
    weighted logit sum equal torch's, tensor by tensor (named by writing them with `to_hf`)."""
    family = "qwen3-layer-types"
    torch, _ = hf_modules()
    reference = build_hf(family)
    weights = np.random.default_rng(1).normal(size=(BATCH, SEQ, VOCAB)).astype(np.float32)
    logits = reference(torch.as_tensor(tokens, dtype=torch.long)).logits
    (logits * torch.as_tensor(weights)).sum().backward()
    spec = None
    if sharded:
        spec = el.ShardingSpec(make_mesh((1, 4), ("data", "context")), "ring", "zigzag")
    model = from_hf(checkpoints[family][0], spec=spec)
    ours_tokens, ours_weights = tokens, weights
    if spec is not None:
        ours_tokens, ours_weights = el.to_layout(tokens, spec), el.to_layout(weights, spec)

    @eqx.filter_jit
    @eqx.filter_grad
    def grads(model):
        return (model(ours_tokens) * ours_weights).sum()

    to_hf(grads(model), tmp_path)
    ours = load_tensors(tmp_path / "model.safetensors")
    theirs = {n: p.grad.numpy() for n, p in reference.named_parameters()}
    assert sorted(ours) == sorted(theirs)
    worst = max(max_diff(ours[n], g) / float(np.max(np.abs(g))) for n, g in theirs.items())
    print(f"{family} sharded={sharded}: max |grad - torch| / max |torch| = {worst:.2e}")
    assert worst <= 2e-5
