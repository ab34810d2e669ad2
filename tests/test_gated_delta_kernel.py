"""The Pallas TPU kernels of the gated delta rule's chunk work, forward and backward
(`eqx_longctx/kernels/_gated_delta*.py`), against the XLA path, without a TPU: Pallas'
interpreter and TPU interpret mode (VMEM simulated, fresh buffers NaN, race detector on),
the Mosaic lowering (`jax.export(platforms=("tpu",))`), the VMEM estimate per TPU
generation, the resolver and the errors.

Every case runs through `gated_delta_rule(..., impl=...)`, as a layer would: outputs and
final state against NumPy float64 (`test_gated_delta_rule.numpy_rule`, which shares no code
with either path) and against the XLA path, gradients (q, k, v, g, beta, initial state)
against the XLA path's. Both kernels are also checked on one chunk against their XLA twin
(`intra_chunk_reference`) and its VJP.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err, segment_ids_from_lengths
from test_gated_delta_rule import make_inputs, numpy_rule

import eqx_longctx as el
from eqx_longctx.kernels import (
    VMEM_CAPACITY,
    PallasGatedDeltaImpl,
    gated_delta_vmem,
    intra_chunk_reference,
    race_detecting_interpret,
    vmem_budget,
)
from eqx_longctx.linear import resolve_gated_delta_impl

TOL = 1e-5  # float32, relative (max abs error / max abs reference)
PLAIN = PallasGatedDeltaImpl(interpret=True)

# name: (kda, seq, dk, dv, chunk, document lengths per row or None, initial state, g range)
CASES = {
    # A length that is not a multiple of the chunk, dk != dv, packed rows (a boundary inside
    # a chunk, one on a chunk's edge, a one-token document), an initial state.
    "gdn_packed_state": (False, 37, 8, 12, 8, [[5, 11, 8, 13], [16, 1, 20]], True, (-1.0, 0.0)),
    "kda_packed_state": (True, 37, 8, 12, 8, [[5, 11, 8, 13], [16, 1, 20]], True, (-1.0, 0.0)),
    # Two chunks of 16, no documents, no state: the state passed between chunks.
    "gdn_two_chunks": (False, 32, 16, 8, 16, None, False, (-1.0, 0.0)),
    # Decays near -20 per token (exp(-G_j) would overflow), documents on a chunk's edge.
    "gdn_strong_packed": (False, 40, 8, 8, 16, [[10, 30], [16, 24]], True, (-21.0, -19.0)),
    # g = -40 for 20 tokens, then about -0.01: the weak decays sit under prefix sums near
    # -800 (a difference of prefix sums would lose them); one chunk of 32.
    "kda_strong_then_weak": (True, 32, 8, 8, 32, None, True, (-0.02, 0.0)),
}


def case_inputs(name):
    kda, s, dk, dv, chunk, lengths, state, (lo, hi) = CASES[name]
    b = 2 if lengths is None else len(lengths)
    q, k, v, g, beta, s0 = make_inputs(
        len(name), b, s, 2, dk, dv, kda=kda, g_low=lo, g_high=hi, state=state
    )
    if name == "kda_strong_then_weak":
        g[:, :20, :, : dk // 2] += np.float32(-40.0)
    ids = None if lengths is None else segment_ids_from_lengths(lengths)
    return (q, k, v, g, beta), ids, s0, chunk


@functools.cache
def grad_fn(impl, with_ids, with_state, chunk):
    """jit of `(out, state)` and the gradients of `<ct_out, out> + <ct_state, state>` with
    respect to q, k, v, g, beta (and the initial state when there is one)."""

    def loss(q, k, v, g, beta, s0, ids, ct_out, ct_state):
        out, state = el.gated_delta_rule(
            q, k, v, g, beta, segment_ids=ids if with_ids else None,
            initial_state=s0 if with_state else None, return_state=True, chunk=chunk,
            impl=impl,
        )  # fmt: skip
        return jnp.sum(out * ct_out) + jnp.sum(state * ct_state), (out, state)

    argnums = (0, 1, 2, 3, 4, 5) if with_state else (0, 1, 2, 3, 4)
    return jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))


def run(impl, name):
    arrays, ids, s0, chunk = case_inputs(name)
    rng = np.random.default_rng(1)
    b, s, h, dv = arrays[2].shape
    ct_out = rng.normal(size=(b, s, h, dv)).astype(np.float32)
    ct_state = rng.normal(size=(b, h, arrays[0].shape[-1], dv)).astype(np.float32)
    fn = grad_fn(impl, ids is not None, s0 is not None, chunk)
    grads, (out, state) = fn(*arrays, s0, ids, ct_out, ct_state)
    return out, state, grads


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_the_xla_path(name):
    """Outputs and final state within 1e-5 of NumPy float64 and of the XLA path; gradients
    of q, k, v, g, beta (and the initial state) within 1e-5 of the XLA path's."""
    arrays, ids, s0, _ = case_inputs(name)
    out, state, grads = run(PLAIN, name)
    want_out, want_state = numpy_rule(*arrays, ids, s0)
    xla_out, xla_state, xla_grads = run("xla", name)
    errors = {"out": rel_err(out, want_out), "state": rel_err(state, want_state),
              "xla out": rel_err(out, xla_out), "xla state": rel_err(state, xla_state)}  # fmt: skip
    for what, a, b in zip(("q", "k", "v", "g", "beta", "s0"), grads, xla_grads, strict=False):
        errors[f"d{what}"] = rel_err(a, b)
    assert len(grads) == (6 if s0 is not None else 5)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in (out, state, *grads))
    assert max(errors.values()) < TOL, errors


