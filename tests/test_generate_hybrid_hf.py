"""Greedy generation of the hybrid families against transformers' `generate(do_sample=False)`:
Qwen3-Next (`Qwen3NextForCausalLM`: Gated DeltaNet, gated attention, experts), Qwen3.5
(`Qwen3_5ForCausalLM`, text, tied embeddings) and Kimi Linear (`KimiLinearForCausalLM`: Kimi
Delta Attention and MLA), each read by `from_hf` from a tiny random float32 checkpoint
(random norm scales and routing biases, as in their parity tests), on one device and under
two specs each: every strategy (ring, all_gather, ulysses, usp) and every layout (none,
zig-zag, striped) runs for at least one family, on 8 fake CPU devices, meshes whose axes
divide the heads.

Two prompts of different lengths, right-padded with `lengths` for us; transformers generates
each row alone (no padding on its side). `eqx_longctx.generate`'s tokens must equal the
reference's token for token (up to a near-tie of its top-2 logits, `compared_steps`), and
the logits each token was chosen from must match within `RTOL`. transformers runs its torch
fallbacks of the delta rules and the short convolution (no flash-linear-attention), its
recurrent form in decode; ours runs the chunked rule in the prefill and
`gated_delta_step` / `kimi_delta_step` per token.
"""

import functools

import jax
import numpy as np
import pytest
from helpers import need_devices, rel_err
from hf_helpers import hf_modules

torch, transformers = hf_modules()
import test_kimi_linear  # noqa: E402
from test_generate_hf import compared_steps  # noqa: E402
from test_qwen3_next_hf import MOE, SMALL, randomize_norms  # noqa: E402

import eqx_longctx as el  # noqa: E402
from models import kimi_linear, qwen3_next  # noqa: E402

RTOL = 1e-4  # step logits, relative to the largest reference logit (float32)
PROMPT, NEW = 20, 8
LENGTHS = np.array([PROMPT, 13], np.int32)  # ragged rows
VOCAB = test_kimi_linear.VOCAB
assert SMALL["vocab_size"] == VOCAB  # one prompt for every family
LINEAR, FULL = "linear_attention", "full_attention"


def build_qwen(cls_name: str, **fields):
    config = getattr(transformers, cls_name)(**{**SMALL, **fields})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return randomize_norms(model.eval())


# name -> (build the transformers model, our loader, [(strategy, layout, mesh axes)])
FAMILIES = {
    # DeltaNet with a dense MLP, attention, DeltaNet after it (experts): three stacks.
    "qwen3_next": (
        lambda: build_qwen("Qwen3NextConfig", **{**MOE, "num_hidden_layers": 3,
                                                 "layer_types": [LINEAR, FULL, LINEAR]}),
        qwen3_next.from_hf,
        [("ring", "zigzag", dict(data=2, context=4)),
         # the ring axis major: the DeltaNet's shifts cross (context, ulysses) in sequence order
         ("usp", "zigzag", dict(context=4, ulysses=2))],
    ),
    # Three DeltaNet layers, then attention (Qwen3.5's default layer_types); tied embeddings.
    "qwen3_5": (
        lambda: build_qwen("Qwen3_5TextConfig", tie_word_embeddings=True),
        qwen3_next.from_hf,
        [("all_gather", "striped", dict(context=8)),
         ("ulysses", "none", dict(data=2, context=4))],
    ),
    # MLA (a query latent, NoPE), then two KDA layers, experts everywhere.
    "kimi_linear": (
        lambda: test_kimi_linear.build_hf("mla-first"),
        kimi_linear.from_hf,
        [("ulysses", "striped", dict(data=2, context=4)),
         # heads split over a tensor axis: the cache's K/V heads and the KDA states too
         ("all_gather", "zigzag", dict(context=4, tensor=2))],
    ),
}  # fmt: skip
CASES = [(f, None) for f in FAMILIES] + [(f, s) for f, v in FAMILIES.items() for s in v[2]]


def case_id(case) -> str:
    family, spec = case
    if spec is None:
        return f"{family}-one-device"
    strategy, layout, axes = spec
    return f"{family}-{strategy}-{layout}-" + "x".join(f"{k}{n}" for k, n in axes.items())


