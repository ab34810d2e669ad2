"""Blockwise (flash) attention in XLA: online softmax forward, recomputing backward.

`XlaBlockImpl` implements the block contract of `_block.py` (the one every strategy calls):
it attends tiled queries to a key/value block given their token positions and segment ids,
and returns `(out, logsumexp)` so partial results from different key blocks can be merged.
Its twin on TPU is the Pallas kernel in `eqx_longctx/kernels/`.

Einsum letters: `b` batch, `k` kv heads, `g` query heads per kv head, `s` query tokens,
`t` key tokens, `d` head dim, `v` value head dim, `n` block index.

References: Dao et al. 2022, "FlashAttention" (arXiv:2205.14135); Dao 2023,
"FlashAttention-2" (arXiv:2307.08691).
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

from ._block import AbstractBlockImpl, BlockOptions, pairs_are_empty, pairs_are_full
from ._tiles import (
    DEFAULT_TILING,
    QueryTiles,
    Tiling,
    _Config,
    _map_head_tiles,
)


class XlaBlockImpl(AbstractBlockImpl):
    """The block contract (`_block.py`) in XLA: `lax` loops over blocks and head tiles, block
    pairs that no query can see skipped with `lax.cond`, any backend.

    **Arguments:**

    - `tiling`: block length and the bytes one block of float32 scores may take.
    """

    tiling: Tiling = eqx.field(static=True, default=DEFAULT_TILING)

    @property
    def splits_zigzag_halves(self) -> bool:
        return True

    def tile_queries(self, q, positions, segment_ids, kv_like, options: BlockOptions):
        return QueryTiles.make(
            q, positions, segment_ids, kv_like, causal=options.causal, scale=options.scale,
            tiling=self.tiling, window=options.window, softcap=options.softcap,
            chunk=options.chunk,
        )  # fmt: skip

    def attend(self, qt: QueryTiles, k, v, kv_positions, kv_segment_ids):
        blocks, config = qt.hop(k, kv_positions, kv_segment_ids)
        kn, vn = blocks.kv_padded(k), blocks.kv_padded(v)
        return _flash_fwd_impl(config, qt.qb, kn, vn, blocks.all_finite(v), *blocks.masks)

    def attend_heads_major(self, qt: QueryTiles, k, v, kv_positions, kv_segment_ids):
        like = jax.ShapeDtypeStruct((k.shape[0], k.shape[2], k.shape[1], k.shape[3]), k.dtype)
        blocks, config = qt.hop(like, kv_positions, kv_segment_ids)
        if _is_direct(blocks, qt.qb, self.tiling):
            return _attend_direct(config, qt, blocks, k, v, kv_positions, kv_segment_ids)
        swap = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
        return self.attend(qt, swap(k), swap(v), kv_positions, kv_segment_ids)

    def attend_backward(
        self, qt: QueryTiles, k, v, kv_positions, kv_segment_ids, dout, lse, delta, dq
    ):
        blocks, config = qt.hop(k, kv_positions, kv_segment_ids)
        kb, vb = blocks.split_kv(k), blocks.split_kv(v)
        dq, dkb, dvb = _backward_blocks(
            config, qt.qb, kb, vb, *blocks.masks, dout.astype(qt.qb.dtype), lse, delta, dq
        )
        return dq, blocks.merge_kv(dkb), blocks.merge_kv(dvb)


# Queries with at most this many rows (per head) in one block attend a whole K/V block in
# one product, in the layout K/V are stored in: a decode step's query heads of one K/V head.
_DIRECT_ROWS = 16


def _is_direct(blocks, qb, tiling: Tiling) -> bool:
    """Whether `attend` takes the direct path: one query block of a few rows, one head tile,
    and all scores within one tile's bytes (no loop over key blocks, no block-major copy of
    K/V, which for a decode step over a long cache cost more than the attention)."""
    scores = blocks.b * blocks.hk * blocks.g * blocks.sq * blocks.sk * 4
    return (
        blocks.nq == 1 and blocks.sq <= _DIRECT_ROWS and qb.shape[0] == 1
        and scores <= tiling.tile_bytes
    )  # fmt: skip


def _attend_direct(config: _Config, qt: QueryTiles, blocks, k, v, kv_pos, kv_seg):
    """`attend` of a few query rows over the whole of heads-major `k`, `v` (`[b, k, t, d]`
    as given): one masked product, results in the native block-major layout."""
    q = qt.qb[0, 0]  # [b, k, g, s, d]
    b, sk = k.shape[0], k.shape[2]
    q_pos, _, q_seg, _ = blocks.masks
    if kv_pos is None:
        kv_pos = jnp.broadcast_to(jnp.arange(sk, dtype=jnp.int32), (b, sk))
    if config.use_segments and kv_seg is None:
        kv_seg = jnp.zeros((b, sk), jnp.int32)
    q_seg = q_seg[0] if config.use_segments else None  # pyright: ignore[reportOptionalSubscript]
    mask = _block_mask(config, q_pos[0], kv_pos, q_seg, kv_seg)
    s = _scores(config, q, k, mask)
    m = s.max(-1)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    p = jnp.exp(s - m_safe[..., None])
    pv = lax.cond(jnp.all(jnp.isfinite(v)), _pv, _pv_nonfinite, p.astype(v.dtype), v, mask)
    out, lse = _finish(m, p.sum(-1), pv, qt.qb.dtype)
    return out[None, None], lse[None, None]


def _finish(m, row_sum, acc, dtype):
    """`(out, lse)` from the running max, row sum and unnormalised output of a softmax."""
    # `row_sum == 0` (not `> 0`): a NaN row sum must give a NaN row, not an empty one.
    empty = row_sum == 0
    denom = jnp.where(empty, 1.0, row_sum)
    out = jnp.where(empty[..., None], 0.0, acc / denom[..., None])
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(denom))
    return out.astype(dtype), lse


def _block_mask(config: _Config, q_pos, kv_pos, q_seg, kv_seg):
    """Visibility `[b, 1, 1, bq, bk]` of one query block against one key block."""
    mask = None
    if config.causal:
        mask = q_pos[:, :, None] >= kv_pos[:, None, :]
    if config.window is not None:
        mask = mask & (q_pos[:, :, None] - kv_pos[:, None, :] < config.window)
    if config.chunk is not None:
        mask = mask & (q_pos[:, :, None] // config.chunk == kv_pos[:, None, :] // config.chunk)
    if config.use_segments:
        same = q_seg[:, :, None] == kv_seg[:, None, :]
        mask = same if mask is None else mask & same
    return None if mask is None else mask[:, None, None]


def _block_mask_keys_major(config: _Config, q_pos, kv_pos, q_seg, kv_seg):
    """Visibility `[b, 1, bk, 1, bq]` of one query block against one key block, keys major."""
    mask = None
    if config.causal:
        mask = q_pos[:, None, :] >= kv_pos[:, :, None]
    if config.window is not None:
        mask = mask & (q_pos[:, None, :] - kv_pos[:, :, None] < config.window)
    if config.chunk is not None:
        mask = mask & (q_pos[:, None, :] // config.chunk == kv_pos[:, :, None] // config.chunk)
    if config.use_segments:
        same = q_seg[:, None, :] == kv_seg[:, :, None]
        mask = same if mask is None else mask & same
    return None if mask is None else mask[:, None, :, None, :]


def _block_is_empty(config: _Config, q_pos, kv_pos, q_seg, kv_seg):
    """True when no query of the block sees any key of the block, for every batch row."""
    segments = (q_seg, kv_seg) if config.use_segments else (None, None)
    return pairs_are_empty(config.options, q_pos, kv_pos, *segments)


def _block_is_full(config: _Config, q_pos, kv_pos, q_seg, kv_seg):
    """True when every query of the block sees every key of the block, for every batch row
    (then the block runs without a mask)."""
    segments = (q_seg, kv_seg) if config.use_segments else (None, None)
    return pairs_are_full(config.options, q_pos, kv_pos, *segments)


def _cap(config: _Config, s):
    """Scaled float32 scores soft-capped (`softcap * tanh(s / softcap)`), or as they are."""
    if config.softcap is None:
        return s
    return config.softcap * jnp.tanh(s / config.softcap)


def _scores(config: _Config, qi, kj, mask):
    s = jnp.einsum("bkgsd,bktd->bkgst", qi, kj, preferred_element_type=jnp.float32)
    s = _cap(config, s * config.scale)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    return s


def _flash_fwd_impl(config, qb, kn, vn, v_finite, q_pos, kv_pos, q_seg, kv_seg):
    def tile(qc, kv_tile):
        return _flash_fwd_tile(config, qc, kn, vn, kv_tile, v_finite, q_pos, kv_pos, q_seg, kv_seg)

    return _map_head_tiles(tile, qb, kn.shape[2] // qb.shape[3])


# Kinds of a (query block, key block) pair in the forward (`_pair_kinds`), in the order the
# pairs are visited: unmasked, masked, the guarded product for values holding NaN or inf,
# and skipped.
_FULL, _MASKED, _NONFINITE, _EMPTY = 0, 1, 2, 3
_KINDS = (_FULL, _MASKED, _NONFINITE)
# Up to this many key blocks, a loop of static length takes them in order, one
# `lax.switch` over its kind each: for short sequences (a context-parallel shard of a few
# hundred tokens, one pair) loops with run-time trip counts cost more than they save (the
# main job's step: 0.69 s against 0.64), and a loop (not an unrolled sequence of
# branches) keeps one block of scores live, not one per block.
_FEW_BLOCKS = 2


def _pair_kinds(config: _Config, q_pos, kv_pos, q_seg, kv_seg, v_finite):
    """The kind of one query block against every key block (`kv_pos` `[n, b, block]`):
    skipped when no query sees a key, unmasked when every query sees every key."""

    def kind(kv_pos_j, kv_seg_j, finite_j):
        empty = _block_is_empty(config, q_pos, kv_pos_j, q_seg, kv_seg_j)
        full = _block_is_full(config, q_pos, kv_pos_j, q_seg, kv_seg_j)
        k = jnp.where(full, _FULL, _MASKED)
        k = jnp.where(finite_j, k, _NONFINITE)
        return jnp.where(empty, _EMPTY, k)

    kv_seg = kv_seg if kv_seg is not None else jnp.zeros(kv_pos.shape, jnp.int32)
    return jax.vmap(kind)(kv_pos, kv_seg, v_finite)


def _flash_fwd_tile(config, qb, kn, vn, kv_tile, v_finite, q_pos, kv_pos, q_seg, kv_seg):
    """One head tile: `qb` `[n, b, k, g, block, d]`; keys and values of every head in their
    own layout, `kn` `[b, t, heads, d]` and `vn` `[b, t, heads, v]` (padded to whole key
    blocks), of which this tile reads the `k` heads of K/V head tile `kv_tile`; `v_finite`
    `[n]` whether a key block's values (of every head) are all finite.

    Each step copies its key block out transposed (`[b x k, d, block]`, as the score
    product reads it) and its value block heads-major: no block-major copy of the whole of
    K/V is made first (at 4K tokens, 8 heads x 64: temporaries 45 -> 29 MiB, and the
    forward 3-7% faster).

    Each query block visits only the key blocks it sees: their indices are sorted by kind
    (`_pair_kinds`) and one loop per kind runs over its share, so no step branches, copies
    its carry, skips, or builds a mask it does not need. The products run on 3-D operands
    (batch `b x k`, rows `g x block`), so that XLA:CPU neither transposes a key block nor
    lays a score block out again per step. (`exp2` with log2(e) folded into the scale was
    no faster here, and XLA:CPU lowers it differently from one program to the next, so a
    rematerialized forward differed from the first in the last bit.)
    """
    _, b, hk, g, bq, d = qb.shape
    nk, bk, dv = kv_pos.shape[0], kv_pos.shape[-1], vn.shape[-1]
    batch, rows = b * hk, g * bq
    scale = jnp.float32(config.scale)
    # Unmasked blocks of float32 queries take queries scaled once per query block, not the
    # scale on every block of scores: XLA:CPU writes scaled scores out again (one more pass
    # over each block). Masked blocks fold the scale into the mask's pass; lower precision
    # keeps the scale on the float32 scores.
    prescale = qb.dtype == jnp.float32

    def kv_block(x, j):
        """Key block `j` of this tile's K/V heads, `[b, block, k, d]`."""
        start = (0, j * bk, kv_tile * hk, 0)
        return lax.dynamic_slice(x, start, (b, bk, hk, x.shape[-1]))

    def step(kind, j, carry, qi, qi_scaled, qpi, qsi):
        """One online-softmax step of a query block over key block `j` (`qi_scaled`:
        `qi` times the scale, when `prescale`)."""
        m, row_sum, acc = carry
        kj = kv_block(kn, j).transpose(0, 2, 3, 1).reshape(batch, d, bk)
        vj = kv_block(vn, j).transpose(0, 2, 1, 3).reshape(batch, bk, dv)
        if kind == _FULL and prescale:
            s = jnp.einsum("BSd,BdT->BST", qi_scaled, kj, preferred_element_type=jnp.float32)
        else:
            s = jnp.einsum("BSd,BdT->BST", qi, kj, preferred_element_type=jnp.float32) * scale
        s = _cap(config, s)
        mask = None
        if kind != _FULL:
            mask = _block_mask(config, qpi, kv_pos[j], qsi, None if qsi is None else kv_seg[j])
        if mask is not None:
            s = jnp.where(mask, s.reshape(b, hk, g, bq, bk), -jnp.inf).reshape(batch, rows, bk)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        row_sum = alpha * row_sum + p.sum(-1)
        if kind == _NONFINITE:
            p5 = p.reshape(b, hk, g, bq, bk).astype(vj.dtype)
            pv = _pv_nonfinite(p5, vj.reshape(b, hk, bk, dv), mask).reshape(batch, rows, dv)
        else:
            pv = jnp.einsum(
                "BST,BTv->BSv", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32
            )
        return m_new, row_sum, alpha[..., None] * acc + pv

    def one_q_block(args):
        qi, qpi, qsi = args
        qi = qi.reshape(batch, rows, d)
        qi_scaled = qi * scale if prescale else None
        qsi = qsi if config.use_segments else None
        kinds = _pair_kinds(config, qpi, kv_pos, qsi, kv_seg, v_finite)
        carry = (
            jnp.full((batch, rows), -jnp.inf, jnp.float32),
            jnp.zeros((batch, rows), jnp.float32),
            jnp.zeros((batch, rows, dv), jnp.float32),
        )
        if nk <= _FEW_BLOCKS:  # a few key blocks: in order, one branch each

            def one(j, c):
                branches = [lambda c, k=k: step(k, j, c, qi, qi_scaled, qpi, qsi) for k in _KINDS]
                return lax.switch(kinds[j], [*branches, lambda c: c], c)

            carry = lax.fori_loop(0, nk, one, carry)
        else:
            order = jnp.argsort(kinds, stable=True)
            start = 0
            for kind in _KINDS:
                stop = start + jnp.sum(kinds == kind)
                body = lambda t, c, k=kind: step(k, order[t], c, qi, qi_scaled, qpi, qsi)  # noqa: E731
                carry = lax.fori_loop(start, stop, body, carry)
                start = stop
        m, row_sum, acc = carry
        stats = (b, hk, g, bq)
        m = m.reshape(stats)
        return _finish(m, row_sum.reshape(stats), acc.reshape(*stats, dv), qb.dtype)

    q_seg_blocks = q_seg if q_seg is not None else jnp.zeros(q_pos.shape, jnp.int32)
    # Query blocks enter the loop flattened: XLA:CPU would otherwise copy a transposed
    # operand whose unit dimensions it laid out in another (physically identical) order.
    flat = lambda x: x.reshape(x.shape[0], -1)  # noqa: E731
    return lax.map(one_q_block, (flat(qb), q_pos, q_seg_blocks))


