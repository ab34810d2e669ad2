"""Checks of model configuration fields and constructor arguments, written once for every
model family, RoPE scaling and the Hugging Face reader (the value checks they build on,
`check_int`, `check_real`, `check_bool`, `check_spec`, are in `eqx_longctx._checks`).
`eqx_longctx.family` exports both sets, so a family outside this repository can use them."""

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import check_bool, check_instance, check_int, check_real, check_spec, seen, short_repr

DTYPES = ("float32", "bfloat16", "float16")
"""The parameter and compute dtypes a model config accepts, by name."""

REMAT_POLICIES = ("none", "full", "dots", "offload")
"""The rematerialisation policies of `LayerStack(remat=...)`, the model configs' `remat` and
the trainer's `--remat` (each is described under `eqx_longctx.nn.LayerStack`)."""


def check_choice(value: Any, what: str, choices: Iterable[str]) -> str:
    """Check that an option is one of its choices.

    **Arguments:**

    - `value`: the value to check.
    - `what`: what it is, for the message (e.g. `"DeepSeekConfig.grouped_matmul"`).
    - `choices`: the allowed strings.

    **Returns:** `value`.

    **Raises:** `ValueError` unless `value` is one of the strings `choices`.
    """
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{what} must be one of {choices}; got {short_repr(value)}.")
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
    `__post_init__`); each value is stored back as a plain Python value.

    **Arguments:**

    - `config`: the frozen dataclass instance.
    - `ints`: fields that must be positive ints.
    - `optional_ints`: fields that must be positive ints or `None`.
    - `non_negative_ints`: fields that must be ints `>= 0`.
    - `positive_reals`: fields that must be finite reals `> 0` (stored as float).
    - `bools`: fields that must be bools.

    **Raises:** as `check_int`, `check_real` and `check_bool` (`TypeError` for a wrong
    type, `ValueError` for a value out of range); each message names `Class.field`.
    """
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
            f"from jax.random.PRNGKey); got {seen(key)}"
            + (f" of shape {shape}" if shape is not None else "")
            + f". Pass key=jax.random.key({seed})."
        )


def check_model_args(owner: str, config: Any, config_cls: type, key: Any, spec: Any) -> None:
    """Check the constructor arguments of a model family's model class.

    **Arguments:**

    - `owner`: the model class's name, for the messages (e.g. `"Llama"`).
    - `config`: must be a `config_cls`.
    - `config_cls`: the family's config class.
    - `key`: must be a JAX PRNG key (`jax.random.key` or `jax.random.PRNGKey`).
    - `spec`: must be a `ShardingSpec` or `None`.

    **Raises:** `TypeError` for a `config`, `key` or `spec` of the wrong kind; each message
    says how to build the right one.
    """
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

    **Arguments:**

    - `config`: the frozen dataclass instance (fields are normalised in place).
    - `scaling_cls`: the RoPE scaling class its `rope_scaling` must be an instance of.

    **Raises:** `TypeError` for a field of the wrong type (a `rope_scaling` that is not a
    `scaling_cls`, say) and `ValueError` for a value out of range or not among the choices;
    each message names `Class.field`, the value and the fix.
    """
    cls = type(config).__name__
    check_fields(
        config,
        ints=("vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "max_seq_len"),
        positive_reals=("norm_eps", "rope_theta", "init_std"),
        bools=("tie_embeddings",),
    )
    scaling = config.rope_scaling
    name = scaling_cls.__name__
    if name == "AbstractRopeScaling":  # any scaling: name the concrete ones
        name = "Llama3RopeScaling, YarnRopeScaling or LinearRopeScaling"
        fix = f"Build one with {name} (eqx_longctx.nn)"
    else:
        fix = f"Build one with {name}(...)"
        if isinstance(scaling, dict):
            fix += f", e.g. {name}(**rope_scaling) for a dict of its fields"
    check_instance(scaling, f"{cls}.rope_scaling", scaling_cls, fix + ".", none_ok=True)
    check_choice(config.remat, f"{cls}.remat", REMAT_POLICIES)
    for name in ("param_dtype", "compute_dtype"):
        value = getattr(config, name)
        try:
            dtype_name = jnp.dtype(value).name
        except Exception:  # jnp.dtype raises TypeError or ValueError, by input
            dtype_name = repr(value)
        if dtype_name not in DTYPES:
            raise ValueError(f"{cls}.{name} must be one of {DTYPES}; got {short_repr(value)}.")
        object.__setattr__(config, name, dtype_name)


def check_preset(presets: Mapping[str, Any], name: Any, overrides: Mapping[str, Any], family: str):
    """Look up a preset for a config's `from_preset(name, **overrides)`.

    **Arguments:**

    - `presets`: preset name -> config (a dataclass instance).
    - `name`: the requested preset.
    - `overrides`: the fields the caller will replace.
    - `family`: the family's name, for the message (e.g. `"Llama"`).

    **Returns:** `presets[name]`.

    **Raises:** `ValueError` when `name` is not a preset (the message lists them);
    `TypeError` when a key of `overrides` is not a field of its config.
    """
    if not isinstance(name, str) or name not in presets:
        raise ValueError(
            f"unknown {family} preset {short_repr(name)}; choose one of {sorted(presets)}."
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


LAYER_TYPES = ("full_attention", "sliding_attention")  # Hugging Face's names


def check_layer_windows(config: Any) -> None:
    """Validate and normalise a config's `sliding_window` and `layer_types` (call from
    `__post_init__` after `n_layers` is checked).

    `sliding_window` is `None` or an int `>= 1`; `layer_types` is `None` (every layer slides
    when `sliding_window` is set, else none does) or one of `LAYER_TYPES` per layer, stored
    as a tuple, and as `None` when every layer is of one kind (so that equal models have
    equal configs). A sliding layer needs a window, and a window needs a sliding layer.

    **Arguments:**

    - `config`: the frozen dataclass instance (fields are normalised in place).

    **Raises:** `TypeError` for a `sliding_window` that is not an int or `layer_types` that
    is not a tuple or list; `ValueError` for a window below 1, `layer_types` without one of
    `LAYER_TYPES` per layer, sliding layers without a window, or a window no layer uses.
    """
    cls = type(config).__name__
    window = config.sliding_window
    if window is not None:
        window = check_int(
            window,
            f"{cls}.sliding_window",
            fix=" A sliding layer's query i sees keys j with 0 <= i - j < sliding_window; use "
            "sliding_window=None for full attention in every layer.",
        )
        object.__setattr__(config, "sliding_window", window)
    types = config.layer_types
    if types is None:
        return
    if isinstance(types, str) or not isinstance(types, list | tuple):
        raise TypeError(
            f"{cls}.layer_types must be None or a tuple of {LAYER_TYPES}, one per layer; got "
            f"{seen(types)}."
        )
    if len(types) != config.n_layers:
        raise ValueError(
            f"{cls}.layer_types needs one entry per layer; got {len(types)} for "
            f"n_layers={config.n_layers}. Give {config.n_layers} of {LAYER_TYPES}."
        )
    for i, kind in enumerate(types):
        check_choice(kind, f"{cls}.layer_types[{i}]", LAYER_TYPES)
    sliding = types.count("sliding_attention")
    if sliding and window is None:
        raise ValueError(
            f"{cls}.layer_types marks {sliding} layer(s) 'sliding_attention' but "
            "sliding_window=None gives them no window. Set sliding_window, or mark them "
            "'full_attention'."
        )
    if not sliding and window is not None:
        raise ValueError(
            f"{cls}.sliding_window={window} is used by no layer: layer_types has no "
            "'sliding_attention' entry. Set sliding_window=None, or mark the sliding layers."
        )
    uniform = sliding in (0, len(types))
    object.__setattr__(config, "layer_types", None if uniform else tuple(types))
