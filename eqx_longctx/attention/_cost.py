"""Cost model for the context-parallel strategies: memory, communication, balance, time.

For one attention call on a `ShardingSpec`, `strategy_cost` predicts per strategy
(`all_gather`, `ulysses`, `ring`, `usp`): whether it can run, the per-device activation
memory, the bytes each device receives per layer (forward, and forward + backward), how
evenly the causal work spreads over the devices under the spec's token layout, and a
roofline time. `_choose.py` picks one strategy from these. `collective_bytes` counts the
same bytes in a compiled program, so the model is checked against what XLA emits
(`tests/test_plan.py`).

- **Communication** is counted as bytes *received per device* (what crosses a link):
  all-gather and all-to-all `result x (n-1)/n`, collective-permute `result`, reduce-scatter
  `result x (n-1)`, all-reduce `result x 2(n-1)/n`, with `n` the replica group size. Int32
  positions (and segment ids) travel with K/V; Ulysses repeats K/V heads first when
  `kv_heads` does not divide by its degree; the ring sends dK/dV home in float32.
- **Memory** is arguments + outputs + the peak of the temporaries of the blockwise (flash)
  XLA path, taken over its phases: the block loop (one block of scores in float32, the
  block-tiled q/k/v, float32 accumulators), the re-tiling of gathered K/V (received and
  tiled copies live together), and in the backward the transposing of dq/dk/dv back; plus
  what each strategy holds (gathered positions, the ring's two K/V shards in flight and its
  float32 output accumulator). Validated against XLA:CPU's memory analysis.
- **Balance** counts non-empty `512 x 512` score blocks per device from `layout_order`.
- **Time** = the busiest device's compute (`DEFAULT_FLOPS_PER_S`) + communication not
  hidden behind it (`DEFAULT_BYTES_PER_S`): gathers and all-to-alls wait for their data;
  a ring hop's transfer overlaps the previous hop's compute.

On XLA:CPU, bfloat16 collectives run in float32, so counted bytes (and gathered buffers) of a
bfloat16 program are twice what the model (written for TPU/GPU) predicts.
"""

import functools
import math
from typing import NamedTuple

import numpy as np

from .._hlo import COLLECTIVES
from .._sharding import ShardingSpec
from . import _halo
from ._block import BlockOptions
from ._halves import half
from ._tiles import DEFAULT_BLOCK_Q, TILE_BYTES, head_tile
from ._tiling_policy import cut_ring_hops

# Roofline constants of the target chip (TPU v5e-class; override per call). FLOP/s is ~half of
# the 197 TFLOP/s bf16 peak, a realistic rate for attention; bytes/s is one ICI link in one
# direction, the bandwidth a ring hop or one step of a ring collective gets.
DEFAULT_FLOPS_PER_S = 100e12
DEFAULT_BYTES_PER_S = 50e9
STRATEGY_ORDER = ("all_gather", "ulysses", "ring", "usp")

_F32 = 4
_INT = 4  # positions and segment ids travel as int32


class StrategyCost(NamedTuple):
    """Predicted cost of one strategy; bytes are per device, times in seconds."""

    strategy: str
    feasible: bool  # the shapes divide as the strategy needs
    runnable: bool  # this spec can dispatch it (usp needs a ulysses_axis, the others none)
    reason: str  # why not feasible / not runnable, else a note (a local layer's exchange) or ""
    degree: str  # "N=8", or "u2 x r4" (ulysses 2 x ring 4)
    memory_forward: int  # arguments + outputs + temporaries of the forward call
    memory_train: int  # the same for forward + backward
    comm_forward: dict  # op -> bytes received per device, forward
    comm_train: dict  # op -> bytes, forward + backward
    balance: float  # max / mean of non-empty score elements over devices
    compute_s: float  # busiest device, forward (+ backward when training)
    exposed_s: float  # communication time not hidden behind compute
    time_s: float  # compute_s + exposed_s


