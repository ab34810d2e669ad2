"""Checks of argument values, one place per rule, for every public entry point.

Each check names the argument (`what`, e.g. `"flash_attention: block_q"`,
`"LlamaConfig.dim"` or `"ckpt/config.json: hidden_size"`), states the rule and the value
seen, raises `TypeError` for a plainly wrong type and `ValueError` for a value out of range,
and returns the value normalised to a plain Python type: NumPy and JAX scalars are accepted,
bools are never numbers, and a float is never an int (readers of `config.json`, whose
numbers have one type, pass `integral_floats=True` to accept `4096.0` as `4096`).
"""

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._sharding import STRATEGIES, ShardingSpec


def short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def seen(value: Any) -> str:
    return f"{short_repr(value)} ({type(value).__name__})"


def _numeric_dtype(value: Any) -> Any:
    """The dtype of a 0-d array or NumPy scalar; `None` for other values."""
    dtype = getattr(value, "dtype", None)
    if dtype is None or getattr(value, "ndim", None) != 0:
        return None
    try:
        return np.dtype(dtype)
    except TypeError:
        return None


def _is_integer(value: Any) -> bool:
    """Whether `value` is an integer: Python (not a bool), NumPy, or a 0-d integer array."""
    dtype = _numeric_dtype(value)
    if dtype is not None:
        return bool(jnp.issubdtype(dtype, jnp.integer))
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(value: Any) -> float | None:
    """`value` as a float if it is a concrete real number (Python, NumPy or a 0-d array of
    integer or floating dtype), not a bool; else `None`."""
    if getattr(value, "dtype", None) is not None:
        dtype = _numeric_dtype(value)
        if dtype is None or not (
            jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
        ):
            return None
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:  # an int too large for a float
        return math.inf
    except TypeError:  # a tracer
        return None


def check_int(
    value: Any,
    what: str,
    *,
    minimum: int | None = 1,
    integral_floats: bool = False,
    fix: str = "",
) -> int:
    """Check an integer argument or config field.

    **Arguments:**

    - `value`: the value to check: a Python or NumPy integer, or a 0-d integer array.
    - `what`: what it is, for the messages (e.g. `"LlamaConfig.dim"`).
    - `minimum`: the smallest allowed value (default 1); `None` allows any.
    - `integral_floats`: accept a float with an integral value (`4096.0`), as `config.json`
      readers do.
    - `fix`: a sentence appended to the messages, saying how to fix the value.

    **Returns:** `value` as a Python `int`.

    **Raises:** `TypeError` when `value` is not an integer (a bool, or a float unless
    `integral_floats` and integral); `ValueError` when it is below `minimum`.
    """
    if _is_integer(value):
        value = int(value)
    else:
        number = _real(value)
        if number is None:
            raise TypeError(f"{what} must be an int; got {seen(value)}.{fix}")
        if not (integral_floats and math.isfinite(number) and number.is_integer()):
            hint = f" Pass {int(number)}." if number.is_integer() else " Pass a whole number."
            raise TypeError(f"{what} must be an int; got {seen(value)}.{hint}{fix}")
        value = int(number)
    if minimum is not None and value < minimum:
        rule = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{what} must be {rule}; got {value}.{fix}")
    return value


def as_int32_ids(x: Any, name: str) -> Any:
    """`x` (NumPy or a nested list) as a NumPy array, checked to fit int32 when it holds
    integers: JAX, with 64-bit types off, would wrap larger ids silently (segment ids
    `0` and `2**32` would then be one document). Other values are returned as they are.

    **Raises:** `ValueError` for integers outside the int32 range.
    """
    arr = np.asarray(x)
    if np.issubdtype(arr.dtype, np.integer) and arr.size:
        low, high = arr.min(), arr.max()
        info = np.iinfo(np.int32)
        if low < info.min or high > info.max:
            raise ValueError(
                f"{name} must fit int32 (JAX compares the ids as int32); got ids in "
                f"[{low}, {high}]. Renumber them, e.g. np.unique(ids, return_inverse=True)[1]."
            )
    return arr


