"""Bad input at every public attention entry point: the exception type and what it says.

Also: NumPy and mixed-dtype inputs that have a well-defined answer just work; NaN and inf
propagate through every strategy exactly as through the oracle; and property-based fuzzing
of shapes and values (a correct result or a `ValueError`, nothing else).
"""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, make_mesh, segment_ids_from_lengths

import eqx_longctx as el
from eqx_longctx import ShardingSpec, attention, flash_attention, latent_attention

# ---- the table of bad inputs ------------------------------------------------------------


def _x(*shape, dtype=jnp.float32):
    return jnp.ones(shape, dtype)


Q = _x(2, 8, 4, 4)
KV = _x(2, 8, 2, 4)


def _spec(strategy="ring", shape=(2, 4), names=("data", "context"), **kw):
    return ShardingSpec(make_mesh(shape, names), strategy, **kw)


_SHAPE = dict(batch=2, seq=64, q_heads=8, kv_heads=2, head_dim=16)


def _plan(**kw):
    return el.explain(_spec(), **(_SHAPE | kw))


def _layout(fn, x, **kw):
    return fn(x, kw.pop("spec", _spec()), **kw)


BAD = [
    # (id, call, exception, message fragment)
    ("attention int q", lambda: attention(_x(2, 8, 4, 4, dtype=jnp.int32), KV, KV),
     TypeError, "floating-point q, k, v; got q of dtype int32"),
    ("attention bool v", lambda: attention(Q, KV, np.ones((2, 8, 2, 4), bool)),
     TypeError, "got v of dtype bool"),
    ("attention rank 3", lambda: attention(Q[0], KV[0], KV[0]), ValueError, "rank 4"),
    ("attention seq 0", lambda: attention(_x(2, 0, 4, 4), _x(2, 0, 2, 4), _x(2, 0, 2, 4)),
     ValueError, r"non-empty dimensions; got q of shape \(2, 0, 4, 4\) \(seq = 0\)"),
    ("attention head_dim 0", lambda: attention(_x(2, 8, 4, 0), _x(2, 8, 2, 0), KV),
     ValueError, r"head_dim = 0"),
    ("attention batch 0", lambda: attention(_x(0, 8, 4, 4), _x(0, 8, 2, 4), _x(0, 8, 2, 4)),
     ValueError, r"batch = 0"),
    ("attention kv heads 0", lambda: attention(Q, _x(2, 8, 0, 4), _x(2, 8, 0, 4)),
     ValueError, r"got k of shape \(2, 8, 0, 4\) \(heads = 0\)"),
    ("attention batch mismatch", lambda: attention(Q, _x(3, 8, 2, 4), _x(3, 8, 2, 4)),
     ValueError, "same batch size"),
    ("attention k/v seq mismatch", lambda: attention(Q, KV, _x(2, 9, 2, 4)),
     ValueError, "same sequence length and number of heads"),
    ("attention head_dim mismatch", lambda: attention(Q, _x(2, 8, 2, 5), KV),
     ValueError, "same head_dim"),
    ("attention GQA groups", lambda: attention(Q, _x(2, 8, 3, 4), _x(2, 8, 3, 4)),
     ValueError, r"multiple of kv_heads .*; got q_heads=4, kv_heads=3"),
    ("attention q/k lengths", lambda: attention(Q, _x(2, 16, 2, 4), _x(2, 16, 2, 4)),
     ValueError, "self-attention needs q and k of the same sequence length"),
    ("attention segment shape", lambda: attention(Q, KV, KV, segment_ids=np.zeros((2, 7), int)),
     ValueError, r"segment_ids must have shape \[batch, seq\] = \(2, 8\)"),
    ("attention float segments", lambda: attention(Q, KV, KV, segment_ids=np.zeros((2, 8))),
     ValueError, "segment_ids must be integers"),
    ("attention causal str", lambda: attention(Q, KV, KV, causal="yes"),
     TypeError, "causal must be True or False; got 'yes'"),
    ("attention scale nan", lambda: attention(Q, KV, KV, scale=float("nan")),
     ValueError, "attention: scale must be finite; got nan"),
    ("attention scale array", lambda: attention(Q, KV, KV, scale="0.5"),
     TypeError, "scale must be a real number"),
    ("attention spec str", lambda: attention(Q, KV, KV, spec="ring"),
     TypeError, r"attention needs spec=a ShardingSpec or None .*strategy='ring'\)"),
    ("attention batch over data axis", lambda: attention(_x(3, 16, 4, 4), _x(3, 16, 2, 4),
     _x(3, 16, 2, 4), spec=_spec()), ValueError, "batch must be divisible by 2; got batch=3"),
    ("attention seq over zigzag", lambda: attention(_x(2, 12, 4, 4), _x(2, 12, 2, 4),
     _x(2, 12, 2, 4), spec=_spec()), ValueError, "seq must be divisible by 8; got seq=12"),
    ("attention ulysses heads", lambda: attention(_x(2, 16, 2, 4), _x(2, 16, 2, 4),
     _x(2, 16, 2, 4), spec=_spec("ulysses")), ValueError, r"needs num_heads divisible by 4"),
    ("flash block_q 0", lambda: flash_attention(Q, KV, KV, block_q=0),
     ValueError, "flash_attention: block_q must be positive; got 0"),
    ("flash block_k float", lambda: flash_attention(Q, KV, KV, block_k=16.0),
     TypeError, "flash_attention: block_k must be an int"),
    ("flash tile_bytes 0", lambda: flash_attention(Q, KV, KV, tile_bytes=0),
     ValueError, "tile_bytes must be positive"),
    ("flash positions shape", lambda: flash_attention(Q, KV, KV, q_positions=np.zeros((2, 9), int)),
     ValueError, r"q_positions must have shape \[batch, seq\] = \(2, 8\)"),
    ("flash float positions", lambda: flash_attention(Q, KV, KV, kv_positions=np.zeros((2, 8))),
     ValueError, "kv_positions must be integers"),
    ("flash one segment array", lambda: flash_attention(Q, KV, KV,
     q_segment_ids=np.zeros((2, 8), int)), ValueError, "together \\(or neither\\)"),
    ("flash int k", lambda: flash_attention(Q, KV.astype(int), KV),
     TypeError, "got k of dtype int"),
    ("latent up_project not callable", lambda: latent_attention(Q, KV, "proj"),
     TypeError, "up_project must be callable"),
    ("latent up_project one array", lambda: latent_attention(Q, KV, lambda x: x),
     ValueError, r"up_project\(latent\) to return a pair \(k, v\)"),
    ("latent up_project triple", lambda: latent_attention(Q, KV, lambda x: (x, x, x)),
     ValueError, "pair"),
    ("latent up_project int", lambda: latent_attention(Q, KV, lambda x: (x, x.astype(int))),
     TypeError, "floating-point k and v; got v of dtype int"),
    ("latent spec str", lambda: latent_attention(Q, KV, lambda x: (x, x), spec="ring"),
     TypeError, "latent_attention needs spec=a ShardingSpec"),
    ("spec context_axis None", lambda: _spec(context_axis=None),
     TypeError, "context_axis must be a str; got None"),
    ("spec strategy list", lambda: _spec(strategy=["ring"]), TypeError, "strategy must be a str"),
    ("spec unknown strategy", lambda: _spec(strategy="megatron"), ValueError, "unknown strategy"),
    ("spec load_balance int", lambda: _spec(load_balance=2), TypeError, "load_balance must be"),
    ("spec tensor_axis int", lambda: _spec(tensor_axis=1), TypeError, "tensor_axis must be a mesh"),
    ("spec axis not in mesh", lambda: _spec(batch_axis="batch"), ValueError, "is not an axis"),
    ("spec axis twice", lambda: _spec(batch_axis="context"), ValueError, "used twice"),
    ("spec data axis named, not in mesh", lambda: _spec(names=("batch", "context"),
     batch_axis="data"), ValueError, "batch_axis='data' is not an axis"),
    ("attention segment ids past int32", lambda: attention(Q, KV, KV, segment_ids=np.array(
        [[0] * 4 + [2**32] * 4] * 2, np.int64)), ValueError, "segment_ids must fit int32"),
    ("spec usp needs ulysses", lambda: _spec("usp"), ValueError, "needs ulysses_axis"),
    ("spec mesh tuple", lambda: ShardingSpec((2, 4)), ValueError, "needs a jax.sharding.Mesh"),
    ("to_layout axis range", lambda: _layout(el.to_layout, np.zeros((2, 16)), axis=2),
     ValueError, r"axis=2 is out of range for an array of rank 2"),
    ("from_layout axis str", lambda: _layout(el.from_layout, np.zeros((2, 16)), axis="1"),
     TypeError, "from_layout: axis must be an int"),
    ("to_layout spec None", lambda: _layout(el.to_layout, np.zeros((2, 16)), spec=None),
     TypeError, "to_layout needs a ShardingSpec; got NoneType"),
    ("to_layout seq", lambda: _layout(el.to_layout, np.zeros((2, 12))),
     ValueError, "seq must be divisible by 8; got seq=12"),
    ("plan negative batch", lambda: _plan(batch=-2), ValueError, "explain: batch must be positive"),
    ("plan seq 0", lambda: _plan(seq=0), ValueError, "seq must be positive; got 0"),
    ("plan float head_dim", lambda: _plan(head_dim=2.5), TypeError, "head_dim must be an int"),
    ("plan bool heads", lambda: _plan(q_heads=True), TypeError, "q_heads must be an int"),
    ("plan dtype", lambda: _plan(dtype="float64x"), TypeError, "dtype must be a NumPy/JAX"),
    ("plan budget", lambda: _plan(memory_budget_bytes=-1), ValueError,
     r"explain: memory_budget_bytes must be > 0; got -1.0. Pass the bytes each device may use"),
    ("plan budget 0", lambda: el.choose_strategy(_spec(), Q, KV, memory_budget_bytes=0),
     ValueError, "choose_strategy: memory_budget_bytes must be > 0; got 0.0"),
    ("plan flops nan", lambda: _plan(flops_per_s=float("nan")), ValueError, "flops_per_s"),
    ("plan spec", lambda: el.choose_strategy(None, Q, KV), TypeError,
     r"choose_strategy needs spec=a ShardingSpec; got None \(NoneType\)\. Build one with"),
    ("plan spec str", lambda: el.explain("ring", **_SHAPE), TypeError,
     r"explain needs spec=a ShardingSpec; got 'ring' \(str\)\. Build one with "
     r"ShardingSpec\(mesh, strategy='ring'\)"),
    ("plan rank 3 q", lambda: el.choose_strategy(_spec(), Q[0], KV[0]), ValueError,
     r"choose_strategy needs q, k of rank 4 laid out \[batch, seq, heads, head_dim\]; got "
     r"q\(8, 4, 4\), k\(8, 2, 4\)\. Add a batch axis"),
    ("plan rank 3 v", lambda: el.choose_strategy(_spec(), Q, KV, KV[0]), ValueError,
     r"needs q, k, v of rank 4 .* got q\(2, 8, 4, 4\), k\(2, 8, 2, 4\), v\(8, 2, 4\)"),
    ("plan unknown keyword", lambda: _plan(heads=8), TypeError,
     r"explain got unknown keyword argument\(s\) 'heads'; it takes batch, seq, q_heads,"),
    ("plan missing shape", lambda: el.explain(_spec(), batch=2, seq=64), TypeError,
     r"explain needs the keyword argument\(s\) q_heads, kv_heads, head_dim: the global shapes"),
    ("plan shape keyword", lambda: el.choose_strategy(_spec(), Q, KV, batch=2), TypeError,
     r"choose_strategy got unknown keyword argument\(s\) 'batch'; it takes causal, window, .*"
     r"\(the shapes and dtype come from q, k, v\)"),
    ("plan batch mismatch", lambda: el.choose_strategy(_spec(), Q, KV[:1]), ValueError,
     r"choose_strategy: q, k, v need the same batch size; got q=2, k=1"),
    ("plan list q", lambda: el.choose_strategy(_spec(), Q.tolist(), KV), TypeError,
     r"choose_strategy needs q, k, v as arrays or jax.ShapeDtypeStructs .* got q of type list"),
]  # fmt: skip


