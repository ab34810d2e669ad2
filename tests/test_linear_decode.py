"""Inference for linear-attention layers (issue 46, part 4): hybrid models whose layers mix
Gated DeltaNet (or Kimi Delta Attention) and softmax attention generate through the
library's cache, prefill and decode step, on one device and under sequence-sharded specs.

The model is built here: an `AbstractDecoder` whose `layer_stacks()` come from
`models._hybrid.hybrid_stacks` (two linear layers, a softmax layer, a linear layer: three
stacks). The oracle is the model's own full forward, re-run on the growing sequence (no
cache), greedy; ragged rows (37 and 29 tokens, and 13 and 9 for the short-prompt path).
"""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mesh, need_devices, rel_err
from jaxtyping import Array, Float

import eqx_longctx as el
from eqx_longctx.nn import (
    AbstractDecoder,
    DecoderBlock,
    GatedDeltaNet,
    KimiDeltaAttention,
    LayerStack,
    RMSNorm,
    RoPE,
    SelfAttention,
    SwiGLU,
)
from models._hybrid import hybrid_stacks

TOL = 1e-5  # float32, relative: states
LOGITS_TOL = 1e-4  # float32, relative: logits after several layers and steps (as test_generate)
KINDS = ("linear", "linear", "full", "linear")
PROMPTS = np.random.default_rng(0).integers(0, 64, (2, 37)).astype(np.int32)
LENGTHS = np.array([37, 29], np.int32)
NEW = 6


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """A tiny hybrid: `linear` is `"gdn"` or `"kda"`."""

    linear: str = "gdn"
    vocab_size: int = 64
    dim: int = 32
    max_seq_len: int = 64
    compute_dtype: Any = jnp.float32
    n_layers: int = len(KINDS)


class Hybrid(AbstractDecoder):
    embed: Float[Array, "vocab embed"]
    layers: tuple[LayerStack, ...]
    norm: RMSNorm
    lm_head: Float[Array, "embed vocab"] | None
    config: HybridConfig = eqx.field(static=True)
    spec: Any = eqx.field(static=True)

    def __init__(self, config: HybridConfig, *, key, spec=None):
        k_embed, k_layers, k_head = jax.random.split(key, 3)
        dim = config.dim

        def linear(k):
            k1, k2 = jax.random.split(k)
            if config.linear == "gdn":
                attn = GatedDeltaNet(dim, 4, 2, 8, 6, key=k1, chunk=8, init_std=0.2, spec=spec)
            else:
                attn = KimiDeltaAttention(dim, 2, 8, key=k1, chunk=8, init_std=0.2, spec=spec)
            return DecoderBlock(attn, SwiGLU(dim, 48, key=k2, init_std=0.2), dim=dim)

        def full(k):
            k1, k2 = jax.random.split(k)
            attn = SelfAttention(dim, 4, 2, 8, rope=RoPE(8, 10000.0), key=k1, init_std=0.2,
                                 spec=spec)  # fmt: skip
            return DecoderBlock(attn, SwiGLU(dim, 48, key=k2, init_std=0.2), dim=dim)

        make = {"linear": linear, "full": full}
        self.layers = hybrid_stacks(KINDS, make, key=k_layers, remat="none", spec=spec)
        self.embed = jax.random.normal(k_embed, (config.vocab_size, dim))
        self.norm = RMSNorm(dim)
        self.lm_head = jax.random.normal(k_head, (dim, config.vocab_size)) * dim**-0.5
        self.config = config
        self.spec = spec

    def layer_stacks(self) -> tuple:
        return self.layers


_MODELS: dict = {}


def build(linear: str = "gdn", spec=None) -> Hybrid:
    """The same weights for every spec."""
    if (linear, spec) not in _MODELS:
        _MODELS[linear, spec] = Hybrid(HybridConfig(linear), key=jax.random.key(0), spec=spec)
    return _MODELS[linear, spec]


