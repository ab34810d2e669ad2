"""Gemma 2 and Gemma 3 (text) checkpoints against transformers: logits on one device and
under three specs, greedy generation, `to_hf` round trips, the local layers' ring-buffer
cache, the soft-capped chunked loss, config errors, and the presets' sizes.

References are tiny random float32 models (eager attention) with windows of 8 under 64-token
sequences, so every local layer masks most of each row: `Gemma2ForCausalLM` (local and
global layers in turn, soft-caps small enough to bite), `Gemma3ForCausalLM` (two local
layers, then a global one: three layers keep the compiles short; linear RoPE scaling,
distinct RoPE bases) and the text model of a `Gemma3ForConditionalGeneration` with the same
text config (so its forward is compiled once with `gemma3_text`'s). Norm scales are random
around 0 (the zero-centred norms start at 0, which would hide a norm read into the wrong
place). Errors are relative: max abs difference / max abs reference logit.
"""

import functools
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import need_devices, rel_err
from hf_helpers import copy_of, edit_config, forward, hf_generate, hf_logits, hf_modules

torch, transformers = hf_modules()
import hf_helpers  # noqa: E402
from test_generate_hf import compared_steps  # noqa: E402

import eqx_longctx as el  # noqa: E402
from eqx_longctx.nn import LinearRopeScaling, chunked_cross_entropy  # noqa: E402
from models import gemma  # noqa: E402

RTOL = 1e-4  # float32, relative to the largest reference logit
BATCH, SEQ, VOCAB, WINDOW = 2, 64, 96, 8
PROMPT, NEW = 20, 8
LENGTHS = np.array([PROMPT, 13], np.int32)  # ragged rows, both longer than the window
SMALL = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.1,
    sliding_window=WINDOW,
)  # fmt: skip
S, F = "sliding_attention", "full_attention"
GEMMA2 = dict(num_hidden_layers=3, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
              final_logit_softcapping=3.0)  # fmt: skip
GEMMA3 = dict(
    num_hidden_layers=3, layer_types=[S, S, F], query_pre_attn_scalar=20,
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e3},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}},
)  # fmt: skip
VISION = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
              image_size=28, patch_size=14)  # fmt: skip


def build_hf(family: str):
    if family == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**SMALL, **GEMMA2))
    elif family == "gemma3_text":
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**SMALL, **GEMMA3))
    else:  # the vision-language wrapper
        text = {**SMALL, **GEMMA3}
        config = transformers.Gemma3Config(text_config=text, vision_config=VISION,
                                           mm_tokens_per_image=4)  # fmt: skip
        model = transformers.Gemma3ForConditionalGeneration(config)
    model.config._attn_implementation = "eager"
    for sub in ("text_config", "vision_config"):
        if hasattr(model.config, sub):
            getattr(model.config, sub)._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # zero-centred: about one, not exactly
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    return model.to(torch.float32).eval()


FAMILIES = ("gemma2", "gemma3_text", "gemma3")
tokens, checkpoints = hf_helpers.checkpoint_fixtures(
    dict.fromkeys(FAMILIES), lambda f: (torch.manual_seed(0), build_hf(f))[1], (BATCH, SEQ), VOCAB
)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(checkpoints, tokens, family):
    path, ref = checkpoints[family]
    model = el.from_hf(path)
    c = model.config
    assert isinstance(model, gemma.Gemma) and c.sliding_window == WINDOW < SEQ
    assert c.qk_norm == (family != "gemma2") and c.tie_embeddings
    if family == "gemma2":
        assert (c.attn_softcap, c.final_softcap, c.query_pre_attn_scalar) == (2.0, 3.0, 24.0)
        assert c.kinds == (S, F, S) and len(model.layer_stacks()) == 3
    else:
        assert c.kinds == (S, S, F) and len(model.layer_stacks()) == 2
        assert (c.rope_theta, c.rope_local_theta, c.rope_scaling) == (
            1e3,
            50.0,
            LinearRopeScaling(8.0),
        )
    err = rel_err(forward(model, tokens), ref)
    print(f"{family}: relative error {err:.2e}")
    assert err <= RTOL


def make_spec(strategy, layout, axes):
    mesh = jax.make_mesh(tuple(axes.values()), tuple(axes))
    return el.ShardingSpec(mesh, strategy, layout)


DATA_CONTEXT = dict(data=2, context=4)
# Gemma 3 under ring / zig-zag: its prefill in test_generate_matches_transformers.
SPECS = [
    ("gemma2", "ring", "zigzag", DATA_CONTEXT),
    ("gemma3_text", "ulysses", "striped", DATA_CONTEXT),
    ("gemma3_text", "all_gather", "none", dict(context=8)),
]