def _heads_major_chunk(name):
    """The first chunk's inputs as the kernels read them (heads-major, `q` scaled)."""
    (q, k, v, g, beta), ids, _, chunk = case_inputs(name)
    size = min(chunk, q.shape[1])
    hm = lambda x: jnp.swapaxes(jnp.asarray(x[:, :size]), 1, 2)  # noqa: E731
    starts = np.zeros((q.shape[0], size), np.float32)
    if ids is not None:
        starts[:, 1:] = ids[:, 1:size] != ids[:, : size - 1]
    g = g if g.ndim == 4 else g[..., None]
    return (hm(q * 0.3), hm(k), hm(v), hm(g), hm(beta[..., None]),
            jnp.asarray(starts)[:, None, :, None]), size  # fmt: skip


@pytest.mark.parametrize("name", ["gdn_packed_state", "kda_packed_state"])
def test_kernels_match_the_twin_and_its_vjp(name):
    """W_k, W_v, P, q_in, k_out of one chunk from the forward kernel against
    `intra_chunk_reference`, and the backward kernel's cotangents of q, k, v, g, beta
    against the twin's VJP: a kernel whose substitution skipped a column, or whose backward
    dropped a path, fails here."""
    from eqx_longctx.kernels._gated_delta_pallas import intra_chunk_kernel
    from eqx_longctx.kernels._gated_delta_pallas_bwd import intra_chunk_backward_kernel

    inputs, size = _heads_major_chunk(name)
    ours = intra_chunk_kernel(*inputs, size=size, interpret=True)
    want, vjp = jax.vjp(lambda *a: intra_chunk_reference(*a, inputs[-1]), *inputs[:-1])
    for what, a, b in zip(("w_k", "w_v", "p", "q_in", "k_out"), ours, want, strict=True):
        assert a.shape == b.shape and rel_err(a, b) < TOL, (what, rel_err(a, b))
    rng = np.random.default_rng(2)
    cts = tuple(jnp.asarray(rng.normal(size=x.shape), jnp.float32) for x in want)
    grads = intra_chunk_backward_kernel(size, True, vmem_budget(), inputs, cts)
    for what, a, b in zip(("q", "k", "v", "g", "beta"), grads, vjp(cts), strict=True):
        assert a.shape == b.shape and rel_err(a, b) < TOL, (what, rel_err(a, b))
    # The documents matter: the second row has a start inside this chunk.
    assert float(jnp.sum(inputs[-1])) > 0


@pytest.fixture
def race_detectors(monkeypatch):
    """Every race detector TPU interpret mode creates (one per kernel run)."""
    from eqx_longctx._compat import pallas_interpret_module

    ipc = pallas_interpret_module()
    made, original = [], ipc.RaceDetectionState

    def recording(*args, **kw):
        made.append(original(*args, **kw))
        return made[-1]

    monkeypatch.setattr(ipc, "RaceDetectionState", recording)
    return made


