"""Greedy generation against transformers' `model.generate(do_sample=False)`: the same
tokens and step logits for Llama 3 (GQA, llama3 RoPE), Qwen2 (qkv bias), Qwen3 (qk norm, mixed
sliding and full layers), Mistral (a window of 8 under a 20-token prompt) and DeepSeek V2/V3
(MLA; V3 with noaux_tc routing); each decode step's logits equal a full forward over the prompt
and the tokens so far; every family gives the same tokens and logits under a sharding spec as
on one device; and `eqx_longctx.generate` emits those greedy tokens.

References are tiny random float32 transformers models (eager attention), saved once per
family and loaded with `from_hf`. Two prompts of different lengths, right-padded for us;
transformers generates each row alone (no padding on its side). Tokens must be equal token
for token, except at a near-tie of the reference's top-2 logits (gap < `TIE`): there the row
may diverge, and is compared no further. The step logits come from `prefill` and
`decode_step` (`greedy_steps`); `generate` must emit the same tokens and logits.
"""

import functools

import hf_helpers
import numpy as np
import pytest
from helpers import make_mesh, rel_err
from hf_helpers import forward, hf_modules
from test_deepseek import FAMILIES as DEEPSEEK
from test_deepseek import SMALL as DEEPSEEK_SMALL
from test_hf_llama import LLAMA3_ROPE
from test_sliding_window_models import FAMILIES as WINDOWED
from test_sliding_window_models import SMALL as LLAMA_SMALL
from test_sliding_window_models import VOCAB, WINDOW

import eqx_longctx as el
from models import deepseek, llama

RTOL = 1e-4  # step logits, relative to the largest reference logit
TIE = 1e-4  # a top-2 logit gap below this may break either way
PROMPT, NEW = 20, 12
LENGTHS = np.array([PROMPT, 15], np.int32)  # ragged rows
DATA_CONTEXT = {"data": 2, "context": 4}
# name -> (transformers config class, extra config fields, (strategy, layout, mesh axes)),
# the configs of the forward parity tests (2 KV heads for 8 query heads)
LLAMA_FAMILIES = {
    "llama3-gqa": (
        "LlamaConfig",
        dict(num_hidden_layers=2, rope_parameters=LLAMA3_ROPE),
        ("usp", "zigzag", {"ulysses": 2, "context": 2, "data": 2}),
    ),
    "qwen2-bias": ("Qwen2Config", dict(num_hidden_layers=2), ("ulysses", "striped", DATA_CONTEXT)),
    "qwen3-mixed-windows": (*WINDOWED["qwen3-layer-types"][:2], ("ring", "zigzag", DATA_CONTEXT)),
    "mistral-window": (*WINDOWED["mistral"][:2], ("all_gather", "none", DATA_CONTEXT)),
}
DEEPSEEK_FAMILIES = {
    "deepseek-v2": (
        *DEEPSEEK["v2-direct-q-group-limited"][:2],
        ("ulysses", "zigzag", DATA_CONTEXT),
    ),
    "deepseek-v3-noaux": (*DEEPSEEK["v3-q-lora-noaux"][:2], ("ring", "striped", DATA_CONTEXT)),
}
FAMILIES = {**LLAMA_FAMILIES, **DEEPSEEK_FAMILIES}
BUILDERS = {
    **dict.fromkeys(LLAMA_FAMILIES, hf_helpers.model_builder(
        LLAMA_FAMILIES, LLAMA_SMALL, _attn_implementation="eager")),
    **dict.fromkeys(DEEPSEEK_FAMILIES, hf_helpers.model_builder(
        DEEPSEEK_FAMILIES, DEEPSEEK_SMALL, _attn_implementation="eager")),
}  # fmt: skip
LOADERS = {
    **dict.fromkeys(LLAMA_FAMILIES, llama.from_hf),
    **dict.fromkeys(DEEPSEEK_FAMILIES, deepseek.from_hf),
}


