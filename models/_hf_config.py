"""`config.json` of Hugging Face checkpoints: reading it, checking its keys and the types of
its values, RoPE parameters, and the arguments of the families' `from_hf`.

Errors about the file name the file and the key; a family reader runs its own rules inside
`errors_in(file)`, so that those name the file too.
"""

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from eqx_longctx.family import DTYPES, check_bool, check_int, check_real, check_spec

CONFIG_FILE = "config.json"

# `config.json` keys that never change what the model computes: identification, token ids,
# generation defaults, training-time initialisation, output flags.
METADATA_KEYS = frozenset(
    {
        "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype",
        "dtype", "use_cache", "initializer_range", "bos_token_id", "eos_token_id",
        "pad_token_id", "sep_token_id", "decoder_start_token_id", "tokenizer_class",
        "output_attentions", "output_hidden_states", "return_dict", "use_return_dict",
        "id2label", "label2id", "problem_type", "task_specific_params", "prefix",
        "torchscript", "finetuning_task", "max_length", "min_length", "do_sample",
        "temperature", "top_k", "top_p", "num_beams", "repetition_penalty",
        "num_return_sequences", "is_decoder", "is_encoder_decoder", "add_cross_attention",
        "tie_encoder_decoder", "chunk_size_feed_forward", "pruned_heads",
    }
)  # fmt: skip