@pytest.mark.parametrize("family,strategy,layout,axes", SPECS)
def test_sharded_logits_match_transformers(checkpoints, tokens, family, strategy, layout, axes):
    need_devices(8)
    path, ref = checkpoints[family]
    spec = make_spec(strategy, layout, axes)
    model = gemma.from_hf(path, spec=spec)
    logits = el.from_layout(forward(model, el.to_layout(tokens, spec)), spec)
    err = rel_err(logits, ref)
    print(f"{family} {strategy}/{layout} {axes}: relative error {err:.2e}")
    assert err <= RTOL


# ---------------------------------------------------------------- generation


@pytest.fixture(scope="module")
def generated(tmp_path_factory, tokens):
    """`generated(family)`: `(checkpoint, [(tokens, logits)] of transformers' greedy
    generation per row of the prompts)`."""

    @functools.cache
    def run(family):
        torch.manual_seed(0)
        hf = build_hf(family)
        hf.generation_config.eos_token_id = None  # generate all NEW tokens
        hf.generation_config.pad_token_id = None
        path = tmp_path_factory.mktemp(f"generate-{family}")
        hf.save_pretrained(path)
        return path, [hf_generate(hf, tokens[r, :n], NEW) for r, n in enumerate(LENGTHS)]

    return run


@pytest.mark.parametrize(
    "family,spec",
    [("gemma2", None), ("gemma3_text", ("ring", "zigzag", DATA_CONTEXT))],
    ids=["gemma2-one-device", "gemma3_text-ring-zigzag"],
)
def test_generate_matches_transformers(generated, tokens, family, spec):
    if spec is not None:
        need_devices(8)
    path, refs = generated(family)
    model = gemma.from_hf(path, spec=None if spec is None else make_spec(*spec))
    prompts = tokens[:, :PROMPT]
    out, logits = el.generate(
        model, prompts, lengths=LENGTHS, max_new_tokens=NEW, return_logits=True
    )
    out, logits = np.asarray(out), np.asarray(logits)
    for row, (ref_tokens, ref_logits) in enumerate(refs):
        n = compared_steps(out[row], ref_tokens, ref_logits)
        err = rel_err(logits[row, :n], ref_logits[:n])
        print(f"{family} {spec} row {row}: {n}/{NEW} tokens equal, logits rel err {err:.1e}")
        assert err <= RTOL


