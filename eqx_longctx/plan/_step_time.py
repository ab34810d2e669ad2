"""The train step's time, its FLOPs and the MFU they imply: every layer, matmuls and attention.

- **Time**, per (strategy, remat): the busiest device's matmuls (6 FLOPs per active
  parameter and token forward and backward, 2 more per token for each forward a remat policy
  runs again) at the roofline FLOP/s, plus, for every layer, the attention cost model's time
  of one call (`eqx_longctx.attention._cost`: the busiest device's forward and backward, and
  the communication not hidden behind it) and its forward again when the policy reruns it.
  Each `LayerStack` is priced with its own attention window: full-attention and sliding
  layers of one model cost differently. A stack of linear-attention layers (its attention
  sublayer declares fixed-size states, `cache_state_shapes`, and a `decay`) is priced by
  `eqx_longctx.linear.linear_attention_cost` instead: its chunked rule's FLOPs (4 forwards
  with the checkpointed backward), the summaries, halos and regrouping it sends.
- **Model FLOPs** of a step (what MFU is computed from, the PaLM convention): 6 per active
  parameter and token, plus the attention's forward and backward, 3 x (2 per query-key pair,
  head and width of q.k and p.v) over the causal pairs only (within the window), with no
  recomputation, no masked blocks and no communication; a linear-attention layer counts 3 x
  the forward of its one-device chunked rule over each chunk's causal pairs with the UT
  system solved by substitution (`linear_attention_cost`'s `model_flops_train`: no inverse
  by doubling, no augmented values of the sequence split, no convolutions).
- **MFU** = model FLOPs / (time x devices x FLOP/s): below 1 by the recomputation, the
  attention's backward recomputing its scores (3.5 forwards where the model FLOPs count 3),
  the causal blocks computed whole on the diagonal, and communication left exposed.
"""

import math
from typing import Any, NamedTuple

import equinox as eqx
import jax

from ..linear import linear_attention_cost

# What each policy runs again in the backward pass: the layer's matmuls ("full" and
# "offload" run each layer's forward twice; "dots" keeps the projections) and the attention
# (its custom backward keeps nothing a policy can save, so every policy but "none" reruns it).
RECOMPUTE_MATMULS = {"none": 0, "dots": 0, "offload": 1, "full": 1}
RECOMPUTE_ATTENTION = {"none": 0, "dots": 1, "offload": 1, "full": 1}


class StepTime(NamedTuple):
    """One (strategy, remat)'s predicted step on the busiest device."""

    time_s: float  # the whole step: matmuls + every layer's attention
    flops: float  # FLOPs it runs, recomputation included
    attention_s: float  # every layer's attention, communication included (part of time_s)


def stack_windows(stacks: dict[str, Any]) -> dict[str, int | None]:
    """**Returns:** the attention window of each `LayerStack` of `stacks` (path -> stack, as
    `_activations.stacks` lists a model's; `None` = full causal attention), read from the
    attention modules of its layers (their `window` field). A chunked softmax layer (its
    `chunk` beside a `softcap` field, as `SelfAttention` has) is priced as a window of its
    chunk: the same neighbour exchange, and an upper bound on its work (a chunk's query sees
    half its chunk on average, a window's query all of it)."""
    out = {}
    for path, stack in stacks.items():
        has = lambda x: isinstance(x, eqx.Module) and hasattr(x, "window")  # noqa: E731
        found = {_reach(m) for m in jax.tree.leaves(stack, is_leaf=has) if has(m)}
        if len(found) > 1:
            raise ValueError(
                f"the layer stack {path!r} has attention layers with windows "
                f"{sorted(found, key=str)}; "
                "a LayerStack's layers are identical, so one window per stack is expected."
            )
        out[path] = found.pop() if found else None
    return out


def _reach(module) -> int | None:
    """The window bounding what `module`'s queries see: its `window`, or its `chunk` for a
    softmax layer, whichever is tighter (`None`: unbounded)."""
    chunk = getattr(module, "chunk", None) if hasattr(module, "softcap") else None
    bounds = [w for w in (module.window, chunk) if w is not None]
    return min(bounds) if bounds else None


def stack_linear(stacks: dict[str, Any]) -> dict[str, dict | None]:
    """**Returns:** per `LayerStack` path, the shape `linear_attention_cost` needs when its
    layers mix tokens by linear attention, else `None`.

    A linear-attention sublayer is one that declares fixed-size states
    (`cache_state_shapes()`, non-empty: the recurrent state `(heads, dk, dv)` first, then
    the short convolutions' windows `(.., K - 1)`) and its `decay` (`"head"` or
    `"channel"`); its `chunk` is the rule's chunk length (64 without one).
    """
    out: dict[str, dict | None] = {}
    for path, stack in stacks.items():
        has = lambda x: isinstance(x, eqx.Module) and hasattr(x, "cache_state_shapes")  # noqa: E731
        found = [m for m in jax.tree.leaves(stack, is_leaf=has) if has(m)]
        shapes = [m.cache_state_shapes() for m in found if hasattr(m, "decay")]
        if not shapes or not shapes[0]:
            out[path] = None
            continue
        (h, dk, dv), *windows = shapes[0]
        out[path] = dict(
            heads=h, head_dim=dk, v_head_dim=dv, gate=found[0].decay,
            conv_channels=tuple(math.prod(w[:-1]) for w in windows),
            conv_size=windows[0][-1] + 1 if windows else 1, chunk=getattr(found[0], "chunk", 64),
        )  # fmt: skip
    return out


