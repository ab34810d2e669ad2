"""Qwen3-Next and Qwen3.5 checkpoints: `from_hf` / `to_hf` against transformers.

References are tiny random float32 transformers models built offline from a config
(`Qwen3NextForCausalLM` with experts, `Qwen3_5ForCausalLM` with tied embeddings, and the
text part of a `Qwen3_5ForConditionalGeneration`), with large weights (std 0.1) and
random norm scales (the zero-centred norms start at 0, which would hide a norm read into
the wrong place). transformers runs its torch fallbacks of the delta rule and the short
convolution. Errors are relative: max abs difference / max abs reference logit.
"""

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
from hf_helpers import copy_of, edit_config, edit_tensors, forward, hf_logits  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

import eqx_longctx as el  # noqa: E402
from models.qwen3_next import Qwen3Next, Qwen3NextConfig, from_hf, to_hf  # noqa: E402

RTOL = 1e-4  # float32, relative to the largest reference logit
BATCH, SEQ, VOCAB = 2, 64, 96
SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
    linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    max_position_embeddings=128, initializer_range=0.1,
)  # fmt: skip
MOE = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=24, mlp_only_layers=[0],
    # four runs: DeltaNet (dense MLP), DeltaNet, attention, DeltaNet (experts)
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
)  # fmt: skip
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)

# name -> (transformers config class, extra config fields)
FAMILIES = {
    "qwen3_next": ("Qwen3NextConfig", MOE),
    "qwen3_5_text": ("Qwen3_5TextConfig", dict(tie_word_embeddings=True)),
    "qwen3_5": ("Qwen3_5Config", {}),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
    )),
}  # fmt: skip


