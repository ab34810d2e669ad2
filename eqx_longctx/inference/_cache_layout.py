"""The geometry of a KV cache, decided once: what `init_cache` allocates and what the
inference planner counts (`eqx_longctx.plan.plan_generate`).

Each `LayerStack` of a model contributes one `StackLayout`, read from its layers'
attention sublayer through the cache protocol:

- `cache_shapes()`: `(heads, dim)` of each array cached **per token** (K and V per K/V
  head; MLA's one latent), each kept in slots split over the sequence axes;
- `cache_split_heads`: whether those heads split over the spec's tensor axis;
- `window`, `chunk`: the layers' sliding window and attention chunk (`None`: none);
- `cache_state_shapes()` (optional, default none): the shape of each **fixed-size state**
  a layer keeps per row instead of per-token slots (a linear-attention layer's recurrent
  state, `[heads, dk, dv]`, and its convolution's windows): its size does not grow with
  the context. States are float32 `[layers, batch, heads, ...]`, replicated over the
  sequence axes (`inference/_cache.py` says why); a stack whose layers cache nothing per
  token has no slots.

Slots: with `N` sequence shards each device holds `slots_per_device` slots of a full
stack (any prompt padded to the layout's multiple, plus the decoded tokens spread
round-robin); a sliding stack whose window is shorter keeps a ring buffer of the window
rounded up to a multiple of `N` (`inference/_cache.py` says how the slots are written). A
chunked stack's (chunk `C`) keeps one of `C` slots the same way: a query at position `p`
sees keys from `C * floor(p / C)` on, never more than the last `C` tokens, so a ring of
`C` holds every key a later query can see.
"""

import math
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from .._sharding import ShardingSpec
from ..attention import check_tensor_heads
from ._cache import slots_per_device

_I32 = 4


class StackLayout(NamedTuple):
    """One layer stack's cache (global sizes).

    - `n_layers`: layers in the stack.
    - `window`: their sliding window, or `None`.
    - `ring`: ring-buffer slots of a sliding or chunked stack, or `None` (a full cache).
    - `slots`: slots in all (`ring`, or `slots_per_device * N`).
    - `entries`: `(heads, dim)` of each per-token cached array.
    - `split_heads`: whether the entries' heads split over the tensor axis.
    - `states`: the per-row shape of each fixed-size state (empty for softmax attention).
    - `chunk`: their attention chunk (chunked attention), or `None`.
    """

    n_layers: int
    window: int | None
    ring: int | None
    slots: int
    entries: tuple[tuple[int, int], ...]
    split_heads: bool
    states: tuple[tuple[int, ...], ...] = ()
    chunk: int | None = None


