"""Sliding-window attention (`window=W`: query `i` sees keys `j` with `0 <= i - j < W`) on one
device and under every strategy and layout, forward and backward, against the oracle; the
ring cut short to the hops the window reaches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, make_mesh, random_segment_ids

import eqx_longctx as el
from eqx_longctx import ShardingSpec, attention, flash_attention, reference_attention
from eqx_longctx.attention._tiling_policy import ring_hops

B, S, HQ, HK, D = 2, 64, 4, 2, 8


def _inputs(seed=0, s=S):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (B, s, HQ, D))
    k = jax.random.normal(ks[1], (B, s, HK, D))
    v = jax.random.normal(ks[2], (B, s, HK, D))
    ct = jax.random.normal(ks[3], (B, s, HQ, D))
    return q, k, v, ct, random_segment_ids(ks[4], B, s, max_docs=3)


def _value_and_grads(f, q, k, v, ct):
    loss = lambda q, k, v: jnp.sum(f(q, k, v) * ct)  # noqa: E731
    return jax.jit(lambda q, k, v: (f(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))(
        q, k, v
    )


def _check(f, window, packed, seed=0, what=""):
    q, k, v, ct, seg = _inputs(seed)
    seg = seg if packed else None
    ref = lambda q, k, v: reference_attention(q, k, v, window=window, segment_ids=seg)  # noqa: E731
    out, grads = _value_and_grads(lambda q, k, v: f(q, k, v, seg), q, k, v, ct)
    ref_out, ref_grads = _value_and_grads(ref, q, k, v, ct)
    assert_close(out, ref_out, what=f"{what} out")
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        if float(jnp.abs(r).max()) < 1e-6:  # W=1: one key per query, so dq is exactly 0
            assert float(jnp.abs(g).max()) < 1e-5, f"{what} d{name}"
            continue
        assert_close(g, r, what=f"{what} d{name}")


@pytest.mark.parametrize(
    "window,block",
    [(1, 8), (3, 16), (16, 16), (17, 48), (40, 8), (64, 48), (200, 16), (5, 48)],
)
def test_local_window_against_oracle(window, block):
    def f(q, k, v, seg):
        out, _ = flash_attention(
            q, k, v, q_segment_ids=seg, kv_segment_ids=seg, window=window, block_q=block,
            block_k=block,
        )  # fmt: skip
        return out

    _check(f, window, packed=block == 16, what=f"W={window} block={block}")


def test_window_blocks_outside_are_skipped(monkeypatch):
    from eqx_longctx.attention import _local

    calls = []
    original = _local._block_is_empty

    def spy(*args):
        empty = original(*args)
        jax.debug.callback(lambda e: calls.append(bool(e)), empty)
        return empty

    monkeypatch.setattr(_local, "_block_is_empty", spy)
    q, k, v, *_ = _inputs(s=256)
    flash_attention(q, k, v, window=32, block_q=32, block_k=32)[0].block_until_ready()
    n = 256 // 32
    assert len(calls) == n * n
    # Query block i sees key blocks i-1 and i only (i - j < 32 from block i-1's last keys).
    assert sum(not c for c in calls) == n + (n - 1)


STRATEGY_MESHES = {
    "all_gather": ((2, 4), ("data", "context"), {}),
    "ulysses": ((1, 2), ("data", "context"), {}),
    "ring": ((1, 8), ("data", "context"), {}),
    "usp": ((2, 4), ("ulysses", "context"), dict(ulysses_axis="ulysses", batch_axis=None)),
}
WINDOWS = [  # (layout, window, packed)
    ("none", 5, False),  # the ring is cut to 2 hops (8-token shards)
    ("none", 12, True),  # 3 hops
    ("zigzag", 9, True),
    ("striped", 20, False),
    ("zigzag", 64, False),  # the window covers the whole sequence
]
# Every row on the strategies with a ring (ring, usp), whose hops the window cuts; all-gather
# and Ulysses attend over the whole sequence, so they get one row per layout, packed and
# not (there the two hop-count rows ran only the block kernel's window, which the rings'
# hops run too: 4 cases, ~15 s of one core).
CASES = [
    (strategy, *row)
    for strategy in STRATEGY_MESHES
    for i, row in enumerate(WINDOWS)
    if strategy in ("ring", "usp") or i in (1, 2, 3)
]


@pytest.mark.parametrize("strategy,layout,window,packed", CASES, ids=str)
def test_every_strategy_with_a_window(strategy, layout, window, packed):
    shape, names, kw = STRATEGY_MESHES[strategy]
    spec = ShardingSpec(make_mesh(shape, names), strategy, layout, **kw)
    lay = lambda x: el.to_layout(x, spec, axis=1)  # noqa: E731

    def f(q, k, v, seg):
        seg = None if seg is None else lay(seg)
        out = attention(lay(q), lay(k), lay(v), spec=spec, window=window, segment_ids=seg)
        return el.from_layout(out, spec, axis=1)

    with jax.set_mesh(spec.mesh):  # eager grad on an Explicit mesh needs it set
        _check(f, window, packed, what=f"{strategy} {layout} W={window}")


@pytest.mark.parametrize(
    "layout,shape,names,kw,window,hops",
    [
        ("none", (1, 8), ("data", "context"), {}, 1, 1),
        ("none", (1, 8), ("data", "context"), {}, 8, 2),  # 8-token shards
        ("none", (1, 8), ("data", "context"), {}, 9, 2),
        ("none", (1, 8), ("data", "context"), {}, 10, 3),
        ("none", (1, 8), ("data", "context"), {}, None, None),
        ("zigzag", (1, 8), ("data", "context"), {}, 3, 8),  # chunks i and 2N-1-i: every hop
        ("striped", (1, 8), ("data", "context"), {}, 3, 8),
        ("none", (2, 4), ("ulysses", "context"), dict(ulysses_axis="ulysses"), 5, 4),
    ],
)
def test_ring_hops(layout, shape, names, kw, window, hops):
    strategy = "usp" if kw else "ring"
    spec = ShardingSpec(make_mesh(shape, names), strategy, layout, batch_axis=None, **kw)
    assert ring_hops(spec, 64, True, window) == hops


def test_cut_ring_sends_fewer_bytes():
    spec = ShardingSpec(make_mesh((1, 8), ("data", "context")), "ring", "none")
    x = jax.ShapeDtypeStruct(
        (1, 1024, 2, 8), jnp.float32, sharding=spec.sharding(spec.heads_pspec())
    )

    def permuted_bytes(window):
        f = lambda q, k, v: jnp.sum(attention(q, k, v, spec=spec, window=window))  # noqa: E731
        compiled = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(x, x, x).compile()
        return el.collective_bytes(compiled.as_text())["collective-permute"]

    with jax.set_mesh(spec.mesh):
        full, cut = permuted_bytes(None), permuted_bytes(100)  # 128-token shards: 2 hops
    assert 0 < cut < full / 3


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(window=0), ValueError, "window must be >= 1"),
        (dict(window=-3), ValueError, "window must be >= 1"),
        (dict(window=4, causal=False), ValueError, "sliding window needs causal=True"),
        (dict(window=2.5), TypeError, "window must be an int"),
    ],
)
def test_bad_window_raises(kw, exc, match):
    q = np.ones((1, 8, 2, 4), np.float32)
    with pytest.raises(exc, match=match):
        attention(q, q, q, **kw)
    with pytest.raises(exc, match=match):
        flash_attention(q, q, q, **kw)


@pytest.mark.parametrize("layout,window", [("none", 100), ("zigzag", 100), ("none", None)])
def test_planner_counts_the_cut_ring(layout, window):
    """The cost model's ring bytes (forward + backward) match the compiled program's."""
    from eqx_longctx.attention._choose import plan
    from eqx_longctx.plan import compiled_attention

    spec = ShardingSpec(make_mesh((1, 8), ("data", "context")), "ring", layout)
    shape = dict(batch=1, seq=1024, q_heads=2, kv_heads=2, head_dim=8, window=window)
    with jax.set_mesh(spec.mesh):
        compiled = compiled_attention(spec, backward=True, **shape)
    measured = el.collective_bytes(compiled)["collective-permute"]
    predicted = plan(spec, **shape).costs["ring"].comm_train["collective-permute"]
    assert measured == pytest.approx(predicted, rel=0.01)
