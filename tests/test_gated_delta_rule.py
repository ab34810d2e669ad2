"""`gated_delta_rule` on one device (the chunked form) against the rule written out here in
NumPy float64, against its float32 twin `reference_gated_delta_rule` (gradients), against
transformers' torch implementations, and its backward's compiled memory.

The NumPy recurrence shares no code with the library. Gradients are compared with
`jax.grad` of the reference (per-token scan, float32), whose forward is itself checked
against NumPy float64 in the same case.
"""

import functools
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err, segment_ids_from_lengths
from hf_helpers import hf_modules

import eqx_longctx as el

TOL = 1e-5  # float32, relative (max abs error / max abs reference)
TOL_BF16 = 2e-2


def numpy_rule(q, k, v, g, beta, segment_ids=None, initial_state=None, scale=None):
    """The rule token by token in float64: `(out, final_state)`."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    b, s, h, dk = q.shape
    scale = dk**-0.5 if scale is None else scale
    if g.ndim == 3:
        g = np.repeat(g[..., None], dk, axis=-1)
    state = np.zeros((b, h, dk, v.shape[-1]))
    if initial_state is not None:
        state = np.asarray(initial_state, np.float64).copy()
    out = np.zeros(v.shape)
    for row in range(b):
        for t in range(s):
            if t > 0 and segment_ids is not None and segment_ids[row, t] != segment_ids[row, t - 1]:
                state[row] = 0.0
            for head in range(h):
                st = np.exp(g[row, t, head])[:, None] * state[row, head]
                kt = k[row, t, head]
                delta = beta[row, t, head] * (v[row, t, head] - kt @ st)
                st = st + np.outer(kt, delta)
                state[row, head] = st
                out[row, t, head] = (scale * q[row, t, head]) @ st
    return out, state


def make_inputs(seed, b, s, h, dk, dv, *, kda, g_low=-1.0, g_high=0.0, state=False):
    """Random inputs as a layer makes them: L2-normalised q and k, beta in (0, 1)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, s, h, dk))
    k = rng.normal(size=(b, s, h, dk))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(b, s, h, dv))
    g = rng.uniform(g_low, g_high, size=(b, s, h, dk) if kda else (b, s, h))
    beta = rng.uniform(0.05, 0.95, size=(b, s, h))
    s0 = rng.normal(size=(b, h, dk, dv)).astype(np.float32) if state else None
    q, k, v, g, beta = (x.astype(np.float32) for x in (q, k, v, g, beta))
    return q, k, v, g, beta, s0


# Document lengths per row: boundaries inside chunks of 8 and on their edges (8, 24, 40;
# 24), and a one-token document.
PACKED = [[8, 5, 11, 16, 8], [1, 20, 3, 24]]
# Over the default chunk of 64: a boundary inside it, and one on its edge.
LONG = [[30, 70], [64, 36]]

# name: (kda, seq, dk, dv, chunk, document lengths per row or None, initial state, g range)
CASES = {
    "gdn": (False, 40, 8, 8, 16, None, False, (-1.0, 0.0)),
    "kda_dk_ne_dv": (True, 40, 8, 12, 16, None, False, (-1.0, 0.0)),
    "gdn_one_token_state": (False, 1, 8, 4, 64, None, True, (-1.0, 0.0)),
    "kda_one_token": (True, 1, 4, 8, 64, None, False, (-1.0, 0.0)),
    "gdn_state": (False, 37, 8, 6, 8, None, True, (-0.5, 0.0)),
    "gdn_packed": (False, 48, 8, 8, 8, PACKED, False, (-1.0, 0.0)),
    "kda_packed_state": (True, 48, 8, 12, 8, PACKED, True, (-1.0, 0.0)),
    # Strong decays over a chunk of 64: exp(-G_j) would be exp(1280), infinite in float32.
    "gdn_strong_decay": (False, 100, 8, 8, 64, LONG, True, (-21.0, -19.0)),
    "kda_strong_decay": (True, 100, 8, 8, 64, LONG, True, (-1.0, 0.0)),
    # g = -40 for 24 tokens, then about -0.01: the weak decays that follow sit under prefix
    # sums near -960, where float32 steps by 6e-5 (a difference of prefix sums fails here).
    "kda_strong_then_weak": (True, 64, 8, 8, 64, None, True, (-0.02, 0.0)),
    "kda_chunk_1": (True, 9, 4, 4, 1, [[3, 6], [9]], True, (-1.0, 0.0)),
}


