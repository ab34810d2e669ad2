"""The gated delta rule split over the sequence, on the layout the model already uses.

Each device holds `P` pieces of the sequence, each a run of consecutive tokens in natural
order: one (`load_balance="none"`), or two for zig-zag (device `d` holds chunks `d` and
`2N - 1 - d` of `2N`). A piece maps the state it receives to the state it hands on,
`S_out = A S_in + B`; the devices compose those maps in natural order (`_compose.py`: one
all-gather, or a log-depth `ppermute` scan) and finish each piece from its true incoming
state.

**One pass gives the summary and the outputs.** The rule acts on each value channel
(column of `S`) on its own: `S <- (I - beta k k^T) diag(a) S + beta k v^T` mixes the rows
of a column, never the columns, and `o_t = S_t^T q_t` reads each column separately. So
running `chunk_gated_delta` with the augmented values `[0 | v]` (width `dk + dv`) from the
augmented state `[I | 0]` runs two recurrences side by side: the first `dk` columns follow
the rule with zero values from `I`, i.e. they are `A_{1..t} I = A_{1..t}`, the linear part
of the map from the piece's start to token `t`; the last `dv` columns follow it with the
true values from zero, i.e. `B_{1..t}`. By linearity in `(S_in, v)` jointly
(`chunk_gated_delta` normalises nothing), `S_t = A_{1..t} S_in + B_{1..t}` for any `S_in`.
The final augmented state is the piece's summary `[A | B]`, and the augmented output holds
`P_t = A_{1..t}^T (scale q_t)` and `o0_t = B_{1..t}^T (scale q_t)`, so the true output is
`o_t = S_t^T (scale q_t) = S_in^T P_t + o0_t`: one einsum, no second pass over the piece.
The augmented pass widens the values from `dv` to `dk + dv`: about 1.7x the plain pass's
FLOPs at `dk = dv = 128` (the `chunk x chunk` products do not widen), against 2x for
summarise-then-rerun.

**Documents.** A document start at token `t` zeroes the augmented state too, so `A` and
`P` vanish from `t` on (nothing before `t` reaches the rest of the piece) and `B` restarts:
no other rule is needed, provided the `starts` flags are those of natural order. Inside a
piece they are local differences of segment ids; a piece's first token compares its id
with the last id of the piece before it in natural order, on another device: each device
all-gathers its pieces' last ids, `(N - 1) P b 4` bytes (int32, flat in the sequence),
instead of gathering the whole `[batch, seq]` ids in natural order (which grows with it).
Natural token 0 never starts a document: the initial state enters the first piece only.

**Striped.** Token `t` sits on device `t mod N`, so a piece would be one token and every
token would need its own summary. Instead one `all_to_all` regroups the layer's inputs into
contiguous pieces (device `e` receives the natural tokens `[e L, (e + 1) L)`, with
`L = ceil(seq / N^2) N`: the sequence is padded at its end to `N L` with tokens that change
nothing), the contiguous algorithm runs, and one `all_to_all` sends the outputs back: per
device, forward,
`(N-1)/N L b h (2 dk + dv + c + 1) 4` bytes in (q, k, v, the gate with `c` = 1 or `dk`
channels, beta) plus `(N-1)/N L b 4` of segment ids, and `(N-1)/N L b h dv 4` out; the
backward sends the same float bytes again. Unlike the other layouts this grows with the
sequence (as Ulysses' all-to-alls do); it is the price of a layout that interleaves every
token.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from .._layout import check_sequence_length
from .._sharding import ShardingSpec
from ._chunked import chunk_gated_delta
from ._compose import all_gather_states, choose_composition, natural_order, scan_states

_HIGHEST = lax.Precision.HIGHEST


def check_spec_inputs(where: str, spec: ShardingSpec, q, v) -> None:
    """Check that rows, the sequence and the heads split over the spec's mesh.

    **Raises:** `ValueError` naming the rule: the batch over the batch axes, the sequence
    under the layout, the heads over the tensor axis.
    """
    b, s, h, _ = q.shape
    try:
        spec.check_batch(b)
        check_sequence_length(spec, s)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    nt = spec.axis_size(spec.tensor_axis)
    if h % nt:
        raise ValueError(
            f"{where}: heads split over tensor_axis={spec.tensor_axis!r} of size {nt}, so "
            f"the number of heads must be divisible by {nt}; got heads={h}. Use a tensor "
            "axis whose size divides the heads, or tensor_axis=None."
        )


def context_parallel_gated_delta(
    q, k, v, g, beta, segment_ids, initial_state, *, spec: ShardingSpec, scale: float,
    chunk: int, return_state: bool, composition: str = "auto", run="xla",
):  # fmt: skip
    """The rule over inputs in the spec's layout (validated by the caller, any float dtype).

    `composition`: `"all_gather"`, `"scan"` or `"auto"` (`_compose.choose_composition`
    from the summary's per-device size). `run`: who does each device's chunk work,
    `"xla"` (`chunk_gated_delta`) or a resolved `PallasGatedDeltaImpl` (the augmented
    pass's values are `dk + dv` wide, so the caller resolves it for that width).

    **Returns:** `(out, final_state)`: `out` `[batch, seq, heads, dv]` float32 in the
    layout, `final_state` `[batch, heads, dk, dv]` float32 after natural token `seq - 1`,
    replicated over the sequence axes (`None` unless `return_state`).
    """
    b, _, h, dk = q.shape
    dv = v.shape[-1]
    n = spec.context_parallel_size
    if composition == "auto":
        rows = b // spec.batch_parallel_size
        heads = h // spec.axis_size(spec.tensor_axis)
        pieces = 2 if _layout(spec) == "zigzag" else 1
        map_bytes, state_bytes = 4 * rows * heads * dk * (dk + dv), 4 * rows * heads * dk * dv
        composition = choose_composition(n, pieces, map_bytes, state_bytes, return_state)
    return _sharded(
        q, k, v, g, beta, segment_ids, initial_state,
        spec=spec, scale=scale, chunk=chunk, return_state=return_state, composition=composition,
        run=run,
    )  # fmt: skip


def _layout(spec: ShardingSpec) -> str:
    return spec.load_balance if spec.context_parallel_size > 1 else "none"


def _pieces(layout: str, n: int) -> np.ndarray:
    """`[N, P]`: the natural index of each device's pieces (striped: after regrouping)."""
    d = np.arange(n)
    if layout == "zigzag":
        return np.stack([d, 2 * n - 1 - d], axis=1)
    return d[:, None]


@functools.partial(
    jax.jit, static_argnames=("spec", "scale", "chunk", "return_state", "composition", "run")
)
def _sharded(
    q, k, v, g, beta, segment_ids, initial_state, *, spec, scale, chunk, return_state,
    composition, run,
):  # fmt: skip
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    batch, seq, tensor = spec.batch_entry(), spec.sequence_axes, spec.tensor_axis
    heads = spec.heads_pspec()
    per_head = PartitionSpec(batch, seq, tensor)
    state = PartitionSpec(batch, tensor, None, None)
    axis = seq[0] if len(seq) == 1 else seq
    layout, n = _layout(spec), spec.context_parallel_size
    local = functools.partial(
        _local, axis=axis, n=n, layout=layout, scale=scale, chunk=chunk,
        composition=composition, final=return_state, kda=g.ndim == 4, run=run,
    )  # fmt: skip
    args = [q, k, v, g, beta]
    in_specs = [heads, heads, heads, heads if g.ndim == 4 else per_head, per_head]
    if segment_ids is not None:
        args.append(segment_ids.astype(jnp.int32))
        in_specs.append(spec.token_pspec())
    if initial_state is not None:
        args.append(initial_state.astype(jnp.float32))
        in_specs.append(state)
    args = [spec.place(x, ps) for x, ps in zip(args, in_specs, strict=True)]
    has_ids, has_state = segment_ids is not None, initial_state is not None

    def body(q, k, v, g, beta, *rest):
        rest = list(rest)
        ids = rest.pop(0) if has_ids else None
        s0 = rest.pop(0) if has_state else None
        out, last = local(q, k, v, g, beta, ids, s0)
        return (out, last) if return_state else out

    out_specs = (heads, state) if return_state else heads
    mapped = jax.shard_map(
        body, mesh=spec.compute_mesh(), in_specs=tuple(in_specs), out_specs=out_specs,
        check_vma=False,
    )  # fmt: skip
    result = mapped(*args)
    return result if return_state else (result, None)


def _local(
    q, k, v, g, beta, ids, s0, *, axis, n, layout, scale, chunk, composition, final, kda, run
):  # fmt: skip
    """One device's part: its pieces' augmented pass, the composition, the finish."""
    b, length, h, dk = q.shape
    dv = v.shape[-1]
    d = lax.axis_index(axis)
    if not kda:
        g = g[..., None]
    valid = None
    if layout == "striped":
        q, k, v, g, beta, ids, valid = _gather_stripes(q, k, v, g, beta, ids, axis, n, d)
        layout = "none"
    pieces = _pieces(layout, n)
    p = pieces.shape[1]
    q, k, v, g, beta = (_split(x, p) for x in (q, k, v, g, beta))  # [P, b, c, h, ...]
    if ids is None:
        starts = jnp.zeros(q.shape[:3], bool)
    else:
        starts = _starts(_split(ids, p), axis, pieces, d)
    if valid is not None:
        starts = starts & valid[None, None, :]  # padding never starts a document
    if s0 is None:
        s0 = jnp.zeros((b, h, dk, dv), jnp.float32)

    if not kda:
        g = g[..., 0]
    aug_out, summaries = _augmented_pass(
        q, k, v, g, beta, starts, scale=scale, chunk=chunk, run=run
    )  # fmt: skip
    compose = all_gather_states if composition == "all_gather" else scan_states
    incoming, last = compose(summaries, s0, axis=axis, pieces=pieces, final=final)
    # o_t = S_in^T P_t + o0_t (module docstring): P_t in the first dk output channels.
    out = (
        jnp.einsum("pbthc,pbhcv->pbthv", aug_out[..., :dk], incoming, precision=_HIGHEST)
        + aug_out[..., dk:]
    )
    out = _merge(out)
    if valid is not None:
        out = _scatter_stripes(out, axis, n, length)
    return out, last


def _split(x, p: int):
    """`[b, L, ...]` -> `[p, b, L / p, ...]`: a device's consecutive pieces."""
    b, length = x.shape[:2]
    return jnp.swapaxes(x.reshape(b, p, length // p, *x.shape[2:]), 0, 1)


def _merge(x):
    """Inverse of `_split`."""
    p, b, c = x.shape[:3]
    return jnp.swapaxes(x, 0, 1).reshape(b, p * c, *x.shape[3:])


def _starts(ids, axis, pieces: np.ndarray, d):
    """`[P, b, c]` natural-order document starts of the pieces from their segment ids."""
    n, p = pieces.shape
    inside = ids[..., 1:] != ids[..., :-1]
    last = lax.all_gather(ids[..., -1], axis)  # [N, P, b]: every piece's last id
    last = last.reshape(n * p, -1)[natural_order(pieces)]  # [M, b] in natural order
    mine = jnp.asarray(pieces)[d]  # [P]
    before = last[jnp.maximum(mine - 1, 0)]
    first = (ids[..., 0] != before) & (mine > 0)[:, None]
    return jnp.concatenate([first[..., None], inside], axis=-1)


def _augmented_pass(q, k, v, g, beta, starts, *, scale, chunk, run: Any = "xla"):
    """`chunk_gated_delta` (or the kernel `run`) from `[I | 0]` with values `[0 | v]`,
    every piece at once (the pieces stacked on the batch axis).

    **Returns:** `(aug_out [P, b, c, h, dk + dv], summaries [P, b, h, dk, dk + dv])`.
    """
    p, b, c, h, dk = q.shape
    dv = v.shape[-1]
    v_aug = jnp.concatenate([jnp.zeros((p, b, c, h, dk), v.dtype), v], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(dk, dk + dv, dtype=jnp.float32), (p * b, h, dk, dk + dv))
    q, k, v_aug, g, beta, starts = (
        x.reshape(p * b, *x.shape[2:]) for x in (q, k, v_aug, g, beta, starts)
    )
    chunks = chunk_gated_delta if run == "xla" else run
    out, summaries = chunks(q, k, v_aug, g, beta, starts, eye, scale=scale, chunk=chunk)
    return out.reshape(p, b, c, h, dk + dv), summaries.reshape(p, b, h, dk, dk + dv)


def _gather_stripes(q, k, v, g, beta, ids, axis, n: int, d):
    """Striped shards -> device `d`'s contiguous piece (module docstring), by one
    `all_to_all` of the float inputs and one of the ids.

    **Returns:** the inputs `[b, mp N, ...]` in natural order, and `valid` `[mp N]`: which
    slots are tokens (the rest pad the sequence to `mp N^2`, after its last token).
    """
    b, length = q.shape[:2]
    mp = -(-length // n)
    widths = [x.shape[-1] for x in (q, k, v, g)]
    floats = jnp.concatenate([q, k, v, g, beta[..., None]], axis=-1)
    floats = _regroup(floats, axis, n, mp)
    q, k, v, g, beta = jnp.split(floats, np.cumsum(widths), axis=-1)
    if ids is not None:
        ids = _regroup(ids, axis, n, mp)
    valid = d * mp * n + jnp.arange(mp * n) < length * n
    return q, k, v, g, beta[..., 0], ids, valid


def _regroup(x, axis, n: int, mp: int):
    """`[b, L, ...]` striped (local slot `m` holds token `m N + d`) -> `[b, mp N, ...]`:
    tokens `[e mp N, (e + 1) mp N)` on device `e`, in natural order."""
    b, length = x.shape[:2]
    rest = x.shape[2:]
    x = jnp.pad(x, [(0, 0), (0, mp * n - length)] + [(0, 0)] * len(rest))
    # Block e of the local slots (m in [e mp, (e + 1) mp)) goes to device e, which stacks
    # the blocks by source device s: slot (s, m') holds token (e mp + m') N + s.
    x = lax.all_to_all(x, axis, 1, 1, tiled=True)
    return jnp.swapaxes(x.reshape(b, n, mp, *rest), 1, 2).reshape(b, mp * n, *rest)


def _scatter_stripes(x, axis, n: int, length: int):
    """Inverse of `_regroup`: `[b, mp N, ...]` contiguous -> `[b, L, ...]` striped."""
    b, size = x.shape[:2]
    rest = x.shape[2:]
    mp = size // n
    x = jnp.swapaxes(x.reshape(b, mp, n, *rest), 1, 2).reshape(b, n * mp, *rest)
    x = lax.all_to_all(x, axis, 1, 1, tiled=True)  # from device e: local slots e mp + m'
    return x[:, :length]
