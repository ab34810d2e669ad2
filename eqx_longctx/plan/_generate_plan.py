"""The inference planner: what the KV cache, the prefill and a decode step hold per device.

For a model, a cache of `seq` tokens per row, a batch and a mesh, `plan_generate` predicts,
per device (the model runs as `eqx_longctx.init_cache`, `prefill` and `decode_step` run it):

- **parameters**: `eqx_longctx.param_bytes_per_device`, as the training planner counts them;
- **cache**: the `KVCache` `init_cache` builds, from the geometry both take from
  `eqx_longctx.inference.cache_layout`: each `LayerStack`'s attention layer caches
  `cache_shapes()` arrays per token (K and V per KV head, or MLA's one latent); a full
  stack keeps `slots_per_device` slots per device, a sliding stack a ring of its window
  rounded up to a multiple of the `N` sequence shards (`ring / N` per device); rows split
  over the batch axes, heads over the tensor axis when the layer's `cache_split_heads`;
  a linear-attention stack its float32 states (`cache_state_shapes()`, whole on every
  device of the sequence axes, no slots); plus each stack's int32 slot positions and the
  lengths;
- **prefill peak**: parameters + cache + the working set of the layer being run: its
  forward activations of the prompt's local tokens (everything one layer computes,
  JAX's list of its residuals as the training planner asks for it, `_activations.py`),
  the attention strategy's transient buffers (the attention cost model's forward memory
  beyond its inputs and output), a linear-attention layer's rule temporaries
  (`linear_attention_cost(...).temporaries_forward`) and one layer's weights, which the
  layer scan slices out of the stacked weights (a stack of one layer has no loop and reads
  them in place);
- **decode-step peak**: parameters + cache + the layer being run: its weights slice, its
  cache slice (read out of the stacked cache, and the updated copy), and the float32
  scores of one query per device against the local slots;
- with fsdp axes, the embedding table and the output head gathered whole (the prefill
  holds the head, the decode step both: measured on XLA:CPU, Llama 3.1 8B).

No backward pass, no optimizer state. `--compile` (`_compile.py`) checks the prediction
against XLA's memory analysis of the real prefill and decode step. Known gap: with fsdp
axes, XLA:CPU's programs hold about one more copy of the parameter shards, not counted
here (docs/scaling.md).
"""

import dataclasses
from typing import Any, NamedTuple, no_type_check

import equinox as eqx
import jax
import jax.numpy as jnp

from .._checks import check_spec
from .._family import ModelFamily
from .._layout import layout_multiple
from .._partition import param_bytes_per_device
from .._sharding import ShardingSpec
from .._units import gib
from ..attention import check_tensor_heads, plan_attention
from ..linear import linear_attention_cost
from ._activations import forward_working_set, stacks
from ._step_plan import _gathered_layer_bytes, as_family
from ._step_time import stack_linear

_I32 = 4
_F32 = 4


class StackCacheShape(NamedTuple):
    """One `LayerStack`'s cache on one device."""

    path: str  # where the stack sits in the model, e.g. "layers[1]"
    n_layers: int
    window: int | None
    ring: int | None  # ring-buffer slots in total (sliding), or None (full)
    slots: int  # slots per device
    entries: tuple[tuple[int, ...], ...]  # per-device shape of each cached array, then state
    bytes: int  # entries + fixed-size states + slot positions, per device
    chunk: int | None = None  # the attention chunk of chunked layers