def _case_inputs(name):
    kda, s, dk, dv, chunk, lengths, state, (lo, hi) = CASES[name]
    b = 2 if lengths is None else len(lengths)
    q, k, v, g, beta, s0 = make_inputs(
        len(name), b, s, 2, dk, dv, kda=kda, g_low=lo, g_high=hi, state=state
    )
    if name == "kda_strong_decay":  # half the channels forget at once, half remember
        g[..., : dk // 2] += np.float32(-20.0)
    if name == "kda_strong_then_weak":
        g[:, :24] += np.float32(-40.0)
    ids = None if lengths is None else segment_ids_from_lengths(lengths)
    return (q, k, v, g, beta), ids, s0, chunk


@functools.cache
def _grad_fn(fn, with_ids, with_state, chunk):
    """jit of the gradients of `<ct_out, out> + <ct_state, final_state>` with respect to q,
    k, v, g, beta (and the initial state when there is one)."""

    def loss(q, k, v, g, beta, s0, ids, ct_out, ct_state):
        kw = dict(segment_ids=ids if with_ids else None, return_state=True)
        kw["initial_state"] = s0 if with_state else None
        if fn is el.gated_delta_rule:
            kw["chunk"] = chunk
        out, state = fn(q, k, v, g, beta, **kw)
        return jnp.sum(out * ct_out) + jnp.sum(state * ct_state)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5) if with_state else (0, 1, 2, 3, 4)))


@pytest.mark.parametrize("name", list(CASES))
def test_against_the_recurrence(name):
    """Forward and final state against NumPy float64; gradients (q, k, v, g, beta and the
    initial state) against the float32 reference's, whose forward is checked too."""
    arrays, ids, s0, chunk = _case_inputs(name)
    kw = dict(segment_ids=ids, initial_state=s0, return_state=True)
    want_out, want_state = numpy_rule(*arrays, ids, s0)
    out, state = el.gated_delta_rule(*arrays, chunk=chunk, **kw)
    ref_out, ref_state = el.reference_gated_delta_rule(*arrays, **kw)
    assert out.dtype == jnp.float32 and state.dtype == jnp.float32
    assert out.shape == want_out.shape and state.shape == want_state.shape
    errors = {
        "out": rel_err(out, want_out),
        "state": rel_err(state, want_state),
        "reference out": rel_err(ref_out, want_out),
        "reference state": rel_err(ref_state, want_state),
    }
    rng = np.random.default_rng(1)
    cts = (rng.normal(size=out.shape), rng.normal(size=state.shape))
    cts = tuple(x.astype(np.float32) for x in cts)
    zeros = np.zeros_like(cts[1]) if s0 is None else s0
    args = (*arrays, zeros, ids, *cts)
    ours = _grad_fn(el.gated_delta_rule, ids is not None, s0 is not None, chunk)(*args)
    theirs = _grad_fn(el.reference_gated_delta_rule, ids is not None, s0 is not None, 0)(*args)
    names = ("q", "k", "v", "g", "beta", "initial_state")[: len(ours)]
    for what, a, e in zip(names, ours, theirs, strict=True):
        assert a.shape == e.shape
        errors[f"d{what}"] = rel_err(a, e)
    bad = {what: f"{err:.2e}" for what, err in errors.items() if not err <= TOL}
    assert not bad, f"{name}: relative errors above {TOL}: {bad}"