def checkpoint_dir(path: Any, what: str = "from_hf") -> str:
    """**Returns:** `path` as a string, after checking it is an existing directory."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(
            f"{what} needs path=a checkpoint directory (str or os.PathLike); got "
            f"{type(path).__name__}."
        )
    path = os.fspath(path)
    if not os.path.isdir(path):
        state = "is a file" if os.path.exists(path) else "does not exist"
        raise ValueError(
            f"{what}: {path!r} {state}; point at a Hugging Face checkpoint directory "
            "(config.json next to model.safetensors or its shards)."
        )
    return path


def read_json(file: str, what: str) -> Any:
    """**Returns:** the parsed JSON `file`; a syntax error names the file, line and column."""
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{file} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); the "
            f"{what} is damaged or incomplete. Re-download it or rewrite it with save_pretrained."
        ) from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{file} is not UTF-8 text ({e.reason}); the {what} is damaged.") from None


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """**Returns:** the parsed `config.json` of the checkpoint directory `path`."""
    path = checkpoint_dir(path)
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise ValueError(
            f"no {CONFIG_FILE} in {path!r}; point at a Hugging Face checkpoint "
            "directory (config.json next to model.safetensors or its shards)."
        )
    config = read_json(file, "config")
    if not isinstance(config, dict):
        raise ValueError(
            f"{file} must hold a JSON object (key: value pairs); got a JSON "
            f"{type(config).__name__}. Rewrite it with save_pretrained."
        )
    return config


@contextlib.contextmanager
def errors_in(file: str):
    """Prefix the `ValueError`s and `TypeError`s raised in the block with `file`, so that an
    error in a rule about a `config.json` value says which file it came from."""
    try:
        yield
    except (ValueError, TypeError) as e:
        if file in str(e):
            raise
        raise type(e)(f"{file}: {e}") from e


def check_config_types(
    hf: Mapping[str, Any],
    file: str,
    *,
    ints: Iterable[str] = (),
    non_negative_ints: Iterable[str] = (),
    reals: Iterable[str] = (),
    bools: Iterable[str] = (),
    objects: Iterable[str] = (),
    lists: Iterable[str] = (),
    prefix: str = "",
) -> dict[str, Any]:
    """Check the types of `config.json` values before any rule computes with them.

    Keys that are absent or `null` are left out of the check (the family reader decides
    their defaults). `ints` are positive and `non_negative_ints` `>= 0` integers (integral
    floats such as `4096.0` are read as ints: JSON has one number type); `reals` positive
    finite numbers; `bools` JSON booleans; `objects` JSON objects (dicts); `lists` JSON
    arrays. Messages name
    `file` and `prefix + key` (e.g. `prefix="rope_scaling."` for a nested object).

    **Returns:** a copy of `hf` with the numbers normalised (ints as `int`, reals as
    `float`).
    """
    out = dict(hf)
    fix = f" Correct it in {os.path.basename(file)}."

    def each(keys: Iterable[str]):
        return [(k, hf[k], f"{file}: {prefix}{k}") for k in keys if hf.get(k) is not None]

    for key, value, what in each(ints):
        out[key] = check_int(value, what, integral_floats=True, fix=fix)
    for key, value, what in each(non_negative_ints):
        out[key] = check_int(value, what, minimum=0, integral_floats=True, fix=fix)
    for key, value, what in each(reals):
        out[key] = check_real(value, what, positive=True, fix=fix)
    for key, value, what in each(bools):
        out[key] = check_bool(value, what, fix=fix)
    for kinds, python_type, name in ((objects, dict, "object"), (lists, list, "array")):
        for _, value, what in each(kinds):
            if not isinstance(value, python_type):
                raise TypeError(
                    f"{what} must be a JSON {name} or null; got {value!r} "
                    f"({type(value).__name__}).{fix}"
                )
    return out


def rope_from_hf(hf: Mapping[str, Any], file: str) -> tuple[float, str, dict[str, Any]]:
    """RoPE base, type and the other parameters, from `rope_parameters` (transformers 5) or
    the older `rope_theta` + `rope_scaling` (the family reader checks type and parameters).
    `hf` must have passed `check_config_types` with `rope_theta` as a real and both dicts
    as objects."""
    if hf.get("rope_parameters") is not None and hf.get("rope_scaling") is not None:
        raise ValueError(
            "config.json has both rope_parameters and rope_scaling; keep one (transformers 5 "
            "writes rope_parameters, older versions rope_scaling)."
        )
    key = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    params = check_config_types(
        hf.get(key) or {},
        file,
        ints=("original_max_position_embeddings",),
        reals=(
            "rope_theta", "factor", "low_freq_factor", "high_freq_factor", "beta_fast",
            "beta_slow", "attention_factor",
        ),
        prefix=f"{key}.",
    )  # fmt: skip
    theta = params.pop("rope_theta", None)
    if theta is not None and hf.get("rope_theta") not in (None, theta):
        raise ValueError(
            f"config.json gives two RoPE bases: rope_theta={hf['rope_theta']} and "
            f"{key}.rope_theta={theta}; keep one."
        )
    theta = float(theta or hf.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    return theta, rope_type, params


def check_from_hf_args(family: str, spec: Any, dtype: Any, overrides: Mapping[str, Any], fields):
    """Check the arguments of a family's `from_hf` that do not come from the checkpoint;
    `fields` are the names of the family config's fields (what `overrides` may name)."""
    check_spec(spec, f"{family}.from_hf")
    if dtype is not None:
        try:
            name = jnp.dtype(dtype).name
        except Exception:  # np.dtype raises TypeError or ValueError, by input
            name = None
        if name not in DTYPES:
            raise ValueError(
                f"{family}.from_hf(dtype=...) must be None (the checkpoint's) or one of "
                f"{DTYPES}; got {dtype!r}."
            )
    bad = sorted(set(overrides) - set(fields))
    if bad:
        raise ValueError(
            f"{family}.from_hf overrides fields of the family's config; got unknown {bad}. "
            f"Valid fields: {sorted(fields)}."
        )