@pytest.mark.parametrize("sharded", [False, True], ids=["one-device", "ring-zigzag"])
def test_local_layers_cache_their_window(checkpoints, sharded):
    """A local layer keeps a ring buffer of `WINDOW` slots per row (rounded up to the
    context shards), whatever `max_len`; a global layer keeps at least `max_len`."""
    if sharded:
        need_devices(8)
    spec = make_spec("ring", "zigzag", DATA_CONTEXT) if sharded else None
    model = gemma.from_hf(checkpoints["gemma3_text"][0], spec=spec)
    n = 1 if spec is None else spec.context_parallel_size
    for max_len in (64, 128):
        layout = el.cache_layout(model, 2, max_len)
        slots = [(s.window, s.slots) for s in layout.stacks]
        print(f"sharded={sharded} max_len={max_len}: (window, slots) per stack {slots}")
        assert [w for w, _ in slots] == [WINDOW, None], slots
        assert slots[0][1] == -(-WINDOW // n) * n and slots[1][1] >= max_len, slots


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip(checkpoints, tokens, tmp_path, family):
    """from_hf -> to_hf -> from_hf is exact, and transformers reads the same model back
    (a gemma3 checkpoint's text model is written as gemma3_text)."""
    path, ref = checkpoints[family]
    model = gemma.from_hf(path)
    el.to_hf(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == ("gemma2" if family == "gemma2" else "gemma3_text")
    again = el.from_hf(tmp_path)
    assert again.config == model.config
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if family != "gemma3":  # the wrapper's logits have no final soft-cap; its text model's do
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, attn_implementation="eager"
        ).eval()
        assert rel_err(hf_logits(reloaded, tokens), ref) <= RTOL


# ---------------------------------------------------------------- the loss


def test_chunked_loss_applies_the_final_softcap():
    """The chunked loss with `softcap` (what the trainer passes: the model's
    `logit_softcap()`) equals the cross-entropy of the soft-capped logits."""
    config = gemma.GemmaConfig.from_preset("tiny", n_layers=1, dim=32, n_heads=2)
    model = eqx.filter_eval_shape(gemma.Gemma, config, key=jax.random.key(0))
    assert model.logit_softcap() == 30.0 and model.embed_scale() == 32**0.5
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(k1, (2, 40, 16))
    weight = 4.0 * jax.random.normal(k2, (16, 24))  # logits of tens: a cap of 3 bites
    targets = jax.random.randint(k3, (2, 40), 0, 24)
    mask = jnp.ones((2, 40), jnp.float32)
    capped = 3.0 * jnp.tanh(jnp.einsum("bse,ev->bsv", hidden, weight) / 3.0)
    want = optax.softmax_cross_entropy_with_integer_labels(capped, targets).sum()
    total, _ = chunked_cross_entropy(hidden, weight, targets, mask, chunk_tokens=24, softcap=3.0)
    np.testing.assert_allclose(float(total), float(want), rtol=1e-5)
    plain, _ = chunked_cross_entropy(hidden, weight, targets, mask, chunk_tokens=24)
    assert abs(float(plain) - float(want)) > 0.1 * float(want)
    with pytest.raises(ValueError, match="softcap"):
        chunked_cross_entropy(hidden, weight, targets, mask, softcap=0.0)


# ---------------------------------------------------------------- errors and presets


@pytest.mark.parametrize(
    "family,edit,field",
    [
        ("gemma3_text", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        ("gemma2", dict(hidden_activation="gelu"), "hidden_activation"),
        ("gemma2", dict(attention_bias=True), "attention_bias"),
        ("gemma2", dict(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                         "rope_theta": 1e4}), "rope_parameters"),
        ("gemma2", dict(quantization_config={"bits": 4}), "quantization_config"),
    ],
)  # fmt: skip
def test_unsupported_checkpoint_fields(checkpoints, tmp_path, family, edit, field):
    path = copy_of(checkpoints, family, tmp_path)
    edit_config(path, **edit)
    with pytest.raises(ValueError, match=field) as e:
        el.from_hf(path)
    assert "\n" not in str(e.value)


# The public config.json of google/gemma-2-9b and of google/gemma-3-27b-pt (its vision
# config left out), keys as the Hub has them.
HUB_CONFIGS = {
    "gemma-2-9b": dict(
        architectures=["Gemma2ForCausalLM"], attention_bias=False, attention_dropout=0.0,
        attn_logit_softcapping=50.0, bos_token_id=2, cache_implementation="hybrid",
        eos_token_id=1, final_logit_softcapping=30.0, head_dim=256,
        hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
        hidden_size=3584, initializer_range=0.02, intermediate_size=14336,
        max_position_embeddings=8192, model_type="gemma2", num_attention_heads=16,
        num_hidden_layers=42, num_key_value_heads=8, pad_token_id=0, query_pre_attn_scalar=256,
        rms_norm_eps=1e-06, rope_theta=10000.0, sliding_window=4096, sliding_window_size=4096,
        torch_dtype="float32", use_cache=True, vocab_size=256000,
    ),
    "gemma-3-27b": dict(
        architectures=["Gemma3ForConditionalGeneration"], boi_token_index=255999,
        eoi_token_index=256000, eos_token_id=[1, 106], image_token_index=262144,
        initializer_range=0.02, mm_tokens_per_image=256, model_type="gemma3",
        text_config=dict(
            head_dim=128, hidden_size=5376, intermediate_size=21504, model_type="gemma3_text",
            num_attention_heads=32, num_hidden_layers=62, num_key_value_heads=16,
            query_pre_attn_scalar=168, rope_scaling={"factor": 8.0, "rope_type": "linear"},
            sliding_window=1024,
        ),
        torch_dtype="bfloat16", vision_config={"model_type": "siglip_vision_model"},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(HUB_CONFIGS))
def test_hub_configs_read_as_the_presets(tmp_path, name):
    """The real checkpoints' config.json (transformers' defaults for what they leave out)
    give the presets."""
    (tmp_path / "config.json").write_text(json.dumps(HUB_CONFIGS[name]))
    family = el.model_family("gemma2" if name.startswith("gemma-2") else "gemma3_text")
    assert name in family.presets
    assert family.config_from_hf(tmp_path, dtype="float32") == family.presets[name]


def test_presets():
    """The real sizes' parameter counts (shapes only), and bad config values."""
    counts = {
        name: eqx.filter_eval_shape(gemma.Gemma, gemma.GemmaConfig.from_preset(name),
                                    key=jax.random.key(0)).num_params() / 1e9
        for name in ("gemma-2-9b", "gemma-3-4b", "gemma-3-27b")
    }  # fmt: skip
    assert [round(v, 2) for v in counts.values()] == [9.24, 3.88, 27.01], counts
    c = gemma.GemmaConfig.from_preset("gemma3-tiny", n_layers=12)
    assert c.kinds == (S,) * 5 + (F,) + (S,) * 5 + (F,)
    with pytest.raises(ValueError, match="GemmaConfig.attn_softcap"):
        gemma.GemmaConfig.from_preset("tiny", attn_softcap=-1.0)
    with pytest.raises(ValueError, match="LinearRopeScaling needs factor >= 1"):
        LinearRopeScaling(0.5)
    for name in ("gemma2", "gemma3_text"):
        family = el.model_family(name)
        tiny = family.config.from_preset(next(iter(family.presets)))
        assert family.local_config(tiny, tensor=2).n_layers == 1
