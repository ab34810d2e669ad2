"""Generation (issue 18) against independent oracles: the model's own full forward over the
prompt and the generated tokens, and the one-device generation.

Tiny random models built here (no transformers): a GQA Llama with a sliding layer and a full
layer (window 8, shorter than the prompts), and a DeepSeek with MLA and MoE. Every spec runs
prompts of 13 tokens (not a multiple of any shard count) in a ragged batch (13 and 9).

The strategy grid runs `generate(return_logits=True)` under each spec (half the grid on Auto
`Mesh(...)` meshes, half on Explicit `jax.make_mesh` ones); the placements and the Pallas
path also drive the public lower-level API (`init_cache`, `prefill`, `decode_step`) through
a greedy loop written here. Both are compared with the one-device `generate`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mesh, rel_err

import eqx_longctx as el
from eqx_longctx.inference import compile_counts
from models.deepseek import DeepSeek, DeepSeekConfig
from models.llama import Llama, LlamaConfig

TOL = 1e-4  # relative, float32 (issue 18)
WINDOW = 8
LLAMA = LlamaConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=64,
    sliding_window=WINDOW, layer_types=("sliding_attention", "full_attention"), init_std=0.1,
)  # fmt: skip
DEEPSEEK = DeepSeekConfig.from_preset(
    "tiny", vocab_size=64, dim=32, n_layers=2, hidden_dim=64, moe_hidden_dim=16,
    kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    max_seq_len=64, init_std=0.1,
)  # fmt: skip
FAMILIES = {"llama": (Llama, LLAMA), "deepseek": (DeepSeek, DEEPSEEK)}
PROMPTS = np.random.default_rng(0).integers(0, 64, (2, 13)).astype(np.int32)
LENGTHS = np.array([13, 9], np.int32)
NEW, MAX_LEN = 5, 24

DATA_CONTEXT = ((2, 4), ("data", "context"))
DATA_ULYSSES_CONTEXT = ((2, 2, 2), ("data", "ulysses", "context"))


@pytest.fixture(autouse=True)
def _fresh_compile_cache():
    """Per test, on top of `conftest.py`'s per module. Many distinct executables in one
    process had crashed XLA:CPU here; the cause found since is the kernel's limit on memory
    mappings (`conftest._release_compiled_programs`)."""
    yield
    jax.clear_caches()


def build(family: str, spec=None, *, sharded: bool = False):
    """The family's tiny model with the same weights for every spec; `sharded` places the
    weights by the spec's rules (tensor, fsdp, expert axes)."""
    cls, config = FAMILIES[family]
    if sharded:
        return el.init_sharded(lambda: cls(config, key=jax.random.key(0), spec=spec))
    return cls(config, key=jax.random.key(0), spec=spec)


def spec_on(shape, names, strategy="ring", layout="zigzag", axes="explicit", **kw):
    return el.ShardingSpec(make_mesh(shape, names, axes), strategy, layout, **kw)


def greedy_loop(model, prompts=PROMPTS, lengths=LENGTHS, new=NEW, max_len=MAX_LEN, impl=None,
                forced=None):  # fmt: skip
    """Greedy tokens `[b, new]` and the logits they were chosen from `[b, new, vocab]`,
    through `init_cache` / `prefill` / `decode_step`; `forced` feeds those tokens instead."""
    cache = el.init_cache(model, prompts.shape[0], max_len)
    logits, cache = el.prefill(model, cache, prompts, lengths, impl=impl)
    tokens, seen = [], []
    for t in range(new):
        seen.append(np.asarray(logits))
        tokens.append(np.argmax(seen[-1], -1).astype(np.int32) if forced is None else forced[:, t])
        if t < new - 1:
            logits, cache = el.decode_step(model, cache, tokens[-1], impl=impl)
    return np.stack(tokens, 1), np.stack(seen, 1)