def test_bfloat16_inputs():
    """bfloat16 in, bfloat16 out, float32 state: within bfloat16's tolerance of the rule
    run in float64 on the same (rounded) inputs."""
    arrays, ids, s0, chunk = _case_inputs("kda_packed_state")
    bf16 = tuple(jnp.asarray(x, jnp.bfloat16) for x in arrays)
    out, state = el.gated_delta_rule(
        *bf16, segment_ids=ids, initial_state=s0, chunk=chunk, return_state=True
    )
    assert out.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in bf16)
    want_out, want_state = numpy_rule(q, k, v, g, beta, ids, s0)
    assert rel_err(out, want_out) <= TOL_BF16
    assert rel_err(state, want_state) <= TOL_BF16


def test_chunk_size_changes_nothing():
    """The same result whatever the chunk (one token, a divisor, larger than the row)."""
    arrays, ids, s0, _ = _case_inputs("gdn_packed")
    outs = [
        el.gated_delta_rule(*arrays, segment_ids=ids, initial_state=s0, chunk=c)
        for c in (1, 12, 64)
    ]
    assert max(rel_err(o, outs[0]) for o in outs[1:]) <= TOL


def _torch_cases():
    return ["gdn_chunk", "gdn_recurrent", "kda_chunk", "kda_recurrent"]


@pytest.mark.parametrize("which", _torch_cases())
def test_against_transformers(which):
    """transformers' torch implementations (float32; we pass q and k already L2-normalised,
    and both sides use scale dk ** -0.5), forward and final state, 70 tokens from an
    initial state (their chunked forms pad to 64 as ours does)."""
    torch, _ = hf_modules()
    if which.startswith("gdn"):
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m

        chunked, recurrent = m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule
    else:
        from transformers.models.kimi_linear import modeling_kimi_linear as m

        chunked, recurrent = m.chunk_kimi_delta_attention, m.recurrent_kimi_delta_attention
    kda = which.startswith("kda")
    q, k, v, g, beta, s0 = make_inputs(7, 2, 70, 2, 16, 12, kda=kda, state=True)
    t = [torch.from_numpy(x) for x in (q, k, v, g, beta, s0)]
    if which.endswith("chunk"):
        kw = dict(chunk_size=64, initial_state=t[5], output_final_state=True)
        want_out, want_state = chunked(*t[:5], use_qk_l2norm_in_kernel=False, **kw)
    else:
        kw = dict(initial_state=t[5], output_final_state=True, use_qk_l2norm_in_kernel=False)
        want_out, want_state = recurrent(*t[:5], **kw)
    out, state = el.gated_delta_rule(q, k, v, g, beta, initial_state=s0, return_state=True)
    assert rel_err(out, want_out.numpy()) <= TOL
    assert rel_err(state, want_state.numpy()) <= TOL


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_backward_keeps_no_per_token_state(kda):
    """The compiled gradient at 4096 tokens (heads 2, dk = dv = 64) needs far less scratch
    than the per-token states would take (4096 * 2 * 64 * 64 * 4 bytes = 128 MiB).

    Measured here (XLA:CPU, JAX 0.10.2): 10.9 MiB for GDN and 22.8 MiB for KDA: the inputs
    in chunk order, one state per chunk (2 MiB) and one chunk's work at a time (for KDA,
    a few `[64, 64, dk]` decay factors and their cotangents, 2 MiB each).
    """
    b, s, h, d = 1, 4096, 2, 64
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    args = (spec(b, s, h, d), spec(b, s, h, d), spec(b, s, h, d))
    args += (spec(b, s, h, d) if kda else spec(b, s, h), spec(b, s, h))

    def loss(q, k, v, g, beta):
        return jnp.sum(cast(jax.Array, el.gated_delta_rule(q, k, v, g, beta)))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).compile()
    memory = compiled.memory_analysis()
    assert memory is not None
    temp = memory.temp_size_in_bytes
    per_token_states = s * h * d * d * 4
    assert temp < per_token_states / 4, f"{temp / 2**20:.1f} MiB of temporaries"
