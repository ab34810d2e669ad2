"""The KV cache's bytes, read from the arrays' shards, and bad input to generation: each a
clear `ValueError` / `TypeError` naming the argument, raised before anything is compiled
(issue 18). Models and prompts: `test_generate.py`."""

import jax
import numpy as np
import pytest
from test_generate import (
    DATA_CONTEXT,
    DEEPSEEK,
    LENGTHS,
    LLAMA,
    MAX_LEN,
    PROMPTS,
    WINDOW,
    build,
    spec_on,
)

import eqx_longctx as el
from eqx_longctx.inference import compile_counts


def device0_bytes(arr) -> int:
    (shard,) = [s for s in arr.addressable_shards if s.device == jax.devices()[0]]
    return shard.data.nbytes


def stacks_by_window(cache):
    return {s.window: s for s in cache.stacks}


# ---- cache bytes -------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_device_0_holds_one_eighth_of_the_cache_over_data_and_context(family):
    spec = spec_on(*DATA_CONTEXT)  # batch over 2, sequence over 4
    cache = el.init_cache(build(family, spec), 2, 64)
    for stack in cache.stacks:  # full layers, and Llama's sliding ring
        for arr in (*stack.entries, stack.positions):
            assert device0_bytes(arr) * 8 == arr.nbytes, (arr.shape, arr.sharding)
    total = sum(a.nbytes for a in jax.tree.leaves(cache))
    assert cache.nbytes_per_device() <= total / 8 + 1024  # + the tiny lengths / counters


def test_gqa_cache_holds_kv_heads_and_a_sliding_layer_about_its_window():
    model = build("llama")
    for max_len in (32, 64):
        by_window = stacks_by_window(el.init_cache(model, 2, max_len))
        k, v = by_window[None].entries  # the full layer: K and V of the 2 KV heads, never 4
        # heads-major: [layers, batch, kv_heads, slots, head_dim]
        assert k.shape == v.shape == (1, 2, LLAMA.n_kv_heads, max_len, LLAMA.head_dim)
        ring = by_window[WINDOW]  # the sliding layer: a ring of W slots whatever max_len is
        assert ring.ring is not None and ring.entries[0].shape[3] <= WINDOW + 128
        assert ring.entries[0].shape[3] == WINDOW and ring.entries[0].shape[2] == 2
    spec = spec_on((8,), ("context",))
    ring = stacks_by_window(el.init_cache(build("llama", spec), 2, 64))[WINDOW].entries[0]
    assert ring.shape[3] == 8 and device0_bytes(ring) * 8 == ring.nbytes  # 1 slot per device


def test_mla_cache_is_latent_and_rope_only():
    width = DEEPSEEK.kv_lora_rank + DEEPSEEK.qk_rope_head_dim
    cache = el.init_cache(build("deepseek"), 2, MAX_LEN)
    for stack in cache.stacks:
        (latent,) = stack.entries  # one array: no per-head K/V
        assert latent.shape[1:] == (2, 1, MAX_LEN, width), latent.shape


def test_tensor_axis_splits_kv_heads_but_not_the_mla_latent():
    spec = spec_on((4, 2), ("context", "tensor"), tensor_axis="tensor")
    llama = el.init_cache(build("llama", spec, sharded=True), 2, 64)
    for stack in llama.stacks:
        for arr in stack.entries:  # 2 KV heads over tensor 2, slots over context 4
            shard = arr.addressable_shards[0].data
            assert shard.shape[2] == LLAMA.n_kv_heads // 2 and device0_bytes(arr) * 8 == arr.nbytes
    deepseek = el.init_cache(build("deepseek", spec, sharded=True), 2, 64)
    for stack in deepseek.stacks:
        (latent,) = stack.entries  # whole on every tensor device: 1/4 (context) only
        shard = latent.addressable_shards[0].data.shape
        assert (shard[2], shard[4]) == (latent.shape[2], latent.shape[4])
        assert device0_bytes(latent) * 4 == latent.nbytes


# ---- bad input ---------------------------------------------------------------------------

