"""Block sizes, input validation, padding and block-pair classification of the Pallas kernels.

Everything here runs in the wrapper, outside the kernels: it checks what the caller passed,
pads the sequences to block multiples, lays the per-token positions and segment ids out the
way the TPU kernels read them, and classifies every (query block, key block) pair from
per-block ranges so the kernels skip empty pairs and drop the mask arithmetic on full ones.

## Block-pair classification

For a batch row and a pair (query block `i`, key block `j`), let `qp`/`kp` be the minimum
and maximum query/key positions in the blocks and `qs`/`ks` the minimum and maximum segment
ids. A token pair is visible iff `(not causal or q_pos >= kv_pos)` and
`(window is None or q_pos - kv_pos < window)` and
`(chunk is None or q_pos // chunk == kv_pos // chunk)` and `(no segments or q_seg == kv_seg)`.

- `EMPTY` (0), no pair can be visible, if any of: `causal` and `max qp < min kp`;
  `window` and `min qp - max kp >= window`; `chunk` and the chunks of the two ranges do not
  meet (`min qp // chunk > max kp // chunk` or `max qp // chunk < min kp // chunk`);
  segments and the ranges `[min qs, max qs]` and `[min ks, max ks]` do not overlap.
- `FULL` (2), every pair is visible, if not empty and all of: not `causal` or
  `min qp >= max kp`; no `window` or `max qp - min kp < window`; no `chunk` or both ranges
  lie in one chunk; no segments or both blocks hold one and the same segment id
  (`min qs == max qs == min ks == max ks`).
- `PARTIAL` (1) otherwise: the kernel computes the mask per token pair.

Ranges are conservative, so `EMPTY` and `FULL` are exact claims and `PARTIAL` may include
pairs that turn out empty or full. Padding tokens get segment ids that match nothing
(`_PAD_Q_SEGMENT`, `_PAD_KV_SEGMENT`), so a block that holds padding is never `FULL`.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from ._checks import check_variants
from ._operands import NUM_LANES, Side, pad_side

EMPTY, PARTIAL, FULL = 0, 1, 2
# Padded query rows and padded keys get segment ids no real token has (nor each other).
_PAD_Q_SEGMENT = int(np.iinfo(np.int32).min)
_PAD_KV_SEGMENT = _PAD_Q_SEGMENT + 1

# (block_q, block_k) starting points per TPU generation (`jax.devices()[0].device_kind`):
# a 512 x 1024 block of float32 scores is 2 MiB, which leaves room in the default scoped
# VMEM (16 MiB on v5e, 32 MiB on v5p/v6e) for the score temporaries and double-buffered
# inputs. Not tuned; `benchmarks/pallas_kernels.py` measures them.
DEFAULT_BLOCK_SIZES = {
    "TPU v4": (512, 512),
    "TPU v5 lite": (512, 512),
    "TPU v5e": (512, 512),
    "TPU v5": (512, 1024),
    "TPU v5p": (512, 1024),
    "TPU v6 lite": (512, 1024),
    "TPU v6e": (512, 1024),
}
"""`(block_q, block_k)` per TPU `jax.devices()[0].device_kind`: untuned starting points
that leave room in scoped VMEM. Any other device gets `(512, 512)`."""
FALLBACK_BLOCK_SIZES = (512, 512)


def default_block_sizes(device_kind: str | None = None) -> tuple[int, int]:
    """`(block_q, block_k)` for a TPU generation.

    **Arguments:**

    - `device_kind`: e.g. `"TPU v5 lite"`; default `jax.devices()[0].device_kind`.

    **Returns:** the entry of `DEFAULT_BLOCK_SIZES`, or `FALLBACK_BLOCK_SIZES` for any other
    device (CPU included).
    """
    kind = jax.devices()[0].device_kind if device_kind is None else device_kind
    return DEFAULT_BLOCK_SIZES.get(kind, FALLBACK_BLOCK_SIZES)


def call_kernel(interpret, build, *operands):
    """`build(interpret)(*operands)`, where `build` makes a `pl.pallas_call`.

    With `interpret=None` the choice follows the platform the program is *lowered for*,
    not the host: compiled Mosaic on a TPU, Pallas' interpreter anywhere else
    (`lax.platform_dependent`). So `jax.export(..., platforms=("tpu",))` or
    `jit(...).trace(...).lower(lowering_platforms=("tpu",))` from a CPU host carries the
    TPU kernels, while running on the CPU interprets them.
    """
    if interpret is not None:
        return build(interpret)(*operands)
    return lax.platform_dependent(*operands, tpu=build(False), default=build(True))


def race_detecting_interpret(num_cores: int = 1) -> pltpu.InterpretParams:
    """TPU interpret mode that simulates VMEM/SMEM, scalar prefetch and DMAs, fills fresh
    buffers with NaN and checks for data races (slower than `interpret=True`).

    **Arguments:**

    - `num_cores`: TensorCores per chip to simulate; 2 (megacore, v4/v5p) splits the
      "parallel" grid axes between them, in a random order.

    **Returns:** a `pltpu.InterpretParams` to pass as `interpret=`.
    """
    return pltpu.InterpretParams(
        detect_races=True, uninitialized_memory="nan", num_cores_or_threads=num_cores
    )


class Config(NamedTuple):
    """Static parameters of one kernel call (hashable: a `custom_vjp` nondiff argument)."""

    causal: bool
    window: int | None
    scale: float
    block_q: int
    block_k: int
    use_segments: bool
    interpret: object
    max_live_blocks: int | None = None
    block_k_compute: int | None = None  # None: the largest that fits VMEM (`_vmem`)
    softcap: float | None = None  # scaled scores x -> softcap * tanh(x / softcap)
    chunk: int | None = None  # q_pos // chunk == kv_pos // chunk

    @property
    def reach(self) -> int | None:
        """The tighter of `window` and `chunk` (a query sees keys fewer than this many
        positions back), which bounds the live blocks; `None`: unbounded."""
        bounds = [n for n in (self.window, self.chunk) if n is not None]
        return min(bounds) if bounds else None

    def steps(self, n: int) -> int:
        """Grid steps along a sequential axis over `n` blocks: `n`, or the caller's bound
        on non-empty pairs (`max_live_blocks`) when smaller."""
        return n if self.max_live_blocks is None else min(n, self.max_live_blocks)


def make_config(
    q, k, q_segment_ids, *, causal, window, scale, block_q, block_k, interpret,
    max_live_blocks=None, block_k_compute=None, softcap=None, chunk=None,
) -> Config:  # fmt: skip
    """Validate the static parameters and clamp the blocks to the (padded) sequences.

    Block lengths must be positive multiples of 128 (the TPU lane width): the forward keeps
    keys in lanes, and the dK/dV pass keys-major scores `[block_k, block_q]` with queries in
    lanes and stores the row statistics lane-dense. A sequence shorter than a block gets one
    block of its length rounded up to 128.
    """
    defaults = default_block_sizes()
    block_q = defaults[0] if block_q is None else block_q
    block_k = defaults[1] if block_k is None else block_k
    for name, blk in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(blk, int | np.integer) or blk <= 0 or blk % NUM_LANES:
            fix = 512
            if isinstance(blk, int | np.integer) and blk > 0:
                fix = -(-int(blk) // NUM_LANES) * NUM_LANES
            raise ValueError(
                f"{name} must be a positive multiple of {NUM_LANES} (the TPU lane width: keys "
                f"and, in the backward, queries sit in lanes); got {name}={blk!r}. Use e.g. "
                f"{name}={fix}."
            )
    if window is not None:
        if not isinstance(window, int | np.integer) or window <= 0:
            raise ValueError(
                f"window must be a positive int (keys with q_pos - kv_pos < window are "
                f"visible) or None; got window={window!r}."
            )
        if not causal:
            raise ValueError(
                f"window={window} needs causal=True (a sliding window looks back only); got "
                "causal=False. Pass causal=True, or window=None for full attention."
            )
    softcap, chunk = check_variants(causal, softcap, chunk)
    round_up = lambda n: -(-n // NUM_LANES) * NUM_LANES  # noqa: E731
    bq = min(int(block_q), round_up(q.shape[1]))
    bk = min(int(block_k), round_up(k.shape[1]))
    scale = 1.0 / float(np.sqrt(q.shape[-1])) if scale is None else float(scale)
    use_segments = q_segment_ids is not None or q.shape[1] % bq != 0 or k.shape[1] % bk != 0
    if max_live_blocks is not None and (
        not isinstance(max_live_blocks, int | np.integer) or max_live_blocks <= 0
    ):
        raise ValueError(
            "max_live_blocks must be a positive int (a bound on the non-empty partner "
            f"blocks of any query or key block) or None; got max_live_blocks={max_live_blocks!r}."
        )
    cfg = Config(bool(causal), None if window is None else int(window), scale, bq, bk,
                 use_segments, interpret,
                 None if max_live_blocks is None else int(max_live_blocks),
                 _sub_block(block_k_compute, int(block_k), bk), softcap, chunk)  # fmt: skip
    if max_live_blocks is None and cfg.reach is not None:
        # A chunk bounds the reach as a window of the same length does.
        bound = window_live_blocks(bq, bk, cfg.reach)
        if bound < max(-(-q.shape[1] // bq), -(-k.shape[1] // bk)):  # else: no cut
            cfg = cfg._replace(max_live_blocks=bound)
    check_smem(cfg, q.shape[0], q.shape[1], k.shape[1])
    return cfg


def _sub_block(block_k_compute, block_k: int, bk: int) -> int | None:
    """Validate the key sub-block against the requested `block_k` and fit it to the
    clamped one `bk`: the largest multiple of 128 that divides `bk`, at most the request."""
    if block_k_compute is None:
        return None
    b = block_k_compute
    if not isinstance(b, int | np.integer) or b <= 0 or b % NUM_LANES or block_k % b:
        raise ValueError(
            f"block_k_compute must be a positive multiple of {NUM_LANES} that divides block_k"
            f"={block_k} (the key sub-block each grid step walks its key block in); got "
            f"block_k_compute={b!r}. Use e.g. block_k_compute={NUM_LANES}, or None "
            "for the largest that fits the VMEM budget."
        )
    b = min(int(b), bk)
    while bk % b:
        b -= NUM_LANES
    return b


# Scalar memory of one TensorCore (1 MiB on v4, v5e, v5p and v6e). The block schedule the
# kernels read by scalar prefetch must fit in half of it, next to Mosaic's own scalars.
SMEM_BYTES = 2**20
"""A TensorCore's scalar memory (SMEM), in bytes; the block schedules keep within half."""
_SMEM_BUDGET = SMEM_BYTES // 2


