"""The short causal depthwise convolution of linear-attention layers, on one device or split
over the sequence with halos.

Gated DeltaNet and Kimi Delta Attention mix each channel of q, k and v with its own last
`K` tokens (`K = 4` in the checkpoints) before the rule runs. Channel `c` of token `t`
reads `x[t - K + 1 + i, c] * w[c, i]` for `i = 0 .. K-1` (`w[:, K-1]` weighs the token
itself: the order of transformers' `conv1d` weights, `[channels, 1, K]` squeezed), with
zeros before the row's first token and before the first token of each packed document.

Every layout computes the same thing from one function, `_combine`: the `K` *taps* of each
local token (its own input and those of its `K - 1` predecessors in natural order), the
segment ids of those taps, and whether each predecessor exists. What differs is where the
taps come from (`_layout_taps`):

- **contiguous** (`"none"`): the piece before device `d`'s is device `d - 1`'s; its last
  `K - 1` tokens come over in one `ppermute` (device 0 receives zeros).
- **zig-zag**: device `i` holds chunks `i` and `2N-1-i`. The front chunk's halo is the tail
  of chunk `i - 1`, device `i - 1`'s front chunk (one `ppermute` up the axis); the back
  chunk's is the tail of chunk `2N-2-i`, device `i + 1`'s back chunk (one `ppermute` down),
  except on device `N - 1`, where chunk `N - 1` is its own front chunk.
- **striped**: token `t` sits on device `t mod N`, so its `K - 1` predecessors sit on the
  `K - 1` devices before it (cyclically, one local slot earlier past device 0). The whole
  shard is passed `min(K-1, N-1)` times one device along (a chain of neighbour hops: device
  `d` receives device `d - r`'s shard at hop `r`); each received shard, shifted by zero or
  one slot, is one tap.

Einsum-free; letters in comments: `b` batch, `s` sequence, `c` channels.
"""

import functools
from typing import no_type_check

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec
from jax.typing import ArrayLike

from .._checks import as_int32_ids, check_spec
from .._collectives import ppermute
from .._layout import check_sequence_length, layout_order
from .._sharding import ShardingSpec

ACTIVATIONS = (None, "silu")


@no_type_check  # validated eagerly, with errors that say what to fix
def short_conv(
    x: ArrayLike,
    weight: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    activation: str | None = None,
    segment_ids: ArrayLike | None = None,
    spec: ShardingSpec | None = None,
):
    """Short causal depthwise convolution over the sequence, documents kept apart, on one
    device or split over the sequence by a `ShardingSpec`.

    `out[b, t, c] = act(bias[c] + sum_i w[c, i] x[b, t - K + 1 + i, c])`, where a term
    whose token lies before the row's start, or in an earlier packed document than token
    `t` (a change of segment id between them), counts as zero: a token never sees an
    earlier document's inputs. This is transformers' `causal_conv1d_fn` (Qwen3-Next,
    Qwen3.5, Kimi Linear) with the documents' resets added; its weights `[channels, 1, K]`
    are `weight[:, None, :]`.

    Under a `spec`, `x` and `segment_ids` are global arrays in the spec's token layout
    (`eqx_longctx.to_layout`), as `eqx_longctx.attention` takes them, and the output is
    in that layout too. Each piece of the sequence needs the last `K - 1` inputs of the
    piece before it in natural order, a *halo* from the device that holds it. Per device,
    per call, with `b` local rows, `c` local channels (split over the spec's tensor axis
    when it divides them), `p` bytes per element and `L = seq / N` local tokens, the
    forward sends:

    - contiguous (`load_balance="none"`): one `ppermute` of `(K-1) b c p` bytes;
    - zig-zag: two, `2 (K-1) b c p` bytes (front chunks up the axis, back chunks down);
    - striped: `min(K-1, N-1)` neighbour `ppermute`s of the whole shard,
      `min(K-1, N-1) L b c p` bytes: a token's predecessors are on other devices, so there
      is no halo smaller than the shard. (Regrouping into contiguous pieces and back would
      move `2 (N-1)/N` of the shard through two all-to-alls, less for `K = 4` but with a
      divisibility rule on `seq`; the layer's other `[seq, embed]` work stays striped.)

    With `segment_ids`, the same hops carry their int32 ids (`4/(c p)` of the bytes
    above). The backward (autodiff through `ppermute`) sends the cotangents of the halos
    back, the same bytes again, and sums the gradients of `weight` and `bias` over the
    devices that share them (one all-reduce of `c (K + 1)` floats). The gradients are
    exact. (On (context 8), batch 2, 6 float32 channels, `K = 4`, 48 tokens, compiled:
    144, 288 and 864 bytes forward for contiguous, zig-zag and striped.)

    **Arguments:**

    - `x`: `[batch, seq, channels]` floats.
    - `weight`: `[channels, K]`, `K >= 1`; `weight[:, K-1]` weighs the token itself.
    - `bias`: `[channels]` or `None`.
    - `activation`: `None` or `"silu"` (applied after the bias).
    - `segment_ids`: `[batch, seq]` ints, packed documents (or `None`: one per row).
    - `spec`: a `ShardingSpec` whose layout `x` is in, or `None` (one device).

    **Returns:** `[batch, seq, channels]` in the promoted dtype of `x`, `weight` and
    `bias`; the sum is formed in float32.

    **Raises:** `TypeError` for non-float `x`, `weight` or `bias`, non-integer
    `segment_ids`, or a `spec` that is not a `ShardingSpec`; `ValueError` for shapes that
    disagree, an unknown `activation`, and under a spec a batch or sequence the mesh does
    not split, or a piece shorter than the halo: contiguous needs `seq / N >= K - 1` and
    zig-zag `seq / (2N) >= K - 1` (a halo is taken from one neighbouring piece, never
    chained across several); striped has no such rule.
    """
    check_spec(spec, "short_conv")
    x, weight, bias, segment_ids = _check_inputs(x, weight, bias, activation, segment_ids)
    if spec is None:
        return _one_device(x, weight, bias, segment_ids, activation)
    _check_spec_inputs(spec, x.shape, weight.shape[1])
    return _context_parallel(x, weight, bias, segment_ids, activation, spec)