def full_forward_logits(model, prompts, lengths, tokens):
    """The model's own forward over each row's prompt and new tokens (one call, right
    padded: causal, so the padding never reaches a kept position), at the positions whose
    logits chose each new token."""
    rows = [np.concatenate([p[:n], t]) for p, n, t in zip(prompts, lengths, tokens, strict=True)]
    seq = max(map(len, rows))
    x = np.stack([np.pad(r, (0, seq - len(r))) for r in rows]).astype(np.int32)
    logits = np.asarray(eqx.filter_jit(lambda m, x: m(x))(model, jnp.asarray(x)))
    new = tokens.shape[1]
    return np.stack([logits[b, n - 1 + np.arange(new)] for b, n in enumerate(lengths)])


_REFERENCE: dict = {}


def reference(family: str):
    """The one-device `generate` tokens and the logits they came from (teacher-forced)."""
    if family not in _REFERENCE:
        model = build(family)
        tokens = np.asarray(el.generate(model, PROMPTS, lengths=LENGTHS, max_new_tokens=NEW,
                                        max_len=MAX_LEN))  # fmt: skip
        _, logits = greedy_loop(model, forced=tokens)
        _REFERENCE[family] = tokens, logits
    return _REFERENCE[family]


def check_same(tokens, logits, family: str, what: str):
    ref_tokens, ref_logits = reference(family)
    np.testing.assert_array_equal(tokens, ref_tokens, err_msg=what)
    err = rel_err(logits, ref_logits)
    assert err <= TOL, f"{what}: logits relative error {err:.2e}"


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_one_device_generate_equals_the_full_forward(family):
    model = build(family)
    tokens, logits = reference(family)
    full = full_forward_logits(model, PROMPTS, LENGTHS, tokens)
    assert rel_err(logits, full) <= TOL, rel_err(logits, full)
    np.testing.assert_array_equal(tokens, np.argmax(full, -1))  # greedy
    # The test's own greedy loop is the same greedy decoding (the specs below use it).
    loop_tokens, _ = greedy_loop(model)
    np.testing.assert_array_equal(loop_tokens, tokens)


# ---- every strategy and layout -------------------------------------------------------------

LAYOUTS = ("none", "zigzag", "striped")
# (strategy, layout, mesh): all_gather / ulysses / ring over 'context' of a 2x4 (data,
# context) mesh; usp over (ulysses 2, context 2) of a 2x2x2 mesh, and 'auto' there (which
# runs its choice over both sequence axes together).
# Pairwise in family, not the full product: every (strategy, layout) pair runs once, on
# DeepSeek (MLA and MoE) for a diagonal and on Llama (GQA, a sliding layer) for the rest,
# so each family meets every strategy and every layout and both meshes; the Llama rows the
# diagonal already ran (4 cases, ~50 s of one core) are left out.
DIAGONAL = [("all_gather", "striped", "2x4"), ("ulysses", "zigzag", "2x4"),
            ("ring", "none", "2x4"), ("usp", "zigzag", "2x2x2")]  # fmt: skip
GRID = [(s, lay, "2x4") for s in ("all_gather", "ulysses", "ring") for lay in LAYOUTS]
GRID += [("usp", lay, "2x2x2") for lay in LAYOUTS]
GRID = [g for g in GRID if g not in DIAGONAL] + [("auto", "striped", "2x2x2")]
CASES = [("llama", *g) for g in GRID] + [("deepseek", *g) for g in DIAGONAL]


@pytest.mark.parametrize("family,strategy,layout,mesh", CASES)
def test_every_strategy_and_layout_equals_one_device(family, strategy, layout, mesh):
    # Auto (Mesh(...)) and Explicit (jax.make_mesh) axes alternate over the grid.
    axes = ("auto", "explicit")[CASES.index((family, strategy, layout, mesh)) % 2]
    if mesh == "2x4":
        spec = spec_on(*DATA_CONTEXT, strategy, layout, axes=axes)
    else:
        spec = spec_on(*DATA_ULYSSES_CONTEXT, strategy, layout, axes=axes, ulysses_axis="ulysses")
    kw = dict(lengths=LENGTHS, max_new_tokens=NEW, max_len=MAX_LEN, return_logits=True)
    tokens, logits = el.generate(build(family, spec), PROMPTS, **kw)
    what = f"{family} {strategy}/{layout} on {mesh} ({axes})"
    check_same(np.asarray(tokens), np.asarray(logits), family, what)