@pytest.mark.slow
@pytest.mark.parametrize("kda", [False, True])
def test_tpu_interpret_mode_without_races(kda, race_detectors):
    """TPU interpret mode with 2 cores (the "parallel" grid axes split between them), fresh
    buffers NaN-filled and the race detector on: outputs, state and gradients (through the
    backward kernel; KDA's with its VMEM scratch) as the XLA path's."""
    name = "kda_packed_state" if kda else "gdn_packed_state"
    arrays, ids, s0, _ = case_inputs(name)
    impl = PallasGatedDeltaImpl(race_detecting_interpret(2))
    out, state, grads = run(impl, name)
    assert len(race_detectors) == 2  # the forward and the backward kernel
    assert not any(r.races_found for r in race_detectors)
    want_out, want_state, want_grads = run("xla", name)
    assert rel_err(out, want_out) < TOL and rel_err(state, want_state) < TOL
    assert max(rel_err(a, b) for a, b in zip(grads, want_grads, strict=True)) < TOL


@pytest.mark.parametrize("kda", [False, True])
def test_lowers_to_mosaic_for_tpu(kda):
    """`gated_delta_rule(impl="pallas")` and its gradient exported for a TPU from this host:
    the forward and backward kernels are in the program as Mosaic (`tpu_custom_call`).
    Real shapes: dk = dv = 128, chunk 64, a ragged length, packed documents."""
    b, s, h, dk, dv = 1, 200, 4, 128, 128
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731

    def grads(q, k, v, g, beta, ids, s0):
        def loss(q, k, v, g, beta, s0):
            out, state = el.gated_delta_rule(
                q, k, v, g, beta, segment_ids=ids, initial_state=s0, return_state=True,
                impl="pallas",
            )  # fmt: skip
            return jnp.sum(out) + jnp.sum(state)

        return jax.grad(loss, (0, 1, 2, 3, 4, 5))(q, k, v, g, beta, s0)

    g = f32(b, s, h, dk) if kda else f32(b, s, h)
    ids = jax.ShapeDtypeStruct((b, s), jnp.int32)
    exported = jax.export.export(jax.jit(grads), platforms=("tpu",))(
        f32(b, s, h, dk), f32(b, s, h, dk), f32(b, s, h, dv), g, f32(b, s, h), ids,
        f32(b, h, dk, dv),
    )  # fmt: skip
    text = exported.mlir_module()
    assert text.count("tpu_custom_call") == 2
    assert "eqx_longctx_gated_delta_chunks" in text
    assert "eqx_longctx_gated_delta_chunks_bwd" in text


@pytest.mark.parametrize("kind", sorted(VMEM_CAPACITY))
@pytest.mark.parametrize("kda", [False, True])
def test_vmem_within_every_generations_budget(kind, kda):
    """At real shapes (16 to 32 heads of dk = dv = 128, chunk 64; a grid step is one chunk
    of one head, so the heads do not enter) one grid step of each kernel is within 3/4 of
    each generation's budget, the budget the attention kernels ask for."""
    budget = vmem_budget(kind)
    assert budget == min(VMEM_CAPACITY[kind], 32 * 2**20)
    for backward in (False, True):
        est = gated_delta_vmem(chunk=64, dk=128, dv=128, kda=kda, backward=backward)
        assert est.total <= 0.75 * budget, (kind, backward, est)


@pytest.mark.parametrize("kda, dk, dv, chunk", [(False, 128, 128, 64), (True, 128, 256, 32)])
def test_estimated_buffers_are_what_the_kernels_declare(kda, dk, dv, chunk):
    """The estimate's buffers and scratch are the blocks (doubled) and scratch the traced
    forward and backward `pallas_call`s declare, lanes padded; the export for a TPU asks
    Mosaic for the budget (16 MiB from a CPU host)."""
    from test_kernel_vmem import _declared, _pallas_calls

    b, s, h = 1, 4 * chunk, 16
    q, v = jnp.zeros((b, s, h, dk)), jnp.zeros((b, s, h, dv))
    g = jnp.zeros((b, s, h, dk) if kda else (b, s, h))
    args = (q, q, v, g, g[..., 0] if kda else g)

    def grads(interpret):
        def loss(*a):
            return jnp.sum(
                el.gated_delta_rule(*a, chunk=chunk, impl=PallasGatedDeltaImpl(interpret))
            )

        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))

    calls = list(_pallas_calls(jax.make_jaxpr(grads(True))(*args).jaxpr))
    for backward, call in zip((False, True), calls, strict=True):
        est = gated_delta_vmem(chunk=chunk, dk=dk, dv=dv, kda=kda, backward=backward)
        assert (est.buffers, est.scratch) == _declared(call), backward
    exported = jax.export.export(jax.jit(grads(False)), platforms=("tpu",))(*args)
    sizes = exported.mlir_module().count(f"\\22size\\22: {vmem_budget()}")
    assert sizes == len(calls)


