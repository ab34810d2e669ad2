"""One token of the gated delta rule and of the short convolution (`gated_delta_step`,
`short_conv_step`, issue 46 part 4) against the room's oracles run over a whole sequence:
`reference_gated_delta_rule` (token by token, its own scan) and `short_conv`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err

from eqx_longctx.linear import (
    gated_delta_step,
    reference_gated_delta_rule,
    short_conv,
    short_conv_step,
)

TOL = 1e-5  # float32, relative
B, S, H, DK, DV = 2, 11, 3, 8, 6


def rule_inputs(kda: bool, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(keys[0], (B, S, H, DK))
    k = jax.random.normal(keys[1], (B, S, H, DK))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(keys[2], (B, S, H, DV))
    g_shape = (B, S, H, DK) if kda else (B, S, H)
    g = -jax.nn.softplus(jax.random.normal(keys[3], g_shape))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, S, H)))
    state0 = jax.random.normal(keys[5], (B, H, DK, DV)) * 0.3
    return q, k, v, g, beta, state0


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_steps_equal_the_reference_rule(kda):
    """Stepping token by token from an initial state gives the reference's outputs and,
    after each token, the state the reference ends with on that prefix."""
    q, k, v, g, beta, state = rule_inputs(kda)
    ref_out, ref_state = reference_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, return_state=True
    )
    step = jax.jit(gated_delta_step)
    outs = []
    for t in range(S):
        out, state = step(state, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        outs.append(out)
        if t == 4:
            _, mid = reference_gated_delta_rule(
                q[:, :5], k[:, :5], v[:, :5], g[:, :5], beta[:, :5],
                initial_state=rule_inputs(kda)[-1], return_state=True,
            )  # fmt: skip
            assert rel_err(state, mid) <= TOL
    assert state.dtype == jnp.float32
    assert rel_err(jnp.stack(outs, 1), ref_out) <= TOL
    assert rel_err(state, ref_state) <= TOL


def test_leading_axes_scale_and_a_no_op_token():
    """Any leading axes (here rows x copies); `scale`; a token with g = 0 and beta = 0
    leaves the state exactly as it was."""
    q, k, v, g, beta, state = rule_inputs(False)
    copies = lambda x: jnp.broadcast_to(x[:, None], (B, 4, *x.shape[1:]))  # noqa: E731
    out, new = gated_delta_step(
        copies(state), copies(q[:, 0]), copies(k[:, 0]), copies(v[:, 0]), copies(g[:, 0]),
        copies(beta[:, 0]), scale=0.5,
    )  # fmt: skip
    ref, ref_state = reference_gated_delta_rule(
        q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], initial_state=state, scale=0.5,
        return_state=True,
    )  # fmt: skip
    assert out.shape == (B, 4, H, DV) and new.shape == (B, 4, H, DK, DV)
    for c in range(4):
        assert rel_err(out[:, c], ref[:, 0]) <= TOL and rel_err(new[:, c], ref_state) <= TOL
    zeros = jnp.zeros((B, H))
    _, same = gated_delta_step(state, q[:, 0], k[:, 0], v[:, 0], zeros, zeros)
    np.testing.assert_array_equal(same, state)


def test_out_dtype_follows_the_inputs():
    q, k, v, g, beta, state = rule_inputs(False)
    bf = lambda x: x[:, 0].astype(jnp.bfloat16)  # noqa: E731
    out, new = gated_delta_step(state, bf(q), bf(k), bf(v), g[:, 0], beta[:, 0])
    assert out.dtype == jnp.bfloat16 and new.dtype == jnp.float32


@pytest.mark.parametrize("bias", [False, True])
def test_conv_steps_equal_short_conv(bias):
    """From a zero window (the row's start), stepping each token gives `short_conv`'s
    outputs, and the window ends as the last K-1 inputs."""
    kx, kw, kb = jax.random.split(jax.random.key(1), 3)
    c, kernel = 5, 4
    x = jax.random.normal(kx, (B, S, c))
    w = jax.random.normal(kw, (c, kernel))
    b = jax.random.normal(kb, (c,)) if bias else None
    expected = short_conv(x, w, b, activation="silu")
    window = jnp.zeros((B, c, kernel - 1))
    outs = []
    for t in range(S):
        out, window = short_conv_step(window, x[:, t], w, b, activation="silu")
        outs.append(out)
    assert rel_err(jnp.stack(outs, 1), expected) <= TOL
    np.testing.assert_array_equal(window, jnp.swapaxes(x[:, -3:], 1, 2))


def test_bad_input():
    q, k, v, g, beta, state = rule_inputs(False)
    q, k, v, g, beta = q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]
    with pytest.raises(ValueError, match=r"v must be \[2, 3, 6\]"):
        gated_delta_step(state, q, k, v[..., :4], g, beta)
    with pytest.raises(ValueError, match=r"g must be \[\.\.\., heads\]"):
        gated_delta_step(state, q, k, v, g[:, :2], beta)
    with pytest.raises(ValueError, match=r"state \[\.\.\., heads, dk, dv\]"):
        gated_delta_step(state[0, 0], q, k, v, g, beta)
    with pytest.raises(TypeError, match="floating-point q"):
        gated_delta_step(state, q.astype(jnp.int32), k, v, g, beta)
    window, x, w = jnp.zeros((2, 5, 3)), jnp.zeros((2, 5)), jnp.zeros((5, 4))
    with pytest.raises(ValueError, match="K-1=3"):
        short_conv_step(window[..., :2], x, w)
    with pytest.raises(ValueError, match="bias"):
        short_conv_step(window, x, w, jnp.zeros(4))
    with pytest.raises(ValueError, match="activation must be one of"):
        short_conv_step(window, x, w, activation="gelu")