class Problem(NamedTuple):
    """The shapes and mesh sizes of one attention call, as the cost model sees them."""

    nb: int  # batch-axis size
    nt: int  # tensor-axis size
    n: int  # sequence shards
    batch: int
    seq: int
    hq: int
    hk: int
    d: int
    dv: int
    e: int  # bytes per element of q, k, v
    causal: bool
    seg: bool
    block: int  # flash tile size the dispatcher uses for this spec and length
    tile_bytes: int  # bytes of one block of float32 scores (heads are tiled to fit)
    window: int | None = None  # sliding window (causal only)
    halves: bool = False  # all-gather and Ulysses split into zig-zag's causal halves
    chunk: int | None = None  # chunked attention (causal only)

    @property
    def reach_window(self) -> int | None:
        """The window that bounds what a query sees (`window` or `chunk`, the tighter)."""
        bounds = [w for w in (self.window, self.chunk) if w is not None]
        return min(bounds) if bounds else None

    @property
    def b(self) -> int:  # local batch
        return self.batch // self.nb

    @property
    def hq_l(self) -> int:  # local query heads (tensor parallel)
        return self.hq // self.nt

    @property
    def hk_l(self) -> int:
        return self.hk // self.nt

    @property
    def ids(self) -> int:  # int32 arrays travelling with each token
        return 1 + int(self.seg)


def common_problem(spec: ShardingSpec, p: Problem) -> str:
    """Why no strategy can run these shapes (the rules `check_spec_inputs` enforces), or ""."""
    need = 2 * p.n if spec.load_balance == "zigzag" else p.n
    if p.batch % p.nb:
        return f"batch={p.batch} not divisible by batch axis size {p.nb}"
    if p.seq % need:
        return f"seq={p.seq} not divisible by {need} ({spec.load_balance} over N={p.n})"
    if p.hq % p.nt or p.hk % p.nt:
        return f"heads {p.hq}/{p.hk} not divisible by tensor axis size {p.nt}"
    if p.hq % p.hk:
        return f"q_heads={p.hq} not a multiple of kv_heads={p.hk}"
    return ""


def _split(spec: ShardingSpec, name: str, p: Problem) -> tuple[int, int, str]:
    """(ulysses degree, ring degree, why not runnable under this spec) of strategy `name`."""
    if spec.ulysses_axis is not None:
        nu, nr = spec.axis_size(spec.ulysses_axis), spec.axis_size(spec.context_axis)
        if name == "usp":
            return nu, nr, ""
        # With a ulysses axis, the other strategies run over both sequence axes at once.
        return (p.n, 1, "") if name == "ulysses" else (1, p.n, "")
    if name == "usp":
        us = [u for u in range(p.n - 1, 1, -1) if p.n % u == 0 and p.hq_l % u == 0]
        u = us[0] if us else 1
        what = (
            f"what-if ulysses {u} x ring {p.n // u}; needs strategy='usp' on a mesh with a "
            f"ulysses axis of size {u}"
            if us
            else "needs a ulysses axis that divides the heads"
        )
        return u, p.n // u, what
    return (p.n, 1, "") if name == "ulysses" else (1, p.n, "")


