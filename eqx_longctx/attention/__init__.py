"""One attention entry point; the sharding spec picks how it runs.

With `spec=None` the sequence lives on one device and the blockwise (flash) XLA path runs.
With a `ShardingSpec`, the inputs (global arrays in the spec's token layout) are placed on
the mesh and one of the context-parallel strategies runs under `jax.shard_map`:
`_all_gather.py`, `_ulysses.py`, `_ring.py`, `_usp.py`. Every strategy computes masks from
the original token positions of the layout, so every layout works with every strategy.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._layout import layout_order
from .._sharding import ShardingSpec
from ._all_gather import all_gather_attention
from ._local import flash_attention as flash_attention
from ._local import flash_attention_backward as flash_attention_backward
from ._reference import reference_attention as reference_attention
from ._ring import ring_attention
from ._ulysses import ulysses_attention
from ._usp import usp_attention
from ._validate import check_attention_inputs, check_spec_inputs


def attention(
    # Shapes are checked by `check_attention_inputs`, whose errors say what to fix; the
    # docstring gives them.
    q: Float[Array, "..."],
    k: Float[Array, "..."],
    v: Float[Array, "..."],
    *,
    spec: ShardingSpec | None = None,
    causal: bool = True,
    segment_ids: Int[Array, "..."] | Float[Array, "..."] | None = None,
    scale: float | None = None,
) -> Float[Array, "batch seq q_heads v_head_dim"]:
    """Scaled dot-product attention over long sequences, on one device or context-parallel.

    Supports MHA, GQA and MQA (`q_heads` a multiple of `kv_heads`, K/V never repeated on one
    device), `v_head_dim != head_dim`, any sequence length on one device, float32 or
    bfloat16 inputs with float32 accumulation. Memory is O(seq): scores are computed block
    by block with an online softmax, blocks the causal mask or the segment ids leave empty
    are skipped, and the backward pass recomputes scores blockwise instead of storing them.

    **Arguments:**

    - `q`: `[batch, seq, q_heads, head_dim]`.
    - `k`: `[batch, seq, kv_heads, head_dim]`.
    - `v`: `[batch, seq, kv_heads, v_head_dim]`.
    - `spec`: a `ShardingSpec`, or `None` for one device. With a spec, all arrays are global
      arrays (sharded or not) in the spec's token layout (see `to_layout`).
    - `causal`: query `i` attends keys `j <= i` (by original token index).
    - `segment_ids`: `[batch, seq]` ints; tokens attend only within their own segment
      (packed documents stay isolated).
    - `scale`: score scale, default `1/sqrt(head_dim)`.

    **Returns:** `[batch, seq, q_heads, v_head_dim]` in the dtype of `q` (layout order).
    """
    check_attention_inputs(q, k, v, segment_ids)
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)
    if spec is None:
        out, _ = flash_attention(
            q,
            k,
            v,
            q_segment_ids=segment_ids,
            kv_segment_ids=segment_ids,
            causal=causal,
            scale=scale,
        )
        return out
    strategy = check_spec_inputs(spec, q, k, segment_ids)
    return _context_parallel(spec, strategy, q, k, v, segment_ids, causal=causal, scale=scale)


def _context_parallel(spec, strategy, q, k, v, segment_ids, *, causal, scale):
    b, s = q.shape[:2]
    positions = jnp.broadcast_to(jnp.asarray(layout_order(spec, s)), (b, s))
    heads, tokens = spec.heads_pspec(), spec.token_pspec()
    q, k, v = (spec.place(x, heads) for x in (q, k, v))
    positions = spec.place(positions, tokens)
    kw = dict(causal=causal, scale=scale)
    # Outside USP, a strategy runs over every sequence axis (two of them when "auto" had a
    # ulysses axis to choose with); collectives accept a tuple of mesh axes.
    axes = spec.sequence_axes
    axis = axes[0] if len(axes) == 1 else axes
    if strategy == "all_gather":
        local = functools.partial(all_gather_attention, axis=axis, **kw)
    elif strategy == "ulysses":
        local = functools.partial(ulysses_attention, axis=axis, **kw)
    elif strategy == "ring":
        local = functools.partial(ring_attention, axis=axis, **kw)
    else:
        local = functools.partial(
            usp_attention, ulysses_axis=spec.ulysses_axis, ring_axis=spec.context_axis, **kw
        )
    if segment_ids is None:
        fn = lambda q, k, v, p: local(q, k, v, p, None)  # noqa: E731
        args, in_specs = (q, k, v, positions), (heads, heads, heads, tokens)
    else:
        fn = local
        segment_ids = spec.place(segment_ids, tokens)
        args, in_specs = (q, k, v, positions, segment_ids), (heads, heads, heads, tokens, tokens)
    mesh = spec.compute_mesh()
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=heads, check_vma=False)
    return mapped(*args)


__all__ = ["attention", "flash_attention", "flash_attention_backward", "reference_attention"]
