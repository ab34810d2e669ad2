"""`generate` under a sharding spec gives the one-device tokens; `return_logits` and raw
PRNG keys work (issue 18).

Regression tests: the first inference commit donated the key and the kept logits to its
compiled step, and sampled batch-sharded logits with replicated keys.
"""

import dataclasses

import jax
import numpy as np
import pytest

import eqx_longctx as el
from models.llama import PRESETS, Llama

CONFIG = dataclasses.replace(
    PRESETS["tiny"], n_layers=1, dim=64, hidden_dim=128, n_heads=4, n_kv_heads=2
)
PROMPTS = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 12)).astype(np.int32)


def one_device_tokens():
    model = Llama(CONFIG, key=jax.random.key(0))
    return np.asarray(el.generate(model, PROMPTS, max_new_tokens=3))


@pytest.mark.parametrize(
    "shape, names",
    [
        pytest.param((8,), ("context",), id="context8"),
        pytest.param((2, 4), ("data", "context"), id="data2-context4"),
    ],
)
def test_generate_under_a_spec(shape, names):
    spec = el.ShardingSpec(jax.make_mesh(shape, names), "ring", "zigzag")
    model = Llama(CONFIG, key=jax.random.key(0), spec=spec)
    tokens = el.generate(model, PROMPTS, max_new_tokens=3)
    np.testing.assert_array_equal(tokens, one_device_tokens())


def test_generate_returns_logits_on_one_device():
    model = Llama(CONFIG, key=jax.random.key(0))
    tokens, logits = el.generate(model, PROMPTS, max_new_tokens=3, return_logits=True)
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))


def test_generate_samples_with_a_raw_key():
    model = Llama(CONFIG, key=jax.random.key(0))
    kwargs = dict(max_new_tokens=3, temperature=1.0, top_k=5)
    tokens = el.generate(model, PROMPTS, key=jax.random.PRNGKey(0), **kwargs)
    again = el.generate(model, PROMPTS, key=jax.random.PRNGKey(0), **kwargs)
    np.testing.assert_array_equal(tokens, again)
