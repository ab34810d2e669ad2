"""Type and value checks for configuration fields and constructor arguments, written once
for every model family, RoPE scaling and the Hugging Face reader.

Each check names the field (`what`, e.g. `"LlamaConfig.dim"` or
`"ckpt/config.json: hidden_size"`), states the rule and the value seen, and returns the
value normalised to a plain Python type: NumPy integers and floats are accepted (a config
built from NumPy arithmetic just works, and stays JSON-serialisable), bools are never
numbers, and a float is never an int. JSON has no separate integer type, so readers of
`config.json` pass `integral_floats=True` to accept e.g. `4096.0` as `4096`.
"""

import dataclasses
import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._sharding import STRATEGIES, ShardingSpec

DTYPES = ("float32", "bfloat16", "float16")  # parameter and compute dtypes a config accepts


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _seen(value: Any) -> str:
    return f"{_short(value)} ({type(value).__name__})"


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
    """**Returns:** `value` as a Python `int`, after checking it is an integer (not a bool,
    not a float unless `integral_floats` and integral) `>= minimum` (`None`: any)."""
    if _is_integer(value):
        value = int(value)
    else:
        number = _real(value)
        if number is None:
            raise TypeError(f"{what} must be an int; got {_seen(value)}.{fix}")
        if not (integral_floats and math.isfinite(number) and number.is_integer()):
            hint = f" Pass {int(number)}." if number.is_integer() else " Pass a whole number."
            raise TypeError(f"{what} must be an int; got {_seen(value)}.{hint}{fix}")
        value = int(number)
    if minimum is not None and value < minimum:
        rule = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{what} must be {rule}; got {value}.{fix}")
    return value


def check_real(
    value: Any, what: str, *, positive: bool = False, minimum: float | None = None, fix: str = ""
) -> float:
    """**Returns:** `value` as a Python `float`, after checking it is a finite real number
    (int or float, not a bool), `> 0` if `positive`, `>= minimum` if given."""
    number = _real(value)
    if number is None:
        raise TypeError(f"{what} must be a real number; got {_seen(value)}.{fix}")
    value = number
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite; got {value}.{fix}")
    if positive and not value > 0:
        raise ValueError(f"{what} must be > 0; got {value}.{fix}")
    if minimum is not None and not value >= minimum:
        raise ValueError(f"{what} must be >= {minimum}; got {value}.{fix}")
    return value