def spec_of(family: str) -> el.ShardingSpec:
    strategy, layout, axes = FAMILIES[family][2]
    mesh = make_mesh(tuple(axes.values()), tuple(axes))
    extra = dict(ulysses_axis="ulysses") if strategy == "usp" else {}
    return el.ShardingSpec(mesh, strategy, layout, **extra)


def hf_generate(model, prompt) -> tuple[np.ndarray, np.ndarray]:
    """transformers' greedy `(tokens [NEW], logits [NEW, vocab])` after one unpadded prompt."""
    torch, _ = hf_modules()
    with torch.no_grad():
        out = model.generate(
            torch.as_tensor(prompt[None], dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW,
            return_dict_in_generate=True,
            output_logits=True,
        )
    tokens = out.sequences[0, len(prompt) :].numpy()
    assert tokens.shape == (NEW,)  # no eos stopped it
    return tokens, torch.stack(out.logits, 1)[0].numpy()


def greedy_steps(model, prompts) -> tuple[np.ndarray, np.ndarray]:
    """Greedy `(tokens [2, NEW], logits [2, NEW, vocab])` by `prefill` and `decode_step`:
    what `generate(..., return_logits=True)` returns (see `test_generate_returns_logits`)."""
    cache = el.init_cache(model, 2, PROMPT + NEW)
    logits, cache = el.prefill(model, cache, prompts, LENGTHS)
    steps = [np.asarray(logits)]
    for _ in range(NEW - 1):
        logits, cache = el.decode_step(model, cache, steps[-1].argmax(-1).astype(np.int32))
        steps.append(np.asarray(logits))
    logits = np.stack(steps, 1)
    return logits.argmax(-1).astype(np.int32), logits


@pytest.fixture(scope="module")
def prompts():
    return np.random.default_rng(0).integers(0, VOCAB, (2, PROMPT)).astype(np.int32)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prompts):
    """`reference(family)`: `(checkpoint directory, [(tokens, logits)] of transformers' greedy
    generation per row)`; each family built, generated and saved once."""
    hf_modules()

    @functools.cache
    def checkpoint(family):
        hf = BUILDERS[family](family)
        hf.generation_config.eos_token_id = None  # generate all NEW tokens
        path = tmp_path_factory.mktemp(family)
        hf.save_pretrained(path)
        return path, [hf_generate(hf, prompts[r, :n]) for r, n in enumerate(LENGTHS)]

    return checkpoint


@pytest.fixture(scope="module")
def runs(reference, prompts):
    """`runs(family, sharded)`: `(model, tokens, logits)` of our greedy steps, on one device
    or under the family's spec (`spec_of`)."""

    @functools.cache
    def run(family, sharded):
        path, _ = reference(family)
        model = LOADERS[family](path, spec=spec_of(family) if sharded else None)
        return (model, *greedy_steps(model, prompts))

    return run


def compared_steps(tokens, ref_tokens, ref_logits) -> int:
    """How many steps of a row to compare: all, or up to and including the first token
    that differs, which must be a near-tie of the reference's top-2 logits."""
    differ = np.flatnonzero(tokens != ref_tokens)
    if differ.size == 0:
        return len(ref_tokens)
    step = int(differ[0])
    second, first = np.sort(ref_logits[step])[-2:]
    assert first - second < TIE, (
        f"step {step}: token {tokens[step]} != reference {ref_tokens[step]}, and the "
        f"reference's top-2 logit gap {first - second:.2e} is no near-tie (< {TIE})"
    )
    return step + 1


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(reference, runs, family):
    model, tokens, logits = runs(family, False)
    if family in ("qwen3-mixed-windows", "mistral-window"):  # windows shorter than prompts
        assert model.config.sliding_window == WINDOW < min(LENGTHS)
    for row, (ref_tokens, ref_logits) in enumerate(reference(family)[1]):
        assert np.array_equal(ref_tokens, ref_logits.argmax(-1))  # transformers: greedy
        n = compared_steps(tokens[row], ref_tokens, ref_logits)
        err = rel_err(logits[row, :n], ref_logits[:n])
        print(f"{family} row {row}: {n}/{NEW} steps compared, logits rel err {err:.1e}")
        assert err <= RTOL, f"{family} row {row}: step logits rel err {err:.2e} > {RTOL}"