def _check_inputs(x, weight, bias, activation, segment_ids):
    where = "short_conv"
    x, weight = (v if isinstance(v, jax.Array) else jnp.asarray(v) for v in (x, weight))
    if bias is not None and not isinstance(bias, jax.Array):
        bias = jnp.asarray(bias)
    for name, v in (("x", x), ("weight", weight), ("bias", bias)):
        if v is not None and not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(
                f"{where} needs floating-point {name}; got dtype {v.dtype}. Cast with "
                ".astype(jnp.float32)."
            )
    if x.ndim != 3 or 0 in x.shape:
        raise ValueError(
            f"{where} needs x laid out [batch, seq, channels] with no empty dimension; got "
            f"x{tuple(x.shape)}. Flatten heads into channels first (x.reshape(b, s, -1))."
        )
    c = x.shape[2]
    if weight.ndim != 2 or weight.shape[0] != c or weight.shape[1] < 1:
        raise ValueError(
            f"{where} needs weight [channels, K] = [{c}, K] with K >= 1 (one kernel per "
            f"channel of x{tuple(x.shape)}); got weight{tuple(weight.shape)}. A transformers "
            "Conv1d weight [channels, 1, K] is weight[:, 0, :]."
        )
    if bias is not None and tuple(bias.shape) != (c,):
        raise ValueError(f"{where} needs bias [channels] = [{c}]; got bias{tuple(bias.shape)}.")
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"{where}: activation must be one of {ACTIVATIONS}; got {activation!r}. "
            "Apply another activation to the output yourself."
        )
    if segment_ids is not None:
        if not isinstance(segment_ids, jax.Array):
            segment_ids = jnp.asarray(as_int32_ids(segment_ids, f"{where}: segment_ids"))
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise TypeError(
                f"{where}: segment_ids must be integers (one id per packed document); got "
                f"dtype {segment_ids.dtype}. Cast with .astype(jnp.int32)."
            )
        if tuple(segment_ids.shape) != tuple(x.shape[:2]):
            raise ValueError(
                f"{where}: segment_ids must be [batch, seq] = {tuple(x.shape[:2])}; got "
                f"{tuple(segment_ids.shape)}."
            )
        segment_ids = segment_ids.astype(jnp.int32)
    return x, weight, bias, segment_ids


