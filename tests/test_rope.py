"""The one RoPE module: both pair conventions, every scaling through one protocol.

Oracles are NumPy float64 rotations written here; the scalings' frequencies are checked
against the Llama 3.1 reference loop (tests/test_llama.py) and transformers' YaRN
(tests/test_deepseek.py).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_longctx.nn import (
    AbstractRopeScaling,
    Llama3RopeScaling,
    RoPE,
    RotaryTables,
    YarnRopeScaling,
)
from tests.helpers import assert_close

D = 16
SCALINGS = {
    "none": None,
    "llama3": Llama3RopeScaling(8.0, 1.0, 4.0, 64),
    "yarn": YarnRopeScaling(4.0, 64, attention_factor=1.3),
}


def numpy_rope(x, positions, frequencies, factor, interleaved):
    """The rotation in float64, one feature pair at a time."""
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    half = x.shape[-1] // 2
    for i, freq in enumerate(frequencies):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        angle = np.asarray(positions, np.float64)[:, :, None] * freq
        cos, sin = factor * np.cos(angle), factor * np.sin(angle)
        out[..., a] = x[..., a] * cos - x[..., b] * sin
        out[..., b] = x[..., b] * cos + x[..., a] * sin
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("scaling", SCALINGS)
def test_rope_matches_numpy(scaling, interleaved):
    s = SCALINGS[scaling]
    rope = RoPE(D, 10000.0, s, interleaved=interleaved)
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, D))
    pos = jax.random.randint(jax.random.key(1), (2, 5), 0, 500)
    freqs = 10000.0 ** (-np.arange(0, D, 2) / D) if s is None else s.frequencies(D, 10000.0)
    factor = 1.0 if s is None else s.rotary_factor()
    expected = numpy_rope(x, pos, freqs, factor, interleaved)
    assert_close(rope(x, pos), expected, factor=5, what=f"{scaling}, interleaved={interleaved}")
    np.testing.assert_allclose(rope.frequencies(), freqs, rtol=1e-14)


def test_conventions_are_a_feature_permutation():
    """Interleaved RoPE is half-split RoPE with features (2i, 2i+1) moved to (i, i + D/2)."""
    perm = np.concatenate([np.arange(0, D, 2), np.arange(1, D, 2)])
    x = jax.random.normal(jax.random.key(0), (1, 7, 2, D))
    pos = jnp.arange(7)[None] * 13
    for s in SCALINGS.values():
        split = RoPE(D, 500.0, s)(x[..., perm], pos)
        inter = RoPE(D, 500.0, s, interleaved=True)(x, pos)
        np.testing.assert_allclose(split, inter[..., perm], rtol=1e-6, atol=1e-6)


def test_a_new_scaling_plugs_in_through_the_protocol():
    @dataclasses.dataclass(frozen=True)
    class Linear(AbstractRopeScaling):  # position interpolation: every frequency / factor
        factor: float

        def frequencies(self, head_dim, theta):
            return 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim) / self.factor

    x = jax.random.normal(jax.random.key(0), (1, 3, 1, D))
    pos = jnp.array([[0, 4, 10]])
    slow = RoPE(D, 10000.0, Linear(2.0))
    np.testing.assert_allclose(slow(x, pos), RoPE(D, 10000.0)(x, pos // 2), rtol=1e-6, atol=1e-6)
    assert Linear(2.0).rotary_factor() == Linear(2.0).softmax_scale_factor() == 1.0


def test_llama3_scaling_leaves_magnitudes_alone():
    s = SCALINGS["llama3"]
    assert s.rotary_factor() == 1.0 and s.softmax_scale_factor() == 1.0


def test_rope_argument_errors():
    # Under pytest, beartype checks the annotations before RoPE's own checks run.
    with pytest.raises(TypeError, match=r"RoPE scaling must be an?|parameter 'scaling'"):
        RoPE(D, 1e4, {"factor": 8.0})
    with pytest.raises(TypeError, match=r"RoPE interleaved must be True|parameter 'interleaved'"):
        RoPE(D, 1e4, interleaved=1)
    with pytest.raises(ValueError, match="positive base theta"):
        RoPE(D, -1.0)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("scaling", SCALINGS)
def test_tables_rotate_as_the_positions_do(scaling, interleaved):
    """`rope(x, rope.tables(positions))` is `rope(x, positions)`, bit for bit, and both the
    float64 rotation."""
    s = SCALINGS[scaling]
    rope = RoPE(D, 10000.0, s, interleaved=interleaved)
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, D))
    pos = jax.random.randint(jax.random.key(1), (2, 5), 0, 500)
    tables = rope.tables(pos)
    assert isinstance(tables, RotaryTables)
    assert tables.cos.shape == tables.sin.shape == (2, 5, D // 2)
    assert tables.cos.dtype == tables.sin.dtype == jnp.float32
    np.testing.assert_array_equal(rope(x, tables), rope(x, pos))
    freqs = rope.frequencies()
    factor = 1.0 if s is None else s.rotary_factor()
    assert_close(rope(x, tables), numpy_rope(x, pos, freqs, factor, interleaved), factor=5)


def test_tables_of_other_tokens_or_width_are_refused():
    rope = RoPE(D, 10000.0)
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, D))
    other_tokens = rope.tables(jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"RotaryTables of shape \(2, 4, 8\) cannot rotate"):
        rope(x, other_tokens)
    other_width = RoPE(2 * D, 10000.0).tables(jnp.zeros((2, 5), jnp.int32))
    with pytest.raises(ValueError, match=r"must be \[batch, seq, head_dim / 2\] = \(2, 5, 8\)"):
        rope(x, other_width)
