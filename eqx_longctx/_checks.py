"""Checks of plain Python values (ints, bools, finite numbers), one place per rule.

Every public entry point validates its arguments eagerly, before any tracing, and raises a
`TypeError` for a plainly wrong type or a `ValueError` for a value out of range; messages
name the argument, the value seen and the fix.
"""

import math
import numbers

import numpy as np


def check_int(value, name: str, *, minimum: int | None = None, where: str = "") -> int:
    """`value` as a Python int: an integer (not a bool) `>= minimum`."""
    prefix = f"{where}: " if where else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{prefix}{name} must be an int; got {value!r} of type {type(value).__name__}. "
            f"Pass an integer, e.g. {name}=int(...)."
        )
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{prefix}{name} must be >= {minimum}; got {name}={value}.")
    return value


def check_bool(value, name: str, *, where: str = "") -> bool:
    """`value` as a Python bool (NumPy bools accepted)."""
    if not isinstance(value, bool | np.bool_):
        prefix = f"{where}: " if where else ""
        raise TypeError(
            f"{prefix}{name} must be True or False; got {value!r} of type {type(value).__name__}."
        )
    return bool(value)


def check_number(
    value, name: str, *, positive: bool = False, allow_none: bool = False, where: str = ""
) -> float | None:
    """`value` as a finite Python float (`> 0` with `positive`), or None with `allow_none`."""
    prefix = f"{where}: " if where else ""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{prefix}{name} must be a number; got {value!r} of type {type(value).__name__}."
        )
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        rule = "a finite number > 0" if positive else "a finite number"
        raise ValueError(f"{prefix}{name} must be {rule}; got {name}={value}.")
    return value
