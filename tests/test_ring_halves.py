"""The ring's zig-zag causal halves (`attention/_halves.RING_PLANS`, `_ring.py`): that each
kind of hop computes every pair the causal mask shows and only the fraction the layout
leaves, that the ring and USP still equal the float32 oracle (forward and gradients) on
several meshes, and that the skipped calls really do not run."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, make_mesh, random_segment_ids

from eqx_longctx import ShardingSpec, attention, from_layout, reference_attention, to_layout
from eqx_longctx._layout import layout_order
from eqx_longctx.attention._halves import ALL, EARLY, OWN, RING_PLANS, half, ring_hop_kind
from eqx_longctx.attention._local import XlaBlockImpl


def _spec(strategy, shape, axes="explicit", impl="xla"):
    if strategy == "usp":
        mesh = make_mesh(shape, ("ulysses", "context"), axes)
        return ShardingSpec(
            mesh, "usp", "zigzag", batch_axis=None, ulysses_axis="ulysses", impl=impl
        )
    return ShardingSpec(make_mesh(shape, ("data", "context"), axes), strategy, "zigzag", impl=impl)


def _covered(plan, q_pos, k_pos, shards):
    """`[q, k]` booleans: the pairs a plan's calls compute (positions of one device)."""
    groups = [half(q_pos[None], shards, i)[0] for i in (0, 1)]
    keys = {ALL: k_pos, EARLY: half(k_pos[None], shards, 0)[0]}
    covered = np.zeros((q_pos.size, k_pos.size), bool)
    for g, part in plan:
        covered |= np.isin(q_pos, groups[g])[:, None] & np.isin(k_pos, keys[part])[None, :]
    return covered


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("nu", [1, 2])
def test_plans_cover_every_visible_pair_and_no_more_than_their_share(n, nu):
    """For every pair of devices of a zig-zag ring (after USP's all-to-all when `nu > 1`,
    a device holds `nu` shards), the calls of the hop's plan cover every (query, key) pair
    the causal mask shows: the brute-force mask of the positions. They compute 3/4 of the
    pairs on the own hop and, on a plain ring, 1/2 on every other hop."""
    seq = 2 * n * nu * 3  # chunks of 3 tokens
    spec = _spec("ring", (8 // n, n)) if nu == 1 else None
    order = layout_order(spec, seq) if spec is not None else _zigzag(n * nu, seq)
    shards = order.reshape(n * nu, -1)
    held = [shards[[u * n + c for u in range(nu)]].reshape(-1) for c in range(n)]
    for i in range(n):
        for j in range(n):
            q_pos, k_pos = held[i], held[j]
            kind = int(ring_hop_kind(q_pos[None], k_pos[None], np.where)) if nu == 1 else OWN
            covered = _covered(RING_PLANS[kind], q_pos, k_pos, nu)
            visible = q_pos[:, None] >= k_pos[None, :]
            assert not (visible & ~covered).any(), (i, j, kind)
            share = covered.mean()
            assert share == (0.75 if i == j or nu > 1 else 0.5), (i, j, kind, share)


def _zigzag(n, seq):
    """Zig-zag order over `n` shards, from its definition (chunks `i` and `2n-1-i`)."""
    chunks = np.arange(seq).reshape(2 * n, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def test_the_layout_module_agrees_with_the_zigzag_definition():
    spec = _spec("ring", (2, 4))
    assert (layout_order(spec, 48) == _zigzag(4, 48)).all()


CASES = [  # strategy, mesh shape, mesh axes, window, packed, impl, GQA
    ("ring", (2, 4), "explicit", None, True, "xla", True),
    ("ring", (1, 8), "auto", 9, False, "xla", False),
    ("ring", (4, 2), "explicit", None, True, "auto", True),
    ("ring", (1, 8), "explicit", 30, True, "auto", True),
    ("usp", (2, 4), "explicit", None, True, "xla", True),
    ("usp", (4, 2), "auto", 9, False, "auto", True),
]


@pytest.mark.parametrize(("strategy", "shape", "axes", "window", "packed", "impl", "gqa"), CASES)
def test_ring_halves_against_oracle(strategy, shape, axes, window, packed, impl, gqa):
    """Forward and gradients of the ring and USP, split into their causal halves (the chunks
    are 96 / 16 = 6 tokens), against `reference_attention` in the natural order."""
    spec = _spec(strategy, shape, axes, impl)
    batch, seq, hk = 4, 96, (2 if gqa else 8)
    ks = jax.random.split(jax.random.PRNGKey(11), 5)
    q = jax.random.normal(ks[0], (batch, seq, 8, 16))
    k = jax.random.normal(ks[1], (batch, seq, hk, 16))
    v = jax.random.normal(ks[2], (batch, seq, hk, 16))
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
    assert_close(got, want, what="forward")
    for name, a, b in zip("qkv", got_grads, want_grads, strict=True):
        assert_close(a, b, what=f"d{name}")


def _run_pairs(spec, monkeypatch, backward=False):
    """(query rows x keys) summed over the block calls that *ran* (not merely traced) in
    one forward, or one forward + backward, of the ring on `spec`; and the traced shapes."""
    ran, traced = [], set()
    method = "attend_backward" if backward else "attend"
    real = getattr(XlaBlockImpl, method)

    def spy(self, qt, k, *args):
        traced.add((qt.q.shape[1], k.shape[1]))
        jax.debug.callback(lambda a, b: ran.append(int(a) * int(b)), qt.q.shape[1], k.shape[1])
        return real(self, qt, k, *args)

    monkeypatch.setattr(XlaBlockImpl, method, spy)
    q = jnp.ones((2, 256, 8, 32))
    kv = jnp.ones((2, 256, 4, 32))
    f = lambda q, k, v: attention(q, k, v, spec=spec)  # noqa: E731
    if backward:
        jax.block_until_ready(jax.jit(jax.grad(lambda *a: f(*a).sum(), (0, 1, 2)))(q, kv, kv))
    else:
        jax.block_until_ready(jax.jit(f)(q, kv, kv))
    jax.effects_barrier()
    monkeypatch.undo()
    return sum(ran), traced


@pytest.mark.parametrize("backward", [False, True])
def test_the_skipped_quarters_do_not_run(backward, monkeypatch):
    """On a ring of 4 (chunks of 32 tokens), the block calls that run compute
    (3/4 + 3 x 1/2) / 4 = 9/16 of the pairs the whole hops would: the own hop 3/4, every
    other hop half. The calls are half the queries over half or all of the shard's keys."""
    spec = _spec("ring", (2, 4))
    split, traced = _run_pairs(spec, monkeypatch, backward)
    assert traced == {(32, 32), (32, 64)}, traced
    dispatcher = sys.modules["eqx_longctx.attention"]  # the package, not its function
    monkeypatch.setattr(dispatcher, "zigzag_halves", lambda *a: False)
    whole, traced = _run_pairs(spec, monkeypatch, backward)
    assert traced == {(64, 64)}, traced
    assert split / whole == pytest.approx(9 / 16), (split, whole)


def test_the_kernels_keep_whole_hops():
    """The Pallas kernels decline the split (`splits_zigzag_halves`): the ring's
    configuration for them is the plain one."""
    from eqx_longctx.attention._ring import _on, _plans, _RingConfig
    from eqx_longctx.kernels import PallasBlockImpl

    config = _RingConfig("context", XlaBlockImpl(), None, None, halves=True)  # pyright: ignore[reportArgumentType]
    assert _plans(_on(XlaBlockImpl(), config)) == RING_PLANS
    assert _plans(_on(PallasBlockImpl(128, 128, True), config)) == ((), ((0, ALL),))


@pytest.mark.parametrize(
    ("strategy", "shape", "share"), [("ring", (2, 4), 9 / 16), ("usp", (2, 4), 3 / 4)]
)
def test_cost_model_counts_the_ring_halves(strategy, shape, share):
    """`plan` prices the ring's halves where the XLA path splits (9/16 of the pairs on a ring
    of 4; USP's hops 3/4 each), and whole hops for the Pallas kernels."""
    from eqx_longctx.attention._choose import plan

    def compute(impl):
        spec = _spec(strategy, shape, impl=impl)
        dims = dict(batch=4, seq=256, q_heads=8, kv_heads=4, head_dim=32)
        return plan(spec, **dims).costs[strategy].compute_s

    assert compute("xla") == pytest.approx(share * compute("pallas"))