def build_hf(family: str, seed: int = 0):
    cls_name, extra = FAMILIES[family]
    if family == "qwen3_5":  # the vision-language wrapper around a Qwen3.5 text model
        config = transformers.Qwen3_5Config(text_config=SMALL, vision_config=VISION)
    elif family == "qwen3_5_moe_text":  # no dense MLP, so no intermediate_size
        small = {k: v for k, v in SMALL.items() if k != "intermediate_size"}
        config = transformers.Qwen3_5MoeTextConfig(**small, **extra)
    else:
        config = getattr(transformers, cls_name)(**SMALL, **extra)
    torch.manual_seed(seed)
    if family == "qwen3_5":
        model = transformers.Qwen3_5ForConditionalGeneration(config).to(torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return randomize_norms(model.eval())


def randomize_norms(model):
    """Random norm scales: the zero-centred norms (`1 + weight`) around 0, the DeltaNet's
    output norm (`weight`) around 1, so that each scales by about one as trained models do
    (`hf_helpers.randomize_biases_and_norms` would double every zero-centred norm)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                noise = 0.3 * torch.randn(param.shape, generator=gen)
                param.copy_(noise + (1.0 if "linear_attn.norm" in name else 0.0))
    return model


tokens, checkpoints = hf_helpers.checkpoint_fixtures(FAMILIES, build_hf, (BATCH, SEQ), VOCAB)


def rel_err(a, ref) -> float:
    return hf_helpers.max_diff(a, ref) / float(np.max(np.abs(ref)))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(checkpoints, tokens, family):
    path, ref = checkpoints[family]
    model = from_hf(path)
    c = model.config
    assert c.param_dtype == "float32" and c.partial_rotary_factor == 0.25
    assert c.checkpoint_format == ("qwen3_next" if family == "qwen3_next" else "qwen3_5")
    assert c.tie_embeddings == (family == "qwen3_5_text")
    assert len(model.layer_stacks()) == (4 if family == "qwen3_next" else 2)
    assert (c.n_experts > 0) == family.endswith(("next", "moe_text"))
    err = rel_err(forward(model, tokens), ref)
    print(f"{family}: relative error {err:.2e}")
    assert err <= RTOL


# (family, strategy, layout, mesh axes): each layout and strategy kind once.
SPECS = [
    ("qwen3_next", "ring", "zigzag", dict(data=2, context=4)),
    ("qwen3_5_text", "all_gather", "striped", dict(context=8)),
    # The mesh names context before ulysses while the sequence splits over (ulysses,
    # context): lax.ppermute counts devices in the mesh's order (eqx_longctx._collectives).
    ("qwen3_next", "usp", "zigzag", dict(context=4, ulysses=2)),
]


def make_spec(strategy, layout, axes):
    mesh = jax.make_mesh(tuple(axes.values()), tuple(axes))
    ulysses = "ulysses" if "ulysses" in axes else None
    return el.ShardingSpec(mesh, strategy, layout, ulysses_axis=ulysses)


@pytest.mark.parametrize("family,strategy,layout,axes", SPECS)
def test_sharded_logits_match_transformers(checkpoints, tokens, family, strategy, layout, axes):
    path, ref = checkpoints[family]
    spec = make_spec(strategy, layout, axes)
    model = from_hf(path, spec=spec)
    logits = el.from_layout(forward(model, el.to_layout(tokens, spec)), spec)
    err = rel_err(logits, ref)
    print(f"{family} {strategy}/{layout} {axes}: relative error {err:.2e}")
    assert err <= RTOL


def packed_row(lengths):
    """Segment ids and positions of one row of documents of `lengths`."""
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])
    pos = np.concatenate([np.arange(n) for n in lengths])
    return seg.astype(np.int32), pos.astype(np.int32)


@pytest.mark.parametrize("sharded", [False, True], ids=["one-device", "ring-zigzag"])
def test_packed_documents_match_each_document_alone(checkpoints, tokens, sharded):
    """A row of packed documents gives each document's transformers logits, as if it were
    alone: the convolution, the recurrence and the attention restart at each document."""
    path, _ = checkpoints["qwen3_next"]
    lengths = [[21, 3, 40], [64]]
    segs, positions = zip(*(packed_row(n) for n in lengths), strict=True)
    segs, positions = np.stack(segs), np.stack(positions)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ref = np.zeros((BATCH, SEQ, VOCAB), np.float32)
    for row, row_lengths in enumerate(lengths):
        start = 0
        for n in row_lengths:
            ref[row, start : start + n] = hf_logits(hf, tokens[row : row + 1, start : start + n])
            start += n
    spec = make_spec("ring", "zigzag", dict(data=2, context=4)) if sharded else None
    model = from_hf(path, spec=spec)
    if spec is None:
        logits = forward(model, tokens, positions, segs)
    else:
        put = lambda a: el.to_layout(a, spec)  # noqa: E731
        logits = el.from_layout(forward(model, put(tokens), put(positions), put(segs)), spec)
    err = rel_err(logits, ref)
    print(f"packed, {'ring/zigzag' if sharded else 'one device'}: relative error {err:.2e}")
    assert err <= RTOL


def params(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_through_transformers(checkpoints, tokens, tmp_path, family):
    """`to_hf` writes every tensor bit for bit as the source stores it (the text model's
    tensors, for the vision-language source), transformers loads the result with the same
    logits, and `from_hf` reads back the same weights and config."""
    path, ref = checkpoints[family]
    model = from_hf(path)
    shard = 40_000 if family == "qwen3_next" else None
    to_hf(model, tmp_path, max_shard_size=shard)
    written = {}
    for file in tmp_path.glob("*.safetensors"):
        written.update(load_file(file))
    source = load_file(path / "model.safetensors")
    if family == "qwen3_5":
        source = {
            k.replace("model.language_model.", "model."): v
            for k, v in source.items()
            if not k.startswith("model.visual.")
        }
    if family == "qwen3_5_text":  # tied: transformers stores no lm_head either
        source.pop("lm_head.weight", None)
    assert sorted(written) == sorted(source)
    for name, array in source.items():
        np.testing.assert_array_equal(written[name], array, err_msg=name)
    arch = json.loads((tmp_path / "config.json").read_text())["architectures"]
    assert arch == [ARCHITECTURES.get(family, "Qwen3_5ForCausalLM")]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert rel_err(hf_logits(reloaded, tokens), ref) <= 1e-6
    again = from_hf(tmp_path)
    assert again.config == model.config
    for a, b in zip(params(again), params(model), strict=True):
        np.testing.assert_array_equal(a, b)


ARCHITECTURES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}


@pytest.fixture
def next_copy(checkpoints, tmp_path):
    return copy_of(checkpoints, "qwen3_next", tmp_path)


CONFIG_ERRORS = [
    (dict(model_type="qwen3_moe"), "model_type.*'qwen3_5_moe_text', 'qwen3_5_text', 'qwen3_next'"),
    (dict(architectures=["Qwen3NextModel"]), "architectures"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (dict(attention_bias=True), "attention_bias=True is not supported: .*no(ne| biases)"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1 is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_parameters.*'yarn'"),
    (dict(layer_types=["linear_attention"] * 3), "layer_types=.* is not supported: .*4 layers"),
    (dict(layer_types=["sliding_attention"] * 4), "layer_types=.* is not supported"),
    (dict(mlp_only_layers=[7]), r"mlp_only_layers=\[7\] is not supported"),
    (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0"),
    (dict(use_sliding_window=True), "use_sliding_window=True is not supported"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(linear_num_value_heads=None), "lacks.*linear_num_value_heads"),
    (dict(linear_num_key_heads=1), r"conv1d.weight: expected \(48, 1, 4\), found \(64, 1, 4\)"),
]


@pytest.mark.parametrize("changes,match", CONFIG_ERRORS)
def test_config_errors(next_copy, changes, match):
    edit_config(next_copy, **changes)
    with pytest.raises(ValueError, match=match) as e:
        from_hf(next_copy)
    assert "\n" not in str(e.value)


def test_tensor_and_argument_errors(next_copy, tmp_path):
    name = "model.layers.2.self_attn.q_proj.weight"
    original = load_file(next_copy / "model.safetensors")
    edit_tensors(next_copy, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"lacks tensor.*{name}#0"):
        from_hf(next_copy)
    edit_tensors(next_copy, lambda t: t.update({name: original[name][:64]}))
    with pytest.raises(ValueError, match=rf"{name}: expected \(128, 32\), found \(64, 32\)"):
        from_hf(next_copy)
    edit_tensors(next_copy, lambda t: t.update({name: original[name], "mtp.fc.weight": t[name]}))
    from_hf(next_copy)  # multi-token-prediction tensors are skipped
    with pytest.raises(ValueError, match="would change the weights"):
        from_hf(next_copy, n_experts=8)
    dense = Qwen3NextConfig.from_preset("tiny", dim=32, n_experts=0)
    with pytest.raises(ValueError, match="always has a gated shared expert"):
        moe = Qwen3NextConfig.from_preset("tiny", dim=32, shared_hidden_dim=0)
        to_hf(Qwen3Next(moe, key=jax.random.key(0)), tmp_path / "a")
    with pytest.raises(ValueError, match="Qwen3.5-MoE, which has experts in every layer"):
        c = Qwen3NextConfig.from_preset("tiny", dim=32, checkpoint_format="qwen3_5")
        to_hf(Qwen3Next(c, key=jax.random.key(0)), tmp_path / "b")
    to_hf(Qwen3Next(dense, key=jax.random.key(0)), tmp_path / "c")  # Qwen3-Next, no experts
    assert from_hf(tmp_path / "c").config == dense
