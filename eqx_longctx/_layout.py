"""Token layouts that balance causal work across sequence shards, and their inverse.

A layout is a permutation of token indices: slot `i` of the laid-out sequence holds token
`layout_order(...)[i]`. Device `d` of the `N` sequence shards holds the `d`-th contiguous
`seq / N` slots.

- `none`: contiguous chunks; under the causal mask the last device does ~2x the mean work.
- `zigzag`: `2N` chunks, device `i` holds chunks `i` and `2N-1-i` (Brandon et al. 2023,
  "Striped Attention" discuss both; zig-zag as in Megatron-LM's context parallelism).
- `striped`: token `t` on device `t mod N` (Brandon et al. 2023, arXiv:2311.09431).

Layouts are applied once to the data (tokens, positions, segment ids, labels), never per
layer: attention reads each token's original index from `layout_order`.
"""

import functools
from typing import no_type_check

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import NamedSharding, PartitionSpec

from ._checks import check_int
from ._sharding import ShardingSpec


def layout_multiple(spec: ShardingSpec | None) -> int:
    """Sequence lengths the spec's layout splits: `2N` for zig-zag, else `N` (1 alone)."""
    if spec is None:
        return 1
    n = spec.context_parallel_size
    return 2 * n if spec.load_balance == "zigzag" and n > 1 else n


