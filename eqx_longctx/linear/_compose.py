"""Composing the pieces' affine summaries across the sequence shards, and what each costs.

A piece of the sequence maps the state it receives to the state it hands on,
`S_out = A S_in + B` (`A` `[dk, dk]`, `B` `[dk, dv]` per row and head). A summary travels
as one array `M = [A | B]` `[..., dk, dk + dv]`, the augmented final state of the piece
(`_context_parallel.py`). Maps compose as `(A2, B2) o (A1, B1) = (A2 A1, A2 B1 + B2)`, i.e.
`M2 o M1 = A2 M1 + [0 | B2]`: associative, so the incoming state of every piece is a
prefix composition, which a device can fold from everyone's summaries (one all-gather) or
which the devices can compute together in `ceil(log2 N)` rounds of `ppermute`
(Hillis and Steele's scan, "Data parallel algorithms", CACM 1986).

Both run inside `shard_map` over the sequence axes (`axis`, a name or a tuple: the `N`
shards of the layout, indexed major to minor as `lax.axis_index` and `all_gather` index
them). `pieces[d, j]` is the natural index (position in sequence order) of slot `j` of
device `d`: `[[d] for d]` for the contiguous layout, `[[d, 2N - 1 - d] for d]` for zig-zag.

**Cost per device** (bytes received, as `eqx_longctx.collective_bytes` counts them;
`m = b h dk (dk + dv) 4` for one piece's float32 summary and `st = b h dk dv 4` for a state,
`b` and `h` the device's rows and heads, `P` pieces per device, `R = ceil(log2 N)`):

| composition | layout | forward bytes | rounds (collectives that wait on each other) |
|---|---|---|---|
| all-gather | contiguous | `(N-1) m` | 1 |
| all-gather | zig-zag | `2 (N-1) m` | 1 |
| scan | contiguous | `R m + st` (`+ 2 (N-1)/N st` for the final state) | `R + 1` |
| scan | zig-zag | `2 R m + 2 st + 2 (N-1)/N st` (`+ 2 (N-1)/N st`) | `R + 2` |

None of it depends on the sequence length. The backward moves the same bytes again (an
all-gather's transpose is a reduce-scatter of the same size, a `ppermute`'s the reverse
`ppermute`, an all-reduce's an all-reduce). `choose_composition` picks the cheaper under
`rounds * LATENCY_S + bytes / BYTES_PER_S`: the all-gather for few devices or small
summaries (one collective, however many devices), the scan once `(N-1) P m` outweighs the
extra rounds (about `N >= 8` at `h = 32`, `dk = dv = 128`).

Einsum letters: `b` batch, `h` heads, `c` and `e` key channels (rows of the state and of
`A`), `v` value channels (`dv`, or `dk + dv` for a summary).
"""

import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

from .._collectives import ppermute

_HIGHEST = lax.Precision.HIGHEST

# One collective's fixed cost and the bandwidth of a device's links: orders of magnitude
# for TPU ICI (attention's cost model assumes the same 50 GB/s), used only to choose.
LATENCY_S = 10e-6
BYTES_PER_S = 50e9
COMPOSITIONS = ("all_gather", "scan")


def compose(later: Float[Array, "*b c v"], earlier: Float[Array, "*b c v"]):
    """`later o earlier` of two summaries `[A | B]`: `[A2 A1 | A2 B1 + B2]`."""
    dk = later.shape[-2]
    out = jnp.einsum("...ce,...ev->...cv", later[..., :dk], earlier, precision=_HIGHEST)
    return out.at[..., dk:].add(later[..., dk:])


def apply(summary: Float[Array, "*b c v"], state: Float[Array, "*b c w"]):
    """The state a piece hands on, `A S + B`, from the state `S` it receives."""
    dk = summary.shape[-2]
    out = jnp.einsum("...ce,...ev->...cv", summary[..., :dk], state, precision=_HIGHEST)
    return out + summary[..., dk:]


def composition_costs(
    n: int, pieces: int, map_bytes: int, state_bytes: int, final: bool
) -> dict[str, tuple[int, float]]:
    """`{composition: (rounds, bytes received per device)}` of the forward,
    for `n` shards holding `pieces` pieces each (1 or 2); `final`: the final state is
    wanted on every device. The table of the module docstring."""
    if n == 1:
        return {"all_gather": (0, 0.0), "scan": (0, 0.0)}
    r = math.ceil(math.log2(n))
    reduce = 2 * (n - 1) / n * state_bytes  # an all-reduce of one state
    gather = (1, float((n - 1) * pieces * map_bytes))
    # The final state's all-reduce runs beside the last shift, so it adds bytes, no round.
    if pieces == 1:
        scan = (r + 1, r * map_bytes + state_bytes + final * reduce)
    else:
        scan = (r + 2, 2 * r * map_bytes + 2 * state_bytes + (1 + final) * reduce)
    return {"all_gather": gather, "scan": (scan[0], float(scan[1]))}