def linear_costs(spec, linear: dict, counts: dict, batch: int, seq: int, grad_accum: int,
                 rates: dict) -> tuple[dict, float]:  # fmt: skip
    """`({path: LinearCost}, model FLOPs of the step's linear layers)` for the linear stacks
    of `linear` (`stack_linear`'s; `counts`: layers per path), `batch` rows of one
    micro-batch of `grad_accum`, `rates` the cost model's `flops_per_s`, `bytes_per_s`,
    `dtype_bytes`."""
    shapes = {path: shape for path, shape in linear.items() if shape is not None}
    costs = {
        path: linear_attention_cost(spec, batch=batch, seq=seq, **shape, **rates)
        for path, shape in shapes.items()
    }
    flops = sum(
        counts[path] * grad_accum
        * linear_attention_cost(None, batch=batch, seq=seq, **shape).model_flops_train
        for path, shape in shapes.items()
    )  # fmt: skip
    return costs, float(flops)


def causal_pairs(seq: int, window: int | None) -> int:
    """(query, key) pairs of causal attention over `seq` tokens: key `j` for query `i` with
    `0 <= i - j < window` (every `j <= i` without a window)."""
    if window is None or window >= seq:
        return seq * (seq + 1) // 2
    return window * (window + 1) // 2 + (seq - window) * window


def model_flops(
    active_params: float,
    heads: tuple[int, int, int, int],
    layers: list[tuple[int, int | None]],
    *,
    batch: int,
    seq: int,
    linear: float = 0.0,
) -> float:
    """Model FLOPs of one train step (all devices, no recomputation).

    **Arguments:**

    - `active_params`: parameters one token multiplies with (`ModelFamily.active_params`).
    - `heads`: `(q_heads, kv_heads, head_dim, v_head_dim)`.
    - `layers`: `(n_layers, window)` per softmax layer stack.
    - `batch`, `seq`: the step's rows (all micro-batches) and tokens per row.
    - `linear`: the linear-attention layers' model FLOPs of the step, all of them
      (`LinearCost.model_flops_train` of the whole batch on one device, times layers).
    """
    hq, _, d, dv = heads
    pairs = sum(n * causal_pairs(seq, window) for n, window in layers)
    return 6 * active_params * batch * seq + 3 * 2 * (d + dv) * hq * batch * pairs + linear


def step_time(
    param_tokens: float,
    layer_costs: list[tuple[int, Any]],
    remat: str,
    heads: tuple[int, int, int, int],
    flops_per_s: float,
    grad_accum: int = 1,
) -> StepTime:
    """The step's time and FLOPs on the busiest device.

    **Arguments:**

    - `param_tokens`: active parameters on the device x its tokens, of one micro-batch.
    - `layer_costs`: `(n_layers, cost)` per layer stack: the cost model's prediction of one
      attention call (forward and backward) of that stack's layers, a `StrategyCost` or a
      linear stack's `LinearCost` (its forward's share is its own `forward_fraction`).
    - `remat`: the remat policy (what is run again).
    - `heads`: `(q_heads, kv_heads, head_dim, v_head_dim)`.
    - `flops_per_s`: the device's FLOP/s (the cost model's rate).
    - `grad_accum`: micro-batches per step.
    """
    _, _, d, dv = heads
    # The forward's share of the attention cost model's forward + backward FLOPs per score:
    # 2(d + dv) of 2(d + dv) + 6d + 4dv (2/7 when d == dv).
    forward = 2 * (d + dv) / (8 * d + 6 * dv)
    rerun = RECOMPUTE_ATTENTION[remat]
    again = [rerun * getattr(c, "forward_fraction", forward) for _, c in layer_costs]
    matmuls = (6 + 2 * RECOMPUTE_MATMULS[remat]) * param_tokens
    attention_s = sum(
        n * (c.time_s + a * c.compute_s) for (n, c), a in zip(layer_costs, again, strict=True)
    )
    attention_flops = flops_per_s * sum(
        n * (1 + a) * c.compute_s for (n, c), a in zip(layer_costs, again, strict=True)
    )
    return StepTime(
        grad_accum * (matmuls / flops_per_s + attention_s),
        grad_accum * (matmuls + attention_flops),
        grad_accum * attention_s,
    )


def mfu(flops: float, time_s: float, devices: int, flops_per_s: float) -> float:
    """**Returns:** model FLOPs utilisation, `flops / (time_s x devices x flops_per_s)`."""
    return flops / (time_s * devices * flops_per_s) if time_s > 0 else 0.0
