"""`init_cache`, `prefill` and `decode_step`: the inference path of every model family,
and `lower_prefill` / `lower_decode`, the same two programs lowered for abstract arrays
(what the planner compiles to check its predictions).

The library walks a model through the `AbstractDecoder` protocol only (`embed_tokens`,
`layer_stacks`, `head`) and each layer through `prefill` / `decode`, so a family plugs in
without being named here. Each public call validates its inputs eagerly, then runs one
compiled function: the prefill compiles once per padded prompt length, the decode step once
per cache shape (`compile_counts` says how often each was traced).

Which block implementation runs is `eqx_longctx.attention.resolve_block_impl`'s: `impl=`
reaches every layer's attention in the prefill (`"xla"` traces no Pallas kernel), and the
decode step resolves it for the host (it drives the contract's methods itself).
"""

import collections
import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from .._layout import layout_multiple, layout_order
from .._sharding import ShardingSpec
from ..attention import check_impl, resolve_block_impl
from ._cache import (
    KVCache,
    StackCache,
    slot_positions,
    slots_per_device,
    state_pspec,
    store_fn,
    store_states,
    write_states,
    write_token,
)
from ._cache_layout import cache_layout
from ._checks import check_cache, check_model, check_prompts, check_step_tokens

_TRACES: collections.Counter = collections.Counter()


def compile_counts() -> dict[str, int]:
    """**Returns:** how many times the prefill and the decode step were traced (compiled)
    in this process, `{"prefill": n, "decode": m}`: the decode step compiles once per
    model, spec and cache shape, whatever the step or the prompt length."""
    return {"prefill": _TRACES["prefill"], "decode": _TRACES["decode"]}


def _seq_shards(spec: ShardingSpec | None) -> int:
    return 1 if spec is None else spec.context_parallel_size


def init_cache(model: Any, batch: int, max_len: int, *, dtype: Any = None) -> KVCache:
    """An empty KV cache for `batch` rows of up to `max_len` tokens.

    Under `model.spec` the cache's slots split over the spec's sequence axes, its rows over
    the batch axes and (for K/V heads) its heads over the tensor axis, so each device holds
    1/N of it. Full-attention layers keep `max_len` slots (plus the layout's padding);
    sliding-window layers a ring buffer of their window rounded up to a multiple of the
    sequence shards; MLA layers their latent and rotary key only; linear-attention layers
    (Gated DeltaNet, Kimi Delta Attention) their fixed-size float32 states (the recurrent
    state and the convolution's windows), whatever `max_len` is, replicated over the
    sequence axes (every device runs the one-token recurrence of its rows and heads).

    **Arguments:**

    - `model`: the model (an `AbstractDecoder`, e.g. `models.llama.Llama`).
    - `batch`: rows.
    - `max_len`: tokens per row the cache must hold (prompt and new tokens), at most the
      model's `max_seq_len`.
    - `dtype`: the cache's dtype; default the model's compute dtype.

    **Returns:** the `KVCache` (its geometry is `cache_layout(model, batch, max_len,
    dtype)`'s).

    **Raises:** `TypeError` for a model that is not an `AbstractDecoder` with layer stacks,
    a `dtype` that is not floating-point, or arguments of the wrong type; `ValueError` for
    a batch or `max_len` that is not positive, a `max_len` above `max_seq_len`, a batch
    the spec's batch axes do not split, or heads the spec's tensor axis does not split.
    """
    check_model(model)
    batch, max_len = check_cache(model, batch, max_len)
    spec = model.spec
    dtype = jnp.dtype(model.config.compute_dtype if dtype is None else dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"init_cache's dtype must be a floating-point dtype (the cached keys and values); "
            f"got {dtype}. Use None (the model's compute dtype), jnp.bfloat16 or jnp.float32."
        )
    layout = cache_layout(model, batch, max_len, dtype)
    stacks = []
    for s in layout.stacks:
        entries = tuple(jnp.zeros(shape, dtype) for shape in layout.entry_shapes(s))
        positions = jnp.full((batch, s.slots), -1, jnp.int32)
        states = tuple(jnp.zeros(shape, jnp.float32) for shape in layout.state_shapes(s))
        stacks.append(StackCache(entries, positions, states, s.ring, s.window, s.split_heads))
    step, offset = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)  # two buffers (donated)
    lengths = jnp.zeros((batch,), jnp.int32)
    cache = KVCache(tuple(stacks), lengths, step, offset, max_len, model.config, spec)
    if spec is None:
        return cache
    shardings = jax.tree.map(spec.sharding, cache_pspecs(cache), is_leaf=_is_pspec)
    return jax.device_put(cache, shardings)


def _is_pspec(x) -> bool:
    return isinstance(x, PartitionSpec)


def cache_pspecs(cache: KVCache) -> Any:
    """The cache's pytree with a `PartitionSpec` per array (needs `cache.spec`)."""
    spec = cache.spec
    assert spec is not None
    leaves = []
    for s in cache.stacks:  # the leaves in KVCache's field order
        heads = spec.tensor_axis if s.split_heads else None
        entry = PartitionSpec(None, spec.batch_entry(), heads, spec.sequence_axes, None)
        leaves += [entry] * len(s.entries) + [spec.token_pspec()]
        leaves += [state_pspec(spec, s.split_heads)] * len(s.states)
    leaves += [PartitionSpec(spec.batch_entry()), PartitionSpec(), PartitionSpec()]
    return jax.tree.structure(cache).unflatten(leaves)