def check_sequence_length(spec: ShardingSpec, seq: int) -> None:
    """Raise `ValueError` unless `seq` splits evenly under the spec's layout."""
    n = spec.context_parallel_size
    need = 2 * n if spec.load_balance == "zigzag" else n
    if seq % need:
        what = "2N chunks" if spec.load_balance == "zigzag" else "N shards"
        lo, hi = (seq // need) * need, -(-seq // need) * need
        raise ValueError(
            f"load_balance={spec.load_balance!r} over N={n} sequence shards splits the sequence "
            f"into {what}, so seq must be divisible by {need}; got seq={seq}. Use seq={hi} "
            f"(pad the row) or {lo}."
        )


@functools.lru_cache(maxsize=64)
def _order(load_balance: str, n: int, seq: int) -> np.ndarray:
    idx = np.arange(seq)
    if load_balance == "none" or n == 1:
        return idx
    if load_balance == "striped":
        return idx.reshape(seq // n, n).T.reshape(-1)
    chunks = idx.reshape(2 * n, seq // (2 * n))
    pairs = [np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)]
    return np.concatenate(pairs)


def layout_order(spec: ShardingSpec, seq: int) -> np.ndarray:
    """Original token index held at each slot of the laid-out sequence.

    **Arguments:**

    - `spec`: the `ShardingSpec` whose `load_balance` and sequence shards define the layout.
    - `seq`: the sequence length.

    **Returns:** an `int32 [seq]` NumPy array: slot `i` holds token `order[i]`.

    **Raises:** `ValueError` when `seq` does not split evenly into the layout's `N` shards
    (`2N` chunks for `"zigzag"`); the message suggests the nearest lengths that do.
    """
    check_sequence_length(spec, seq)
    order = _order(spec.load_balance, spec.context_parallel_size, seq)
    return order.astype(np.int32)


@no_type_check  # validated eagerly, with errors that say what to fix
def to_layout(x, spec: ShardingSpec, axis: int = 1):
    """Permute `x` along `axis` from natural token order into the spec's layout.

    Works on NumPy arrays (the data pipeline's host path) and on JAX arrays, sharded or not,
    eagerly or under `jit`.

    **Arguments:**

    - `x`: an array whose `axis` is the sequence.
    - `spec`: the `ShardingSpec` whose `load_balance` and sequence shards define the layout.
    - `axis`: the sequence axis.

    **Returns:** `x` in layout order (same type, shape and dtype).

    **Raises:** `TypeError` when `spec` is not a `ShardingSpec`; `ValueError` when `axis` is
    out of range or the sequence does not split evenly under the layout.
    """
    x, axis = _check_layout_args("to_layout", x, spec, axis)
    return _permute(x, layout_order(spec, x.shape[axis]), axis, spec)


@no_type_check  # validated eagerly, with errors that say what to fix
def from_layout(x, spec: ShardingSpec, axis: int = 1):
    """Inverse of `to_layout`: back to natural token order along `axis`.

    **Arguments:**

    - `x`: an array in the spec's layout along `axis` (NumPy or JAX, sharded or not).
    - `spec`: the `ShardingSpec` that laid it out.
    - `axis`: the sequence axis.

    **Returns:** `x` in natural token order (same type, shape and dtype).

    **Raises:** as `to_layout`.
    """
    x, axis = _check_layout_args("from_layout", x, spec, axis)
    order = layout_order(spec, x.shape[axis])
    return _permute(x, np.argsort(order).astype(np.int32), axis, spec)


def _check_layout_args(where: str, x, spec, axis):
    """**Returns:** `(x, axis)`: `x` an array (lists become NumPy), `axis` non-negative."""
    if not isinstance(spec, ShardingSpec):
        raise TypeError(
            f"{where} needs a ShardingSpec; got {type(spec).__name__}. Build one with "
            "ShardingSpec(mesh, load_balance='zigzag')."
        )
    if not isinstance(x, np.ndarray | jax.Array):
        x = np.asarray(x)
    axis = check_int(axis, f"{where}: axis", minimum=None)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(
            f"{where}: axis={axis} is out of range for an array of rank {x.ndim} (shape "
            f"{tuple(x.shape)}); pass the sequence axis, e.g. axis=1 for [batch, seq, ...]."
        )
    return x, axis % x.ndim


def _permute(x, perm: np.ndarray, axis: int, spec: ShardingSpec):
    if isinstance(x, np.ndarray):
        return np.take(x, perm, axis=axis)
    x = jnp.asarray(x)
    sharding = getattr(x, "sharding", None)
    inverse = np.argsort(perm).astype(np.int32)
    args = (x, jnp.asarray(perm), jnp.asarray(inverse), axis, spec.mesh, _explicit_pspec(x))
    if isinstance(x, Tracer) or sharding is None or len(sharding.device_set) == 1:
        return _take_permutation(*args)
    return jax.jit(_take_permutation, static_argnums=(3, 4, 5))(*args)


# The transpose of a permutation is the inverse permutation: a gather, not a scatter-add
# (which an Explicit-axis mesh would also ask output shardings for).
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _take_permutation(x, perm, inverse, axis: int, mesh, in_pspec):
    return _take(x, perm, axis, mesh)


def _take_permutation_fwd(x, perm, inverse, axis, mesh, in_pspec):
    return _take(x, perm, axis, mesh), (perm, inverse)


def _take_permutation_bwd(axis, mesh, in_pspec, residuals, ct):
    perm, inverse = residuals
    dx = _take(ct, inverse, axis, mesh)
    if in_pspec is not None:
        dx = jax.sharding.reshard(dx, NamedSharding(mesh, in_pspec))
    return dx, None, None


def _explicit_pspec(x):
    """The partition spec of `x` when its sharding is Explicit (part of its type), else None."""
    typeof = getattr(jax, "typeof", None)
    sharding = getattr(typeof(x), "sharding", None) if typeof is not None else None
    mesh = getattr(sharding, "mesh", None)
    types = getattr(mesh, "axis_types", ())
    if sharding is None or not any(str(t).endswith("Explicit") for t in types):
        return None
    return sharding.spec


_take_permutation.defvjp(_take_permutation_fwd, _take_permutation_bwd)


def _take(x, perm, axis: int, mesh):
    typeof = getattr(jax, "typeof", None)
    aval_sharding = getattr(typeof(x), "sharding", None) if typeof is not None else None
    pspec = getattr(aval_sharding, "spec", None)
    if pspec is not None and axis < len(pspec) and pspec[axis] is not None:
        # An Explicit-axis mesh needs the gather's output sharding spelled out: gather the
        # sequence axis, keep the others where they were.
        out = list(pspec) + [None] * (x.ndim - len(pspec))
        out[axis] = None
        x = jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec(*out)))
    return jnp.take(x, perm, axis=axis)
