"""`generate` under a sharding spec gives the one-device tokens; `return_logits` and raw
PRNG keys work (issue 18).

Each case fails on the inference core as merged (0f2a10b), for the reason its mark gives,
and is marked `xfail(strict=True)` until it is fixed; meanwhile the notebook
`long_context_generation` generates under a spec with `prefill` + `decode_step`, and the
notebooks sample with typed keys (`jax.random.key`) and without `return_logits`.
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


DONATED_KEY = pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="_generate.py: _step_jit donates every argument but the model "
    "(donate='warn-except-first'), the PRNG key included; generate passes the same key to "
    "every step, so under a spec (key replicated on 8 devices, donation usable) the second "
    "step raises 'Array has been deleted'",
)
VMAP_SHARDING = pytest.mark.xfail(
    strict=True,
    raises=ValueError,
    reason="_sampling.py:_sample: jax.vmap(jax.random.categorical)(keys, scaled) maps the "
    "replicated keys with the logits sharded over the batch axis 'data' ('Mapped away "
    "dimension of inputs passed to vmap should be sharded the same'); generate always "
    "passes a key, so even greedy generation fails under a spec with a batch axis",
)


@pytest.mark.parametrize(
    "shape, names",
    [
        pytest.param((8,), ("context",), marks=DONATED_KEY, id="context8"),
        pytest.param((2, 4), ("data", "context"), marks=VMAP_SHARDING, id="data2-context4"),
    ],
)
def test_generate_under_a_spec(shape, names):
    spec = el.ShardingSpec(jax.make_mesh(shape, names), "ring", "zigzag")
    model = Llama(CONFIG, key=jax.random.key(0), spec=spec)
    tokens = el.generate(model, PROMPTS, max_new_tokens=3)
    np.testing.assert_array_equal(tokens, one_device_tokens())


@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="_generate.py: with return_logits=True, generate keeps each step's logits in "
    "`seen` and then passes the same array to _step_jit, which donates it; the final "
    "jnp.stack(seen) raises 'Array has been deleted'",
)
def test_generate_returns_logits_on_one_device():
    model = Llama(CONFIG, key=jax.random.key(0))
    tokens, logits = el.generate(model, PROMPTS, max_new_tokens=3, return_logits=True)
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))


@pytest.mark.xfail(
    strict=True,
    raises=ValueError,
    reason="_generate.py: _step_jit donates the key; a raw uint32[2] key "
    "(jax.random.PRNGKey) is a donatable buffer even on one device, so sampling with it "
    "fails at the second step ('Buffer has been deleted or donated')",
)
def test_generate_samples_with_a_raw_key():
    model = Llama(CONFIG, key=jax.random.key(0))
    kwargs = dict(max_new_tokens=3, temperature=1.0, top_k=5)
    tokens = el.generate(model, PROMPTS, key=jax.random.PRNGKey(0), **kwargs)
    again = el.generate(model, PROMPTS, key=jax.random.PRNGKey(0), **kwargs)
    np.testing.assert_array_equal(tokens, again)