# Three families under a spec (sliding windows, all_gather; MLA, ulysses; mixed windows, ring);
# every strategy x layout runs on tiny models in tests/test_generate.py.
@pytest.mark.parametrize("family", ["qwen3-mixed-windows", "mistral-window", "deepseek-v2"])
def test_spec_matches_one_device(runs, family):
    _, tokens, logits = runs(family, False)
    _, sharded_tokens, sharded_logits = runs(family, True)
    np.testing.assert_array_equal(sharded_tokens, tokens)
    err = rel_err(sharded_logits, logits)
    print(f"{family} {FAMILIES[family][2]}: logits rel err to one device {err:.1e}")
    assert err <= RTOL


@pytest.mark.parametrize(
    "family,sharded",
    [("qwen3-mixed-windows", False), ("qwen3-mixed-windows", True), ("deepseek-v3-noaux", False)],
)
def test_decode_logits_equal_full_forward(runs, prompts, family, sharded):
    """Teacher forcing: the forward over each prompt and its generated tokens gives, at
    every generated position, the logits that decode step chose from."""
    model, tokens, logits = runs(family, sharded)
    rows = np.zeros((2, PROMPT + NEW), np.int32)  # trailing zeros: after every used position
    for r, n in enumerate(LENGTHS):
        rows[r, : n + NEW] = np.concatenate([prompts[r, :n], tokens[r]])
    spec = model.spec
    if spec is None:
        full = np.asarray(forward(model, rows))
    else:
        full = np.asarray(el.from_layout(forward(model, el.to_layout(rows, spec)), spec))
    for r, n in enumerate(LENGTHS):
        err = rel_err(logits[r], full[r, n - 1 : n - 1 + NEW])
        print(f"{family} sharded={sharded} row {r}: decode vs forward rel err {err:.1e}")
        assert err <= RTOL


@pytest.mark.parametrize(
    "family,sharded",
    [(f, False) for f in FAMILIES]
)  # fmt: skip
def test_generate_emits_the_greedy_steps(runs, prompts, family, sharded):
    """`generate`'s greedy tokens are the argmax chain of `prefill` and `decode_step`."""
    model, tokens, _ = runs(family, sharded)
    generated = el.generate(model, prompts, lengths=LENGTHS, max_new_tokens=NEW)
    np.testing.assert_array_equal(np.asarray(generated), tokens)


def test_generate_returns_logits(runs, prompts):
    model, tokens, logits = runs("llama3-gqa", False)
    got_tokens, got_logits = el.generate(
        model, prompts, lengths=LENGTHS, max_new_tokens=NEW, return_logits=True
    )
    np.testing.assert_array_equal(np.asarray(got_tokens), tokens)
    assert rel_err(got_logits, logits) <= 1e-6


def test_near_tie_rule():
    """Rows agree, or diverge at a top-2 gap below TIE and are compared up to there."""
    ref_logits = np.zeros((4, 5), np.float32)
    ref_logits[:, 1] = 1.0
    ref_logits[2, 3] = 1.0 - TIE / 2  # step 2: a near-tie of tokens 1 and 3
    ref = ref_logits.argmax(-1)
    assert compared_steps(ref, ref, ref_logits) == 4
    assert compared_steps(np.array([1, 1, 3, 0]), ref, ref_logits) == 3
    with pytest.raises(AssertionError, match="no near-tie"):
        compared_steps(np.array([1, 3, 1, 1]), ref, ref_logits)
    ref_logits[2, 3] = 1.0 - 2 * TIE
    with pytest.raises(AssertionError, match="step 2: token 3 != reference 1"):
        compared_steps(np.array([1, 1, 3, 0]), ref, ref_logits)