class CacheLayout(NamedTuple):
    """The cache of a model for `batch` rows of up to `max_len` tokens in `dtype`, under
    `spec` (`None`: one device): one `StackLayout` per layer stack, in order."""

    batch: int
    max_len: int
    dtype: Any
    spec: ShardingSpec | None
    stacks: tuple[StackLayout, ...]

    def _split(self) -> tuple[int, int, int]:
        spec = self.spec
        if spec is None:
            return 1, 1, 1
        return (
            spec.context_parallel_size,
            spec.batch_parallel_size,
            spec.axis_size(spec.tensor_axis),
        )

    def entry_shapes(self, stack: StackLayout) -> tuple[tuple[int, ...], ...]:
        """**Returns:** the global shape of each per-token array of `stack`, heads-major
        `[layers, batch, heads, slots, dim]`."""
        return tuple((stack.n_layers, self.batch, h, stack.slots, d) for h, d in stack.entries)

    def device_shapes(self, stack: StackLayout) -> tuple[tuple[int, ...], ...]:
        """**Returns:** each per-token array of `stack` as one device holds it (rows split
        over the batch axes, slots over the sequence axes, heads over the tensor axis when
        `split_heads`)."""
        n, nb, nt = self._split()
        split = nt if stack.split_heads else 1
        return tuple(
            (layers, b // nb, h // split, slots // n, d)
            for layers, b, h, slots, d in self.entry_shapes(stack)
        )

    def state_shapes(self, stack: StackLayout) -> tuple[tuple[int, ...], ...]:
        """**Returns:** the global shape of each fixed-size state of `stack`, `[layers,
        batch, heads, ...]` (float32)."""
        return tuple((stack.n_layers, self.batch, *shape) for shape in stack.states)

    def state_device_shapes(self, stack: StackLayout) -> tuple[tuple[int, ...], ...]:
        """**Returns:** each fixed-size state of `stack` as one device holds it (float32;
        rows split over the batch axes, heads over the tensor axis when `split_heads`,
        whole on every device of the sequence axes)."""
        _, nb, nt = self._split()
        split = nt if stack.split_heads else 1
        return tuple(
            (layers, b // nb, h // split, *rest) for layers, b, h, *rest in self.state_shapes(stack)
        )

    def stack_bytes_per_device(self, stack: StackLayout) -> int:
        """**Returns:** the bytes of `stack`'s cache on one device: its per-token arrays,
        its fixed-size states and the int32 positions of its slots."""
        n, nb, _ = self._split()
        itemsize = jnp.dtype(self.dtype).itemsize
        total = sum(math.prod(s) for s in self.device_shapes(stack)) * itemsize
        total += sum(math.prod(s) for s in self.state_device_shapes(stack)) * _F32
        return total + (self.batch // nb) * (stack.slots // n) * _I32

    def bytes_per_device(self) -> int:
        """**Returns:** the bytes of the whole cache on one device: every stack, the rows'
        lengths, the step and the offset."""
        _, nb, _ = self._split()
        stacks = sum(self.stack_bytes_per_device(s) for s in self.stacks)
        return stacks + (self.batch // nb) * _I32 + 2 * _I32


_F32 = 4  # fixed-size states are kept in float32 (a recurrence accumulates in them)


def attention_layer(stack) -> Any:
    """The attention sublayer of a `LayerStack`'s layers (what the cache protocol is read
    from).

    **Raises:** `TypeError` for a layer whose attention does not describe its cache.
    """
    attn = getattr(stack.layers, "attn", None)
    if attn is None or not hasattr(attn, "cache_shapes"):
        raise TypeError(
            f"inference needs each layer to be a DecoderBlock whose attention caches tokens "
            f"(SelfAttention, MultiHeadLatentAttention, or a layer with cache_shapes, prefill "
            f"and decode); got a layer of type {type(stack.layers).__name__}."
        )
    return attn


def cache_layout(model: Any, batch: int, max_len: int, dtype: Any = None) -> CacheLayout:
    """The KV cache `init_cache(model, batch, max_len, dtype=dtype)` allocates.

    **Arguments:**

    - `model`: the model (an `AbstractDecoder` with `layer_stacks()`; built, or its
      `eqx.filter_eval_shape`).
    - `batch`, `max_len`: rows, and tokens per row the cache holds.
    - `dtype`: the cache's dtype; default the model's compute dtype.

    **Returns:** a [`CacheLayout`][].

    **Raises:** `TypeError` for a layer that does not describe its cache; `ValueError`
    when a stack's cached heads (split over the spec's tensor axis) do not divide over it,
    naming the tensor axis and the fix.
    """
    spec = model.spec
    dtype = jnp.dtype(model.config.compute_dtype if dtype is None else dtype)
    n = 1 if spec is None else spec.context_parallel_size
    per = slots_per_device(spec, max_len)
    stacks = []
    for stack in model.layer_stacks():
        attn = attention_layer(stack)
        window, chunk = attn.window, getattr(attn, "chunk", None)
        reach = min((r for r in (window, chunk) if r is not None), default=None)
        ring = None
        if reach is not None and -(-reach // n) < per:  # a ring of round_up(reach, N)
            ring = -(-reach // n) * n
        entries = tuple((int(h), int(d)) for h, d in attn.cache_shapes())
        states_of = getattr(attn, "cache_state_shapes", None)
        states = tuple(tuple(int(x) for x in s) for s in (states_of() if states_of else ()))
        split = bool(attn.cache_split_heads)
        if spec is not None:  # the layer's own rule, before any array is placed
            q_heads = getattr(attn, "n_heads", None)
            if q_heads is not None:
                kv_heads = getattr(attn, "n_kv_heads", getattr(attn, "n_key_heads", q_heads))
                check_tensor_heads(spec, q_heads, kv_heads)
            elif split:
                for h, _ in entries:
                    check_tensor_heads(spec, h, h)
        slots = per * n if ring is None else ring
        if not entries:  # fixed-size states only: no per-token slots
            ring, slots = None, 0
        stacks.append(
            StackLayout(stack.n_layers, window, ring, slots, entries, split, states, chunk)
        )
    return CacheLayout(int(batch), int(max_len), np.dtype(dtype), spec, tuple(stacks))