def _check_spec_inputs(spec: ShardingSpec, shape, kernel: int) -> None:
    b, s, _ = shape
    spec.check_batch(b)
    check_sequence_length(spec, s)
    n = spec.context_parallel_size
    if spec.load_balance == "striped" or n == 1:
        return
    pieces = 2 * n if spec.load_balance == "zigzag" else n
    if s // pieces < kernel - 1:
        raise ValueError(
            f"short_conv under load_balance={spec.load_balance!r} over N={n} takes each piece's "
            f"halo (the last K-1={kernel - 1} inputs before it) from one neighbouring piece, so "
            f"each of the {pieces} pieces needs >= {kernel - 1} tokens; got seq={s} "
            f"({s // pieces} per piece). Use seq >= {pieces * (kernel - 1)}, or "
            "load_balance='striped'."
        )


# The backward keeps the convolution's inputs and the halos received from other devices
# (named HALO), and recomputes the K shifted taps and their sum: K + 2 arrays the size of
# the input otherwise stay alive per convolution, for 2 K multiply-adds per channel.
HALO = "short_conv_halo"
_KEEP_HALOS = jax.checkpoint_policies.save_only_these_names(HALO)


@functools.partial(jax.jit, static_argnames=("activation",))
@functools.partial(jax.checkpoint, static_argnums=(4,), policy=_KEEP_HALOS)
def _one_device(x, weight, bias, segment_ids, activation):
    kernel = weight.shape[1]
    taps = [_shift(x, j) for j in range(kernel)]
    segs = None if segment_ids is None else [_shift(segment_ids, j) for j in range(kernel)]
    tokens = jnp.arange(x.shape[1])
    exists = [jnp.broadcast_to(tokens >= j, x.shape[:2]) for j in range(kernel)]
    return _combine(taps, segs, exists, weight, bias, activation)


def _combine(taps, segs, exists, weight, bias, activation):
    """The convolution from its taps: `taps[j]` `[b, s, c]` holds each token's `j`-th
    predecessor's input (`taps[0]` its own), `segs[j]` `[b, s]` that predecessor's segment
    id (or `segs` is `None`), `exists[j]` `[b, s]` whether it lies in the row."""
    kernel = weight.shape[1]
    dtype = jnp.result_type(taps[0].dtype, weight.dtype, *(() if bias is None else (bias,)))
    w = weight.astype(jnp.float32)
    out = taps[0].astype(jnp.float32) * w[:, kernel - 1]
    keep = None
    for j in range(1, kernel):
        # Predecessor j counts while no document starts between it and the token.
        ok = exists[j] if segs is None else exists[j] & (segs[j] == segs[j - 1])
        keep = ok if keep is None else keep & ok
        tap = jnp.where(keep[..., None], taps[j].astype(jnp.float32), 0.0)
        out = out + tap * w[:, kernel - 1 - j]
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    if activation == "silu":
        out = jax.nn.silu(out)
    return out.astype(dtype)


def _shift(x, j: int):
    """Along axis 1, slot `i` gets `x[:, i - j]`; the first `j` slots get zeros."""
    if j == 0:
        return x
    s = x.shape[1]
    if j >= s:
        return jnp.zeros_like(x)
    return jnp.concatenate([jnp.zeros_like(x[:, :j]), x[:, : s - j]], axis=1)


def _behind(piece, halo, j: int):
    """`piece` `[b, L, ...]` with its `halo` (the `K-1` inputs before it): each slot's
    `j`-th predecessor."""
    kernel_1 = halo.shape[1]
    ext = jnp.concatenate([halo, piece], axis=1)
    return ext[:, kernel_1 - j : kernel_1 - j + piece.shape[1]]


