"""Token cross-entropy from the final hidden states, a chunk of tokens at a time, so that the
`[tokens, vocab]` logits are never held whole.

Each chunk's logits are computed, reduced to its loss and dropped; the backward pass
recomputes them (`jax.checkpoint` per chunk of a `lax.scan`), so a step holds one chunk's
logits, never all of them. Under a spec every device runs its own tokens (`jax.shard_map`);
when the output head's vocabulary is split over mesh axes (the rules table's `"vocab"`,
the tensor axis by default) each device holds its vocabulary shard of a chunk's logits, and
the logsumexp and the target's logit are reduced over those axes (a vocabulary-parallel
logsumexp). Sums are float32.
"""

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int

from .._after import after
from .._sharding import ShardingSpec

LOSS_CHUNK_BYTES = 128 * 2**20
"""Float32 logits per chunk when `chunk_tokens` is not given: a device's chunk holds
`chunk_tokens x local vocabulary` of them (e.g. 256 tokens at a 128K vocabulary)."""


def loss_chunk_tokens(vocab: int, tokens: int, chunk: int | None = None) -> int:
    """Tokens per chunk of the loss on a device holding `tokens` tokens and `vocab` ids of
    the vocabulary: `chunk` tokens (at most `tokens`; `0`: all of them, the whole logits),
    or with `None` the most whose float32 logits take at most `LOSS_CHUNK_BYTES`. The one
    rule the loss and the step planner both use."""
    if chunk is None:
        return max(1, min(tokens, LOSS_CHUNK_BYTES // (4 * vocab)))
    return tokens if chunk == 0 else min(chunk, tokens)


def check_loss_chunk(value: object, *, whole_ok: bool = True) -> None:
    """The rule for a loss chunk (`--loss-chunk`, `loss_chunk`, `chunk_tokens`): `None`
    (automatic), an int `>= 1` tokens per chunk, or `0` (the whole logits) where
    `whole_ok`.

    **Raises:** `ValueError` naming the rule and the value otherwise.
    """
    low = 0 if whole_ok else 1
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= low):
        return
    whole = ", 0 for the whole logits at once," if whole_ok else ""
    raise ValueError(
        f"loss_chunk (--loss-chunk; chunk_tokens of chunked_cross_entropy) must be tokens "
        f"per chunk of the loss (an int >= 1){whole} or None (automatic: "
        f"{LOSS_CHUNK_BYTES // 2**20} MiB of float32 logits per chunk); got {value!r}. Pass "
        "e.g. 1024."
    )


def softcap_logits(logits: Array, softcap: float | None) -> Array:
    """**Returns:** `softcap * tanh(logits / softcap)` (the logits themselves for `None`)."""
    if softcap is None:
        return logits
    return softcap * jnp.tanh(logits / softcap)


def vocab_axes(weight_pspec: PartitionSpec | None) -> tuple[str, ...]:
    """The mesh axes an `[embed, vocab]` output head's `weight_pspec` splits the vocabulary
    over (`None`: no spec, none)."""
    entry = weight_pspec[1] if weight_pspec is not None and len(weight_pspec) > 1 else None
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _local_loss(hidden, weight, targets, mask, chunk_tokens, vocab_axes, softcap=None):
    """The summed loss of one device's tokens: `hidden [b, s, e]`, `weight [e, v_local]`
    (this device's vocabulary shard, at offset `index * v_local` over `vocab_axes`)."""
    e, v_local = weight.shape
    n = math.prod(hidden.shape[:-1])
    h = hidden.reshape(n, e)
    t = targets.reshape(n)
    m = mask.reshape(n).astype(jnp.float32)
    offset = 0
    if vocab_axes:
        offset = jax.lax.axis_index(vocab_axes) * v_local

    def chunk_loss(h, t, m):
        logits = jnp.einsum("ne,ev->nv", h, weight, preferred_element_type=jnp.float32)
        logits = softcap_logits(logits, softcap)
        local_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
        top = jax.lax.pmax(local_max, vocab_axes) if vocab_axes else local_max
        sum_exp = jnp.sum(jnp.exp(logits - top[:, None]), axis=-1)
        local_t = t - offset
        inside = (local_t >= 0) & (local_t < v_local)
        picked = jnp.take_along_axis(logits, jnp.clip(local_t, 0, v_local - 1)[:, None], axis=-1)
        picked = jnp.where(inside, picked[:, 0], 0.0)
        if vocab_axes:
            sum_exp = jax.lax.psum(sum_exp, vocab_axes)
            picked = jax.lax.psum(picked, vocab_axes)
        return jnp.sum((top + jnp.log(sum_exp) - picked) * m)

    chunk = loss_chunk_tokens(v_local, n, chunk_tokens)
    if chunk >= n:  # one chunk: its logits are at most a chunk's, kept for the backward
        return chunk_loss(h, t, m)
    steps = -(-n // chunk)
    pad = steps * chunk - n  # padded tokens carry no loss (mask 0, target 0)
    if pad:
        h = jnp.pad(h, ((0, pad), (0, 0)))
        t = jnp.pad(t, (0, pad))
        m = jnp.pad(m, (0, pad))
    xs = (h.reshape(steps, chunk, e), t.reshape(steps, chunk), m.reshape(steps, chunk))
    rematted = jax.checkpoint(chunk_loss)  # the backward recomputes each chunk's logits

    def body(total, x):
        return total + rematted(*x), None

    zero = jnp.zeros_like(m[0])  # varying over the token axes as the chunks' sums are
    total, _ = jax.lax.scan(body, zero, xs)
    return total


def chunked_cross_entropy(
    hidden: Float[Array, "batch seq embed"],
    weight: Float[Array, "embed vocab"],
    targets: Int[Array, "batch seq"],
    loss_mask: Float[Array, "batch seq"],
    *,
    spec: ShardingSpec | None = None,
    weight_pspec: PartitionSpec | None = None,
    chunk_tokens: int | None = None,
    softcap: float | None = None,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """Summed masked token cross-entropy (nats) of `hidden @ weight`, never holding the
    whole logits: equal to `optax.softmax_cross_entropy_with_integer_labels` of the full
    float32 logits, summed over the tokens with `loss_mask > 0` (up to summation order).

    **Arguments:**

    - `hidden`: the final hidden states, after the final norm (an `AbstractDecoder`'s
      `hidden_states`), in the compute dtype.
    - `weight`: the output head `[embed, vocab]` (`AbstractDecoder.head_weight()`, which
      is the transposed embedding of a tied model).
    - `targets`: the next token of each position; `loss_mask`: 1 where it counts (any
      float; the loss is weighted by it).
    - `spec`: the sharding spec of the model (`None`: one device). Each device computes
      its own tokens (`spec.token_pspec()`) against the weight as `weight_pspec` splits it.
    - `weight_pspec`: the weight's partition spec (default: the vocabulary over the spec's
      tensor axis); its second entry names the axes the vocabulary is split over, which
      the logsumexp and the target logit are reduced over.
    - `chunk_tokens`: tokens per chunk on each device; `None` picks the most whose float32
      logits over the device's share of the vocabulary take `LOSS_CHUNK_BYTES`.
    - `softcap`: the logits' soft-cap `c`: each chunk's logits become `c * tanh(logits /
      c)` before the softmax (the model's `logit_softcap()`); `None` = none.

    **Returns:** `(loss summed over the masked tokens, sum of loss_mask)`, float32.

    **Raises:** `ValueError` for a `chunk_tokens` that is not an int `>= 1`, a `softcap`
    that is not a positive number, or shapes
    that do not match (`hidden`'s embed against `weight`'s, `targets` and `loss_mask`
    against `hidden`'s `[batch, seq]`).
    """
    check_loss_chunk(chunk_tokens, whole_ok=False)
    if softcap is not None and not (
        isinstance(softcap, int | float) and not isinstance(softcap, bool) and softcap > 0
    ):
        raise ValueError(
            f"chunked_cross_entropy's softcap must be a positive number (the cap c of c * "
            f"tanh(logits / c)) or None; got softcap={softcap!r}. Pass model.logit_softcap()."
        )
    if hidden.shape[-1] != weight.shape[0] or targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"chunked_cross_entropy takes hidden [batch, seq, embed], weight [embed, vocab] "
            f"and targets [batch, seq]; got hidden {tuple(hidden.shape)}, weight "
            f"{tuple(weight.shape)}, targets {tuple(targets.shape)}. Pass the weight as "
            "[embed, vocab] (a tied embedding transposed: model.head_weight())."
        )
    if loss_mask.shape != targets.shape:
        raise ValueError(
            f"loss_mask must have the targets' shape {tuple(targets.shape)}; got "
            f"{tuple(loss_mask.shape)}."
        )
    with jax.named_scope("cross_entropy"):
        return _cross_entropy(
            hidden, weight, targets, loss_mask, spec, weight_pspec, chunk_tokens, softcap
        )


def _cross_entropy(hidden, weight, targets, loss_mask, spec, weight_pspec, chunk_tokens, softcap):
    if spec is None:
        count = jnp.sum(loss_mask.astype(jnp.float32))
        return _local_loss(hidden, weight, targets, loss_mask, chunk_tokens, (), softcap), count
    if weight_pspec is None:
        weight_pspec = PartitionSpec(None, spec.tensor_axis)
    axes = vocab_axes(weight_pspec)
    token_axes = tuple(a for a in (*spec.batch_axes, *spec.sequence_axes) if a is not None)
    tokens, act = spec.token_pspec(), spec.activation_pspec()

    def local(h, w, t, m):
        total = _local_loss(h, w, t, m, chunk_tokens, axes, softcap)
        # One reduction of the loss and the token count, after the loss (see `eqx_longctx._after`).
        sums = jnp.stack([total, jnp.sum(m.astype(jnp.float32))])
        sums = jax.lax.psum(sums, token_axes) if token_axes else sums
        return sums[0], sums[1]

    def run(h, w, t, m):
        mapped = jax.shard_map(
            local,
            mesh=spec.compute_mesh(),
            in_specs=(act, weight_pspec, tokens, tokens),
            out_specs=(PartitionSpec(), PartitionSpec()),
        )
        h, w = _in_order(h, w)
        return mapped(h, w, t, m)

    pair = (PartitionSpec(), PartitionSpec())
    return spec.auto_axes(run, pair)(hidden, weight, targets, loss_mask)


@jax.custom_vjp
def _in_order(hidden, weight):
    """The identity, whose backward hands on the hidden states' cotangent only after the
    weight's is complete: the weight gradient's reduction over the token axes could
    otherwise run beside the layer stack's backward loop, which that cotangent enters
    (`eqx_longctx._after`). In the forward the token count is reduced with the loss."""
    return hidden, weight


def _in_order_fwd(hidden, weight):
    return (hidden, weight), None


def _in_order_bwd(_, cotangents):
    d_hidden, d_weight = cotangents
    return after(d_hidden, d_weight), d_weight


_in_order.defvjp(_in_order_fwd, _in_order_bwd)
