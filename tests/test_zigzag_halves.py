"""Zig-zag's causal halves (`attention/_halves.py`): when all-gather and Ulysses take them,
that they equal the float32 oracle (forward and gradients) on several meshes, and that they
skip the quarter of the scores the layout hides."""

import sys

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_close, make_mesh, random_segment_ids

from eqx_longctx import ShardingSpec, attention, from_layout, reference_attention, to_layout
from eqx_longctx.attention import _halo, _halves, _tiling_policy
from eqx_longctx.attention._halves import half, join
from eqx_longctx.attention._local import XlaBlockImpl


def _spec(strategy="all_gather", layout="zigzag", shape=(2, 4), axes="explicit"):
    return ShardingSpec(make_mesh(shape, ("data", "context"), axes), strategy, layout)


def test_policy_takes_the_halves_only_where_tiles_cannot_align():
    halves = _tiling_policy.zigzag_halves
    spec = _spec()  # 4 context devices: chunks of seq / 8 tokens
    assert halves(spec, 256, causal=True)  # chunks of 32 < MIN_ALIGNED_BLOCK
    assert halves(spec, 8 * 127, causal=True)
    assert not halves(spec, 8 * 128, causal=True)  # aligned tiles skip the same pairs
    assert _tiling_policy.block_size(spec, 8 * 128) == 128
    assert not halves(spec, 256, causal=False)  # nothing is hidden
    for layout in ("none", "striped"):
        assert not halves(_spec(layout=layout), 256, causal=True)


def test_the_xla_path_splits_and_the_kernels_decline():
    from eqx_longctx.kernels import PallasBlockImpl

    assert XlaBlockImpl().splits_zigzag_halves
    assert not PallasBlockImpl(128, 128, True).splits_zigzag_halves


@pytest.mark.parametrize("shards", [1, 4])
def test_half_and_join_are_inverse(shards):
    x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
    early, late = half(x, shards, 0), half(x, shards, 1)
    assert early.shape == late.shape == (2, 8, 3)
    chunk = 16 // (2 * shards)  # the first half of every shard is early
    assert (early[0, :chunk, 0] == x[0, :chunk, 0]).all()
    assert (join(early, late, shards) == x).all()


CASES = [  # strategy, mesh shape, mesh axes, window, packed, impl
    ("all_gather", (2, 4), "explicit", None, True, "xla"),
    ("all_gather", (1, 8), "auto", 9, True, "auto"),
    ("all_gather", (4, 2), "explicit", None, False, "auto"),
    ("ulysses", (1, 8), "explicit", None, True, "auto"),
    ("ulysses", (2, 4), "auto", 9, False, "xla"),
]


@pytest.mark.parametrize(("strategy", "shape", "axes", "window", "packed", "impl"), CASES)
def test_halves_against_oracle(strategy, shape, axes, window, packed, impl, monkeypatch):
    """Forward and gradients of the strategy, which must call the halves (their query and
    key lengths counted), against `reference_attention` in the natural order; GQA, packed
    documents, a sliding window. With `impl="auto"` on this host the program also holds the
    TPU side, which keeps one whole call of the kernels."""
    calls, real = [], _halves.block_attention

    def counted(impl, q, k, *args):
        calls.append((type(impl).__name__, q.shape[1], k.shape[1]))
        return real(impl, q, k, *args)

    monkeypatch.setattr(_halves, "block_attention", counted)
    # A windowed all_gather layer on zig-zag runs the neighbour exchange instead
    # (`tests/test_attention_variants.py`); turned off here, it runs the halves under test.
    monkeypatch.setattr(_halo, "HALO_REPLACES", ())
    spec = ShardingSpec(make_mesh(shape, ("data", "context"), axes), strategy, "zigzag", impl=impl)
    batch, seq = 4, 96
    ks = jax.random.split(jax.random.PRNGKey(7), 5)
    q = jax.random.normal(ks[0], (batch, seq, 8, 16))
    k = jax.random.normal(ks[1], (batch, seq, 2, 16))
    v = jax.random.normal(ks[2], (batch, seq, 2, 16))
    ct = jax.random.normal(ks[3], (batch, seq, 8, 16))
    seg = random_segment_ids(ks[4], batch, seq) if packed else None
    lay = lambda x: to_layout(x, spec, axis=1)  # noqa: E731

    def ours(q, k, v):
        ids = None if seg is None else lay(seg)
        out = attention(lay(q), lay(k), lay(v), spec=spec, window=window, segment_ids=ids)
        out = from_layout(out, spec, axis=1)
        return jnp.sum(out * ct), out

    def oracle(q, k, v):
        out = reference_attention(q, k, v, window=window, segment_ids=seg)
        return jnp.sum(out * ct), out

    grad = lambda f: jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)  # noqa: E731
    (_, got), got_grads = jax.jit(grad(ours))(q, k, v)
    (_, want), want_grads = grad(oracle)(q, k, v)
    queries = seq // shape[1] if strategy == "all_gather" else seq
    halves = {("XlaBlockImpl", queries // 2, seq // 2), ("XlaBlockImpl", queries // 2, seq)}
    whole_kernels = {("PallasBlockImpl", queries, seq)}
    assert set(calls) == (halves if impl == "xla" else halves | whole_kernels), calls
    assert_close(got, want, what="forward")
    for name, a, b in zip("qkv", got_grads, want_grads, strict=True):
        assert_close(a, b, what=f"d{name}")


@pytest.mark.parametrize("strategy", ["all_gather", "ulysses"])
def test_halves_compute_three_quarters_of_the_products(strategy, monkeypatch):
    """The compiled forward's FLOPs with the halves against the same call left whole: the
    score products are 3/4, and nothing else grows much (the ratio stays under 0.82)."""
    spec = _spec(strategy, shape=(1, 8))
    q = jnp.ones((2, 256, 8, 32))
    kv = jnp.ones((2, 256, 8, 32))

    def flops():
        f = jax.jit(lambda q, k, v: attention(q, k, v, spec=spec))
        return f.lower(q, kv, kv).compile().cost_analysis()["flops"]

    split = flops()
    dispatcher = sys.modules["eqx_longctx.attention"]  # the package, not its function
    monkeypatch.setattr(dispatcher, "zigzag_halves", lambda *a: False)
    whole = flops()
    assert 0.7 <= split / whole <= 0.82, (split, whole)


@pytest.mark.parametrize("strategy", ["all_gather", "ulysses"])
def test_cost_model_counts_the_halves_where_they_run(strategy):
    """`plan` prices 3/4 of the work where the XLA path splits, and the whole block for the
    Pallas kernels, which keep one call."""
    from eqx_longctx.attention._choose import plan

    def compute(impl):
        spec = ShardingSpec(make_mesh((2, 4), ("data", "context")), strategy, "zigzag", impl=impl)
        shape = dict(batch=4, seq=256, q_heads=8, kv_heads=4, head_dim=32)
        return plan(spec, **shape).costs[strategy].compute_s

    assert compute("xla") == pytest.approx(0.75 * compute("pallas"))
