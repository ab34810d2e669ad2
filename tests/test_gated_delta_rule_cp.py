"""`gated_delta_rule` split over the sequence (`linear/_context_parallel.py`) against the
same op on one device: outputs, final state and gradients on every layout and mesh, both
compositions of the summaries, the augmented pass that makes the summaries, and the
collective bytes of the compiled forward + backward.

The one-device op is itself checked against the rule written out in NumPy float64
(`test_gated_delta_rule.py`); here it is the oracle, in float32 at 1e-5 relative.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mesh, pairwise_cover, rel_err, segment_ids_from_lengths

import eqx_longctx as el
from eqx_longctx.linear import _context_parallel as cp
from eqx_longctx.linear._chunked import chunk_gated_delta, document_starts
from eqx_longctx.linear._compose import choose_composition, composition_costs

TOL = 1e-5
B, S, H, DK, DV, CHUNK = 2, 48, 2, 8, 6, 4
# Document boundaries per row at 6, 19, 24 and 3, 23, 24, 36 (a one-token document ends at
# 24): 24 and 36 fall on device boundaries of every layout below (pieces of 3, 6, 8, 12 or
# 24 tokens), 6 and 3 on some, 19 and 23 inside pieces.
LENGTHS = [[6, 13, 5, 24], [3, 20, 1, 12, 12]]

# name: (mesh shape, axis names, ShardingSpec keywords, axis types)
MESHES = {
    "dc": ((2, 4), ("data", "context"), {}, "explicit"),
    "c8": ((8,), ("context",), {}, "explicit"),
    # The mesh names context before ulysses, the sequence splits over (ulysses, context):
    # lax.ppermute counts devices in the mesh's order, the layout in the spec's.
    "usp": ((2, 2, 2), ("data", "context", "ulysses"), dict(ulysses_axis="ulysses"), "explicit"),
    # Heads split over the tensor axis, on a mesh with Auto axes (`Mesh(...)`).
    "tp": ((2, 2, 2), ("data", "tensor", "context"), dict(tensor_axis="tensor"), "auto"),
}
FACTORS = {
    "mesh": list(MESHES),
    "layout": ["none", "zigzag", "striped"],
    "gate": ["gdn", "kda"],
    "composition": ["all_gather", "scan"],
    "inputs": ["packed_state", "packed", "plain"],  # documents and initial state, or neither
}
ROWS = pairwise_cover(FACTORS)


def _spec(mesh_name: str, layout: str) -> el.ShardingSpec:
    shape, names, kw, axes = MESHES[mesh_name]
    strategy = "usp" if "ulysses_axis" in kw else "ring"
    return el.ShardingSpec(make_mesh(shape, names, axes), strategy, layout, **kw)


@functools.cache
def _inputs(gate: str, inputs: str, seed: int = 0):
    """`(q, k, v, g, beta, segment_ids, initial_state, ct_out, ct_state)`, NumPy float32
    (`segment_ids` and `initial_state` `None` for plain inputs)."""
    rng = np.random.default_rng(seed)
    q, k = (rng.normal(size=(B, S, H, DK)) for _ in range(2))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    v = rng.normal(size=(B, S, H, DV))
    g = rng.uniform(-1.0, 0.0, size=(B, S, H, DK) if gate == "kda" else (B, S, H))
    beta = rng.uniform(0.05, 0.95, size=(B, S, H))
    s0 = rng.normal(size=(B, H, DK, DV)) if inputs == "packed_state" else None
    ct_out, ct_state = rng.normal(size=(B, S, H, DV)), rng.normal(size=(B, H, DK, DV))
    f32 = lambda x: None if x is None else np.asarray(x, np.float32)  # noqa: E731
    ids = None if inputs == "plain" else segment_ids_from_lengths(LENGTHS)
    return (*map(f32, (q, k, v, g, beta)), ids, f32(s0), f32(ct_out), f32(ct_state))


def _value_and_grads(spec, data):
    """`(out, final_state, grads)` of `<ct_out, out> + <ct_state, final_state>` for
    `data` as `_inputs` gives it, the gradients with respect to q, k, v, g, beta (and the
    initial state when given)."""
    q, k, v, g, beta, ids, s0, ct_out, ct_state = data
    argnums = (0, 1, 2, 3, 4, 5) if s0 is not None else (0, 1, 2, 3, 4)

    def loss(q, k, v, g, beta, s0):
        out, state = el.gated_delta_rule(
            q, k, v, g, beta, segment_ids=ids, initial_state=s0, spec=spec,
            return_state=True, chunk=CHUNK,
        )  # fmt: skip
        return jnp.sum(out * ct_out) + jnp.sum(state * ct_state), (out, state)

    fn = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))
    grads, (out, state) = fn(q, k, v, g, beta, s0)
    return out, state, grads


@functools.cache
def _one_device(gate: str, inputs: str):
    return _value_and_grads(None, _inputs(gate, inputs))


@pytest.mark.parametrize("row", ROWS, ids=lambda r: "-".join(r.values()))
def test_matches_one_device(row, monkeypatch):
    """Output, final state and every gradient under the spec equal the one-device op."""
    monkeypatch.setattr(cp, "choose_composition", lambda *a: row["composition"])
    spec = _spec(row["mesh"], row["layout"])
    q, k, v, g, beta, ids, s0, ct_out, ct_state = _inputs(row["gate"], row["inputs"])
    lay = lambda x: None if x is None else el.to_layout(x, spec, axis=1)  # noqa: E731
    laid = (lay(q), lay(k), lay(v), lay(g), lay(beta), lay(ids), s0, lay(ct_out), ct_state)
    out, state, grads = _value_and_grads(spec, laid)
    want_out, want_state, want_grads = _one_device(row["gate"], row["inputs"])
    names = ("q", "k", "v", "g", "beta", "initial_state")
    errors = {
        "out": rel_err(el.from_layout(out, spec, axis=1), want_out),
        "final_state": rel_err(state, want_state),
    }
    for name, got, want in zip(names, grads, want_grads, strict=False):
        got = got if name == "initial_state" else el.from_layout(got, spec, axis=1)
        errors[f"d{name}"] = rel_err(got, want)
    print(f"max rel err {max(errors.values()):.1e}")  # the table reads it (-rA)
    bad = {name: f"{e:.2e}" for name, e in errors.items() if not e <= TOL}
    assert not bad, f"relative errors above {TOL}: {bad}"
    assert out.sharding.is_equivalent_to(spec.sharding(spec.heads_pspec()), out.ndim)


def test_compositions_agree():
    """The all-gather and the ppermute scan give the same outputs and state (zig-zag over
    8 devices: two pieces per device, composed in opposite device orders), with and
    without `return_state`."""
    spec = _spec("c8", "zigzag")
    q, k, v, g, beta, ids, s0, _, _ = _inputs("kda", "packed_state")
    lq, lk, lv, lg, lbeta, lids = (el.to_layout(x, spec, axis=1) for x in (q, k, v, g, beta, ids))
    results = {}
    for composition in ("all_gather", "scan"):
        run = functools.partial(
            cp.context_parallel_gated_delta, lq, lk, lv, lg, lbeta, lids, s0, spec=spec,
            scale=DK**-0.5, chunk=CHUNK, composition=composition,
        )  # fmt: skip
        results[composition] = run(return_state=True)
        out, last = run(return_state=False)
        assert last is None
        np.testing.assert_array_equal(out, results[composition][0])
    (out_a, state_a), (out_s, state_s) = results["all_gather"], results["scan"]
    assert rel_err(out_s, out_a) <= 1e-6 and rel_err(state_s, state_a) <= 1e-6
    want_out, want_state = el.gated_delta_rule(
        q, k, v, g, beta, segment_ids=ids, initial_state=s0, return_state=True, chunk=CHUNK
    )
    assert rel_err(el.from_layout(out_s, spec, axis=1), want_out) <= TOL
    assert rel_err(state_s, want_state) <= TOL


@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_augmented_pass_is_the_affine_map(gate):
    """One pass from `[I | 0]` with values `[0 | v]` gives `A`, `B`, `P_t`, `o0_t` such
    that, from any incoming state, the piece's final state is `A S_in + B` and its output
    `S_in^T P_t + o0_t` (documents starting inside the piece included)."""
    q, k, v, g, beta, ids, _, _, _ = _inputs(gate, "packed")
    starts = document_starts(jnp.asarray(ids), B, S).at[:, 0].set(True)
    starts = starts.at[1, 0].set(False)  # row 1 continues the incoming state
    s_in = np.random.default_rng(1).normal(size=(B, H, DK, DV)).astype(np.float32)
    q, k, v, g, beta = (jnp.asarray(x) for x in (q, k, v, g, beta))
    one = lambda x: x[None]  # noqa: E731 (a device with one piece)
    aug_out, summary = cp._augmented_pass(
        one(q), one(k), one(v), one(g), one(beta), one(starts), scale=0.3, chunk=CHUNK
    )
    a, b = summary[0, ..., :DK], summary[0, ..., DK:]
    out = jnp.einsum("bthc,bhcv->bthv", aug_out[0, ..., :DK], s_in) + aug_out[0, ..., DK:]
    want_out, want_state = chunk_gated_delta(
        q, k, v, g, beta, starts, jnp.asarray(s_in), scale=0.3, chunk=CHUNK
    )
    assert rel_err(jnp.einsum("bhce,bhev->bhcv", a, s_in) + b, want_state) <= TOL
    assert rel_err(out, want_out) <= TOL
    assert float(jnp.max(jnp.abs(a[0]))) == 0.0  # row 0 starts a document: nothing passes


def test_choose_composition():
    """The all-gather for few devices or small summaries, the scan for large ones on many
    devices; the costs are the docstring's table."""
    big_map, big_state = 4 * 32 * 128 * 256, 4 * 32 * 128 * 128  # h = 32, dk = dv = 128
    assert choose_composition(8, 1, 4096, 2048, True) == "all_gather"
    assert choose_composition(4, 2, big_map, big_state, True) == "all_gather"
    assert choose_composition(8, 1, big_map, big_state, True) == "scan"
    assert choose_composition(8, 2, big_map, big_state, True) == "scan"
    assert choose_composition(1, 2, big_map, big_state, True) == "all_gather"
    costs = composition_costs(8, 2, 10, 4, True)
    assert costs == {"all_gather": (1, 140.0), "scan": (5, 60 + 8 + 2 * 7.0)}