def _pv(p, vj, mask):
    return jnp.einsum("bkgst,bktv->bkgsv", p, vj, preferred_element_type=jnp.float32)


def _pv_nonfinite(p, vj, mask):
    """`p @ v` for a key block holding NaN or inf values: a row gets NaN where it sees one
    (as naive softmax would), and a value it does not see never reaches it (`0 * inf` in the
    plain product would poison every row of the block)."""
    ok = jnp.isfinite(vj)
    pv = _pv(p, jnp.where(ok, vj, 0).astype(vj.dtype), mask)
    seen = jnp.ones(p.shape, jnp.float32) if mask is None else jnp.broadcast_to(mask, p.shape)
    hit = jnp.einsum("bkgst,bktv->bkgsv", seen.astype(jnp.float32), (~ok).astype(jnp.float32))
    return jnp.where(hit > 0, jnp.nan, pv)


def _backward_blocks(config, qb, kb, vb, q_pos, kv_pos, q_seg, kv_seg, dout, lse, delta, dq_t):
    """Blockwise gradients (float32), one head tile after another. The query gradient is
    added to `dq_t` (transposed, see `_backward_tile`) and dK/dV to the K/V head tile's
    accumulator, both in place, so no gradient is ever stacked per tile.

    **Returns:** `(dq_t, dk, dv)`, block-major.
    """
    per_kv = qb.shape[0] // kb.shape[0]

    def tile(c, dq_t):
        kc = c // per_kv
        dq_c, dk, dv = _backward_tile(
            config, qb[c], kb[kc], vb[kc], q_pos, kv_pos, q_seg, kv_seg, dout[c], lse[c],
            delta[c], dq_t[c],
        )  # fmt: skip
        return dq_c, dk, dv

    if qb.shape[0] == 1:
        return jax.tree.map(lambda x: x[None], tile(0, dq_t))

    def step(c, carry):
        dq_t, dk, dv = carry
        dq_c, dk_c, dv_c = tile(c, dq_t)
        kc = c // per_kv
        return dq_t.at[c].set(dq_c), dk.at[kc].add(dk_c), dv.at[kc].add(dv_c)

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
    return lax.fori_loop(0, qb.shape[0], step, (dq_t, zeros(kb), zeros(vb)))