def check_bool(value: Any, what: str, *, fix: str = "") -> bool:
    """**Returns:** `value` as a Python `bool`, after checking it is one (NumPy bools too)."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{what} must be True or False; got {_seen(value)}.{fix}")
    return bool(value)


def check_choice(value: Any, what: str, choices: Iterable[str]) -> str:
    """Raise `ValueError` unless `value` is one of the strings `choices`."""
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{what} must be one of {choices}; got {_short(value)}.")
    return value


def check_fields(
    config: Any,
    *,
    ints: Iterable[str] = (),
    optional_ints: Iterable[str] = (),
    non_negative_ints: Iterable[str] = (),
    positive_reals: Iterable[str] = (),
    bools: Iterable[str] = (),
) -> None:
    """Check and normalise fields of a frozen dataclass in place (call from
    `__post_init__`): positive ints, positive ints or `None`, ints `>= 0`, positive finite
    reals (stored as float), bools. Messages name `Class.field`."""
    cls = type(config).__name__

    def put(name: str, check, **kwargs) -> None:
        value = getattr(config, name)
        object.__setattr__(config, name, check(value, f"{cls}.{name}", **kwargs))

    for name in ints:
        put(name, check_int)
    for name in optional_ints:
        if getattr(config, name) is not None:
            put(name, check_int, fix=" Use None to leave it unset.")
    for name in non_negative_ints:
        put(name, check_int, minimum=0)
    for name in positive_reals:
        put(name, check_real, positive=True)
    for name in bools:
        put(name, check_bool)


def check_instance(value: Any, what: str, cls: type, fix: str, *, none_ok: bool = False) -> None:
    """Raise `TypeError` unless `value` is a `cls` (or `None` when `none_ok`)."""
    if (value is None and none_ok) or isinstance(value, cls):
        return
    allowed = f"a {cls.__name__}" + (" or None" if none_ok else "")
    raise TypeError(f"{what} must be {allowed}; got {_seen(value)}. {fix}")


def check_key(key: Any, owner: str) -> None:
    """Raise `TypeError` unless `key` is a JAX PRNG key: a typed key (`jax.random.key`) or a
    raw `uint32[2]` one (`jax.random.PRNGKey`)."""
    shape, dtype = getattr(key, "shape", None), getattr(key, "dtype", None)
    typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key) and shape == ()
    raw = dtype == np.uint32 and shape in ((2,), (4,))
    if not (typed or raw):
        seed = key if isinstance(key, int) and not isinstance(key, bool) else 0
        raise TypeError(
            f"{owner} needs key=a JAX PRNG key (a scalar from jax.random.key, or a uint32[2] "
            f"from jax.random.PRNGKey); got {_seen(key)}"
            + (f" of shape {shape}" if shape is not None else "")
            + f". Pass key=jax.random.key({seed})."
        )


def check_spec(spec: Any, owner: str) -> None:
    """Raise `TypeError` unless `spec` is a `ShardingSpec` or `None`, saying how to build one."""
    if spec is None or isinstance(spec, ShardingSpec):
        return
    if isinstance(spec, str) and spec in STRATEGIES:
        build = f"ShardingSpec(mesh, strategy={spec!r})"
    elif isinstance(spec, jax.sharding.Mesh):
        build = "ShardingSpec(mesh) (the mesh goes inside the spec)"
    else:
        build = "ShardingSpec(mesh, strategy='ring')"
    raise TypeError(
        f"{owner} needs spec=a ShardingSpec or None (one device); got {_seen(spec)}. Build one "
        f"with {build}, where mesh = jax.make_mesh((2, 4), ('data', 'context')) for example."
    )


def check_model_args(owner: str, config: Any, config_cls: type, key: Any, spec: Any) -> None:
    """The constructor arguments of a model family: its config class, a PRNG key, a spec."""
    check_instance(
        config,
        f"{owner}'s config",
        config_cls,
        f"Build one with {config_cls.__name__}(...) or {config_cls.__name__}.from_preset(name).",
    )
    check_key(key, owner)
    check_spec(spec, owner)


def check_decoder_config(config: Any, *, scaling_cls: type) -> None:
    """Validate and normalise the fields every decoder config has (call first in a frozen
    dataclass's `__post_init__`, before rules that compute with them).

    `vocab_size`, `dim`, `n_layers`, `n_heads`, `hidden_dim` and `max_seq_len` are positive
    ints; `norm_eps`, `rope_theta` and `init_std` positive finite reals (stored as float);
    `tie_embeddings` a bool; `rope_scaling` a `scaling_cls` or `None`; `remat` one of
    `REMAT_POLICIES`; `param_dtype` and `compute_dtype` become dtype names from `DTYPES`.
    """
    from ._transformer import REMAT_POLICIES  # (its module imports this one)

    cls = type(config).__name__
    check_fields(
        config,
        ints=("vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "max_seq_len"),
        positive_reals=("norm_eps", "rope_theta", "init_std"),
        bools=("tie_embeddings",),
    )
    scaling = config.rope_scaling
    fix = f"Build one with {scaling_cls.__name__}(...)"
    if isinstance(scaling, dict):
        fix += f", e.g. {scaling_cls.__name__}(**rope_scaling) for a dict of its fields"
    check_instance(scaling, f"{cls}.rope_scaling", scaling_cls, fix + ".", none_ok=True)
    check_choice(config.remat, f"{cls}.remat", REMAT_POLICIES)
    for name in ("param_dtype", "compute_dtype"):
        value = getattr(config, name)
        try:
            dtype_name = jnp.dtype(value).name
        except Exception:  # jnp.dtype raises TypeError or ValueError, by input
            dtype_name = repr(value)
        if dtype_name not in DTYPES:
            raise ValueError(f"{cls}.{name} must be one of {DTYPES}; got {_short(value)}.")
        object.__setattr__(config, name, dtype_name)


def check_preset(presets: Mapping[str, Any], name: Any, overrides: Mapping[str, Any], family: str):
    """**Returns:** `presets[name]`, after checking that `name` is a preset and every key of
    `overrides` a field of its config."""
    if not isinstance(name, str) or name not in presets:
        raise ValueError(
            f"unknown {family} preset {_short(name)}; choose one of {sorted(presets)}."
        )
    preset = presets[name]
    fields = {f.name for f in dataclasses.fields(preset)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(
            f"{type(preset).__name__}.from_preset({name!r}) got override(s) {unknown} that are "
            f"not fields of {type(preset).__name__}; the fields are {sorted(fields)}."
        )
    return preset
