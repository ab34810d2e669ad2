"""Cost model of one linear-attention layer's rule and convolutions: FLOPs, bytes, time.

For one Gated DeltaNet or Kimi Delta Attention layer on a `ShardingSpec`,
`linear_attention_cost` predicts what the busiest device computes and receives in the
forward and in the forward + backward of the layer's sequence mixing (the three short
convolutions and `gated_delta_rule`), and a roofline time, as
`eqx_longctx.attention`'s cost model does for a softmax layer. The planner prices a
hybrid model's linear layers with it. Per device: `b` rows, `s` tokens (`s = seq / N`
over `N` sequence shards), `h` heads (split over the tensor axis), key width `dk`, value
width `dv`, `C` tokens per chunk, `c` decay channels (1 for a GDN gate per head, `dk` for
KDA's per channel).

**FLOPs** (the XLA chunked form, `_chunked.py`, counted per chunk, row and head; a
multiply-add is 2): the decayed `C x C` products `A = k k^T` and `P = q k^T`
(`2 C^2 dk` each for GDN; `3 C^2 dk` for KDA's three-operand product), the inverse of
`I + A` by doubling blocks (`ceil(log2 C)` rounds of two `C x C x C` products:
`4 C^3 log2 C`), the UT solve `W = inv [k | v]` (`2 C^2 (dk + w)`), the corrections and
the state products (`u = W_v - W_k S`, `(q e^G) S`, the new state: `6 C dk w`) and
`P u` (`2 C^2 w`), with `w = dv` on one device and `w = dk + dv` split over the sequence
(the augmented values `[0 | v]` of `_context_parallel.py`), which also finishes each
token by `S_in^T P_t` (`2 dk dv` a token). The backward is a forward again (the chunk
step is checkpointed) plus twice the forward (the gradient of every product): 4 forwards
in all. The convolutions (`2 K` a channel and token, 3 times that with the backward) are
counted too.

**Model FLOPs** (what MFU counts, no recomputation, as the softmax layers' causal pairs):
3 x the forward of the one-device chunked form with the causal pairs of each chunk only
(`C (C + 1) / 2` for `A`, `P` and `P u`), the UT system solved by forward substitution
(`C (C - 1) / 2 (dk + dv)` multiply-adds) and the state products; no inverse by doubling,
no augmented values, no convolutions.

**Bytes received per device** (`eqx_longctx.collective_bytes`' count):

- the summaries: `_compose.composition_costs` at the composition `choose_composition`
  picks (the op's own choice: same sizes, same rule), with the all-gather of each piece's
  last segment id (`(N - 1) P b 4`);
- striped: the `all_to_all` of the float32 inputs, ids and outputs, `(N - 1)/N L b (h (2 dk
  + dv + c + 1) + 1 + h dv) 4`, `L = ceil(s N / N^2) N` (the regrouped run);
- the convolution halos, per convolution of `ch` channels in the compute dtype (`p`
  bytes): `(K - 1) b (ch p + 4)` contiguous, twice that zig-zag, `min(K-1, N-1) s b (ch p
  + 4)` striped (ids travel with the inputs);
- the backward moves the same bytes again (transposes of the same collectives).

**Time** = `flops / flops_per_s + rounds x LATENCY_S + bytes / bytes_per_s`: the summaries
are a dependency of every token's output, so nothing hides them; the convolution halo and
the striped regrouping sit before the work as well.

**Memory** beyond what one device's trace saves (the planner asks JAX for the one-device
layer's residuals): split over the sequence the checkpointed chunk states are `dk + dv`
wide instead of `dv` (`(s / C + 1) b h dk dk 4` more) and the augmented outputs keep
`P_t` (`s b h dk 4`). The backward's working set: one chunk's recomputation for every
piece (zig-zag's two run as rows): `DECAY_COPIES` arrays of its decays' shape `[C, C, c]`
(the decays, the decayed products and their cotangents: 7 live together in XLA:CPU's buffer
assignment of a KDA step), a few `C x C` products, and the float32 gradients of the rule's
inputs. The forward's (a prefill's): `FORWARD_DECAY_COPIES` = 4 such arrays (the decays,
the decayed keys and queries, their product), the same `C x C` products, and the outputs,
`dk + dv` wide under a split. Under a remat policy the layer's backward also rebuilds
the convolutions' taps: `CONV_COPIES` = 10 float32 arrays per convolution input (JAX's list
of a Gated DeltaNet layer's residuals before `short_conv` checkpointed them).
"""

import math
from typing import Literal, NamedTuple, no_type_check

from .._sharding import ShardingSpec
from ._compose import LATENCY_S, choose_composition, composition_costs

_F32 = 4
GATES = ("head", "channel")
DECAY_COPIES = 7
FORWARD_DECAY_COPIES = 4
CONV_COPIES = 10