def no_cache_greedy(model, prompts, lengths, new):
    """The oracle: greedy tokens and their logits from the full forward of each row's prompt
    and the tokens so far (right-padded to one length: the layers are causal, so the
    padding never reaches the row's last token), re-run for every new token."""
    total = int(lengths.max()) + new
    rows = [list(p[:n]) for p, n in zip(prompts, lengths, strict=True)]
    forward = eqx.filter_jit(lambda m, x: m(x))
    tokens, seen = [], []
    for _ in range(new):
        x = np.stack([np.pad(r, (0, total - len(r))) for r in rows]).astype(np.int32)
        logits = np.asarray(forward(model, jnp.asarray(x)))
        last = np.stack([logits[b, len(r) - 1] for b, r in enumerate(rows)])
        seen.append(last)
        tokens.append(np.argmax(last, -1))
        for r, t in zip(rows, tokens[-1], strict=True):
            r.append(int(t))
    return np.stack(tokens, 1).astype(np.int32), np.stack(seen, 1)


_REFERENCE: dict = {}


def reference(linear: str, prompts=PROMPTS, lengths=LENGTHS):
    key = (linear, prompts.shape)
    if key not in _REFERENCE:
        _REFERENCE[key] = no_cache_greedy(build(linear), prompts, lengths, NEW)
    return _REFERENCE[key]


def check_generate(model, linear: str, what: str, prompts=PROMPTS, lengths=LENGTHS):
    tokens, logits = el.generate(
        model, prompts, lengths=lengths, max_new_tokens=NEW, return_logits=True
    )
    ref_tokens, ref_logits = reference(linear, prompts, lengths)
    np.testing.assert_array_equal(np.asarray(tokens), ref_tokens, err_msg=what)
    err = rel_err(logits, ref_logits)
    assert err <= LOGITS_TOL, f"{what}: logits relative error {err:.2e}"
    return err


@pytest.mark.parametrize("linear", ["gdn", "kda"])
def test_one_device_generate_equals_the_no_cache_forward(linear):
    check_generate(build(linear), linear, f"{linear}, one device")


SPECS = {
    # name: (mesh shape, axis names, strategy, layout, linear layer)
    "ring-zigzag-data2": ((2, 4), ("data", "context"), "ring", "zigzag", "gdn"),
    "all_gather-striped": ((8,), ("context",), "all_gather", "striped", "gdn"),
    "usp-contiguous": ((2, 4), ("ulysses", "context"), "usp", "none", "gdn"),
    "ring-zigzag-tensor2": ((4, 2), ("context", "tensor"), "ring", "zigzag", "kda"),
}


def spec_of(name: str):
    shape, names, strategy, layout, linear = SPECS[name]
    axes = dict(ulysses_axis="ulysses") if "ulysses" in names else {}
    if "tensor" in names:
        axes = dict(tensor_axis="tensor", batch_axis=None)
    return el.ShardingSpec(make_mesh(shape, names), strategy, layout, **axes), linear


@pytest.mark.parametrize("name", list(SPECS))
def test_generate_under_a_spec_equals_the_no_cache_forward(name):
    need_devices(8)
    spec, linear = spec_of(name)
    check_generate(build(linear, spec), linear, name)


def test_short_prompts_under_zigzag():
    """Prompts shorter than the convolution's halos (16 padded tokens in 16 zig-zag chunks
    of one token, K - 1 = 3): the prefill's convolution runs in natural order."""
    need_devices(8)
    spec = el.ShardingSpec(make_mesh((8,), ("context",)), "ring", "zigzag")
    prompts, lengths = PROMPTS[:, :13], np.array([13, 9], np.int32)
    check_generate(build("gdn", spec), "gdn", "short prompts", prompts, lengths)


@eqx.filter_jit
def _row_states(model, tokens):
    """`{(stack, layer): (states, raw)}` for the linear layers of a one-device full forward
    of `tokens` `[1, seq]`: the states the layer's prefill gives on these tokens alone, and
    the q, k, v projections of the last 3 tokens (`[heads, dim, 3]`)."""
    x = model.embed_tokens(tokens)
    positions = jnp.arange(tokens.shape[1])[None]
    out = {}
    for s, stack in enumerate(model.layer_stacks()):
        for i in range(stack.n_layers):
            block = stack.layer(i)
            attn = block.attn
            if not isinstance(attn, SelfAttention):
                h = block.attn_norm(x)
                _, states = attn.prefill(h, positions)
                raw = [jnp.einsum("se,ehd->hds", h[0, -3:], w) for w in (attn.wq, attn.wk, attn.wv)]
                out[s, i] = tuple(x[0] for x in states), tuple(raw)
            x = block(x, positions)
    return out