def test_sampling_with_a_fixed_key_is_the_same_under_a_spec():
    kw = dict(lengths=LENGTHS, max_new_tokens=NEW, max_len=MAX_LEN, temperature=1.0, top_k=5,
              key=jax.random.key(7))  # fmt: skip
    one = np.asarray(el.generate(build("llama"), PROMPTS, **kw))
    other = np.asarray(el.generate(build("llama"), PROMPTS, **{**kw, "key": jax.random.key(8)}))
    assert not np.array_equal(one, other)  # the key matters
    spec = spec_on(*DATA_CONTEXT, "ring", "striped")
    np.testing.assert_array_equal(np.asarray(el.generate(build("llama", spec), PROMPTS, **kw)), one)


def test_generate_returns_the_logits_it_chose_from():
    model = build("llama")
    tokens, logits = el.generate(model, PROMPTS, lengths=LENGTHS, max_new_tokens=NEW,
                                 max_len=MAX_LEN, return_logits=True)  # fmt: skip
    check_same(np.asarray(tokens), np.asarray(logits), "llama", "return_logits")


# ---- ragged rows, eos ------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_a_ragged_batch_equals_each_row_alone(family):
    model = build(family)
    tokens, logits = reference(family)
    for b, n in enumerate(LENGTHS):  # (the greedy loop is generate's, by the first test)
        alone, alone_logits = greedy_loop(model, PROMPTS[b : b + 1, :n], None)
        np.testing.assert_array_equal(alone[0], tokens[b])
        assert rel_err(alone_logits[0], logits[b]) <= TOL


def test_eos_pads_its_row_and_leaves_the_others_alone():
    tokens, _ = reference("llama")
    eos = next(v for v in tokens[0] if v not in tokens[1])  # row 0 emits it, row 1 never
    pad = int(eos + 1) % LLAMA.vocab_size
    out = np.asarray(el.generate(build("llama"), PROMPTS, lengths=LENGTHS, max_new_tokens=NEW,
                                 max_len=MAX_LEN, eos_id=int(eos), pad_id=pad))  # fmt: skip
    first = list(tokens[0]).index(eos)
    np.testing.assert_array_equal(out[0, : first + 1], tokens[0, : first + 1])
    assert first + 1 < NEW and (out[0, first + 1 :] == pad).all(), out
    np.testing.assert_array_equal(out[1], tokens[1])


def test_several_eos_ids_stop_each_row_at_its_first():
    tokens, _ = reference("llama")
    eos0 = next(v for v in tokens[0] if v not in tokens[1])
    eos1 = next(v for v in tokens[1] if v not in tokens[0])
    pad = next(v for v in range(LLAMA.vocab_size) if v not in (eos0, eos1))
    stops = [int(eos0), int(eos1)]
    out = np.asarray(el.generate(build("llama"), PROMPTS, lengths=LENGTHS, max_new_tokens=NEW,
                                 max_len=MAX_LEN, eos_id=stops, pad_id=pad))  # fmt: skip
    for row, eos in ((0, eos0), (1, eos1)):
        first = list(tokens[row]).index(eos)
        np.testing.assert_array_equal(out[row, : first + 1], tokens[row, : first + 1])
        assert (out[row, first + 1 :] == pad).all(), out


# ---- compile once ------------------------------------------------------------------------