def _compiled_bytes(spec, seq: int, composition: str) -> dict[str, int]:
    """Collective bytes per device of forward + backward (the forward's values are used,
    as a next layer would) at `seq` tokens: 1 row, 2 heads, dk = dv = 16, GDN gate."""
    b, h, d = 1, 2, 16

    def loss(q, k, v, g, beta, ids, s0):
        out, state = cp.context_parallel_gated_delta(
            q, k, v, g, beta, ids, s0, spec=spec, scale=0.25, chunk=64, return_state=True,
            composition=composition,
        )  # fmt: skip
        return jnp.sum(out * out) + jnp.sum(state * state)

    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    ids = jax.ShapeDtypeStruct((b, seq), jnp.int32)
    args = (f32(b, seq, h, d), f32(b, seq, h, d), f32(b, seq, h, d), f32(b, seq, h),
            f32(b, seq, h), ids, f32(b, h, d, d))  # fmt: skip
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 6)))
    found = el.collective_bytes(grad.lower(*args).compile())
    return {op: n for op, n in found.items() if n}


@pytest.mark.parametrize(
    "layout,composition",
    [("none", "all_gather"), ("none", "scan"), ("zigzag", "all_gather"), ("zigzag", "scan"),
     ("striped", "scan")],
)  # fmt: skip
def test_collective_bytes(layout, composition):
    """Compiled forward + backward on 8 devices: the summaries' bytes are the formulas of
    `_compose.py` and the same at 4K and 16K tokens; striped adds the all-to-alls of the
    regrouping, which grow with the sequence as predicted."""
    spec = _spec("c8", layout)
    n, r, p = 8, 3, 2 if layout == "zigzag" else 1
    m, st = 4 * 2 * 16 * 32, 4 * 2 * 16 * 16  # one summary, one state (b = 1, h = 2)
    reduce = 2 * (n - 1) * st // n  # an all-reduce of one state
    ids = (n - 1) * p * 4  # every piece's last segment id
    if composition == "all_gather":  # ... and its reduce-scatter; the initial state's grad
        want = {"all-gather": (n - 1) * p * m + ids, "reduce-scatter": (n - 1) * p * m}
        want["all-reduce"] = reduce
    else:  # the rounds, the shifts; the middle (zig-zag), the final state, and both
        # transposed, then the initial state's gradient
        want = {"all-gather": ids, "collective-permute": 2 * p * (r * m + st)}
        want["all-reduce"] = (5 if p == 2 else 3) * reduce
    for seq in (4096, 16384):
        found = _compiled_bytes(spec, seq, composition)
        if layout == "striped":
            local = seq // n  # = mp N: no padding at these lengths
            floats = (n - 1) * local * 2 * (3 * 16 + 1 + 1) * 4 // n  # q, k, v, g, beta
            outs = (n - 1) * local * 2 * 16 * 4 // n
            assert found.pop("all-to-all") == 2 * (floats + outs) + (n - 1) * local * 4 // n
        assert found == want, f"seq={seq}"


@pytest.mark.parametrize(
    "mesh,layout,shape,match",
    [
        ("c8", "zigzag", (2, 40, 2), "zigzag.*divisible by 16; got seq=40"),
        ("c8", "striped", (2, 12, 2), "striped.*divisible by 8; got seq=12"),
        ("usp", "none", (2, 6, 2), "divisible by 4; got seq=6"),
        ("tp", "none", (2, 16, 3), "tensor_axis='tensor'.*divisible by 2; got heads=3"),
        ("dc", "none", (3, 16, 2), "batch.*divisible by 2"),
    ],
)
def test_bad_input_under_spec(mesh, layout, shape, match):
    """A sequence, batch or head count the spec does not split: one line naming the rule."""
    b, s, h = shape
    x = np.zeros((b, s, h, 4), np.float32)
    gate = np.zeros((b, s, h), np.float32)
    with pytest.raises(ValueError, match=match) as info:
        el.gated_delta_rule(x, x, x, gate, gate, spec=_spec(mesh, layout))
    assert "\n" not in str(info.value)