G = dict(max_new_tokens=3, lengths=LENGTHS)
BAD_GENERATE = [
    ("new tokens 0", dict(G, max_new_tokens=0), ValueError, "max_new_tokens"),
    ("new tokens < 0", dict(G, max_new_tokens=-2), ValueError, "max_new_tokens"),
    ("past max_seq_len", dict(G, max_new_tokens=60), ValueError, "max_seq_len=64"),
    ("past max_len", dict(G, max_len=14), ValueError, "max_len=14"),
    ("temperature < 0", dict(G, temperature=-0.5, key=jax.random.key(0)), ValueError,
     "temperature"),
    ("top_k 0", dict(G, temperature=1.0, top_k=0, key=jax.random.key(0)), ValueError, "top_k"),
    ("top_p 0", dict(G, temperature=1.0, top_p=0.0, key=jax.random.key(0)), ValueError, "top_p"),
    ("top_p > 1", dict(G, temperature=1.0, top_p=1.5, key=jax.random.key(0)), ValueError,
     "top_p"),
    ("sampling without key", dict(G, temperature=1.0), ValueError, "key"),
    ("length 0", dict(G, lengths=np.array([13, 0])), ValueError, "lengths"),
    ("length > prompt", dict(G, lengths=np.array([14, 9])), ValueError, "lengths"),
    ("eos outside vocab", dict(G, eos_id=64), ValueError, "eos_id"),
    ("eos negative", dict(G, eos_id=-1), ValueError, "eos_id"),
    ("one of several eos outside vocab", dict(G, eos_id=[3, 64]), ValueError, "eos_id"),
    ("pad outside vocab", dict(G, pad_id=64), ValueError, "pad_id"),
    ("float prompts", dict(G, prompts=PROMPTS.astype(np.float32)), TypeError, "prompts"),
    ("token outside vocab", dict(G, prompts=PROMPTS + 60), ValueError, "prompts"),
    ("no rows", dict(max_new_tokens=3, prompts=PROMPTS[:0]), ValueError, "prompts"),
    ("temperature past float32", dict(G, temperature=1e39, key=jax.random.key(0)), ValueError,
     "temperature must fit float32"),
    ("on_token not callable", dict(G, on_token=5), TypeError, "on_token"),
]  # fmt: skip


@pytest.fixture(scope="module")
def llama():
    return build("llama")


@pytest.mark.parametrize("name,kw,error,match", BAD_GENERATE, ids=[c[0] for c in BAD_GENERATE])
def test_bad_generate_input_raises_before_compiling(llama, name, kw, error, match):
    kw = dict(kw)
    prompts = kw.pop("prompts", PROMPTS)
    before = compile_counts()
    with pytest.raises(error, match=match):
        el.generate(llama, prompts, **kw)
    assert compile_counts() == before


def test_a_cache_of_another_model_or_spec_is_refused(llama):
    other = build("deepseek")
    spec = spec_on((4,), ("context",))
    before = compile_counts()
    wrongs = (
        (el.init_cache(other, 2, MAX_LEN), "another model"),
        (el.init_cache(build("llama", spec), 2, MAX_LEN), "another sharding spec"),
    )
    for wrong, match in wrongs:
        with pytest.raises(ValueError, match=match):
            el.prefill(llama, wrong, PROMPTS, LENGTHS)
        with pytest.raises(ValueError, match=match):
            el.decode_step(llama, wrong, np.zeros(2, np.int32))
    with pytest.raises(TypeError, match="KVCache"):
        el.prefill(llama, {"not": "a cache"}, PROMPTS)
    assert compile_counts() == before


def test_a_cache_of_integers_is_refused(llama):
    with pytest.raises(TypeError, match="floating-point"):
        el.init_cache(llama, 2, MAX_LEN, dtype=np.int8)


def test_decode_step_needs_a_prefilled_cache_with_room(llama):
    cache = el.init_cache(llama, 2, 14)
    before = compile_counts()
    with pytest.raises(ValueError, match="call prefill"):
        el.decode_step(llama, cache, np.zeros(2, np.int32))
    assert compile_counts() == before
    with pytest.raises(ValueError, match="tokens"):
        el.decode_step(llama, cache, np.zeros(3, np.int32))
    _, cache = el.prefill(llama, cache, PROMPTS, LENGTHS)
    _, cache = el.decode_step(llama, cache, np.zeros(2, np.int32))  # row 0: 14 tokens, full
    before = compile_counts()
    with pytest.raises(ValueError, match="cache is full"):
        el.decode_step(llama, cache, np.zeros(2, np.int32))
    with pytest.raises(TypeError, match="tokens"):
        el.decode_step(llama, cache, np.zeros(2, np.float32))
    assert compile_counts() == before