def strategy_cost(name, spec, p, order, common, backward, flops_per_s, bytes_per_s) -> StrategyCost:
    """The predicted cost of strategy `name`; `common` says why no strategy can run, or is ""."""
    nu, nr, not_runnable = _split(spec, name, p)
    degree = f"N={p.n}" if name != "usp" else f"u{nu} x r{nr}"
    reason = common
    if not reason and name == "usp" and nu == 1:
        reason = f"no ulysses degree > 1 divides both N={p.n} and q_heads={p.hq_l}"
    if not reason and name in ("ulysses", "usp") and p.hq_l % nu:
        reason = f"q_heads per device {p.hq_l} not divisible by ulysses degree {nu}"
    if reason:
        nothing, nan = dict.fromkeys(COLLECTIVES, 0), float("nan")
        return StrategyCost(name, False, False, reason, degree, 0, 0, nothing, nothing, *[nan] * 4)
    r = nu // math.gcd(p.hk_l, nu)  # K/V head repeats before the all-to-all
    hops = nr if order is None else cut_ring_hops(order, nu, nr, p.reach_window)
    fwd, train = _comm(name, p, nu, nr, r, hops)
    mem_f, mem_t = _memory(name, p, nu, nr, r)
    exchange, note = None, not_runnable
    if name in _halo.HALO_REPLACES and order is not None:
        options = BlockOptions(p.causal, p.window, 1.0, None, p.chunk)
        exchange = _halo.halo_plan(order, p.n, options)
    if exchange is not None:  # what runs: a neighbour exchange, not this strategy's shards
        fwd, train = _halo_comm(p, exchange.tokens_received())
        mem_f, mem_t = _memory("ring", p, 1, p.n, 1)  # a shard and its halo, as a ring hop
        note = f"local layer: a neighbour exchange of {exchange.halo_len}-token halos"
    work = _work(name, order, p, nu, nr)  # non-empty score elements x heads, per device
    flops_f = 2 * (p.d + p.dv)  # per score element: q.k and p.v
    flops_t = flops_f + 6 * p.d + 4 * p.dv  # backward: recompute s, dp, dv, dq, dk
    compute = float(work.max()) * (flops_t if backward else flops_f) / flops_per_s
    comm = sum((train if backward else fwd).values()) / bytes_per_s
    ring_bytes = (train if backward else fwd)["collective-permute"]
    hidden = min(ring_bytes / bytes_per_s, compute)  # next hop's transfer overlaps this hop
    exposed = comm - hidden
    balance = float(work.max() / work.mean()) if work.mean() > 0 else 1.0
    fields = (not not_runnable, note, degree, int(mem_f), int(mem_t), fwd, train)
    return StrategyCost(name, True, *fields, balance, compute, exposed, compute + exposed)


def _halo_comm(p: Problem, tokens: int) -> tuple[dict, dict]:
    """Bytes of a neighbour exchange (`_halo.py`) receiving `tokens` tokens' K/V and ids per
    device: (forward, forward + backward); the backward sends their gradients back in the
    same packed lanes."""
    halo = p.b * tokens * (p.hk_l * (p.d + p.dv) * p.e + _INT * p.ids)
    fwd = dict.fromkeys(COLLECTIVES, 0)
    fwd["collective-permute"] = int(halo)
    train = dict(fwd, **{"collective-permute": int(2 * halo)})
    return fwd, train


