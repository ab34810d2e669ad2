"""What issue 45 fixed in inference: which block implementation runs in the prefill and the
decode step (`impl=` reaches every layer), the cache's geometry decided once
(`cache_layout`, read by `init_cache` and the planner alike), the programs lowered for
abstract arrays (`lower_prefill`, `lower_decode`), a tensor axis the heads do not divide
refused by the model's own rule, and the length errors naming the limit that binds.
Models and prompts: `test_generate.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from test_generate import LENGTHS, MAX_LEN, PROMPTS, build, greedy_loop, spec_on

import eqx_longctx as el
from eqx_longctx.inference import cache_layout, lower_decode, lower_prefill
from eqx_longctx.kernels import PallasBlockImpl
from models.llama import Llama, LlamaConfig

TOL = 1e-4


@pytest.fixture
def pallas_calls(monkeypatch):
    """How many times a Pallas kernel is traced (`pl.pallas_call` built)."""
    count = [0]
    real = pl.pallas_call

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(pl, "pallas_call", counting)
    return count


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_impl_xla_traces_no_kernel_in_prefill_or_decode(family, pallas_calls):
    spec = spec_on((4,), ("context",), "ring", "zigzag")
    model = build(family, spec)
    xla = greedy_loop(model, new=3, impl="xla")
    assert pallas_calls[0] == 0  # neither side of "auto": XLA alone
    auto = greedy_loop(model, new=3)  # the spec's "auto": the TPU side carries the kernels
    assert pallas_calls[0] > 0
    np.testing.assert_array_equal(xla[0], auto[0])


@pytest.mark.slow
def test_impl_pallas_runs_the_kernels_in_prefill_and_in_decode(pallas_calls):
    """The Pallas kernels (TPU interpret mode) in the prefill's attention and in the decode
    step, and the tokens and logits of the XLA path."""
    impl = PallasBlockImpl(128, 128, pltpu.InterpretParams())
    spec = spec_on((2,), ("context",), "ring", "zigzag")
    model = build("llama", spec)
    cache = el.init_cache(model, 2, MAX_LEN)
    logits, cache = el.prefill(model, cache, PROMPTS, LENGTHS, impl=impl)
    in_prefill = pallas_calls[0]
    assert in_prefill > 0
    el.decode_step(model, cache, np.argmax(np.asarray(logits), -1).astype(np.int32), impl=impl)
    assert pallas_calls[0] > in_prefill
    tokens, got = greedy_loop(model, new=3, impl=impl)
    want_tokens, want = greedy_loop(model, new=3, impl="xla")
    np.testing.assert_array_equal(tokens, want_tokens)
    assert float(np.max(np.abs(got - want)) / np.max(np.abs(want))) <= TOL


# ---- the cache's geometry, decided once ----------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_init_cache_allocates_the_layout(family):
    spec = spec_on((2, 4), ("data", "context"))
    model = build(family, spec)
    layout = cache_layout(model, 2, 40)
    cache = el.init_cache(model, 2, 40)
    assert len(layout.stacks) == len(cache.stacks)
    for s, sc in zip(layout.stacks, cache.stacks, strict=True):
        assert layout.entry_shapes(s) == tuple(x.shape for x in sc.entries)
        assert (s.ring, s.window, s.split_heads) == (sc.ring, sc.window, sc.split_heads)
        for shape, x in zip(layout.device_shapes(s), sc.entries, strict=True):
            assert {tuple(d.data.shape) for d in x.addressable_shards} == {shape}
    assert layout.bytes_per_device() == cache.nbytes_per_device()


def test_a_fixed_size_state_is_laid_out_and_counted(monkeypatch):
    """Room for a layer whose cache is a state per row (linear attention): counted by the
    layout (in float32, its heads split like the layer's) and allocated by `init_cache`
    (tests/test_linear_decode.py decodes with it)."""
    from eqx_longctx.nn import SelfAttention

    model = build("llama")
    before = cache_layout(model, 2, 32)
    monkeypatch.setattr(SelfAttention, "cache_state_shapes", lambda self: ((2, 8, 8),), False)
    layout = cache_layout(model, 2, 32)
    extra = sum(s.n_layers for s in layout.stacks) * 2 * (2 * 8 * 8) * 4
    assert layout.stacks[0].states == ((2, 8, 8),)
    assert layout.bytes_per_device() == before.bytes_per_device() + extra
    cache = el.init_cache(model, 2, 32)
    assert [x.shape for x in cache.stacks[0].states] == [(layout.stacks[0].n_layers, 2, 2, 8, 8)]
    assert cache.stacks[0].states[0].dtype == jnp.float32
    assert cache.nbytes_per_device() == layout.bytes_per_device()


def test_a_tensor_axis_the_heads_do_not_divide_is_the_models_own_error():
    spec = el.ShardingSpec(jax.make_mesh((2, 4), ("context", "tensor")), tensor_axis="tensor")
    config = LlamaConfig.from_preset("tiny", n_layers=1, n_heads=8, n_kv_heads=2)
    model = Llama(config, key=jax.random.key(0), spec=spec)
    match = r"tensor_axis 'tensor' has 4 devices .* q_heads=8, kv_heads=2"
    with pytest.raises(ValueError, match=match):
        el.init_cache(model, 1, 64)
    with pytest.raises(ValueError, match=match):
        el.generate(model, np.ones((1, 8), np.int32), max_new_tokens=2)


# ---- the programs, lowered ----------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_lowered_programs_are_the_ones_that_run(family):
    """`lower_prefill` / `lower_decode`, for a built or an abstract model, compile to
    programs whose arguments are the weights (laid out by the rules table) and, for the
    decode step, the cache `init_cache` makes (bytes per device), which it holds once
    (donated, aliased). The prefill writes the cache whole, so XLA drops the old one."""
    spec = spec_on((2, 4), ("data", "context"))
    model = build(family, spec)
    abstract = jax.eval_shape(lambda: build(family, spec))
    cache = el.init_cache(model, 2, 32)
    first = lower_prefill(abstract, batch=2, max_len=32, prompt_len=13).compile()
    step = lower_decode(model, batch=2, max_len=32).compile()
    params, held = el.param_bytes_per_device(model, spec), cache.nbytes_per_device()
    assert params <= first.memory_analysis().argument_size_in_bytes < params + held
    m = step.memory_analysis()
    assert m.argument_size_in_bytes >= params + held - 64  # lengths and counters: tiny
    assert m.alias_size_in_bytes >= held - 64
    with pytest.raises(ValueError, match="prompt_len must lie in 1..max_len=32"):
        lower_prefill(model, batch=2, max_len=32, prompt_len=33)


# ---- which limit binds ---------------------------------------------------------------------


def test_the_length_error_names_the_limit_that_binds():
    model = build("llama")  # max_seq_len 64
    prompt = np.ones((1, 60), np.int32)
    with pytest.raises(ValueError, match=r"max_seq_len=64; got 70 tokens\. Generate at most 4"):
        el.generate(model, prompt, max_new_tokens=10)
    with pytest.raises(ValueError, match=r"max_len=62, the cache's length; .* at least 63"):
        el.generate(model, prompt, max_new_tokens=3, max_len=62)
    out = el.generate(model, prompt, max_new_tokens=3, max_len=64)
    assert out.shape == (1, 3) and out.dtype == jnp.int32