def window_live_blocks(block_q: int, block_k: int, window: int) -> int:
    """Non-empty partner blocks of one block under a sliding window, when positions run in
    order (one device's tokens, a ring hop of the contiguous layout): a query block of
    `block_q` rows sees keys over `block_q + window - 1` positions, which touch at most
    `ceil((block_q + window - 1) / block_k) + 1` key blocks; the same with the roles swapped
    for the dK/dV pass. Other orders (zig-zag, striped, packed) may need more; then the
    schedule overflows and the kernels take the whole grid (`with_fallback`)."""
    per_q = -(-(block_q + window - 1) // block_k) + 1
    per_k = -(-(block_k + window - 1) // block_q) + 1
    return max(per_q, per_k)


def with_fallback(cfg: Config, ids, sched, run):
    """`run(cfg, sched)`, the grid cut to `cfg.max_live_blocks` steps per block, unless the
    schedule overflowed that bound (a block with more non-empty partners): then `run` on
    the whole grid instead, chosen at run time. A bound that is too small costs time, never
    a wrong number."""
    nq, nk = ids.q_pos.shape[1] // cfg.block_q, ids.kv_pos.shape[1] // cfg.block_k
    if cfg.max_live_blocks is None or cfg.max_live_blocks >= max(nq, nk):
        return run(cfg, sched)
    whole = cfg._replace(max_live_blocks=None)
    return lax.cond(
        sched.overflow, lambda: run(whole, schedule(whole, ids)), lambda: run(cfg, sched)
    )


def smem_bytes(cfg: Config, batch: int, sq: int, sk: int) -> int:
    """Bytes of the largest kernel's scalar-prefetch tables (two per kernel: the pair kind
    and the block to fetch, `batch x blocks x steps` entries each), counted as 32-bit words
    (SMEM's word size) for the forward and dQ (per query block) and dK/dV (per key block)."""
    nq, nk = -(-sq // cfg.block_q), -(-sk // cfg.block_k)
    return 2 * 4 * batch * max(nq * cfg.steps(nk), nk * cfg.steps(nq))


def smem_rows(cfg: Config, sq: int, sk: int) -> int:
    """How many batch rows one kernel call may take with its schedule in SMEM (that of the
    whole grid, which a bounded call falls back to)."""
    return _SMEM_BUDGET // smem_bytes(cfg._replace(max_live_blocks=None), 1, sq, sk)


def query_chunk(cfg: Config, sq: int, sk: int) -> int:
    """The most query rows (a multiple of `block_q`, at most `sq` padded) whose one-row
    schedule against `sk` keys fits in SMEM: a longer call runs its queries in pieces of
    this many (`QuerySide.chunks`); 0 when not even one query block fits."""
    per_block = smem_bytes(cfg._replace(max_live_blocks=None), 1, cfg.block_q, sk)
    padded = -(-sq // cfg.block_q) * cfg.block_q
    return min(_SMEM_BUDGET // per_block * cfg.block_q, padded)


def check_smem(cfg: Config, batch: int, sq: int, sk: int) -> None:
    """**Raises:** `ValueError` when not even one query block's schedule against the `sk`
    keys fits in SMEM (more rows than fit go in several kernel calls, `by_batch_rows`, and
    more queries in pieces, `query_chunk`)."""
    del batch
    if query_chunk(cfg, sq, sk) >= 1:
        return
    raise ValueError(
        f"the Pallas kernels' block schedule needs "
        f"{smem_bytes(cfg, 1, cfg.block_q, sk) / 2**10:.0f} KiB of SMEM for one block of "
        f"{cfg.block_q} queries against {sk} keys in blocks of {cfg.block_k}; the limit is "
        f"{_SMEM_BUDGET // 2**10} KiB (half of the TensorCore's {SMEM_BYTES // 2**20} MiB). "
        "Use a larger block_k, a context-parallel spec that splits the sequence, a bound on "
        "the live blocks (max_live_blocks) for a windowed call, or impl='xla'."
    )


def by_batch_rows(cfg: Config, fn, sq: int, sk: int, *arrays):
    """`fn(*arrays)` (pytrees whose arrays are all `[batch, ...]`), run on as many batch
    rows at a time as keep the block schedule in SMEM (`smem_rows`) and concatenated."""
    batch = jax.tree.leaves(arrays[0])[0].shape[0]
    rows = smem_rows(cfg, sq, sk)
    if rows >= batch:
        return fn(*arrays)
    rows_of = lambda lo: lambda a: a[lo : lo + rows] if hasattr(a, "shape") else a  # noqa: E731
    parts = [fn(*jax.tree.map(rows_of(lo), arrays)) for lo in range(0, batch, rows)]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)


class Ids(NamedTuple):
    """Padded positions and segment ids `[batch, padded_seq]` int32 (segments may be None)."""

    q_pos: jax.Array
    kv_pos: jax.Array
    q_seg: jax.Array | None
    kv_seg: jax.Array | None


def query_ids(cfg: Config, q_positions, q_segment_ids) -> Side:
    """The query side's ids padded to `block_q`, with their tiles (see `_operands`)."""
    return pad_side(q_positions, q_segment_ids, block=cfg.block_q,
                    use_segments=cfg.use_segments, pad_segment=_PAD_Q_SEGMENT)  # fmt: skip


def kv_ids(cfg: Config, kv_positions, kv_segment_ids) -> Side:
    """The K/V side's ids padded to `block_k`, with their tiles."""
    return pad_side(kv_positions, kv_segment_ids, block=cfg.block_k,
                    use_segments=cfg.use_segments, pad_segment=_PAD_KV_SEGMENT)  # fmt: skip


def pad_ids(cfg: Config, sq, sk, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    """Pad to block multiples: positions repeat the last one (tight block ranges), segment
    ids of padding match nothing; segments are synthesised when only padding needs them."""
    del sq, sk
    q, kv = query_ids(cfg, q_positions, q_segment_ids), kv_ids(cfg, kv_positions, kv_segment_ids)
    return Ids(q.pos, kv.pos, q.seg, kv.seg)


class Schedule(NamedTuple):
    """Scalar-prefetch tables, flattened for SMEM, in the smallest integer type that holds
    them (int8 classes; int8/int16/int32 block indices), as splash attention does: SMEM is
    small and these grow with `(tokens / block)^2`.

    Query block `i`'s non-empty key blocks come first, in order: at step `t` of the forward
    and dQ passes (`nt = cfg.steps(nk)` steps) it fetches key block
    `kv_block[(b * nq + i) * nt + t]`, a pair of class `row_kind[same]`. Likewise the dK/dV
    pass at step `t` of key block `j` (`cfg.steps(nq)` steps) fetches query block
    `q_block[(b * nk + j) * nt + t]`, of class `col_kind[same]`. Steps past the last
    non-empty pair are `EMPTY` and re-point at the block fetched last, so they issue no DMA.
    `overflow` is True when some block has more non-empty partners than steps (only
    possible with `max_live_blocks`); the wrappers then run the whole grid instead.
    """

    row_kind: jax.Array
    kv_block: jax.Array
    col_kind: jax.Array
    q_block: jax.Array
    overflow: jax.Array


def _ranges(x, block: int):
    x = x.reshape(x.shape[0], -1, block)
    return x.min(-1), x.max(-1)


def classify(cfg: Config, ids: Ids) -> jax.Array:
    """`[batch, nq, nk]` int32 pair classes (see the module docstring for the rule)."""
    qp_lo, qp_hi = (r[:, :, None] for r in _ranges(ids.q_pos, cfg.block_q))
    kp_lo, kp_hi = (r[:, None, :] for r in _ranges(ids.kv_pos, cfg.block_k))
    shape = (qp_lo.shape[0], qp_lo.shape[1], kp_lo.shape[2])
    empty = jnp.zeros(shape, bool)
    full = jnp.ones(shape, bool)
    if cfg.causal:
        empty |= qp_hi < kp_lo
        full &= qp_lo >= kp_hi
    if cfg.window is not None:
        empty |= qp_lo - kp_hi >= cfg.window
        full &= qp_hi - kp_lo < cfg.window
    if cfg.chunk is not None:  # the blocks' chunk ranges do not meet / are one chunk
        qc_lo, qc_hi, kc_lo, kc_hi = (x // cfg.chunk for x in (qp_lo, qp_hi, kp_lo, kp_hi))
        empty |= (qc_lo > kc_hi) | (qc_hi < kc_lo)
        full &= (qc_lo == kc_hi) & (qc_hi == kc_lo)
    if ids.q_seg is not None:
        qs_lo, qs_hi = (r[:, :, None] for r in _ranges(ids.q_seg, cfg.block_q))
        ks_lo, ks_hi = (r[:, None, :] for r in _ranges(ids.kv_seg, cfg.block_k))
        empty |= (qs_hi < ks_lo) | (qs_lo > ks_hi)
        full &= (qs_lo == qs_hi) & (ks_lo == ks_hi) & (qs_lo == ks_lo)
    return jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)).astype(jnp.int32)


def _compact(kind, steps: int):
    """Per row of `kind` `[b, n, m]`: the indices of its non-empty entries first (in order)
    and their classes, cut to `steps`; later steps repeat the last index as `EMPTY`.

    **Returns:** `(classes, indices, overflow)`, the first two `[b, n, steps]`.
    """
    live = kind != EMPTY
    order = jnp.argsort(~live, axis=-1, stable=True)[..., :steps].astype(jnp.int32)
    # int32 like the tables, also under jax_enable_x64 (int64 is emulated on a TPU).
    count = live.sum(-1, keepdims=True, dtype=jnp.int32)
    valid = jnp.arange(steps, dtype=jnp.int32) < count
    last = jnp.take_along_axis(order, jnp.clip(count - 1, 0, steps - 1), axis=-1)
    index = jnp.where(valid, order, last)
    classes = jnp.where(valid, jnp.take_along_axis(kind, order, axis=-1), EMPTY)
    return classes, index, jnp.any(count > steps)


def _smallest_int(x, max_value: int):
    for dtype in (jnp.int8, jnp.int16):
        if max_value <= jnp.iinfo(dtype).max:
            return x.astype(dtype)
    return x


def schedule(cfg: Config, ids: Ids) -> Schedule:
    """Classify the block pairs and derive the fetch order (see `Schedule`)."""
    kind = classify(cfg, ids)
    nq, nk = kind.shape[1:]
    row_kind, kv_block, row_over = _compact(kind, cfg.steps(nk))
    col_kind, q_block, col_over = _compact(kind.transpose(0, 2, 1), cfg.steps(nq))
    flat = lambda x: x.reshape(-1)  # noqa: E731
    return Schedule(
        flat(row_kind).astype(jnp.int8),
        _smallest_int(flat(kv_block), nk - 1),
        flat(col_kind).astype(jnp.int8),
        _smallest_int(flat(q_block), nq - 1),
        row_over | col_over,
    )


def floor_div(x, c: int):
    """`x // c` for a positive int `c`, from a truncating division: Mosaic lowers
    `jnp.floor_divide`'s sign by asking the TPU generation, which a CPU host exporting a TPU
    program does not have."""
    d = lax.div(x, jnp.asarray(c, x.dtype))
    return d - (d * c > x).astype(x.dtype)


def visible(cfg: Config, q_pos, kv_pos, q_seg, kv_seg, *, widen_q=None, widen_kv=None):
    """The visibility rule on one score tile (inside a kernel), or None when every pair is
    visible. The ids broadcast to the tile once `widen_q` / `widen_kv` (if given) have
    tiled the side held in columns (`[rows, 128]`, equal lanes) to the tile's width; a
    chunk index is divided out before that, on the narrow tile."""
    same = lambda x: x  # noqa: E731
    widen_q, widen_kv = widen_q or same, widen_kv or same
    mask = None
    chunks = None
    if cfg.chunk is not None:
        chunks = widen_q(floor_div(q_pos, cfg.chunk)), widen_kv(floor_div(kv_pos, cfg.chunk))
    q_pos, kv_pos = widen_q(q_pos), widen_kv(kv_pos)
    if q_seg is not None and kv_seg is not None:
        q_seg, kv_seg = widen_q(q_seg), widen_kv(kv_seg)

    def conj(a, b):
        return b if a is None else a & b

    if cfg.causal:
        mask = conj(mask, q_pos >= kv_pos)
    if cfg.window is not None:
        mask = conj(mask, q_pos - kv_pos < cfg.window)
    if chunks is not None:
        mask = conj(mask, chunks[0] == chunks[1])
    if cfg.use_segments:
        mask = conj(mask, q_seg == kv_seg)
    return mask
