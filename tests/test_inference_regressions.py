"""Regression tests of two inference bugs found while benchmarking generation (issue 18):
`generate` donated the logits it keeps for `return_logits`, and `KVCache.nbytes_per_device`
summed whole arrays for an abstract cache instead of one device's shard."""

import equinox as eqx
import jax
import numpy as np

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