class LinearCost(NamedTuple):
    """Predicted cost of one linear-attention layer's sequence mixing on one device."""

    composition: str  # "all_gather" or "scan" ("" on one shard)
    flops_forward: float  # busiest device, forward
    flops_train: float  # forward + backward (the checkpointed chunks recomputed)
    model_flops_train: float  # MFU's count for this device's tokens (see the module)
    comm_forward: dict  # op -> bytes received per device, forward
    comm_train: dict  # op -> bytes, forward + backward
    rounds_train: int  # collectives that wait on each other, forward + backward
    saved_extra: int  # residual bytes beyond the one-device layer's (sequence split)
    temporaries: int  # the backward's working set of the rule, bytes
    temporaries_forward: int  # the forward's (a prefill's), bytes
    conv_rebuild: int  # the convolutions' taps a rematerialised layer's backward rebuilds
    compute_s: float  # flops_train / flops_per_s
    exposed_s: float  # communication, none of it hidden
    time_s: float  # compute_s + exposed_s

    @property
    def forward_fraction(self) -> float:
        """The forward's share of `flops_train` (what a remat policy runs again)."""
        return self.flops_forward / self.flops_train if self.flops_train else 0.0


def chunk_forward_flops(chunk: int, dk: int, w: int, gate: str, *, model: bool = False) -> float:
    """Forward FLOPs of one chunk of `chunk` tokens, per row and head, value width `w`
    (`dv`, or `dk + dv` augmented); `model=True`: MFU's count (causal pairs, forward
    substitution). See the module docstring."""
    c = chunk
    if model:
        pairs, solve = c * (c + 1) / 2, c * (c - 1) / 2 * 2 * (dk + w)
        return float(2 * 2 * pairs * dk + solve + 2 * pairs * w + 6 * c * dk * w)
    dots = (3 if gate == "channel" else 2) * c * c * dk
    inverse = 4 * c**3 * math.ceil(math.log2(c)) if c > 1 else 0
    return float(2 * dots + inverse + 2 * c * c * (dk + w) + 2 * c * c * w + 6 * c * dk * w)