class GenerateMemory(NamedTuple):
    """Predicted per-device bytes of inference."""

    params: int
    cache: int
    prefill_layer: int  # working set of the layer the prefill runs
    prefill_attention: int  # attention temporaries (part of prefill_layer)
    decode_layer: int  # working set of the layer the decode step runs
    logits: int  # float32 [batch, vocab] logits of the local rows
    prefill_tables: int  # the output head gathered over the fsdp axes (0 without)
    decode_tables: int  # the embedding and the output head gathered (0 without fsdp axes)
    prefill_linear: int = 0  # linear attention's rule temporaries (part of prefill_layer)

    @property
    def prefill(self) -> int:
        """Predicted peak bytes per device of the prefill."""
        return self.params + self.cache + self.prefill_layer + self.logits + self.prefill_tables

    @property
    def decode(self) -> int:
        """Predicted peak bytes per device of one decode step."""
        return self.params + self.cache + self.decode_layer + self.logits + self.decode_tables

    def breakdown(self) -> dict:
        """The parts, name -> bytes per device, and the two peaks."""
        return {**{k: int(v) for k, v in self._asdict().items()}, "prefill": self.prefill,
                "decode": self.decode}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class GeneratePlan:
    """What `plan_generate` predicts: `problem` (the model, shapes, mesh), `memory` (a
    `GenerateMemory`) and `stacks` (a `StackCacheShape` per layer stack)."""

    problem: dict
    memory: GenerateMemory
    stacks: tuple[StackCacheShape, ...]

    def explain(self) -> str:
        """**Returns:** the cache per stack and the prefill and decode peaks, as text."""
        pr, m = self.problem, self.memory
        mesh = ",".join(f"{k}={v}" for k, v in pr["mesh"].items()) or "one device"
        lines = [
            f"inference: {pr['model']} {pr.get('preset', '')}, batch {pr['batch']}, cache of "
            f"{pr['seq']} tokens per row ({pr['cache_dtype']}), prompt {pr['prompt_len']} "
            f"tokens, strategy {pr['strategy']}, on mesh {mesh}; bytes per device",
            "cache per layer stack:",
        ]
        for s in self.stacks:
            reach = f"window {s.window}" if s.chunk is None else f"chunk {s.chunk}"
            kind = "full" if s.ring is None else f"{reach}, ring {s.ring} slots"
            kind = "fixed-size states" if not s.slots else kind
            shapes = " + ".join("x".join(map(str, e)) for e in s.entries)
            lines.append(
                f"  {s.path:12} {s.n_layers} layers ({kind}): {s.slots} slots per device, "
                f"[{shapes}] per layer, {gib(s.bytes)}"
            )
        lines += [
            f"parameters {gib(m.params)}, cache {gib(m.cache)}",
            f"prefill: layer working set {gib(m.prefill_layer)} (attention "
            f"{gib(m.prefill_attention)}"
            + (f", linear attention's rule {gib(m.prefill_linear)}" if m.prefill_linear else "")
            + f"), gathered head {gib(m.prefill_tables)}, logits "
            f"{gib(m.logits)}: peak {gib(m.prefill)}",
            f"decode step: layer working set {gib(m.decode_layer)}, gathered embedding and "
            f"head {gib(m.decode_tables)}: peak {gib(m.decode)}",
        ]
        return "\n".join(lines)