def check_real(
    value: Any, what: str, *, positive: bool = False, minimum: float | None = None, fix: str = ""
) -> float:
    """Check a real-number argument or config field.

    **Arguments:**

    - `value`: the value to check: a Python or NumPy int or float, or a 0-d array of one.
    - `what`: what it is, for the messages.
    - `positive`: require `value > 0`.
    - `minimum`: require `value >= minimum`, if given.
    - `fix`: a sentence appended to the messages.

    **Returns:** `value` as a Python `float`.

    **Raises:** `TypeError` when `value` is not a real number (a bool is not);
    `ValueError` when it is not finite, or breaks `positive` or `minimum`.
    """
    number = _real(value)
    if number is None:
        raise TypeError(f"{what} must be a real number; got {seen(value)}.{fix}")
    value = number
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite; got {value}.{fix}")
    if positive and not value > 0:
        raise ValueError(f"{what} must be > 0; got {value}.{fix}")
    if minimum is not None and not value >= minimum:
        raise ValueError(f"{what} must be >= {minimum}; got {value}.{fix}")
    return value


def check_bool(value: Any, what: str, *, fix: str = "") -> bool:
    """Check a flag.

    **Arguments:**

    - `value`: the value to check (a Python or NumPy bool).
    - `what`: what it is, for the messages.
    - `fix`: a sentence appended to the message.

    **Returns:** `value` as a Python `bool`.

    **Raises:** `TypeError` when `value` is not a bool (`0` and `1` are not).
    """
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{what} must be True or False; got {seen(value)}.{fix}")
    return bool(value)


def check_instance(value: Any, what: str, cls: type, fix: str, *, none_ok: bool = False) -> None:
    """Check that an argument is an instance of a class.

    **Arguments:**

    - `value`: the value to check.
    - `what`: what it is, for the message.
    - `cls`: the class it must be an instance of.
    - `fix`: a sentence saying how to build one, appended to the message.
    - `none_ok`: also accept `None`.

    **Raises:** `TypeError` unless `value` is a `cls` (or `None` when `none_ok`).
    """
    if (value is None and none_ok) or isinstance(value, cls):
        return
    allowed = f"a {cls.__name__}" + (" or None" if none_ok else "")
    raise TypeError(f"{what} must be {allowed}; got {seen(value)}. {fix}")


def check_spec(spec: Any, owner: str, *, none_ok: bool = True) -> None:
    """Check a `spec=` argument.

    **Arguments:**

    - `spec`: the value to check.
    - `owner`: the function or class that received it, for the message.
    - `none_ok`: also accept `None` (one device).

    **Raises:** `TypeError` unless `spec` is a `ShardingSpec` (or `None` when `none_ok`);
    the message says how to build one from what was passed (a strategy name, a mesh).
    """
    if (spec is None and none_ok) or isinstance(spec, ShardingSpec):
        return
    if isinstance(spec, str) and spec in STRATEGIES:
        build = f"ShardingSpec(mesh, strategy={spec!r})"
    elif isinstance(spec, jax.sharding.Mesh):
        build = "ShardingSpec(mesh) (the mesh goes inside the spec)"
    else:
        build = "ShardingSpec(mesh, strategy='ring')"
    allowed = "a ShardingSpec or None (one device)" if none_ok else "a ShardingSpec"
    raise TypeError(
        f"{owner} needs spec={allowed}; got {seen(spec)}. Build one with {build}, where "
        "mesh = jax.make_mesh((2, 4), ('data', 'context')) for example."
    )


def check_names(
    values: Any, where: str, name: str, kind: str, choices: tuple[str, ...], fix: str = ""
) -> tuple[str, ...]:
    """**Returns:** `values` as a tuple, after checking it is a tuple or list of strings,
    each one of `choices` (the argument `name` of `where`; `kind` names one entry in the
    messages, e.g. `"strategy"`), and not empty."""
    if not isinstance(values, tuple | list):
        hint = f" Pass ({values!r},)." if isinstance(values, str) else ""
        raise TypeError(
            f"{where}: {name} must be a tuple of {kind} names; got {seen(values)}.{hint}"
        )
    if not values:
        raise ValueError(
            f"{where}: {name}=() names no {kind}; pass at least one of {choices}.{fix}"
        )
    unknown = [v for v in values if not (isinstance(v, str) and v in choices)]
    if unknown:
        bad = ", ".join(short_repr(v) for v in unknown)
        raise ValueError(
            f"{where}: unknown {kind} {bad} in {name}={tuple(values)!r}; choose from "
            f"{choices}.{fix}"
        )
    return tuple(values)


def check_memory_budget(value: Any, where: str) -> float | None:
    """**Returns:** `None`, or the per-device memory budget `value` (bytes) as a `float`,
    after checking it is a finite real number `> 0` (the rule of every planner)."""
    if value is None:
        return None
    fix = " Pass the bytes each device may use, e.g. 16 * 2**30 for 16 GiB."
    return check_real(value, f"{where}: memory_budget_bytes", positive=True, fix=fix)