@pytest.mark.parametrize("linear", ["gdn", "kda"])
def test_prefill_states_equal_the_full_forward(linear):
    """The states a ragged, zig-zagged prefill on (data 2, context 4) leaves equal those of
    each row's real prompt alone through the one-device layer (its final recurrent state);
    each conv window holds the row's last K-1 projected inputs."""
    need_devices(8)
    spec = el.ShardingSpec(make_mesh((2, 4), ("data", "context")), "ring", "zigzag")
    model = build(linear, spec)
    cache = el.init_cache(model, 2, 48)
    _, cache = el.prefill(model, cache, PROMPTS, LENGTHS)
    for b, n in enumerate(LENGTHS):
        for (s, i), (expected, raw) in _row_states(build(linear), PROMPTS[b : b + 1, :n]).items():
            got = [np.asarray(x)[i, b] for x in cache.stacks[s].states]
            for j, (g, e) in enumerate(zip(got, expected, strict=True)):
                assert rel_err(g, e) <= TOL, f"row {b}, stack {s}, layer {i}, state {j}"
            for j, r in enumerate(raw):
                assert rel_err(got[1 + j], r) <= TOL, f"window {j} of row {b}"


def test_linear_cache_bytes_do_not_grow_with_max_len():
    """A linear stack's cache is its states, the same at any max_len (on one device and
    under a spec, laid out and allocated); the softmax stack's grows."""
    need_devices(8)
    spec = el.ShardingSpec(make_mesh((8,), ("context",)), "ring", "zigzag")
    for model in (build("gdn"), build("gdn", spec)):
        short, long = (el.cache_layout(model, 2, m) for m in (16, 64))
        linear = [i for i, s in enumerate(short.stacks) if s.states]
        assert linear == [0, 2] and short.stacks[1].states == ()
        for i in linear:
            assert short.stack_bytes_per_device(short.stacks[i]) == long.stack_bytes_per_device(
                long.stacks[i]
            )
            assert short.stacks[i].slots == 0
        assert short.stack_bytes_per_device(short.stacks[1]) < long.stack_bytes_per_device(
            long.stacks[1]
        )
        caches = [el.init_cache(model, 2, m) for m in (16, 64)]
        for i in linear:
            a, b = (c.stacks[i] for c in caches)
            assert [x.shape for x in a.states] == [x.shape for x in b.states]
            assert all(x.dtype == jnp.float32 for x in a.states)
        # 2 layers x 2 rows x (4 x 8 x 6 state + 3-slot windows of 2x8, 2x8, 4x6) floats.
        per_row = 4 * 8 * 6 + 3 * (2 * 8 + 2 * 8 + 4 * 6)
        assert short.stack_bytes_per_device(short.stacks[0]) == 2 * 2 * per_row * 4
        assert caches[0].nbytes_per_device() == short.bytes_per_device()


def test_the_planner_counts_the_states():
    """`plan_generate` takes the cache from `cache_layout`: a hybrid family's linear stacks
    (Qwen3-Next's Gated DeltaNet) are their float32 states alone, no slots."""
    from eqx_longctx.plan import plan_generate
    from models.qwen3_next import Qwen3NextConfig

    config = Qwen3NextConfig.from_preset("tiny")
    plan = plan_generate("qwen3_next", config, None, batch=2, seq=1024)
    linear = [s for s in plan.stacks if s.slots == 0]
    assert linear and len(linear) < len(plan.stacks)
    for s in linear:
        assert s.entries[0][-2:] == (32, 32)  # the recurrent state, dk x dv
        assert s.bytes == sum(int(np.prod(e)) for e in s.entries) * 4
    assert "fixed-size states" in plan.explain()
