"""Limits of the TPU the Pallas kernels respect without a TPU to hit them: the block
schedule read by scalar prefetch fits in SMEM (batch rows split over several kernel calls
when it would not, and a row's queries over several pieces; a clear error when one query
block alone would not)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_longctx import flash_attention
from eqx_longctx import reference_attention as oracle
from eqx_longctx.kernels import _blocks


def _cfg(block_q, block_k, max_live_blocks=None):
    q = jax.ShapeDtypeStruct((1, 128, 1, 128), jnp.float32)
    return _blocks.make_config(
        q, q, None, causal=True, window=None, scale=None, block_q=block_q, block_k=block_k,
        interpret=True, max_live_blocks=max_live_blocks,
    )  # fmt: skip


@pytest.mark.parametrize(
    "batch, sq, sk, blocks, live, expected",
    [
        # two tables x 4 bytes x batch x max(nq x steps_k, nk x steps_q)
        (1, 131072, 131072, (512, 1024), None, 2 * 4 * 256 * 128),
        (16, 131072, 131072, (512, 1024), None, 16 * 2 * 4 * 256 * 128),
        (2, 4096, 8192, (512, 512), None, 2 * 2 * 4 * 8 * 16),
        (1, 131072, 131072, (512, 1024), 8, 2 * 4 * max(256 * 8, 128 * 8)),
    ],
)
def test_smem_estimate(batch, sq, sk, blocks, live, expected):
    cfg = _cfg(*blocks, live)._replace(block_q=blocks[0], block_k=blocks[1])
    assert _blocks.smem_bytes(cfg, batch, sq, sk) == expected
    # 256 KiB a row at 128K tokens in v5p blocks: two rows per call fit the 512 KiB budget
    if (batch, sq, live) == (16, 131072, None):
        assert _blocks.smem_rows(cfg, sq, sk) == 2


def _case(batch, seq=256, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (batch, seq, 2, 128), jnp.float32)
    k, v = (jax.random.normal(kk, (batch, seq, 1, 128), jnp.float32) for kk in ks[1:])
    return q, k, v


def _whole_then_split(monkeypatch, budget: int, q, k, v, seg=None):
    """The kernels' outputs `(out, lse)` and gradients as one call, then with the SMEM
    budget cut to `budget` bytes; **returns** `(whole, split, kernel calls of split)`."""

    def results():  # new functions each time, so jit traces (and counts kernel calls) again
        def run(q, k, v):
            return flash_attention(q, k, v, causal=True, impl="pallas", block_q=128,
                                   block_k=128, q_segment_ids=seg, kv_segment_ids=seg)  # fmt: skip

        def loss(q, k, v):
            out, lse = run(q, k, v)
            return jnp.sum(out * out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

        return jax.jit(run)(q, k, v), jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)

    whole = results()
    calls = []
    original = _blocks.call_kernel

    def counting(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(_blocks, "_SMEM_BUDGET", budget)
    for module in ("_flash_pallas", "_flash_pallas_bwd"):
        monkeypatch.setattr(f"eqx_longctx.kernels.{module}.call_kernel", counting)
    return whole, results(), len(calls)


def test_batch_rows_split_over_calls_when_the_schedule_overflows_smem(monkeypatch):
    """With the budget cut to two rows' schedules, batch 5 runs as 3 kernel calls per
    pass and gives the same output, logsumexp and gradients as one call (and the oracle)."""
    q, k, v = _case(5)
    whole, split, calls = _whole_then_split(monkeypatch, 2 * 2 * 4 * 2 * 2, q, k, v)
    assert calls == 3 + 3 * (1 + 2)  # forward; then forward again, dQ and dK/dV
    for a, b in zip(jax.tree.leaves(split), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(split[0][0], oracle(q, k, v, causal=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("segmented", [False, True])
def test_queries_go_in_pieces_when_one_rows_schedule_overflows_smem(monkeypatch, segmented):
    """With the budget cut to two query blocks' schedules against 4 key blocks, each row's
    512 queries run in 2 pieces per pass, one row a call: the same output and logsumexp as
    one call, and gradients (dK, dV summed over the pieces) to float32 rounding; the oracle
    agrees."""
    q, k, v = _case(2, seq=512, seed=1)
    seg = None
    if segmented:
        seg = jnp.asarray(np.repeat([[0, 1, 1, 2]], 128, axis=1).repeat(2, 0), jnp.int32)
    budget = 2 * 4 * 4 * 2  # 2 of the 4 query blocks against 4 key blocks, one row
    whole, split, calls = _whole_then_split(monkeypatch, budget, q, k, v, seg)
    assert calls == 2 * 2 * (1 + 1 + 2)  # pieces x rows x (forward; forward, dQ, dK/dV)
    (out, lse), (out_whole, lse_whole) = split[0], whole[0]
    np.testing.assert_array_equal(out, out_whole)
    np.testing.assert_array_equal(lse, lse_whole)
    for a, b in zip(split[1], whole[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    want = oracle(q, k, v, causal=True, segment_ids=seg)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_one_query_block_over_smem_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(_blocks, "_SMEM_BUDGET", 8)  # one query block against 2 key blocks: 16
    q, k, v = _case(1)
    match = r"block schedule needs .* KiB of SMEM for one block of 128 queries against 256 keys"
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v, causal=True, impl="pallas", block_q=128, block_k=128)


def _pallas_grids(jaxpr) -> list[tuple[int, ...]]:
    """The grid of every `pallas_call` in a (closed) jaxpr, sub-jaxprs included."""
    grids = []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "pallas_call":
                grids.append(tuple(eqn.params["grid_mapping"].grid))
            for param in eqn.params.values():
                for sub in param if isinstance(param, tuple | list) else (param,):
                    inner = getattr(sub, "jaxpr", None)
                    if inner is not None:
                        walk(getattr(inner, "jaxpr", inner))

    walk(jaxpr.jaxpr)
    return grids


def test_windowed_call_visits_about_the_live_pairs():
    """A window of W over S tokens in b x b blocks: the forward's bounded grid takes
    `window_live_blocks` key steps per query block (4 here), O(S W / b^2) pairs instead of
    (S / b)^2, and this ordered layout never overflows the bound (the run-time check keeps
    the bounded grid; the whole one is the staged-out fallback)."""
    from eqx_longctx.kernels import PallasBlockImpl

    s, w, blk = 4096, 256, 128
    q, k, v = (x[:, :s] for x in _case(1, seq=s))
    impl = PallasBlockImpl(blk, blk, interpret=True)

    def fwd(q, k, v):
        return flash_attention(q, k, v, causal=True, window=w, impl=impl)

    grids = _pallas_grids(jax.make_jaxpr(fwd)(q, k, v))
    nq = s // blk
    steps = _blocks.window_live_blocks(blk, blk, w)
    assert steps == 4
    assert sorted(grids) == sorted([(1, 2, nq, steps), (1, 2, nq, nq)])  # bounded, fallback
    cfg = _blocks.make_config(q, k, None, causal=True, window=w, scale=None, block_q=blk,
                              block_k=blk, interpret=True)  # fmt: skip
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (1, s))
    ids = _blocks.pad_ids(cfg, s, s, pos, pos, None, None)
    assert not bool(_blocks.schedule(cfg, ids).overflow)
    out, lse = fwd(q, k, v)
    ref = oracle(q, k, v, causal=True, window=w)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
