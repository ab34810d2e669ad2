"""`position_loss`: the mean next-token loss in buckets of position over held-out text, the
curve that keeps falling when a model uses its context."""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._runner import EvalModel


@eqx.filter_jit
def _token_losses(model, batch):
    """Each token's loss in nats (0 where `loss_mask` is 0): the gradient of the summed
    chunked cross-entropy with respect to the mask, so the whole logits are never held
    and the loss is the one the trainer computes."""
    from ..nn import chunked_cross_entropy

    hidden = model.hidden_states(
        batch.tokens, positions=batch.positions, segment_ids=batch.segment_ids
    )

    def total(mask):
        return chunked_cross_entropy(
            hidden, model.head_weight(), batch.targets, mask, spec=model.spec,
            weight_pspec=model.head_pspec(), softcap=model.logit_softcap(),
        )[0]  # fmt: skip

    return jax.grad(total)(batch.loss_mask.astype(jnp.float32)) * batch.loss_mask


def held_out_rows(em: EvalModel, documents: Sequence[str], length: int, rows: int) -> np.ndarray:
    """`[rows, length]` token ids: the first `length` tokens (after `em.start`) of the
    held-out documents long enough to fill them, longest first.

    **Raises:** `ValueError` when no document has `length` tokens.
    """
    need = length - len(em.start)
    picked = []
    for doc in sorted(documents, key=len, reverse=True):
        if len(doc.encode("utf-8")) < need // 8:  # no tokenizer packs 8 bytes into a token
            break
        ids = [int(i) for i in em.text.encode(doc)]
        if len(ids) >= need:
            picked.append(list(em.start) + ids[:need])
        if len(picked) == rows:
            break
    if not picked:
        longest = max((len(d) for d in documents), default=0)
        raise ValueError(
            f"position_loss at length {length} needs held-out documents of at least {need} "
            f"tokens; the longest of {len(documents)} has {longest} characters. Pass shorter "
            "--lengths, or --data with longer documents."
        )
    return np.asarray(picked, np.int32)


def position_loss(
    em: EvalModel,
    documents: Sequence[str],
    lengths: Sequence[int],
    *,
    rows: int = 8,
    buckets: int = 16,
) -> dict[int, dict[str, Any]]:
    """Mean next-token loss by position over held-out text, at each length.

    Each row is one held-out document's first `length` tokens (one segment, positions
    `0..length-1`), run under the model's spec (split over its sequence axes in its
    layout, as training runs); the loss of the token at position `p` (predicting `p + 1`)
    falls in bucket `p * buckets // length`.

    **Arguments:**

    - `em`: the model.
    - `documents`: held-out texts (e.g. the validation split of the run's corpus).
    - `lengths`: tokens per row.
    - `rows`: documents per length (fewer when fewer are that long).
    - `buckets`: equal position buckets per length.

    **Returns:** `{length: {"bucket_start": [...], "bucket_end": [...], "loss": [...],
    "tokens": [...], "rows": n}}`, losses in nats per token.

    **Raises:** `ValueError` as `held_out_rows` (no held-out document is that long).
    """
    from ..data import Batch, place_batch

    spec = getattr(em.model, "spec", None)
    multiple = 1
    if spec is not None:
        sizes = dict(spec.mesh.shape)
        multiple = int(np.prod([sizes[a] for a in spec.batch_axes if a is not None]))
    out: dict[int, dict[str, Any]] = {}
    for length in lengths:
        tokens = held_out_rows(em, documents, length, rows)
        n = tokens.shape[0]
        fill = -(-n // multiple) * multiple - n
        mask = np.ones_like(tokens, np.float32)
        mask[:, -1] = 0.0
        if fill:
            tokens = np.concatenate([tokens, np.repeat(tokens[:1], fill, 0)])
            mask = np.concatenate([mask, np.zeros((fill, length), np.float32)])
        targets = np.concatenate([tokens[:, 1:], tokens[:, :1] * 0], axis=1)
        positions = np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape)
        batch = Batch(tokens, targets, np.array(positions), np.ones_like(tokens), mask)
        placed = place_batch(batch, spec)
        losses = np.asarray(jax.device_get(_token_losses(em.model, placed)), np.float64)
        where = np.asarray(jax.device_get(placed.positions))
        counted = np.asarray(jax.device_get(placed.loss_mask)) > 0
        bucket = where * buckets // length
        loss, count = [], []
        for k in range(buckets):
            sel = counted & (bucket == k)
            count.append(int(sel.sum()))
            loss.append(float(losses[sel].mean()) if sel.any() else float("nan"))
        out[int(length)] = {
            "bucket_start": [k * length // buckets for k in range(buckets)],
            "bucket_end": [(k + 1) * length // buckets for k in range(buckets)],
            "loss": loss, "tokens": count, "rows": n,
        }  # fmt: skip
    return out