def _backward_tile(config, qb, kb, vb, q_pos, kv_pos, q_seg, kv_seg, dout, lse, delta, dq_t):
    """One head tile's gradients: outer loop over key blocks, inner over query blocks.

    Scores are formed keys-major (`[.., t, g, s]`), so every product contracts a minor
    dimension with a major one and XLA needs no transposed copy of a score tile; the query
    gradient is accumulated into `dq_t`, transposed (`[n, b, k, d, g, block]`) for the same
    reason (`_dq_from_transposed` turns it around once, after every key block is done).
    """
    nq = qb.shape[0]
    lse_safe = jnp.where(lse == -jnp.inf, 0.0, lse)

    def one_kv_block(dq_t, args):
        kj, vj, kpj, ksj = args

        def q_step(i, carry):
            dk, dv, dq_t = carry
            qsi = None if q_seg is None else q_seg[i]

            def compute(masked, dk, dv):
                mask = None
                if masked:
                    mask = _block_mask_keys_major(config, q_pos[i], kpj, qsi, ksj)
                s_t = jnp.einsum("bktd,bkgsd->bktgs", kj, qb[i], preferred_element_type=jnp.float32)
                x_t = s_t * config.scale
                t_t = x_t
                if config.softcap is not None:  # d(c tanh(x / c))/dx = 1 - tanh(x / c)^2
                    t_t = jnp.tanh(x_t / config.softcap)
                    x_t = config.softcap * t_t
                z_t = x_t - lse_safe[i][:, :, None]
                # Masked before the exponential (exp(-inf) is 0), so that the masked
                # probabilities are one pass: masked after it, XLA:CPU wrote `p_t` out
                # unmasked, then masked, and built the mask again for `ds_t`.
                if mask is not None:
                    z_t = jnp.where(mask, z_t, -jnp.inf)
                p_t = jnp.exp(z_t)
                dv = dv + jnp.einsum(
                    "bktgs,bkgsv->bktv",
                    p_t.astype(vj.dtype),
                    dout[i],
                    preferred_element_type=jnp.float32,
                )
                dp_t = jnp.einsum(
                    "bktv,bkgsv->bktgs", vj, dout[i], preferred_element_type=jnp.float32
                )
                ds_t = p_t * (dp_t - delta[i][:, :, None]) * config.scale
                if config.softcap is not None:
                    ds_t = ds_t * (1.0 - t_t * t_t)
                dk = dk + jnp.einsum(
                    "bktgs,bkgsd->bktd",
                    ds_t.astype(qb.dtype),
                    qb[i],
                    preferred_element_type=jnp.float32,
                )
                # In float32: XLA:CPU has no unfused bf16 x bf16 -> f32 dot for this form.
                dq_i = jnp.einsum("bktd,bktgs->bkdgs", kj.astype(jnp.float32), ds_t)
                return dk, dv, dq_i

            def skip(dk, dv):
                return dk, dv, jnp.zeros(dq_t.shape[1:], jnp.float32)

            # dq stays out of the switch: a conditional copies its operands, and dq is the
            # whole query gradient. A block every query sees whole runs without a mask (one
            # pass less over its probabilities).
            empty = _block_is_empty(config, q_pos[i], kpj, qsi, ksj)
            full = _block_is_full(config, q_pos[i], kpj, qsi, ksj)
            kind = jnp.where(empty, 0, jnp.where(full, 1, 2))
            branches = (skip, functools.partial(compute, False), functools.partial(compute, True))
            dk, dv, dq_i = lax.switch(kind, branches, dk, dv)
            return dk, dv, dq_t.at[i].add(dq_i)

        init = (jnp.zeros(kj.shape, jnp.float32), jnp.zeros(vj.shape, jnp.float32), dq_t)
        dk, dv, dq_t = lax.fori_loop(0, nq, q_step, init)
        return dq_t, (dk, dv)

    kv_seg_blocks = kv_seg if kv_seg is not None else jnp.zeros(kv_pos.shape, jnp.int32)
    dq_t, (dk, dv) = lax.scan(one_kv_block, dq_t, (kb, vb, kv_pos, kv_seg_blocks))
    return dq_t, dk, dv