def make_spec(strategy, layout, axes) -> el.ShardingSpec:
    mesh = jax.make_mesh(tuple(axes.values()), tuple(axes))
    extra = {}
    if "ulysses" in axes:
        extra["ulysses_axis"] = "ulysses"
    if "tensor" in axes:
        extra["tensor_axis"] = "tensor"
    return el.ShardingSpec(mesh, strategy, layout, **extra)


def hf_generate(model, prompt) -> tuple[np.ndarray, np.ndarray]:
    """transformers' greedy `(tokens [NEW], logits [NEW, vocab])` after one unpadded prompt."""
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


@pytest.fixture(scope="module")
def prompts():
    return np.random.default_rng(0).integers(0, VOCAB, (2, PROMPT)).astype(np.int32)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prompts):
    """`reference(family)`: `(checkpoint directory, [(tokens, logits)] of transformers' greedy
    generation per row)`; each family built, generated and saved once."""

    @functools.cache
    def checkpoint(family):
        hf = FAMILIES[family][0]()
        hf.generation_config.eos_token_id = None  # generate all NEW tokens
        hf.generation_config.pad_token_id = None
        path = tmp_path_factory.mktemp(family)
        hf.save_pretrained(path)
        return path, [hf_generate(hf, prompts[r, :n]) for r, n in enumerate(LENGTHS)]

    return checkpoint


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_generate_matches_transformers(reference, prompts, case):
    family, spec = case
    if spec is not None:
        need_devices(8)
    path, refs = reference(family)
    model = FAMILIES[family][1](path, spec=None if spec is None else make_spec(*spec))
    kinds = {s.states != () for s in el.cache_layout(model, 2, PROMPT + NEW).stacks}
    assert kinds == {True, False}, "a hybrid: linear stacks (states) and softmax stacks"
    before = el.inference.compile_counts()
    tokens, logits = el.generate(
        model, prompts, lengths=LENGTHS, max_new_tokens=NEW, return_logits=True
    )
    after = el.inference.compile_counts()
    # One prefill and one decode step, whatever the spec: the step's inputs keep their
    # shardings from one token to the next.
    assert {k: after[k] - before[k] for k in after} == {"prefill": 1, "decode": 1}
    tokens, logits = np.asarray(tokens), np.asarray(logits)
    for row, (ref_tokens, ref_logits) in enumerate(refs):
        assert np.array_equal(ref_tokens, ref_logits.argmax(-1))  # transformers: greedy
        n = compared_steps(tokens[row], ref_tokens, ref_logits)
        err = rel_err(logits[row, :n], ref_logits[:n])
        print(f"{case_id(case)} row {row}: {n}/{NEW} tokens equal, logits rel err {err:.1e}")
        assert err <= RTOL, f"{case_id(case)} row {row}: logits rel err {err:.2e} > {RTOL}"


@pytest.mark.parametrize("sharded", [False, True], ids=["one-device", "ring-zigzag"])
def test_linear_cache_bytes_do_not_grow_with_max_len(reference, sharded):
    """Qwen3-Next's DeltaNet stacks cache their fixed-size float32 states: the same bytes
    per device at 32 and at 128 tokens (`cache_layout`, and `init_cache`'s arrays), while
    its attention stack grows with `max_len`."""
    if sharded:
        need_devices(8)
    path, _ = reference("qwen3_next")
    spec = make_spec(*FAMILIES["qwen3_next"][2][0]) if sharded else None
    model = qwen3_next.from_hf(path, spec=spec)
    short, long = (el.cache_layout(model, 2, m) for m in (32, 128))
    linear = [i for i, s in enumerate(short.stacks) if s.states]
    assert linear == [0, 2], [s.states for s in short.stacks]  # DeltaNet, attention, DeltaNet
    sizes = [[c.stack_bytes_per_device(s) for s in c.stacks] for c in (short, long)]
    print(f"sharded={sharded}: bytes per device per stack at max_len 32 / 128: {sizes}")
    for i in linear:
        assert short.stacks[i].slots == 0 and sizes[0][i] == sizes[1][i] > 0
    assert sizes[0][1] < sizes[1][1]  # the attention stack's slots
    caches = [el.init_cache(model, 2, m) for m in (32, 128)]
    assert caches[0].nbytes_per_device() == short.bytes_per_device()
    for i in linear:
        a, b = (c.stacks[i].states for c in caches)
        assert [x.shape for x in a] == [x.shape for x in b]