def read_model_config(
    path: Any,
    family: str,
    parse: Callable[[dict[str, Any], str], tuple[dict[str, Any], Any]],
    *,
    model_cls: type,
    config_cls: type,
    spec: Any,
    dtype: Any,
    overrides: Mapping[str, Any],
) -> tuple[str, dict[str, Any], Any]:
    """What every family's `from_hf` does first: check its arguments, read `config.json`,
    run the family's `parse(hf, file) -> (checked hf, config)` (its errors name the file),
    then apply `dtype` and `overrides` (their errors name the field), refusing overrides
    that would change a weight of `model_cls` (`check_same_weights`); `config_cls` is the
    family's config class.

    **Returns:** `(checkpoint directory, checked config.json, config)`.
    """
    fields = [f.name for f in dataclasses.fields(config_cls)]
    check_from_hf_args(family, spec, dtype, overrides, fields)
    path = checkpoint_dir(path, f"{family}.from_hf")
    file = os.path.join(path, CONFIG_FILE)
    hf = read_config(path)
    with errors_in(file):
        hf, config = parse(hf, file)
    stored = apply_overrides(config, dtype, {})
    config = apply_overrides(config, dtype, overrides)
    check_same_weights(model_cls, stored, config, overrides, f"{family}.from_hf", file)
    return path, hf, config


def check_same_weights(model_cls: type, stored, config, overrides, what: str, file: str):
    """Raise `ValueError` when `config` (the checkpoint's `stored` config with `overrides`)
    gives `model_cls` weights of other names or shapes than the checkpoint holds: an
    override may change how the weights are used (RoPE base and scaling, the context
    length, remat, dtypes), never what they are."""

    def shapes(c) -> dict[str, tuple[int, ...]]:
        abstract = eqx.filter_eval_shape(model_cls, c, key=jax.random.key(0))
        leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
        return {
            jax.tree_util.keystr(p, simple=True, separator="."): x.shape
            for p, x in leaves
            if isinstance(x, jax.ShapeDtypeStruct)
        }

    before, after = shapes(stored), shapes(config)
    if before == after:
        return
    # Name the overrides that change weights on their own (else all: together they do).
    culprits = {
        k: v
        for k, v in overrides.items()
        if shapes(dataclasses.replace(stored, **{k: v})) != before
    } or dict(overrides)
    diffs = [
        f"{name} {before.get(name, 'absent')} -> {after.get(name, 'absent')}"
        for name in sorted(set(before) | set(after))
        if before.get(name) != after.get(name)
    ]
    more = f" and {len(diffs) - 6} more" if len(diffs) > 6 else ""
    raise ValueError(
        f"{what}: override(s) {culprits} would change the weights {file} describes "
        f"({'; '.join(diffs[:6])}{more}); an override may change how the weights are used "
        "(e.g. rope_theta, rope_scaling, max_seq_len, remat, dtypes), not their shapes. Drop "
        "the override(s) that change the architecture, or train a model of that shape from "
        "scratch."
    )


def apply_overrides(config, dtype, overrides: Mapping[str, Any]):
    """**Returns:** `config` (read from a checkpoint) with `from_hf`'s `dtype` (parameters,
    and compute unless overridden) and `overrides` applied; their errors name the field."""
    dtype = config.param_dtype if dtype is None else dtype
    changes = {"param_dtype": dtype, "compute_dtype": dtype, **overrides}
    return dataclasses.replace(config, **changes)


def stored_dtype(hf: Mapping[str, Any]) -> str:
    """The parameter dtype a `config.json` states (`dtype` or `torch_dtype`), if it is one of
    `DTYPES`; else float32 (e.g. a float64 or 8-bit checkpoint is read as float32)."""
    stored = hf.get("dtype") or hf.get("torch_dtype")
    return stored if stored in DTYPES else "float32"


def check_config_keys(config: Mapping[str, Any], known: Iterable[str], family: str) -> None:
    """Raise `ValueError` for `config.json` keys that are neither `known` to the family reader
    nor harmless metadata (an unknown key may change the computation, e.g. quantization)."""
    unknown = sorted(set(config) - set(known) - METADATA_KEYS)
    if unknown:
        raise ValueError(
            f"config.json has key(s) {unknown} that the {family} reader does not understand, "
            "so it cannot tell whether they change the model. Supported keys: "
            f"{sorted(set(known))}. Remove them from config.json if they do not change the "
            "computation."
        )