@no_type_check  # validated eagerly, with errors that say what to fix
def plan_generate(
    family: str | ModelFamily,
    config: Any,
    spec: ShardingSpec | None,
    *,
    batch: int,
    seq: int,
    prompt_len: int | None = None,
    cache_dtype: Any = None,
) -> GeneratePlan:
    """Predict the per-device memory of inference: the KV cache, the prefill, a decode step.

    **Arguments:**

    - `family`: a `ModelFamily`, or the name of one (e.g. `"llama"`).
    - `config`: the model's config (`max_seq_len >= seq`).
    - `spec`: the `ShardingSpec` the model runs under, or `None` for one device.
    - `batch`: rows; `seq`: the cache's `max_len` (prompt and new tokens).
    - `prompt_len`: the prompt's tokens (default `seq`).
    - `cache_dtype`: the cache's dtype (default the compute dtype, as `init_cache`).

    **Returns:** a `GeneratePlan`.

    **Raises:** `ValueError` for an unknown family name, a `seq` or `prompt_len` out of
    range, a batch the batch axes do not split, heads the tensor axis does not split;
    `TypeError` for a `family` or `spec` of the wrong type.
    """
    where = "plan_generate"
    fam = as_family(family, where)
    check_spec(spec, where, none_ok=True)
    prompt_len = seq if prompt_len is None else prompt_len
    if not 1 <= prompt_len <= seq <= config.max_seq_len:
        raise ValueError(
            f"{where} needs 1 <= prompt_len <= seq <= max_seq_len; got prompt_len="
            f"{prompt_len}, seq={seq}, max_seq_len={config.max_seq_len}. Raise max_seq_len "
            "(--override max_seq_len=...) or shorten the prompt."
        )
    n = 1 if spec is None else spec.context_parallel_size
    nb = 1 if spec is None else spec.batch_parallel_size
    if spec is not None:
        spec.check_batch(batch)
    heads = tuple(fam.attention_shape(config))
    nt = 1 if spec is None else check_tensor_heads(spec, heads[0], heads[1])
    dtype = jnp.dtype(config.compute_dtype)
    cdtype = dtype if cache_dtype is None else jnp.dtype(cache_dtype)
    model = eqx.filter_eval_shape(fam.model, config, key=jax.random.key(0), spec=spec)
    params = param_bytes_per_device(model, spec)
    b = batch // nb
    cache_stacks, cache = cache_geometry(model, spec, batch, seq, cdtype)
    # The prefill: the prompt padded to the layout's multiple, P / N tokens per device.
    m = layout_multiple(spec)
    s_local = -(-prompt_len // m) * m // n
    ne = 1 if spec is None else spec.axis_size(spec.expert_axis)
    attn_temp, strategy = _attention_forward(spec, b * nb, s_local * n, heads, dtype, config)
    acts = forward_working_set(
        fam, config, batch=b, seq=s_local, tensor=nt, expert=ne, attention=attn_temp
    )
    weights = _layer_weights(model, spec)
    # A linear-attention layer's rule runs inside a nested call, whose temporaries the
    # walk does not see: the cost model's forward working set (`linear_attention_cost`).
    linear = {
        path: linear_attention_cost(
            spec, batch=b * nb, seq=s_local * n, **shape, dtype_bytes=dtype.itemsize
        ).temporaries_forward
        for path, shape in stack_linear(stacks(model)).items()
        if shape is not None
    }
    prefill_layer = decode_layer = 0
    for s in cache_stacks:
        rule = linear.get(s.path, 0)
        # The layer scan's slice of the stacked weights is a copy; a stack of one layer
        # runs without a loop and reads its weights in place.
        layer_weights = weights[s.path] if s.n_layers > 1 else 0
        prefill_layer = max(prefill_layer, acts[s.path] + layer_weights + rule)
        # Entries are stored in the cache dtype (read here in the compute dtype); a linear
        # stack's states are float32 whatever the cache dtype.
        layer_cache = s.bytes // s.n_layers
        if s.slots:
            layer_cache = layer_cache * dtype.itemsize // cdtype.itemsize
        scores = b * (heads[0] // nt) * s.slots * _F32
        decode_layer = max(decode_layer, layer_weights + 2 * layer_cache + 2 * scores)
    logits = b * config.vocab_size * _F32
    # Under fsdp axes the embedding table and the output head are gathered whole (still
    # split over the tensor axis): the prefill holds the head beside the layers' working
    # set, the decode step both tables (XLA gathers them side by side; one when tied).
    table = 0
    if spec is not None and spec.fsdp_axis:
        table = config.vocab_size * config.dim // nt * jnp.dtype(config.param_dtype).itemsize
    tables = table * (1 if getattr(config, "tie_embeddings", False) else 2)
    memory = GenerateMemory(params, cache, prefill_layer, attn_temp, decode_layer, logits,
                            table, tables, max(linear.values(), default=0))  # fmt: skip
    problem = dict(
        model=fam.name, seq=seq, batch=batch, prompt_len=prompt_len, strategy=strategy,
        mesh={} if spec is None else dict(spec.mesh.shape),
        tensor_axis=None if spec is None else spec.tensor_axis,
        load_balance=None if spec is None else spec.load_balance,
        param_dtype=str(jnp.dtype(config.param_dtype)), compute_dtype=str(dtype),
        cache_dtype=str(cdtype), n_layers=config.n_layers, local_batch=b, local_prompt=s_local,
    )  # fmt: skip
    return GeneratePlan(problem, memory, tuple(cache_stacks))


def cache_geometry(
    model: Any, spec: ShardingSpec | None, batch: int, seq: int, dtype: Any
) -> tuple[list[StackCacheShape], int]:
    """Each layer stack's cache on one device, and the whole cache's bytes on one device,
    from the layout `init_cache` allocates (`eqx_longctx.inference.cache_layout`)."""
    from ..inference import cache_layout

    del spec  # the model's own
    layout = cache_layout(model, batch, seq, dtype)
    paths = {id(s): p for p, s in stacks(model).items()}
    out = []
    for stack, s in zip(model.layer_stacks(), layout.stacks, strict=True):
        shapes = layout.device_shapes(s)
        slots = shapes[0][3] if shapes else 0
        shapes += layout.state_device_shapes(s)  # linear attention's fixed-size states
        out.append(StackCacheShape(paths[id(stack)], s.n_layers, s.window, s.ring, slots,
                                   shapes, layout.stack_bytes_per_device(s), s.chunk))  # fmt: skip
    return out, layout.bytes_per_device()


def _layer_weights(model: Any, spec: ShardingSpec | None) -> dict[str, int]:
    """Bytes of one layer's weights as the layer scan reads them (gathered over the fsdp
    axes), per `LayerStack` path."""
    gathered = {} if spec is None or not spec.fsdp_axis else _gathered_layer_bytes(model, spec)
    out = {}
    for path, stack in stacks(model).items():
        own = param_bytes_per_device(stack, spec) // stack.n_layers
        out[path] = gathered.get(path, own)
    return out


def _attention_forward(spec, batch, seq, heads, dtype, config) -> tuple[int, str]:
    """The attention's forward temporaries on one device beyond its inputs and output
    (the attention cost model), and the strategy the spec runs."""
    hq, hk, d, dv = heads
    window = getattr(config, "sliding_window", None)
    if spec is None:  # one device: the local kernel, priced on a mesh of one
        mesh = jax.make_mesh((1,), ("context",), devices=jax.devices()[:1])
        spec = ShardingSpec(mesh, batch_axis=None)
    # The choice is the runtime's (`resolve_strategy`): an attention call cannot know it
    # will not be differentiated, so "auto" weighs forward and backward even in a prefill.
    result = plan_attention(
        spec, batch=batch, seq=seq, q_heads=hq, kv_heads=hk, head_dim=d, v_head_dim=dv,
        dtype=dtype, window=window, backward=True, where="plan_generate",
    )  # fmt: skip
    cost = result.costs[result.strategy]
    nt = spec.axis_size(spec.tensor_axis)
    b, s = batch // spec.batch_parallel_size, seq // spec.context_parallel_size
    inputs = b * s * (hq * d + hk * (d + dv) + hq * dv) // nt * dtype.itemsize
    return max(0, int(cost.memory_forward) - inputs), result.strategy