def _context_parallel(x, weight, bias, segment_ids, activation, spec):
    s, c = x.shape[1], x.shape[2]
    seq_axes = spec.sequence_axes
    nt = spec.axis_size(spec.tensor_axis)
    channels = spec.tensor_axis if nt > 1 and c % nt == 0 else None
    batch = spec.batch_entry()
    x_spec = PartitionSpec(batch, seq_axes, channels)
    tok_spec = PartitionSpec(batch, seq_axes)
    positions = jnp.asarray(layout_order(spec, s))
    args = [spec.place(x, x_spec), spec.place(weight, PartitionSpec(channels, None))]
    in_specs = [x_spec, PartitionSpec(channels, None)]
    args.append(spec.place(positions, PartitionSpec(seq_axes)))
    in_specs.append(PartitionSpec(seq_axes))
    if bias is not None:
        args.append(spec.place(bias, PartitionSpec(channels)))
        in_specs.append(PartitionSpec(channels))
    if segment_ids is not None:
        args.append(spec.place(segment_ids, tok_spec))
        in_specs.append(tok_spec)
    has_bias, has_segs = bias is not None, segment_ids is not None
    n = spec.context_parallel_size
    axis = seq_axes[0] if len(seq_axes) == 1 else seq_axes

    @functools.partial(jax.checkpoint, policy=_KEEP_HALOS)
    def local(x, weight, positions, *rest):
        rest = list(rest)
        bias = rest.pop(0) if has_bias else None
        seg = rest.pop(0) if has_segs else None
        kernel = weight.shape[1]
        taps = _layout_taps(x, kernel, spec.load_balance, n, axis)
        segs = None if seg is None else _layout_taps(seg, kernel, spec.load_balance, n, axis)
        exists = [jnp.broadcast_to(positions >= j, x.shape[:2]) for j in range(kernel)]
        return _combine(taps, segs, exists, weight, bias, activation)

    mesh = spec.compute_mesh()
    mapped = jax.shard_map(
        local, mesh=mesh, in_specs=tuple(in_specs), out_specs=x_spec, check_vma=False
    )
    with jax.named_scope("short_conv"):
        return mapped(*args)


def _layout_taps(x, kernel: int, load_balance: str, n: int, axis):
    """Inside `shard_map`: `taps[j]` `[b, L, ...]`, each local token's `j`-th predecessor in
    natural order (zeros where the row has none), for `j = 0 .. kernel-1`, on this device's
    shard `x` `[b, L, ...]` of a `load_balance` layout over `n` devices along `axis`."""
    if kernel == 1 or n == 1:
        return [_shift(x, j) for j in range(kernel)]
    halo = kernel - 1
    if load_balance == "striped":
        return _striped_taps(x, kernel, n, axis)
    up = [(d, d + 1) for d in range(n - 1)]
    if load_balance == "none":
        tail = x[:, x.shape[1] - halo :]
        received = checkpoint_name(ppermute(tail, axis, up), HALO)  # device 0: zeros
        return [_behind(x, received, j) for j in range(kernel)]
    size = x.shape[1] // 2
    front, back = x[:, :size], x[:, size:]
    front_tail, back_tail = front[:, size - halo :], back[:, size - halo :]
    front_halo = checkpoint_name(ppermute(front_tail, axis, up), HALO)
    down = [(d + 1, d) for d in range(n - 1)]
    from_next = checkpoint_name(ppermute(back_tail, axis, down), HALO)
    last = lax.axis_index(axis) == n - 1  # chunk N-1 precedes chunk N: both on device N-1
    back_halo = jnp.where(last, front_tail, from_next)
    return [
        jnp.concatenate([_behind(front, front_halo, j), _behind(back, back_halo, j)], axis=1)
        for j in range(kernel)
    ]


def _striped_taps(x, kernel: int, n: int, axis):
    """Striped: local slot `i` of device `d` holds token `t = d + N i`; its predecessor
    `t - j` sits on device `(d - r) mod N`, `r = j mod N`, at slot `i - j // N`, or one slot
    earlier when `d < r` (the stripe wrapped past device 0)."""
    cyclic = [(d, (d + 1) % n) for d in range(n)]
    shards = [x]  # shards[r]: device (d - r) mod N's shard
    for _ in range(min(kernel - 1, n - 1)):
        shards.append(checkpoint_name(ppermute(shards[-1], axis, cyclic), HALO))
    d = lax.axis_index(axis)
    taps = [x]
    for j in range(1, kernel):
        r, q = j % n, j // n
        if r == 0:
            taps.append(_shift(x, q))
        else:
            taps.append(jnp.where(d < r, _shift(shards[r], q + 1), _shift(shards[r], q)))
    return taps