def test_the_decode_step_compiles_once():
    model = build("llama")
    kw = dict(max_new_tokens=8, max_len=MAX_LEN)
    before = compile_counts()["decode"]
    el.generate(model, PROMPTS, lengths=LENGTHS, **kw)
    assert compile_counts()["decode"] == before + 1  # 8 tokens, one compiled step
    el.generate(model, PROMPTS[:, :7], **kw)  # another prompt length
    assert compile_counts()["decode"] == before + 1
    sample = dict(kw, key=jax.random.key(0))
    el.generate(model, PROMPTS, temperature=0.7, top_k=5, top_p=0.9, **sample)
    # Filtering (top-k / top-p) is a static specialisation of the step: one compile more.
    after_filtered = compile_counts()["decode"]
    assert after_filtered <= before + 2
    el.generate(model, PROMPTS[:, :10], temperature=1.3, top_k=3, top_p=0.5, **sample)
    el.generate(model, PROMPTS, temperature=0.2, top_k=40, **sample)
    el.generate(model, PROMPTS, temperature=0.9, top_p=0.8, **sample)
    assert compile_counts()["decode"] == after_filtered


# ---- long prompt -------------------------------------------------------------------------


def test_a_long_prompt_under_ring_over_8_devices_equals_the_full_forward():
    config = LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1,
                         hidden_dim=32, max_seq_len=4200, init_std=0.1)  # fmt: skip
    spec = spec_on((8,), ("context",), "ring", "zigzag")
    model = Llama(config, key=jax.random.key(1), spec=spec)
    one = Llama(config, key=jax.random.key(1))
    prompt = np.random.default_rng(1).integers(0, 64, (1, 4096)).astype(np.int32)
    tokens, logits = greedy_loop(model, prompt, None, new=3, max_len=4104)
    full = full_forward_logits(one, prompt, [4096], tokens)
    assert rel_err(logits, full) <= TOL, rel_err(logits, full)
    np.testing.assert_array_equal(tokens, np.argmax(full, -1))


# ---- Pallas path ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family,kernels", [("llama", "tpu"), ("deepseek", "tpu"),
                                            ("deepseek", "gpu")])  # fmt: skip
def test_pallas_decoding_equals_the_xla_path(family, kernels):
    from jax.experimental.pallas import tpu as pltpu

    from eqx_longctx.kernels import PallasBlockImpl, PallasGpuBlockImpl

    impl = (PallasBlockImpl(128, 128, pltpu.InterpretParams()) if kernels == "tpu"
            else PallasGpuBlockImpl(64, 64, True))  # fmt: skip
    tokens, logits = reference(family)
    new = 3
    out = np.asarray(el.generate(build(family), PROMPTS, lengths=LENGTHS, max_new_tokens=new,
                                 max_len=MAX_LEN, impl=impl))  # fmt: skip
    np.testing.assert_array_equal(out, tokens[:, :new])
    if family == "llama":  # its ring / zig-zag loop: test_inference_floor.py's Pallas test
        return
    spec = spec_on((4,), ("context",), "ring", "zigzag")
    got_tokens, got_logits = greedy_loop(build(family, spec), new=new, impl=impl)
    np.testing.assert_array_equal(got_tokens, tokens[:, :new])
    assert rel_err(got_logits, logits[:, :new]) <= TOL


# ---- tensor, fsdp and expert axes ------------------------------------------------

PLACEMENTS = [
    ("llama", ((4, 2), ("context", "tensor")), dict(tensor_axis="tensor"), "explicit"),
    ("deepseek", ((4, 2), ("context", "tensor")), dict(tensor_axis="tensor"), "explicit"),
    ("llama", ((2, 4), ("fsdp", "context")), dict(fsdp_axis="fsdp"), "explicit"),
    ("deepseek", ((2, 4), ("expert", "context")), dict(expert_axis="expert"), "explicit"),
]


@pytest.mark.parametrize("family,mesh,roles,axes", PLACEMENTS)
def test_tensor_fsdp_and_expert_axes_equal_one_device(family, mesh, roles, axes):
    roles = dict(roles)
    strategy = roles.pop("strategy", "ring")
    spec = spec_on(*mesh, strategy, "zigzag", axes=axes, **roles)
    tokens, logits = greedy_loop(build(family, spec, sharded=True))
    check_same(tokens, logits, family, f"{family} {roles} {axes}")