def choose_composition(n: int, pieces: int, map_bytes: int, state_bytes: int, final: bool) -> str:
    """The composition with the smaller `rounds * LATENCY_S + bytes / BYTES_PER_S`
    (the all-gather on a tie)."""
    costs = composition_costs(n, pieces, map_bytes, state_bytes, final)
    time = {name: r * LATENCY_S + b / BYTES_PER_S for name, (r, b) in costs.items()}
    return "scan" if time["scan"] < time["all_gather"] else "all_gather"


def natural_order(pieces: np.ndarray) -> np.ndarray:
    """`[N P]`: the flat slot (`d P + j`) that holds each natural piece, in sequence order."""
    return np.argsort(pieces.reshape(-1)).astype(np.int32)


def all_gather_states(summaries, initial_state, *, axis, pieces: np.ndarray, final: bool):
    """Incoming states by one all-gather of every piece's summary, folded in order.

    **Arguments:** `summaries` `[P, b, h, dk, dk + dv]` of this device's pieces;
    `initial_state` `[b, h, dk, dv]` (replicated over `axis`); `axis`, `pieces` as in the
    module docstring; `final`: also return the state after the last piece.

    **Returns:** `(incoming [P, b, h, dk, dv], final state or None)`.
    """
    n, p = pieces.shape
    everyone = lax.all_gather(summaries, axis)  # [N, P, ...], major-to-minor device order
    everyone = everyone.reshape(n * p, *summaries.shape[1:])[natural_order(pieces)]

    def step(state, summary):
        return apply(summary, state), state

    last, incoming = lax.scan(step, initial_state, everyone)
    mine = jnp.asarray(pieces)[lax.axis_index(axis)]  # [P] natural indices
    return incoming[mine], (last if final else None)


def scan_states(summaries, initial_state, *, axis, pieces: np.ndarray, final: bool):
    """Incoming states by a log-depth `ppermute` scan (Hillis-Steele) over the devices.

    The contiguous layout scans its pieces upwards (device `d` composes `d-1, d-2, d-4,
    ...`), so device `d` ends with the map of pieces `0..d` and the state after its piece;
    one shift hands that state to `d + 1`. Zig-zag's back pieces run in the opposite
    device order (natural order is `front 0..N-1`, then `back N-1..0`): they scan downwards
    in the same rounds, and start from the state after the last front piece (device
    `N-1`'s), which an all-reduce of the masked state gives every device. States that live
    on one device (the middle, the final) reach the others the same way.

    **Arguments and returns:** as `all_gather_states`.
    """
    n, p = pieces.shape
    d = lax.axis_index(axis)
    front = _prefix(summaries[0], axis, n, d, +1)
    out_front = apply(front, initial_state)  # the state after my front piece
    in_front = _shift(out_front, axis, n, d, +1, first=initial_state)
    if p == 1:
        last = _from_device(out_front, axis, d, n - 1) if final else None
        return in_front[None], last
    back = _prefix(summaries[1], axis, n, d, -1)
    middle = _from_device(out_front, axis, d, n - 1)
    out_back = apply(back, middle)
    in_back = _shift(out_back, axis, n, d, -1, first=middle)
    last = _from_device(out_back, axis, d, 0) if final else None
    return jnp.stack([in_front, in_back]), last


def _prefix(summary, axis, n: int, d, step: int):
    """Inclusive scan over devices in the direction `step` (+1: device `d` ends with the
    composition of devices `0..d`; -1: of `N-1..d`), `ceil(log2 N)` `ppermute`s."""
    shift = 1
    while shift < n:
        perm = [(i, i + step * shift) for i in range(n) if 0 <= i + step * shift < n]
        earlier = ppermute(summary, axis, perm)
        has = (d - step * shift >= 0) & (d - step * shift < n)
        summary = jnp.where(has, compose(summary, earlier), summary)
        shift *= 2
    return summary


def _shift(state, axis, n: int, d, step: int, *, first):
    """`state` of device `d - step` (one `ppermute`); the end device with none gets `first`."""
    perm = [(i, i + step) for i in range(n) if 0 <= i + step < n]
    moved = ppermute(state, axis, perm)
    return jnp.where(d == (0 if step > 0 else n - 1), first, moved)


def _from_device(state, axis, d, source: int):
    """Device `source`'s `state` on every device: an all-reduce of the state masked
    elsewhere (its transpose sums the cotangents back onto `source`)."""
    return lax.psum(jnp.where(d == source, state, 0.0), axis)
