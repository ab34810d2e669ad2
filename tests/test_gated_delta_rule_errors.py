"""Every documented error of `gated_delta_rule` (and of its reference): one line, raised
before anything is traced, naming the argument, the values and the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_longctx as el
from eqx_longctx import ShardingSpec

B, S, H, DK, DV = 2, 5, 3, 4, 6


def _good():
    rng = np.random.default_rng(0)
    return dict(
        q=rng.normal(size=(B, S, H, DK)).astype(np.float32),
        k=rng.normal(size=(B, S, H, DK)).astype(np.float32),
        v=rng.normal(size=(B, S, H, DV)).astype(np.float32),
        g=-rng.uniform(size=(B, S, H)).astype(np.float32),
        beta=rng.uniform(size=(B, S, H)).astype(np.float32),
    )


def _with(**changes):
    arrays = _good()
    options = {name: changes.pop(name) for name in list(changes) if name not in arrays}
    return {**arrays, **changes}, options


ERRORS = {
    "positive g": (
        _with(g=np.full((B, S, H), 0.5, np.float32)),
        ValueError,
        r"g is the log of the decay and must be <= 0.*max\(g\) = 0\.5",
    ),
    "k shape": (_with(k=np.zeros((B, S, H, DK + 1), np.float32)), ValueError, "q and k of one"),
    "v heads": (_with(v=np.zeros((B, S, H + 1, DV), np.float32)), ValueError, r"v\(2, 5, 4, 6\)"),
    "g shape": (
        _with(g=np.zeros((B, S, H, DK + 1), np.float32)),
        ValueError,
        r"g must be \[batch, seq, heads\] = \(2, 5, 3\).*\(2, 5, 3, 4\).*got g\(2, 5, 3, 5\)",
    ),
    "beta shape": (_with(beta=np.zeros((B, S), np.float32)), ValueError, "beta must be"),
    "rank": (_with(q=np.zeros((S, H, DK), np.float32)), ValueError, "rank 4"),
    "empty": (_with(**{n: np.zeros((B, 0, H, 4)) for n in "qkv"}), ValueError, "non-empty"),
    "int q": (_with(q=np.zeros((B, S, H, DK), np.int32)), TypeError, "floating-point q;"),
    "int g": (_with(g=np.zeros((B, S, H), np.int32)), TypeError, "floating-point g;"),
    "int beta": (_with(beta=np.ones((B, S, H), np.int32)), TypeError, "floating-point beta"),
    "float segment_ids": (
        _with(segment_ids=np.zeros((B, S), np.float32)),
        TypeError,
        r"segment_ids must be integers.*float32",
    ),
    "segment_ids shape": (
        _with(segment_ids=np.zeros((B, S + 1), np.int32)),
        ValueError,
        r"segment_ids must be \[batch, seq\] = \(2, 5\)",
    ),
    "segment_ids range": (
        _with(segment_ids=np.full((B, S), 2**40, np.int64)),
        ValueError,
        "segment_ids must fit int32",
    ),
    "initial_state shape": (
        _with(initial_state=np.zeros((B, H, DV, DK), np.float32)),
        ValueError,
        r"initial_state must be \[batch, heads, dk, dv\] = \(2, 3, 4, 6\).*got \(2, 3, 6, 4\)",
    ),
    "int initial_state": (
        _with(initial_state=np.zeros((B, H, DK, DV), np.int32)),
        TypeError,
        "floating-point initial_state",
    ),
    "scale": (_with(scale="big"), TypeError, "scale must be a real number"),
    "chunk 0": (_with(chunk=0), ValueError, "chunk must be positive; got 0"),
    "chunk float": (_with(chunk=16.0), TypeError, "chunk must be an int"),
    "return_state": (_with(return_state=1), TypeError, "return_state must be True or False"),
    "spec string": (_with(spec="ring"), TypeError, r"needs spec=a ShardingSpec or None"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors(case):
    (arrays, options), error, match = ERRORS[case]
    with pytest.raises(error, match=match) as info:
        el.gated_delta_rule(**arrays, **options)
    message = str(info.value)
    assert "\n" not in message and message.startswith("gated_delta_rule")


def test_a_sequence_the_spec_does_not_split():
    """Zig-zag over 8 devices splits the sequence into 16 chunks (more cases under a spec:
    `test_gated_delta_rule_cp.py`)."""
    spec = ShardingSpec(jax.make_mesh((8,), ("context",)))
    with pytest.raises(ValueError, match=r"^gated_delta_rule: .*divisible by 16; got seq=5"):
        el.gated_delta_rule(**_good(), spec=spec)


def test_the_reference_checks_the_same():
    arrays, _ = _with(g=np.full((B, S, H), 0.5, np.float32))
    with pytest.raises(ValueError, match="reference_gated_delta_rule: g is the log"):
        el.reference_gated_delta_rule(**arrays)


def test_a_traced_positive_g_is_not_checked():
    """Under `jax.jit` the values of g are unknown: the shapes are checked, the sign not."""
    arrays = _good()
    arrays["g"] = np.abs(arrays["g"])
    out = jax.jit(el.gated_delta_rule)(**arrays)
    assert out.shape == (B, S, H, DV) and out.dtype == jnp.float32