def unsupported(key: str, value, why: str) -> ValueError:
    """The error for a `config.json` value the zoo does not implement."""
    return ValueError(f"config.json {key}={value!r} is not supported: {why}")


def check_config(
    hf: dict,
    file: str,
    family: str,
    architectures: dict[str, str],
    keys: Mapping[str, Iterable[str]],
    required: Iterable[str],
    why: str,
    **types: Iterable[str],
) -> tuple[str, dict[str, Any]]:
    """What every family reader checks before its own rules, in order: `model_type` and
    `architectures` (`check_model_type`), that every key is one the reader knows for that
    model type (`check_config_keys`), that no required key is absent, and the types of the
    values (`check_config_types`).

    **Arguments:**

    - `hf`, `family`, `architectures`: as for `check_model_type`; `file`: where `hf` was
      read.
    - `keys`: model_type -> the keys the family reader understands.
    - `required`: the keys without a default.
    - `why`: the end of the error for absent required keys; `{model_type}` is filled in.
    - `**types`: `ints=`, `reals=`, ... as for `check_config_types`.

    **Returns:** the model type, and `hf` with its numbers normalised.

    **Raises:** `ValueError` or `TypeError` for the first check that fails.
    """
    model_type = check_model_type(hf, architectures, family)
    check_config_keys(hf, keys[model_type], f"{family} ({model_type})")
    missing = [k for k in required if k not in hf]
    if missing:
        raise ValueError(f"config.json lacks {missing}; {why.format(model_type=model_type)}")
    return model_type, check_config_types(hf, file, prefix="", **types)  # top-level keys


def decoder_from_hf(hf: Mapping[str, Any], max_len: int) -> dict[str, Any]:
    """The fields every decoder config has (`eqx_longctx.family.check_decoder_config`'s), but
    RoPE's (each family reads its own scaling), from a `config.json` whose types are
    checked; the parameter and compute dtype are `stored_dtype(hf)`.

    **Arguments:**

    - `hf`: the checked `config.json`.
    - `max_len`: `max_seq_len` when `max_position_embeddings` is absent (transformers'
      default for the model type).
    """
    dtype = stored_dtype(hf)
    return dict(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        hidden_dim=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        max_seq_len=hf.get("max_position_embeddings") or max_len,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        param_dtype=dtype,
        compute_dtype=dtype,
    )


def decoder_to_hf(config, model_type: str, architectures: dict[str, str]) -> dict[str, Any]:
    """The `config.json` keys of the fields every decoder config has (`decoder_from_hf`
    reads them back) and RoPE's base, with `model_type`, its architecture from
    `architectures`, and what every zoo decoder is (SwiGLU, no attention dropout); the
    family adds the rest."""
    return {
        "architectures": [architectures[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": 0.0,
        "torch_dtype": config.param_dtype,
    }


def check_model_type(hf: dict, architectures: dict[str, str], family: str) -> str:
    """Check `model_type` and `architectures` against the family's; return the model type.

    **Arguments:**

    - `hf`: the parsed `config.json`.
    - `architectures`: model_type -> the causal-LM architecture name it must declare.
    - `family`: e.g. `"models.llama"`, for the messages.
    """
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in architectures:
        raise ValueError(
            f"{family}.from_hf reads model_type {sorted(architectures)} "
            f"(architectures {sorted(architectures.values())}); got "
            f"model_type={model_type!r}. Use the zoo family of that model, if there is one."
        )
    arch = hf.get("architectures")
    if arch is not None and list(arch) != [architectures[model_type]]:
        raise ValueError(
            f"{family}.from_hf reads causal LMs, architectures "
            f"[{architectures[model_type]!r}] for model_type={model_type!r}; got "
            f"architectures={arch!r} (a base model or another head is not read)."
        )
    return model_type
