"""`lower_prefill` and `lower_decode`: the compiled programs of `prefill` and `decode_step`
lowered for abstract arrays (nothing allocated), as the trainer's `lower_train_step` lowers
its step. The planner (`python -m eqx_longctx.plan --generate --compile`) compiles them to
read XLA's memory analysis; they are the very `jax.jit` programs the two calls run, so a
prediction is checked against what runs.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .._layout import layout_multiple
from .._partition import param_pspecs
from ._checks import check_cache, check_model
from ._run import (
    _decode_impl,
    _decode_program,
    _is_array,
    _prefill_impl,
    _prefill_program,
    cache_pspecs,
    init_cache,
)


def _abstract(tree: Any, pspecs: Any, spec) -> Any:
    """`tree` with every array a `jax.ShapeDtypeStruct` carrying the sharding the calls
    give it: its `PartitionSpec` of `pspecs` under `spec` (the model's weights as the rules
    table lays them out, whatever device a built model's arrays happen to be on; the cache
    as `init_cache` places it), or none without a spec."""
    arrays, rest = eqx.partition(tree, _is_array)
    leaves, treedef = jax.tree.flatten(arrays)
    if pspecs is None:
        ps: list[Any] = [None] * len(leaves)
    else:
        ps = jax.tree.leaves(pspecs, is_leaf=lambda p: isinstance(p, PartitionSpec))

    def one(x, p):
        sharding = None if spec is None or p is None else spec.sharding(p)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    placed = [one(x, p) for x, p in zip(leaves, ps, strict=True)]
    return eqx.combine(jax.tree.unflatten(treedef, placed), rest)


def _abstract_model(model: Any) -> Any:
    spec = model.spec
    return _abstract(model, None if spec is None else param_pspecs(model, spec), spec)


def _abstract_cache(model: Any, batch: int, max_len: int, dtype: Any) -> Any:
    cache = eqx.filter_eval_shape(init_cache, model, batch, max_len, dtype=dtype)
    spec = model.spec
    return _abstract(cache, None if spec is None else cache_pspecs(cache), spec)


def _ids(model: Any, shape: tuple[int, ...], pspec: Any) -> jax.ShapeDtypeStruct:
    spec = model.spec
    sharding = None if spec is None else spec.sharding(pspec)
    return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)


def lower_prefill(
    model: Any,
    *,
    batch: int,
    max_len: int,
    prompt_len: int | None = None,
    cache_dtype: Any = None,
    impl: Any = None,
) -> jax.stages.Lowered:
    """The program `prefill` runs, lowered for abstract arrays.

    **Arguments:**

    - `model`: the model: built, or abstract (e.g. `eqx.filter_eval_shape` of its
      constructor; arrays without a sharding are laid out as `eqx_longctx.param_pspecs`
      says under `model.spec`).
    - `batch`, `max_len`: the cache's rows and tokens per row (`init_cache`'s).
    - `prompt_len`: the prompt's tokens (default `max_len`), padded to the layout's
      multiple as `prefill` pads it.
    - `cache_dtype`: as `init_cache`'s `dtype`.
    - `impl`: as `prefill`'s.

    **Returns:** a `jax.stages.Lowered` (`.compile().memory_analysis()` says what it holds
    per device).

    **Raises:** as `init_cache`, and `ValueError` for a `prompt_len` outside
    `1..max_len`.
    """
    check_model(model)
    batch, max_len = check_cache(model, batch, max_len)
    prompt_len = max_len if prompt_len is None else prompt_len
    if not 1 <= prompt_len <= max_len:
        raise ValueError(
            f"lower_prefill's prompt_len must lie in 1..max_len={max_len}; got "
            f"prompt_len={prompt_len}. Pass a shorter prompt or a larger max_len."
        )
    spec = model.spec
    cache = _abstract_cache(model, batch, max_len, cache_dtype)
    m = layout_multiple(spec)
    padded = -(-prompt_len // m) * m
    tokens = _ids(model, (batch, padded), None if spec is None else spec.token_pspec())
    rows = _ids(model, (batch,), None if spec is None else PartitionSpec(spec.batch_entry()))
    arrays, static = eqx.partition(_abstract_model(model), _is_array)
    return _prefill_program.lower(
        (static, _prefill_impl(model, impl)), arrays, cache, tokens, tokens, rows, rows
    )


def lower_decode(
    model: Any, *, batch: int, max_len: int, cache_dtype: Any = None, impl: Any = None
) -> jax.stages.Lowered:
    """The program `decode_step` runs, lowered for abstract arrays: one token per row
    against a cache of `batch` rows and `max_len` tokens.

    **Arguments:** as [`lower_prefill`][]; `impl` as `decode_step`'s.

    **Returns:** a `jax.stages.Lowered`.

    **Raises:** as `init_cache`.
    """
    check_model(model)
    batch, max_len = check_cache(model, batch, max_len)
    spec = model.spec
    cache = _abstract_cache(model, batch, max_len, cache_dtype)
    tokens = _ids(model, (batch,), None if spec is None else PartitionSpec(spec.batch_entry()))
    arrays, static = eqx.partition(_abstract_model(model), _is_array)
    return _decode_program.lower((static, _decode_impl(model, impl)), arrays, cache, tokens)
