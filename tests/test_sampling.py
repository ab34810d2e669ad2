"""Sampling laws (issue 18): greedy, temperature, top-k, nucleus, keys, tracing, bad input.

Frequencies are checked against probabilities computed here in NumPy float64 from the
logits: 20,000 draws come from one call (one row per draw, every row its own key), and each
token's frequency must lie within 5 binomial standard deviations of its probability, a
bound that each test also shows rejects the plausible wrong distributions (not
renormalised, temperature ignored, filtering in the wrong order).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_longctx.inference._sampling import _filter, _sample, check_sampling, sample_tokens

N = 20_000  # draws per distribution check
# Logits of a 10-token vocabulary in a shuffled order, so that "the top 5" are not ids 0-4.
LOGITS = np.array([0.0, 2.0, -1.0, 0.7, 1.5, -2.0, 0.5, 0.2, 1.0, -0.3], np.float32)
TOP5 = {1, 4, 8, 3, 6}


def softmax64(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def renormalised(probs: np.ndarray, keep) -> np.ndarray:
    out = np.zeros_like(probs)
    out[list(keep)] = probs[list(keep)]
    return out / out.sum()


def frequencies_match(tokens, probs: np.ndarray) -> bool:
    """Whether the token counts fit `probs`: tokens of probability 0 never appear, the others
    within 5 standard deviations (false alarm about 1e-6 per token)."""
    tokens = np.asarray(tokens)
    freq = np.bincount(tokens, minlength=probs.size)[: probs.size] / tokens.size
    if tokens.max() >= probs.size or np.any(freq[probs == 0] > 0):
        return False
    sigma = np.sqrt(probs * (1 - probs) / tokens.size)
    return bool(np.all(np.abs(freq - probs) <= 5 * sigma + 1e-12))


def draws(logits=LOGITS, seed=0, n=N, **kw):
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
    tokens = sample_tokens(rows, jax.random.key(seed), **kw)
    assert tokens.shape == (n,) and tokens.dtype == jnp.int32
    return np.asarray(tokens)


# ---- greedy ---------------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = jax.random.normal(jax.random.key(0), (64, 50)) * 3
    expected = np.argmax(np.asarray(logits), axis=-1)
    np.testing.assert_array_equal(sample_tokens(logits), expected)
    # Greedy ignores the key, top_k and top_p, and takes bfloat16 logits too.
    key = jax.random.key(1)
    np.testing.assert_array_equal(sample_tokens(logits, key, top_k=3, top_p=0.5), expected)
    bf16 = logits.astype(jnp.bfloat16)
    np.testing.assert_array_equal(
        sample_tokens(bf16), np.argmax(np.asarray(bf16.astype(jnp.float32)), axis=-1)
    )
    # A tie goes to the lowest token id.
    np.testing.assert_array_equal(sample_tokens(jnp.array([[0.0, 3.0, 1.0, 3.0]])), [1])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 30.0])
def test_top_k_1_is_greedy(temperature):
    logits = jax.random.normal(jax.random.key(2), (256, 40))
    tokens = sample_tokens(logits, jax.random.key(3), temperature=temperature, top_k=1)
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), axis=-1))
    # At this temperature, sampling without top_k is far from greedy: the check can fail.
    free = sample_tokens(logits, jax.random.key(3), temperature=temperature)
    assert np.mean(np.asarray(free) != np.argmax(np.asarray(logits), axis=-1)) > 0.3


# ---- distributions --------------------------------------------------------------------------


def test_unfiltered_sampling_is_softmax():
    assert frequencies_match(draws(temperature=1.0), softmax64(LOGITS))


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_follows_softmax_of_scaled_logits(temperature):
    tokens = draws(temperature=temperature, seed=4)
    assert frequencies_match(tokens, softmax64(LOGITS / temperature))
    assert not frequencies_match(tokens, softmax64(LOGITS)), "temperature ignored passes"


def test_top_k_5_stays_in_the_top_5_with_renormalised_frequencies():
    tokens = draws(temperature=1.0, top_k=5, seed=5)
    assert set(np.unique(tokens)) <= TOP5
    probs = softmax64(LOGITS)
    assert frequencies_match(tokens, renormalised(probs, TOP5))
    assert not frequencies_match(tokens, np.where(np.isin(np.arange(10), list(TOP5)), probs, 0))
    assert not frequencies_match(tokens, probs)


def test_top_k_with_temperature():
    tokens = draws(temperature=0.5, top_k=5, seed=6)
    assert frequencies_match(tokens, renormalised(softmax64(LOGITS / 0.5), TOP5))
    assert not frequencies_match(tokens, renormalised(softmax64(LOGITS), TOP5))


def test_top_k_above_vocab_keeps_everything():
    tokens = draws(temperature=1.0, top_k=1000, seed=7)
    assert frequencies_match(tokens, softmax64(LOGITS))


# Probabilities known exactly, in a shuffled order: ids by probability are 3, 0, 5, 1, ...
PROBS = np.array([0.25, 0.1, 0.02, 0.4, 0.05, 0.15, 0.03])
P_LOGITS = np.log(PROBS).astype(np.float32)


@pytest.mark.parametrize(
    "top_p, nucleus",
    [
        (0.7, {3, 0, 5}),  # 0.4 + 0.25 = 0.65 < 0.7: 0.15 joins, and then 0.8 >= 0.7
        (0.9, {3, 0, 5, 1}),
        (0.3, {3}),  # the most probable token alone already holds 0.4 >= 0.3
        (1.0, set(range(7))),
    ],
)
def test_top_p_samples_the_nucleus(top_p, nucleus):
    tokens = draws(P_LOGITS, temperature=1.0, top_p=top_p, seed=8)
    assert set(np.unique(tokens)) <= nucleus
    assert frequencies_match(tokens, renormalised(PROBS, nucleus))
    if len(nucleus) < len(PROBS):
        assert not frequencies_match(tokens, PROBS)


def test_top_p_applies_to_the_renormalised_top_k():
    """As in transformers: temperature, then top-k, then the nucleus of what top-k kept.

    After top_k=3 the probabilities are 0.5, 0.3125, 0.1875: the nucleus of mass 0.7 is the
    first two (0.8125 >= 0.7), while the nucleus of the unrestricted distribution would
    also hold the third (0.65 < 0.7).
    """
    tokens = draws(P_LOGITS, temperature=1.0, top_k=3, top_p=0.7, seed=9)
    assert set(np.unique(tokens)) == {3, 0}
    assert frequencies_match(tokens, renormalised(PROBS, {3, 0}))


def test_no_restriction_is_the_identity():
    """top_k off and top_p = 1.0 keep every token, even the tail whose float32 cumulative
    probability has already rounded to 1."""
    logits = jnp.concatenate([jnp.array([[30.0]]), jnp.zeros((1, 999))], axis=-1)
    probs = jax.nn.softmax(logits[0])
    assert float(jnp.cumsum(probs)[-2] - probs[-2]) >= 1.0  # the trap is set
    np.testing.assert_array_equal(_filter(logits, 0, 1.0), logits)
    np.testing.assert_array_equal(_filter(logits, jnp.int32(0), jnp.float32(1.0)), logits)


def test_ties_at_the_threshold_are_kept():
    logits = np.array([1.0, 3.0, 2.0, 2.0, 0.0], np.float32)
    tokens = draws(logits, temperature=1.0, top_k=2, seed=10, n=4000)
    assert set(np.unique(tokens)) == {1, 2, 3}


# ---- keys and rows --------------------------------------------------------------------------


def test_same_key_same_tokens_other_key_other_tokens():
    logits = jax.random.normal(jax.random.key(11), (128, 64))
    kw = dict(temperature=1.0, top_k=20, top_p=0.95)
    a = sample_tokens(logits, jax.random.key(0), **kw)
    np.testing.assert_array_equal(a, sample_tokens(logits, jax.random.key(0), **kw))
    b = sample_tokens(logits, jax.random.key(1), **kw)
    assert np.mean(np.asarray(a) != np.asarray(b)) > 0.5
    # Legacy uint32 keys work, deterministically.
    old = sample_tokens(logits, jax.random.PRNGKey(0), **kw)
    np.testing.assert_array_equal(old, sample_tokens(logits, jax.random.PRNGKey(0), **kw))


def test_rows_sample_independently():
    """Row i's token depends only on its logits and its key: other rows do not matter, and
    identical rows still draw different tokens."""
    logits = jax.random.normal(jax.random.key(12), (16, 64))
    other = logits.at[1:].set(jax.random.normal(jax.random.key(13), (15, 64)) * 5)
    key = jax.random.key(14)
    for kw in (dict(temperature=1.0), dict(temperature=0.7, top_k=10, top_p=0.9)):
        a = np.asarray(sample_tokens(logits, key, **kw))
        b = np.asarray(sample_tokens(other, key, **kw))
        assert a[0] == b[0]
        assert np.any(a[1:] != b[1:])
    same = sample_tokens(jnp.zeros((32, 1000)), key, temperature=1.0)
    assert len(np.unique(np.asarray(same))) > 25


# ---- traced settings ------------------------------------------------------------------------


def test_traced_settings_compile_once_and_match_eager():
    traces = 0

    @jax.jit
    def step(logits, key, temperature, top_k, top_p):
        nonlocal traces
        traces += 1
        return _sample(logits, key, temperature, top_k, top_p, filtered=True)

    logits = jax.random.normal(jax.random.key(15), (64, 32)) * 2
    key = jax.random.key(16)
    settings = [
        (0.0, None, None),
        (1.0, None, None),
        (0.7, 5, None),
        (1.3, None, 0.8),
        (0.9, 4, 0.6),
        (1.0, 1, None),
        (1.0, 100, None),
        (0.0, 3, 0.5),
    ]
    for t, k, p in settings:
        eager = sample_tokens(logits, key, temperature=t, top_k=k, top_p=p)
        traced = step(
            logits,
            key,
            jnp.float32(t),
            jnp.int32(0 if k is None else k),
            jnp.float32(1.0 if p is None else p),
        )
        np.testing.assert_array_equal(traced, eager, err_msg=f"{t=} {k=} {p=}")
    assert traces == 1
    # The traced top_k really filters: with top_k=1 the draw is the argmax.
    greedy = np.argmax(np.asarray(logits), axis=-1)
    np.testing.assert_array_equal(
        step(logits, key, jnp.float32(5.0), jnp.int32(1), jnp.float32(1.0)), greedy
    )
    assert np.any(
        np.asarray(step(logits, key, jnp.float32(5.0), jnp.int32(0), jnp.float32(1.0))) != greedy
    )
    assert traces == 1


# ---- bad input ------------------------------------------------------------------------------

L = jnp.zeros((2, 8))
K = jax.random.key(0)

BAD = [
    # (id, call, exception, message fragment)
    ("temperature < 0", lambda: sample_tokens(L, K, temperature=-0.5),
     ValueError, r"temperature must be >= 0.0; got -0.5"),
    ("temperature nan", lambda: sample_tokens(L, K, temperature=float("nan")),
     ValueError, "temperature must be finite; got nan"),
    ("temperature inf", lambda: sample_tokens(L, K, temperature=float("inf")),
     ValueError, "temperature must be finite; got inf"),
    ("temperature str", lambda: sample_tokens(L, K, temperature="1.0"),
     TypeError, "temperature must be a real number; got '1.0'"),
    ("temperature bool", lambda: sample_tokens(L, K, temperature=True),
     TypeError, "temperature must be a real number; got True"),
    ("top_k 0", lambda: sample_tokens(L, K, temperature=1.0, top_k=0),
     ValueError, "top_k must be positive; got 0. Use top_k=None"),
    ("top_k < 0", lambda: sample_tokens(L, K, temperature=1.0, top_k=-3),
     ValueError, "top_k must be positive; got -3"),
    ("top_k float", lambda: sample_tokens(L, K, temperature=1.0, top_k=2.5),
     TypeError, "top_k must be an int; got 2.5"),
    ("top_k bool", lambda: sample_tokens(L, K, temperature=1.0, top_k=True),
     TypeError, "top_k must be an int; got True"),
    ("top_k 0 greedy", lambda: sample_tokens(L, top_k=0),
     ValueError, "top_k must be positive; got 0"),
    ("top_p 0", lambda: sample_tokens(L, K, temperature=1.0, top_p=0.0),
     ValueError, r"top_p must be in \(0, 1\]; got 0.0"),
    ("top_p > 1", lambda: sample_tokens(L, K, temperature=1.0, top_p=1.5),
     ValueError, r"top_p must be in \(0, 1\]; got 1.5"),
    ("top_p < 0", lambda: sample_tokens(L, K, temperature=1.0, top_p=-0.1),
     ValueError, r"top_p must be in \(0, 1\]; got -0.1"),
    ("top_p nan", lambda: sample_tokens(L, K, temperature=1.0, top_p=float("nan")),
     ValueError, "top_p must be finite; got nan"),
    ("top_p bool", lambda: sample_tokens(L, K, temperature=1.0, top_p=True),
     TypeError, "top_p must be a real number; got True"),
    ("no key", lambda: sample_tokens(L, temperature=0.8),
     ValueError, r"temperature=0.8 needs a key; got key=None. Pass key=jax.random.key"),
    ("key int", lambda: sample_tokens(L, 0, temperature=1.0),
     TypeError, r"key must be a JAX PRNG key; got 0 \(int\)"),
    ("key float array", lambda: sample_tokens(L, jnp.zeros(2), temperature=1.0),
     TypeError, "key must be a JAX PRNG key"),
    ("key int32 pair", lambda: sample_tokens(L, np.zeros(2, np.int32), temperature=1.0),
     TypeError, "key must be a JAX PRNG key"),
    ("split keys", lambda: sample_tokens(L, jax.random.split(K, 2), temperature=1.0),
     ValueError, r"key must be one PRNG key \(shape \(\)\); got a key array of shape \(2,\)"),
    ("legacy key shape", lambda: sample_tokens(L, np.zeros(3, np.uint32), temperature=1.0),
     ValueError, r"raw uint32 key must have shape \(2,\); got shape \(3,\)"),
    ("bad key greedy", lambda: sample_tokens(L, "seed"),
     TypeError, "key must be a JAX PRNG key; got 'seed'"),
    ("int logits", lambda: sample_tokens(jnp.zeros((2, 8), jnp.int32)),
     TypeError, "logits must be a floating-point array .* dtype int32"),
    ("list logits", lambda: sample_tokens([[0.0, 1.0]]),
     TypeError, r"logits must be a floating-point array \[batch, vocab\]; got \[\[0.0, 1.0\]\]"),
    ("rank 1 logits", lambda: sample_tokens(jnp.zeros(8)),
     ValueError, r"logits must have shape \[batch, vocab\] .*got shape \(8,\)"),
    ("rank 3 logits", lambda: sample_tokens(jnp.zeros((2, 3, 8))),
     ValueError, r"got shape \(2, 3, 8\)"),
    ("empty vocab", lambda: sample_tokens(jnp.zeros((2, 0))),
     ValueError, r"both non-empty; got shape \(2, 0\)"),
]  # fmt: skip


@pytest.mark.parametrize("call, exc, match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match) as info:
        call()
    assert "sample_tokens:" in str(info.value)


def test_check_sampling_names_its_owner_and_allows_greedy_filters():
    with pytest.raises(ValueError, match="generate: top_k must be positive"):
        check_sampling(1.0, 0, None, K, owner="generate")
    # top_k / top_p without sampling are allowed (greedy ignores them); NumPy and 0-d
    # JAX scalars are numbers; legacy keys are keys.
    check_sampling(0.0, 5, 0.5, None)
    check_sampling(np.float32(0.7), np.int64(3), jnp.float32(0.9), jax.random.PRNGKey(1))
    check_sampling(jnp.asarray(1.0), None, 1.0, K)
