"""Regression tests of inference bugs.

Found while benchmarking generation (issue 18): `generate` donated the logits it keeps for
`return_logits`, and `KVCache.nbytes_per_device` summed whole arrays for an abstract cache
instead of one device's shard.

Found in a review (2026-12-05): a prompt right-padded past its longest row spent cache
slots on the padding columns. `generate` sized its cache by the longest row, so its decode
writes ran past the last slot and overwrote a cached token (wrong tokens, no error), and
`decode_step` refused a cache that still had room for the new tokens.
"""

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import rel_err

import eqx_longctx as el
from models.llama import Llama, LlamaConfig

CONFIG = LlamaConfig.from_preset(
    "tiny", vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=64,
    max_seq_len=256,
)  # fmt: skip


def test_generate_return_logits_on_one_device():
    model = Llama(CONFIG, key=jax.random.key(0))
    prompt = np.arange(8, dtype=np.int32)[None] % CONFIG.vocab_size
    tokens, logits = el.generate(model, prompt, max_new_tokens=3, return_logits=True)
    first, _ = el.prefill(model, el.init_cache(model, 1, 11), prompt)
    np.testing.assert_allclose(np.asarray(logits[:, 0]), np.asarray(first), rtol=1e-5, atol=1e-6)
    assert np.array_equal(np.asarray(tokens[:, 0]), np.asarray(first).argmax(-1))


def test_abstract_cache_bytes_per_device():
    spec = el.ShardingSpec(jax.make_mesh((8,), ("context",)), strategy="ring")
    model = el.init_sharded(lambda: Llama(CONFIG, key=jax.random.key(0), spec=spec))
    concrete = el.init_cache(model, 1, 128).nbytes_per_device()
    abstract = eqx.filter_eval_shape(el.init_cache, model, 1, 128).nbytes_per_device()
    assert abstract == concrete


def test_rows_shorter_than_the_prompt_width_equal_the_trimmed_prompt():
    from test_generate import LLAMA, PROMPTS, build, full_forward_logits, spec_on

    lengths, new = np.array([5, 5], np.int32), 8  # 5 + 8 = 13: the cache just fits
    trimmed = build("llama")
    want, want_logits = el.generate(trimmed, PROMPTS[:, :5], max_new_tokens=new,
                                    return_logits=True)  # fmt: skip
    want, want_logits = np.asarray(want), np.asarray(want_logits)
    oracle = full_forward_logits(trimmed, PROMPTS, lengths, want)
    assert rel_err(want_logits, oracle) <= 1e-4
    for spec in (None, spec_on((4,), ("context",))):
        model = build("llama", spec)
        tokens, logits = el.generate(model, PROMPTS, lengths=lengths, max_new_tokens=new,
                                     return_logits=True)  # fmt: skip
        np.testing.assert_array_equal(np.asarray(tokens), want, err_msg=str(spec))
        assert rel_err(np.asarray(logits), oracle) <= 1e-4, spec
    assert LLAMA.sliding_window is not None  # a ring-buffer layer and a full one


def test_decode_step_fills_a_padded_prompts_cache_to_max_len():
    from test_generate import PROMPTS, build

    model = build("llama")
    cache = el.init_cache(model, 2, 13)
    logits, cache = el.prefill(model, cache, PROMPTS, np.array([5, 4], np.int32))
    for _ in range(8):  # row 0: 5 + 8 = 13 tokens
        logits, cache = el.decode_step(model, cache, np.asarray(logits).argmax(-1))
    with pytest.raises(ValueError, match="cache is full"):
        el.decode_step(model, cache, np.zeros(2, np.int32))


def test_top_k_past_the_vocabulary_keeps_every_token():
    from test_generate import PROMPTS, build

    model, key = build("llama"), jax.random.key(3)
    kw = dict(max_new_tokens=4, temperature=1.0, key=key)
    free = np.asarray(el.generate(model, PROMPTS, **kw))
    huge = np.asarray(el.generate(model, PROMPTS, top_k=2**40, **kw))
    vocab = np.asarray(el.generate(model, PROMPTS, top_k=64, **kw))
    np.testing.assert_array_equal(huge, vocab)
    np.testing.assert_array_equal(huge, free)