def _comm(name, p: Problem, nu: int, nr: int, r: int, hops: int) -> tuple[dict, dict]:
    """Bytes received per device per layer, by collective: (forward, forward + backward)."""
    b, s, e = p.b, p.seq, p.e
    fwd: dict[str, float] = dict.fromkeys(COLLECTIVES, 0.0)
    bwd: dict[str, float] = dict.fromkeys(COLLECTIVES, 0.0)
    if name == "all_gather":
        frac = (p.n - 1) / p.n
        kv = b * s * p.hk_l * (p.d + p.dv) * e * frac
        fwd["all-gather"] = kv + b * s * _INT * p.ids * frac
        bwd["reduce-scatter"] = kv  # dK, dV scattered back
    if name in ("ulysses", "usp"):
        frac, sl = (nu - 1) / nu, s // nr  # the all-to-all runs within one ring position
        qkv = b * (sl // nu) * (p.hq_l * p.d + p.hk_l * r * (p.d + p.dv)) * e * frac
        out = b * (sl // nu) * p.hq_l * p.dv * e * frac
        fwd["all-to-all"] = qkv + out
        fwd["all-gather"] = b * sl * _INT * p.ids * frac
        bwd["all-to-all"] = qkv + out  # dout in, dq, dk, dv back
    if name in ("ring", "usp"):
        hk = p.hk_l * r // nu  # kv heads per device inside the ring
        shard = b * (s // nr) * hk * (p.d + p.dv)
        hop = shard * e + b * (s // nr) * _INT * p.ids
        fwd["collective-permute"] = (hops - 1) * hop  # hops < nr: a window cut the ring
        # With two hops both one-hop loops are unrolled and XLA merges the backward's K/V
        # hop with the forward's identical one.
        kv_hops = 0 if hops == 2 else hops - 1
        bwd["collective-permute"] = kv_hops * hop + (hops - 1) * shard * _F32
    train = {k: int(fwd[k] + bwd[k]) for k in COLLECTIVES}
    return {k: int(v) for k, v in fwd.items()}, train


def _flash(
    b,
    sq,
    sk,
    hq,
    hk,
    d,
    dv,
    e,
    backward: bool,
    gathered: bool = False,
    block: int = DEFAULT_BLOCK_Q,
    tile_bytes: int = TILE_BYTES,
) -> int:
    """Peak temporaries of one blockwise attention call (`_local.flash_attention`).

    The peak is the larger of two phases: the block loop (one block of scores, the tiled
    inputs, accumulators) and the copies around it. `gathered`: K/V arrive from a collective
    and are temporaries; the backward re-tiles them (received and tiled copies live
    together), the forward reads them in place.
    """
    bq, bk = min(block, sq), min(block, sk)
    padded = sk % bk != 0
    sq, sk = -(-sq // bq) * bq, -(-sk // bk) * bk  # padded to whole blocks
    q_tiles, kv_tiles = b * sq * hq * d * e, b * sk * hk * (d + dv) * e
    hk_tile, g_tile = head_tile(b, hk, hq // hk, bq, bk, tile_bytes)
    score = b * hk_tile * g_tile * bq * bk  # elements of one block of scores (one head tile)
    if not backward:  # f32 scores + probabilities, stacked outputs + lse, running accumulators
        # K/V are read in their own layout, block by block: in the loop only received ones
        # (or a padded copy) are temporaries, and the two live together while it is made
        kv = kv_tiles if gathered or padded else 0
        out = b * sq * hq * (dv * e + _F32) + b * hq * bq * (dv + 2) * _F32
        copies = q_tiles + kv + (kv_tiles if gathered and padded else 0)
        return max(2 * score * _F32 + q_tiles + kv + out, copies)
    # loop: float32 p, dp and ds (and p, ds cast for their matmuls when the input is
    # narrower); dout tiles, lse, delta, and the float32 accumulators of dq and dk/dv
    dq, dkv = b * sq * hq * d * _F32, b * sk * hk * (d + dv) * _F32
    retile = (2 if gathered else 1) * kv_tiles + q_tiles
    casts = 2 * e if e < _F32 else 0
    loop = score * (3 * _F32 + casts) + q_tiles + kv_tiles + b * sq * hq * (dv * e + 2 * _F32)
    # after the loop the block-major dq, dk, dv are transposed back (two float32 copies)
    untile = kv_tiles + q_tiles + 2 * (dq + dkv)
    return max(loop + dq + dkv, untile, retile)


def _memory(name, p: Problem, nu: int, nr: int, r: int) -> tuple[int, int]:
    """Per-device bytes (arguments + outputs + peak temporaries): forward, forward+backward."""
    b, s, e, d, dv = p.b, p.seq, p.e, p.d, p.dv
    flash = functools.partial(_flash, block=p.block, tile_bytes=p.tile_bytes)
    ln = s // p.n  # local tokens
    args = b * ln * (p.hq_l * d + p.hk_l * (d + dv)) * e + b * ln * _INT * int(p.seg)
    out_f = b * ln * p.hq_l * dv * e
    ids = b * _INT * p.ids
    if p.n == 1:  # on one device every strategy compiles to the same local attention
        name = "all_gather"
    if name in ("all_gather", "ulysses"):  # one attention over the whole sequence
        sq, hq, hk = (
            (ln, p.hq_l, p.hk_l) if name == "all_gather" else (s, p.hq_l // nu, p.hk_l * r // nu)
        )

        def call(backward):
            if not p.halves:
                return flash(b, sq, s, hq, hk, d, dv, e, backward, gathered=True)
            # the late half's call over every key, the early half's over a copy of the
            # early keys (`_halves.py`), one after the other
            early = b * (s // 2) * hk * (d + dv) * e
            one = functools.partial(flash, b, sq // 2, hq=hq, hk=hk, d=d, dv=dv, e=e,
                                    backward=backward, gathered=True)  # fmt: skip
            return max(one(sk=s), one(sk=s // 2) + early)

        tf = call(False) + ids * s
        out = b * sq * hq * dv * e  # the output, a residual of the backward
        tt = call(True) + ids * s + out
    else:  # ring, or usp: the ring over heads / nu and tokens s / nr
        hq, hk, lr = p.hq_l // nu, p.hk_l * r // nu, s // nr
        # K/V + ids of the hop computed and the hop arriving (none on a ring of one device)
        shard = (b * lr * hk * (d + dv) * e + ids * lr) * (nr > 1)
        acc = b * lr * hq * (dv + 1) * _F32  # merged output + logsumexp
        tf = flash(b, lr, lr, hq, hk, d, dv, e, False) + 2 * shard + acc
        # backward: dq, the own shard's dK/dV and the travelling dK/dV (+ the shifted copy)
        # in float32, residuals
        grads = b * lr * hq * d * _F32 + (3 if nr > 1 else 1) * b * lr * hk * (d + dv) * _F32
        resid = b * lr * hq * (dv * e + 2 * _F32)
        tt = flash(b, lr, lr, hq, hk, d, dv, e, True) + 2 * shard + grads + resid
        if name == "usp":  # q after the all-to-all lives through the ring (k, v are its
            # first shard); the backward also keeps k, v as residuals
            moved = b * lr * hq * d * e + ids * lr
            tf, tt = tf + moved, tt + moved + b * lr * hk * (d + dv) * e
    grads = b * ln * (p.hq_l * d + p.hk_l * (d + dv)) * e  # dq, dk, dv: the outputs
    return args + out_f + tf, args + grads + tt


def _work(name, order, p: Problem, nu: int, nr: int) -> np.ndarray:
    """Non-empty score elements (x local heads x local batch) per sequence shard.

    Counted at the block granularity the blockwise kernel skips at, from the token layout:
    a block is empty when its largest query position precedes its smallest key position.
    """
    n, s = p.n, p.seq
    shards = order.reshape(n, s // n)
    scale = p.b * p.hq_l

    def count(qpos, kpos):
        bq, bk = min(p.block, qpos.size), min(p.block, kpos.size)
        qmax = _blocks(qpos, bq).max(1)
        kmin = _blocks(kpos, bk).min(1)
        if not p.causal:
            return qmax.size * kmin.size * bq * bk
        seen = qmax[:, None] >= kmin[None, :]
        qmin, kmax = _blocks(qpos, bq).min(1), _blocks(kpos, bk).max(1)
        if p.window is not None:
            seen &= qmin[:, None] - kmax[None, :] < p.window
        if p.chunk is not None:  # some query and some key of the pair share a chunk
            c = p.chunk
            seen &= (qmax[:, None] // c >= kmin[None, :] // c) & (
                qmin[:, None] // c <= kmax[None, :] // c
            )
        return int(seen.sum()) * bq * bk

    def attend(qpos, kpos, q_shards, kv_shards):  # one call, or its causal halves
        if not p.halves:
            return count(qpos, kpos)
        early_q, late_q = (half(qpos[None], q_shards, i)[0] for i in (0, 1))
        return count(early_q, half(kpos[None], kv_shards, 0)[0]) + count(late_q, kpos)

    if name == "ulysses":  # every device: all tokens, heads / n
        return np.full(n, attend(order, order, n, n) * scale / n, dtype=np.float64)
    if name == "all_gather":
        work = [attend(shards[c], order, 1, n) * scale for c in range(n)]
        return np.array(work, dtype=np.float64)
    # ring / usp: device (u, c) holds shards u'*nr + c for all u' (after the all-to-all)
    held = [shards[[u * nr + c for u in range(nu)]].reshape(-1) for c in range(nr)]
    per_c = [sum(count(held[c], held[j]) for j in range(nr)) * scale / nu for c in range(nr)]
    return np.array([per_c[c] for _ in range(nu) for c in range(nr)], dtype=np.float64)


def _blocks(pos: np.ndarray, block: int) -> np.ndarray:
    pad = -pos.size % block  # padded slots get position 0, as in `_tiles._Blocks`
    return np.concatenate([pos, np.zeros(pad, pos.dtype)]).reshape(-1, block)