def _run(model, fn, out_pspecs, *args):
    """`fn(model, *args)` with the spec's Explicit axes made Auto (as the models run)."""
    if model.spec is None:
        return fn(model, *args)
    return model.spec.auto_axes(fn, out_pspecs)(model, *args)


def _logits_pspec(spec: ShardingSpec) -> PartitionSpec:
    # Replicated (batch x vocab floats): sampling then draws every row with the same keys
    # on every device, whatever the mesh's axis types.
    del spec
    return PartitionSpec(None, None)


# ---- prefill -----------------------------------------------------------------------------


def _prefill_core(model, cache, tokens, positions, lengths, last, impl):
    _TRACES["prefill"] += 1
    spec = model.spec
    per = slots_per_device(spec, cache.max_len)
    x = model.embed_tokens(tokens)
    if spec is not None:
        x = spec.place(x, spec.activation_pspec())
        positions = spec.place(positions, spec.token_pspec())
    stacks = []
    for stack, sc in zip(model.layer_stacks(), cache.stacks, strict=True):
        store = _store(spec, sc, per, positions, lengths)
        # A layer with states is told each row's length: its state is the one after the
        # row's last real token, not after the layout's padding.
        kw = {"lengths": lengths} if sc.states else {}
        x, (entries, states) = stack.prefill(x, positions, None, store, impl=impl, **kw)
        pos = slot_positions(spec, sc, per, positions, lengths) if sc.entries else sc.positions
        stacks.append(StackCache(tuple(entries), pos, tuple(states), sc.ring, sc.window,
                                 sc.split_heads))  # fmt: skip
    # Each row's last prompt token, picked by a one-hot contraction over the (sharded)
    # sequence: a local product and one small all-reduce, never a gather of the sequence.
    onehot = (jnp.arange(x.shape[1])[None, :] == last[:, None]).astype(x.dtype)
    logits = model.head(jnp.einsum("bs,bse->be", onehot, x)[:, None])[:, 0]
    offset = jnp.asarray(tokens.shape[1] // _seq_shards(spec), jnp.int32)
    new = KVCache(tuple(stacks), lengths, jnp.zeros((), jnp.int32), offset, cache.max_len,
                  cache.config, cache.spec)  # fmt: skip
    return logits, new


def _store(spec, sc: StackCache, per: int, positions, lengths):
    """`store(entry) -> (per-token entries, states)`: one layer's prefill entry (its
    per-token arrays, then its states) as the stack's cache keeps them."""
    n = len(sc.entries)
    tokens = store_fn(spec, sc, per, positions, lengths) if n else None

    def store(entry):
        entry = tuple(entry)
        stored = tokens(entry[:n]) if tokens is not None else ()
        return tuple(stored), store_states(spec, sc, entry[n:])

    return store


def _is_array(x: Any) -> bool:
    """Arrays, concrete or abstract (`jax.ShapeDtypeStruct`): what the programs take as
    arguments; the rest of a model is static."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _prefill_program(static, model_arrays, cache, tokens, positions, lengths, last):
    """The compiled prefill: `static` is `(the model's static part, impl)`; the cache (the
    third argument) is donated."""
    model_static, impl = static
    model = eqx.combine(model_arrays, model_static)
    out_pspecs = None
    if model.spec is not None:
        out_pspecs = (_logits_pspec(model.spec), cache_pspecs(cache))
    # `impl` (a name, or an implementation) is static: bound here, never an argument.
    fn = functools.partial(_prefill_core, impl=impl)
    with jax.named_scope("prefill"):
        return _run(model, fn, out_pspecs, cache, tokens, positions, lengths, last)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _decode_program(static, model_arrays, cache, tokens):
    """The compiled decode step: `static` is `(the model's static part, block impl)`; the
    cache is donated."""
    model_static, impl = static
    return decode_core(eqx.combine(model_arrays, model_static), cache, tokens, impl)


def _prefill_impl(model, impl):
    """What the prefill passes to every layer's attention: `impl` checked (`None`: the
    spec's), resolved by the attention itself for the program it traces."""
    return check_impl(("auto" if model.spec is None else model.spec.impl) if impl is None else impl)


def _decode_impl(model, impl):
    """The block implementation the decode step drives itself: for the host's platform."""
    return resolve_block_impl(impl, spec=model.spec, lowering=False)


def prefill(model: Any, cache: KVCache, prompts: Any, lengths: Any = None, *, impl: Any = None):
    """Run the prompts through the model and fill the cache (a new sequence per row).

    The prompt runs as in training, under the spec's strategy and layout; the prefill pads
    it to the layout's multiple and lays it out itself, and each device keeps its own
    tokens' keys and values where the layout put them.

    **Arguments:**

    - `model`: the model the cache was built for.
    - `cache`: a `KVCache` from `init_cache(model, ...)` (donated: do not reuse it).
    - `prompts`: `[batch, prompt_len]` token ids in natural order (NumPy or JAX),
      right-padded when `lengths` is given.
    - `lengths`: `[batch]` prompt length of each row (1..prompt_len), or `None` for all.
    - `impl`: the block implementation every layer's attention runs (`"xla"`,
      `"pallas"`, `"auto"` or an `AbstractBlockImpl`); default the spec's.

    **Returns:** `(logits, cache)`: `[batch, vocab]` float32 logits of each row's last
    prompt token, and the filled cache.

    **Raises:** `TypeError` for prompts or lengths that are not integer arrays, or a cache
    that is not a `KVCache`; `ValueError` for a cache built for another model, spec or
    batch, a prompt longer than the cache's `max_len`, token ids outside the vocabulary,
    or lengths outside `1..prompt_len`.
    """
    check_model(model)
    tokens, lengths = check_prompts(model, cache, prompts, lengths)
    spec = model.spec
    s = tokens.shape[1]
    m = layout_multiple(spec)
    padded = -(-s // m) * m
    tokens = np.pad(tokens, ((0, 0), (0, padded - s)))
    order = np.arange(padded) if spec is None else layout_order(spec, padded)
    inverse = np.argsort(order)
    positions = np.broadcast_to(order, tokens.shape).astype(np.int32)
    tokens = tokens[:, order].astype(np.int32)
    last = inverse[lengths - 1].astype(np.int32)
    if spec is not None:
        tokens = spec.place(jnp.asarray(tokens), spec.token_pspec())
        positions = spec.place(jnp.asarray(positions), spec.token_pspec())
    arrays, static = eqx.partition(model, _is_array)
    return _prefill_program(
        (static, _prefill_impl(model, impl)), arrays, cache, jnp.asarray(tokens),
        jnp.asarray(positions), jnp.asarray(lengths), jnp.asarray(last),
    )  # fmt: skip


# ---- decode ------------------------------------------------------------------------------


def _decode_core(model, cache, tokens, impl):
    _TRACES["decode"] += 1
    spec = model.spec
    n = _seq_shards(spec)
    b = tokens.shape[0]
    p = cache.lengths
    x = model.embed_tokens(tokens[:, None])
    x = jnp.broadcast_to(x, (b, n, x.shape[-1]))
    positions = jnp.broadcast_to(p[:, None], (b, n))
    if spec is not None:
        x = spec.place(x, spec.activation_pspec())
        positions = spec.place(positions, spec.token_pspec())
    stacks = []
    for stack, sc in zip(model.layer_stacks(), cache.stacks, strict=True):
        # A layer's view holds its per-token entries, then its states; its new entry is the
        # new token's per-token arrays (written into one slot), then its new states
        # (replacing the old ones).
        x, new = stack.decode(x, positions, sc.entries + sc.states, sc.positions, impl=impl)
        n = len(sc.entries)
        if n:
            sc = write_token(spec, sc, tuple(new[:n]), p, cache.step, cache.offset)
        if sc.states:
            sc = eqx.tree_at(lambda c: c.states, sc, write_states(spec, sc, tuple(new[n:])))
        stacks.append(sc)
    logits = model.head(x[:, :1])[:, 0]
    new_cache = KVCache(tuple(stacks), p + 1, cache.step + 1, cache.offset, cache.max_len,
                        cache.config, cache.spec)  # fmt: skip
    return logits, new_cache


def decode_core(model, cache, tokens, impl):
    """The decode step as a traceable function (for callers that jit their own loop)."""
    out_pspecs = None
    if model.spec is not None:
        out_pspecs = (_logits_pspec(model.spec), cache_pspecs(cache))
    with jax.named_scope("decode_step"):
        return _run(model, functools.partial(_decode_core, impl=impl), out_pspecs, cache, tokens)


def decode_step(model: Any, cache: KVCache, tokens: Any, *, impl: Any = None):
    """Feed one token per row and get the next logits: one compiled step, reused for every
    token (no recompile per step or per length).

    Each device attends its own cache slots through the block implementation, giving
    `(out, logsumexp)` partials that one all-gather of those partials over the sequence
    axes merges; the cache never moves. The new token's keys and values are then written
    into the cache in place (the cache is donated).

    **Arguments:**

    - `model`: the model the cache was built for.
    - `cache`: a filled `KVCache` (from `prefill` or a previous step; donated).
    - `tokens`: `[batch]` token ids, one per row.
    - `impl`: as in `prefill` (`"auto"` is the host platform's implementation: the step
      drives the block contract itself).

    **Returns:** `(logits, cache)`: `[batch, vocab]` float32 logits for the next token, and
    the cache holding one more token per row.

    **Raises:** `TypeError` / `ValueError` for tokens that are not `[batch]` ids in the
    vocabulary, a cache built for another model or spec, or a full cache.
    """
    check_model(model)
    tokens = check_step_tokens(model, cache, tokens)
    arrays, static = eqx.partition(model, _is_array)
    return _decode_program((static, _decode_impl(model, impl)), arrays, cache, tokens)