def test_default_is_the_xla_path_on_cpu():
    """`impl=None` resolves to the XLA path on a CPU (bitwise the same program), to the
    kernels on a TPU where they run the call's shape (else XLA); an instance passes
    through."""
    fits, odd_chunk, too_big = (64, 128, 128, False), (12, 128, 128, True), (256, 256, 256, True)
    assert resolve_gated_delta_impl(None, platform="cpu", shape=fits) == "xla"
    assert resolve_gated_delta_impl(None, platform="tpu", shape=fits) == PallasGatedDeltaImpl()
    assert resolve_gated_delta_impl(None, platform="tpu", shape=odd_chunk) == "xla"
    assert resolve_gated_delta_impl(None, platform="tpu", shape=too_big) == "xla"
    assert resolve_gated_delta_impl("pallas") == PallasGatedDeltaImpl()
    assert resolve_gated_delta_impl(PLAIN, shape=fits) is PLAIN
    with pytest.raises(ValueError, match="got chunk=12"):
        resolve_gated_delta_impl(PLAIN, shape=odd_chunk)
    arrays, ids, s0, chunk = case_inputs("gdn_two_chunks")
    default = el.gated_delta_rule(*arrays, chunk=chunk)
    xla = el.gated_delta_rule(*arrays, chunk=chunk, impl="xla")
    np.testing.assert_array_equal(default, xla)


def test_errors_name_the_rule_and_the_fix():
    arrays, _, _, _ = case_inputs("gdn_two_chunks")
    with pytest.raises(ValueError, match=r"multiple of 8.*got chunk=12.*impl='xla'"):
        el.gated_delta_rule(*arrays, chunk=12, impl="pallas")
    with pytest.raises(ValueError, match=r"impl must be None, 'xla', 'pallas'.*got impl='tpu'"):
        el.gated_delta_rule(*arrays, impl="tpu")
    with pytest.raises(ValueError, match=r"MiB of VMEM per grid step at chunk=2048.*smaller"):
        el.gated_delta_rule(*arrays, chunk=2048, impl="pallas")
    spec = el.ShardingSpec(jax.make_mesh((1,), ("context",)))
    with pytest.raises(ValueError, match=r"dk \+ dv = 24 wide.*MiB of VMEM.*chunk=2048"):
        el.gated_delta_rule(*arrays, chunk=2048, impl="pallas", spec=spec)


# (mesh, layout, gate): each layout once, each gate, meshes with data, ulysses and tensor axes.
SPLIT_CASES = [("dc", "none", "gdn"), ("c8", "zigzag", "kda"), ("usp", "striped", "gdn"),
               ("tp", "zigzag", "gdn")]  # fmt: skip


@pytest.mark.parametrize("mesh,layout,gate", SPLIT_CASES)
def test_kernel_under_a_sharding_spec(mesh, layout, gate):
    """Under a spec every device's augmented pass (values `[0 | v]` from `[I | 0]`) runs
    on the kernel: output, final state and gradients (q, k, v, g, beta, initial state)
    within 1e-5 of the one-device XLA op, with packed documents crossing device
    boundaries and an initial state; the program holds `pallas_call`s."""
    from test_gated_delta_rule_cp import _inputs, _one_device, _spec

    spec = _spec(mesh, layout)
    q, k, v, g, beta, ids, s0, ct_out, ct_state = _inputs(gate, "packed_state")
    lay = lambda x: el.to_layout(x, spec, axis=1)  # noqa: E731

    def loss(q, k, v, g, beta, s0):
        out, state = el.gated_delta_rule(
            q, k, v, g, beta, segment_ids=lay(ids), initial_state=s0, spec=spec,
            return_state=True, chunk=8, impl=PLAIN,
        )  # fmt: skip
        return jnp.sum(out * lay(ct_out)) + jnp.sum(state * ct_state), (out, state)

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))
    args = (lay(q), lay(k), lay(v), lay(g), lay(beta), s0)
    assert "pallas_call" in str(jax.make_jaxpr(fn)(*args))
    grads, (out, state) = fn(*args)
    want_out, want_state, want_grads = _one_device(gate, "packed_state")
    errors = {"out": rel_err(el.from_layout(out, spec, axis=1), want_out),
              "state": rel_err(state, want_state)}  # fmt: skip
    for name, got, want in zip("q k v g beta s0".split(), grads, want_grads, strict=True):
        got = got if name == "s0" else el.from_layout(got, spec, axis=1)
        errors[f"d{name}"] = rel_err(got, want)
    assert max(errors.values()) < TOL, errors