@no_type_check  # validated eagerly, with errors that say what to fix
def linear_attention_cost(
    spec: ShardingSpec | None,
    *,
    batch: int,
    seq: int,
    heads: int,
    head_dim: int,
    v_head_dim: int,
    gate: Literal["head", "channel"],
    conv_channels: tuple[int, ...] = (),
    conv_size: int = 4,
    chunk: int = 64,
    dtype_bytes: int = 2,
    segment_ids: bool = True,
    flops_per_s: float = 100e12,
    bytes_per_s: float = 50e9,
) -> LinearCost:
    """Predict one linear-attention layer's rule and convolutions on `spec`.

    **Arguments:**

    - `spec`: the `ShardingSpec` (`None`: one device). Rows split over its batch axes,
      heads and channels over its tensor axis, the sequence over its sequence axes in its
      `load_balance` layout.
    - `batch`, `seq`: global rows and tokens.
    - `heads`, `head_dim`, `v_head_dim`: the heads the rule runs (value heads for GDN's
      grouped values), `dk` and `dv`.
    - `gate`: `"head"` (one log decay per head, Gated DeltaNet) or `"channel"` (one per key
      channel, Kimi Delta Attention).
    - `conv_channels`: the channels of each short convolution (all heads), e.g. q, k, v.
    - `conv_size`: the convolutions' width `K`; `chunk`: tokens per chunk `C`.
    - `dtype_bytes`: bytes per element of the convolutions' inputs (the compute dtype).
    - `segment_ids`: packed documents (their ids travel with the halos).
    - `flops_per_s`, `bytes_per_s`: a device's FLOP/s and one link's bytes/s.

    **Returns:** a `LinearCost` (see the module docstring for every formula).

    **Raises:** `ValueError` for a `gate` other than `"head"` or `"channel"`, or sizes that
    are not positive or do not split over the spec's axes.
    """
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}; got {gate!r}.")
    sizes = dict(batch=batch, seq=seq, heads=heads, head_dim=head_dim, v_head_dim=v_head_dim,
                 conv_size=conv_size, chunk=chunk)  # fmt: skip
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1; got {value!r}.")
    nb = nt = n = 1
    layout = "none"
    if spec is not None:
        nb, nt, n = (
            spec.batch_parallel_size,
            spec.axis_size(spec.tensor_axis),
            spec.context_parallel_size,
        )
        layout = spec.load_balance if n > 1 else "none"
    if batch % nb or seq % n or heads % nt or any(ch % nt for ch in conv_channels):
        raise ValueError(
            f"batch={batch}, seq={seq}, heads={heads} and conv_channels={conv_channels} must "
            f"split over {nb} batch shards, {n} sequence shards and {nt} tensor shards."
        )
    b, s, h, dk, dv = batch // nb, seq // n, heads // nt, head_dim, v_head_dim
    channels = [ch // nt for ch in conv_channels]
    striped = layout == "striped"
    run = -(-seq // (n * n)) * n if striped else s  # tokens a device runs the rule over
    w = dk + dv if n > 1 else dv
    chunks = -(-run // min(chunk, run))
    size = min(chunk, run)
    rule = b * h * chunks * chunk_forward_flops(size, dk, w, gate)
    finish = 2 * b * h * run * dk * dv if n > 1 else 0
    conv = sum(2 * conv_size * b * s * ch for ch in channels)
    forward = rule + finish + conv
    train = 4 * (rule + finish) + 3 * conv
    model = 3 * b * h * chunks * chunk_forward_flops(size, dk, dv, gate, model=True)

    fwd: dict[str, float] = {}  # op -> bytes of the forward
    bwd: dict[str, float] = {}  # op -> bytes of the backward: float bytes only (ids have
    # no cotangent), an all-gather's transpose a reduce-scatter
    rounds = 0
    composition = ""

    def add(op: str, nbytes: float | int, back: str | None = None) -> None:
        fwd[op] = fwd.get(op, 0) + nbytes
        if back:
            bwd[back] = bwd.get(back, 0) + nbytes

    if n > 1:
        pieces = 2 if layout == "zigzag" else 1
        m, st = _F32 * b * h * dk * (dk + dv), _F32 * b * h * dk * dv
        composition = choose_composition(n, pieces, m, st, False)
        r, nbytes = composition_costs(n, pieces, m, st, False)[composition]
        rounds += r
        if composition == "all_gather":
            add("all-gather", nbytes, "reduce-scatter")
        else:  # zig-zag's back pieces start from the middle state, an all-reduce
            reduce = 2 * (n - 1) / n * st if pieces == 2 else 0.0
            add("collective-permute", nbytes - reduce, "collective-permute")
            if reduce:
                add("all-reduce", reduce, "all-reduce")
        ids = 4 if segment_ids else 0
        if segment_ids:  # each piece's last id, for the documents' starts
            add("all-gather", (n - 1) * pieces * b * ids)
            rounds += 1
        if striped:
            frac = (n - 1) / n
            inputs = frac * run * b * h * (2 * dk + dv + (dk if gate == "channel" else 1) + 1)
            add("all-to-all", _F32 * (inputs + frac * run * b * h * dv), "all-to-all")
            add("all-to-all", frac * run * b * ids)
            rounds += 2 + segment_ids
        halo_tokens = {"none": conv_size - 1, "zigzag": 2 * (conv_size - 1)}.get(
            layout, min(conv_size - 1, n - 1) * s
        )
        if channels:  # one hop per convolution; the ids travel once (the same for all)
            for ch in channels:
                add("collective-permute", halo_tokens * b * ch * dtype_bytes, "collective-permute")
            add("collective-permute", halo_tokens * b * ids)
            rounds += len(channels)
    train_bytes = {k: fwd.get(k, 0) + bwd.get(k, 0) for k in {**fwd, **bwd}}
    nbytes = sum(train_bytes.values())
    compute_s = train / flops_per_s
    exposed_s = 2 * rounds * LATENCY_S + nbytes / bytes_per_s if n > 1 else 0.0
    saved = _F32 * b * h * dk * ((chunks + 1) * dk + run) if n > 1 else 0
    # A chunk's recomputation and backward, for every piece at once (zig-zag's two pieces
    # run side by side as rows): its `[C, C, c]` decays and the products and cotangents of
    # their shape, about DECAY_COPIES of them live together (XLA:CPU's buffer assignment of
    # the tiny KDA step, context=8 zig-zag), a few `C x C` products and the chunk's inputs.
    rows = b * (2 if layout == "zigzag" else 1)
    decays = size * size * (dk if gate == "channel" else 1)
    temps = _F32 * rows * h * (DECAY_COPIES * decays + 6 * size * size + 4 * size * (dk + w))
    temps += _F32 * b * h * run * (2 * dk + dv + (dk if gate == "channel" else 1) + 1)
    # The forward alone (a prefill): fewer decay arrays live together, and the outputs
    # `w` wide (the augmented ones under a split) before the finish.
    chunk_work = 6 * size * size + 4 * size * (dk + w)
    temps_forward = _F32 * rows * h * (FORWARD_DECAY_COPIES * decays + chunk_work)
    temps_forward += _F32 * b * h * run * w
    # `short_conv`'s backward keeps its input and rebuilds its taps (a `jax.checkpoint`), so
    # JAX's list of a layer's residuals leaves them out; in a rematerialised layer they
    # live beside its other residuals: about CONV_COPIES float32 arrays of the input's size
    # per convolution (the taps, masks and sums of JAX's list before the checkpoint).
    conv_rebuild = _F32 * b * s * sum(channels) * CONV_COPIES
    return LinearCost(
        composition, forward, train, model, {k: int(v) for k, v in fwd.items()},
        {k: int(v) for k, v in train_bytes.items()}, 2 * rounds, saved, temps,
        int(temps_forward), int(conv_rebuild), compute_s, exposed_s, compute_s + exposed_s,
    )  # fmt: skip