@pytest.mark.parametrize("call,exc,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_spec_replace_keeps_a_batch_axis_given_and_moves_a_default_one():
    given = _spec(batch_axis=None)
    assert given.batch_axis is None and given.replace(mesh=given.mesh).batch_axis is None
    assert given.replace(mesh=given.mesh, impl="xla").batch_axis is None
    ring_only = _spec(shape=(8,), names=("context",))
    assert ring_only.batch_axis is None
    assert ring_only.replace(mesh=_spec().mesh).batch_axis == "data"
    assert _spec().replace(mesh=ring_only.mesh).batch_axis is None
    assert _spec(names=("batch", "context")).batch_axis is None


def test_every_entry_point_is_in_the_table():
    names = {b[0].split()[0] for b in BAD}
    assert names >= {"attention", "flash", "latent", "spec", "to_layout", "from_layout", "plan"}


# ---- inputs with a well-defined answer just work -----------------------------------------


def _qkv(seed=0, b=2, s=32, hq=4, hk=2, d=8):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (
        np.asarray(jax.random.normal(k1, (b, s, hq, d))),
        np.asarray(jax.random.normal(k2, (b, s, hk, d))),
        np.asarray(jax.random.normal(k3, (b, s, hk, d))),
    )


@pytest.mark.parametrize("strategy", [None, "ring", "ulysses"])
def test_numpy_inputs_just_work(strategy):
    q, k, v = _qkv()
    seg = segment_ids_from_lengths([[20, 12], [32]])
    spec = None if strategy is None else _spec(strategy, (1, 2), load_balance="none")
    out = attention(q, k, v, spec=spec, segment_ids=seg)
    assert isinstance(out, jax.Array) and out.dtype == jnp.float32
    assert_close(out, el.reference_attention(q, k, v, segment_ids=jnp.asarray(seg)))


def test_mixed_float_dtypes_promote():
    q, k, v = _qkv()
    out = attention(jnp.asarray(q, jnp.bfloat16), k, v)
    assert out.dtype == jnp.float32
    expected = el.reference_attention(jnp.asarray(q, jnp.bfloat16), k, v)
    assert_close(out, expected)
    out, lse = flash_attention(q.astype(np.float16), k.astype(np.float16), v)
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32


def test_negative_layout_axis():
    spec = _spec()
    x = np.arange(2 * 16 * 3).reshape(2, 16, 3)
    np.testing.assert_array_equal(el.to_layout(x, spec, axis=-2), el.to_layout(x, spec, axis=1))


# ---- NaN and inf propagate exactly as in the oracle ---------------------------------------

NAN_MESHES = {
    None: None,
    "all_gather": ((2, 4), ("data", "context")),
    "ulysses": ((1, 4), ("data", "context")),
    "ring": ((1, 8), ("data", "context")),
    "usp": ((2, 4), ("ulysses", "context")),
}


def _poisoned(b=4, s=64, hq=4, hk=2, d=8):
    """Inputs with NaN in a query (row 0), a key (row 1) and inf in a value (row 2)."""
    q, k, v = (np.array(x) for x in _qkv(1, b, s, hq, hk, d))
    q[0, 9, 1, 3] = np.nan
    k[1, 20, 0, 0] = np.nan
    v[2, 40, 1, 5] = np.inf
    seg = segment_ids_from_lengths([[32, 32], [10, 30, 24], [40, 24], [64]])
    return q, k, v, seg


def _assert_same_nonfinite(out, ref, what):
    out, ref = np.asarray(out), np.asarray(ref)
    bad = ~np.isfinite(ref)
    assert bad.any(), "the poisoned inputs must reach some rows"
    assert not bad.all(), "and leave others alone"
    np.testing.assert_array_equal(~np.isfinite(out), bad, err_msg=what)
    assert_close(np.where(bad, 0, out), np.where(bad, 0, ref), what=what)


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("strategy", list(NAN_MESHES), ids=str)
def test_nan_and_inf_propagate_as_in_the_oracle(strategy, packed, layout):
    q, k, v, seg = _poisoned()
    seg = seg if packed else None
    ref = el.reference_attention(q, k, v, segment_ids=None if seg is None else jnp.asarray(seg))
    if strategy is None:
        if layout == "striped":
            pytest.skip("one device has no layout")
        out = attention(q, k, v, segment_ids=seg)
    else:
        shape, names = NAN_MESHES[strategy]
        kw = dict(ulysses_axis="ulysses", batch_axis=None) if strategy == "usp" else {}
        spec = ShardingSpec(make_mesh(shape, names), strategy, layout, **kw)
        lay = lambda x: el.to_layout(x, spec, axis=1)  # noqa: E731
        out = attention(
            lay(q), lay(k), lay(v), spec=spec, segment_ids=None if seg is None else lay(seg)
        )
        out = el.from_layout(out, spec, axis=1)
    _assert_same_nonfinite(out, ref, f"{strategy} {layout} packed={packed}")


def test_nan_query_row_is_nan_not_zero():
    q, k, v = _qkv()
    q = q.copy()
    q[0, 5, 0, 0] = np.nan
    out, lse = flash_attention(q, k, v, block_q=8, block_k=8)
    assert np.isnan(np.asarray(out[0, 5, 0])).all() and np.isnan(float(lse[0, 5, 0]))
    assert np.isfinite(np.asarray(out[0, :5])).all()


# ---- fuzzing: a correct result or a ValueError, nothing else ----------------------------


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
@hypothesis.given(
    b=st.integers(0, 3),
    s=st.integers(0, 40),
    hq=st.integers(0, 4),
    hk=st.integers(0, 4),
    d=st.integers(0, 6),
    dv=st.integers(0, 6),
    causal=st.booleans(),
    packed=st.booleans(),
    magnitude=st.sampled_from([1e-3, 1.0, 30.0]),
    poison=st.sampled_from([None, np.nan, np.inf, -np.inf]),
    seed=st.integers(0, 2**16),
)
def test_fuzz_local_attention(b, s, hq, hk, d, dv, causal, packed, magnitude, poison, seed):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, s, hq, d)).astype(np.float32) * magnitude
    k = rng.normal(size=(b, s, hk, d)).astype(np.float32) * magnitude
    v = rng.normal(size=(b, s, hk, dv)).astype(np.float32)
    if poison is not None and k.size:
        k.flat[rng.integers(k.size)] = poison
    seg = np.sort(rng.integers(0, 3, size=(b, s)), axis=1).astype(np.int32) if packed else None
    try:
        out = attention(q, k, v, causal=causal, segment_ids=seg)
    except ValueError:
        assert 0 in (b, s, hq, hk, d, dv) or hq % max(hk, 1), "a valid shape was refused"
        return
    seg_j = None if seg is None else jnp.asarray(seg)
    ref = el.reference_attention(q, k, v, causal=causal, segment_ids=seg_j)
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(ref))
    finite = np.isfinite(np.asarray(ref))
    assert_close(np.where(finite, out, 0), np.where(finite, ref, 0), factor=2)


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
@hypothesis.given(
    mesh=st.sampled_from(
        [
            ((1, 8), ("data", "context")),
            ((2, 4), ("data", "context")),
            ((4, 2), ("data", "context")),
        ]
    ),  # fmt: skip
    layout=st.sampled_from(["none", "zigzag", "striped"]),
    rank=st.integers(1, 4),
    axis=st.integers(-5, 4),
    seq=st.integers(1, 48),
)
def test_fuzz_layouts_round_trip_or_raise(mesh, layout, rank, axis, seq):
    spec = ShardingSpec(make_mesh(*mesh), "ring", layout)
    shape = [3] * rank
    if -rank <= axis < rank:
        shape[axis] = seq
    x = np.arange(int(np.prod(shape))).reshape(shape)
    try:
        y = el.to_layout(x, spec, axis=axis)
    except ValueError as e:
        n = spec.context_parallel_size * (2 if layout == "zigzag" else 1)
        assert "out of range" in str(e) or (shape[axis] % n and "divisible" in str(e))
        return
    assert sorted(np.moveaxis(y, axis, 0).reshape(shape[axis], -1)[:, 0]) == sorted(
        np.moveaxis(x, axis, 0).reshape(shape[axis], -1)[:, 0]
    )
    np.testing.assert_array_equal(el.from_layout(y, spec, axis=axis), x)


@hypothesis.settings(max_examples=12, deadline=None, derandomize=True)
@hypothesis.given(
    strategy=st.sampled_from(["all_gather", "ulysses", "ring"]),
    layout=st.sampled_from(["none", "zigzag", "striped"]),
    b=st.integers(1, 3),
    s=st.sampled_from([8, 12, 16, 24]),
    heads=st.sampled_from([(4, 2), (2, 2), (3, 1), (4, 1)]),
    seed=st.integers(0, 2**16),
)
def test_fuzz_context_parallel_or_raise(strategy, layout, b, s, heads, seed):
    spec = ShardingSpec(make_mesh((2, 2), ("data", "context")), strategy, layout)
    hq, hk = heads
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, s, hq, 4)).astype(np.float32)
    k, v = (rng.normal(size=(b, s, hk, 4)).astype(np.float32) for _ in range(2))
    try:
        out = attention(*(el.to_layout(x, spec, axis=1) for x in (q, k, v)), spec=spec)
    except ValueError as e:
        assert "divisible" in str(e)
        return
    assert_close(el.from_layout(out, spec, axis=1), el.reference_attention(q, k, v))


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--batch", "-2"], "batch must be positive"),
        (["--mesh", "context=4,context=2"], "names each axis at most once"),
        (["--window", "0"], "window must be >= 1"),
        (["--memory-budget-gib", "-3"], "--memory-budget-gib: must be a finite number > 0"),
        (["--tflops", "0"], "--tflops: must be a finite number > 0; got 0"),
        (["--gbps", "fast"], "--gbps: 'fast' is not a number"),
        (
            ["--seq", "1000", "--mesh", "context=8"],
            "ring, usp: seq=1000 not divisible by 16",
        ),
        (["--kv-heads", "5", "--mesh", "context=8"], "q_heads=32 not a multiple of kv_heads=5"),
        (["--mesh", "data=2,context=4", "--batch", "3"], "batch=3 not divisible"),
        (["--json"], "--json: not used: without --model"),
        (
            ["--model", "llama", "--preset", "tiny", "--heads", "8"],
            "--heads: not used: with --model the attention's shapes come from the model's config",
        ),
        (
            ["--model", "llama", "--preset", "tiny", "--generate", "--loss-chunk", "4"],
            "--loss-chunk: not used: --generate plans inference",
        ),
    ],
)
def test_planner_cli_bad_input_is_one_line(argv, match, capsys):
    from eqx_longctx.plan import main

    with pytest.raises(SystemExit) as e:
        main(["--mesh", "data=2,context=4", "--seq", "1024", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
