"""Llama 2 / Llama 3 decoder-only language model, with presets.

Einsum letters: `b` batch, `s` sequence, `e` embed, `v` vocabulary.

Tokens -> embedding -> `n_layers` x (RMSNorm -> GQA self-attention with RoPE -> residual;
RMSNorm -> SwiGLU -> residual) -> RMSNorm -> LM head (or the tied embedding) -> float32
logits. References: Touvron et al. 2023, "Llama 2" (arXiv:2307.09288); Llama Team 2024,
"The Llama 3 Herd of Models" (arXiv:2407.21783).

The same decoder with q/k/v biases is Qwen2 (Yang et al. 2024, arXiv:2407.10671), with
per-head q/k RMSNorm Qwen3 (Qwen Team 2025, arXiv:2505.09388), and with a sliding window in
every layer Mistral (Jiang et al. 2023, "Mistral 7B", arXiv:2310.06825); Qwen2/Qwen3 may
mix sliding and full layers (`layer_types`). `from_hf` and `to_hf` read and write the
Hugging Face checkpoints of all four families.
"""

import dataclasses
import functools
import itertools
import math
from typing import Any, cast, final, no_type_check

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from eqx_longctx.family import (
    ShardingSpec,
    check_decoder_config,
    check_fields,
    check_layer_windows,
    check_model_args,
    check_preset,
)
from eqx_longctx.nn import (
    AbstractDecoder,
    AbstractRopeScaling,
    DecoderBlock,
    LayerStack,
    RMSNorm,
    RoPE,
    SelfAttention,
    SwiGLU,
)
from eqx_longctx.nn import Llama3RopeScaling as Llama3RopeScaling

from . import _decoder, _hf_io, _llama_hf


@final
@no_type_check  # __post_init__ checks every field, with messages that name the fix
@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters of a Llama model (hashable, so it can be a static field).

    Every field is checked on construction (`TypeError` for a wrong type, `ValueError` for a
    wrong value, naming the field): sizes are ints (Python or NumPy; not bools, and not
    floats, so `dim=32.0` is an error), `norm_eps`, `rope_theta` and `init_std` finite and
    positive, flags bools. NumPy values are stored as Python ones.

    **Arguments:**

    - `vocab_size`, `dim`, `n_layers`, `n_heads`: vocabulary, width, depth, query heads.
    - `hidden_dim`: SwiGLU width.
    - `n_kv_heads`: key/value heads (default `n_heads`: MHA; fewer is GQA, 1 is MQA).
    - `head_dim`: width of each head (default `dim // n_heads`, filled in at construction).
    - `norm_eps`: RMSNorm epsilon.
    - `rope_theta`, `rope_scaling`: RoPE base and optional frequency scaling (Llama 3.1's
      `Llama3RopeScaling` in the presets and checkpoints; any `AbstractRopeScaling`, e.g.
      YaRN or linear, to stretch a trained model at eval time).
    - `max_seq_len`: longest sequence the model accepts.
    - `tie_embeddings`: reuse the token embedding as the LM head.
    - `attention_bias`: biases on the q/k/v projections (Qwen2-style).
    - `qk_norm`: RMSNorm over each query and key head before RoPE (Qwen3-style).
    - `remat`: `"none"`, `"full"`, `"dots"` or `"offload"` (layer inputs kept in host
      memory; see `eqx_longctx.nn.LayerStack`).
    - `param_dtype`, `compute_dtype`: `"float32"`, `"bfloat16"` or `"float16"`; logits
      are always float32.
    - `init_std`: standard deviation of the normal initialisation; output projections use
      `init_std / sqrt(2 * n_layers)`.
    - `sliding_window`: window `W` of the sliding layers (query `i` sees keys `j` with
      `0 <= i - j < W`, Hugging Face's rule), or `None`.
    - `layer_types`: `"full_attention"` or `"sliding_attention"` per layer, as in
      transformers; `None` = every layer slides if `sliding_window` is set (Mistral), else
      none. Stored as `None` when all layers are of one kind. See `windows`.

    **Raises:** each message names the field.

    - `TypeError` for a size that is not an int, `norm_eps`, `rope_theta` or `init_std`
      not a number, a flag that is not a bool, a `rope_scaling` that is not an
      `eqx_longctx.nn.AbstractRopeScaling` (or `None`), or `layer_types` that is not a
      tuple or list.
    - `ValueError` for a size that is not positive, `norm_eps`, `rope_theta` or `init_std`
      not finite and positive, a `remat` or dtype not among the choices, `n_heads` not a
      multiple of `n_kv_heads`, `dim` not divisible by `n_heads` when `head_dim` is
      derived, an odd `head_dim`, `layer_types` not one of `"full_attention"` /
      `"sliding_attention"` per layer, sliding layers without a `sliding_window`, or a
      `sliding_window` that no layer in `layer_types` uses.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    hidden_dim: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float | int = 10000.0
    rope_scaling: AbstractRopeScaling | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    remat: str = "none"
    param_dtype: str | type | np.dtype = "float32"
    compute_dtype: str | type | np.dtype = "float32"
    init_std: float = 0.02
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self):
        check_decoder_config(self, scaling_cls=AbstractRopeScaling)
        check_fields(
            self,
            optional_ints=("n_kv_heads", "head_dim"),
            bools=("attention_bias", "qk_norm"),
        )
        check_layer_windows(self)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        n_kv_heads = cast(int, self.n_kv_heads)
        if self.n_heads % n_kv_heads != 0:
            raise ValueError(
                "LlamaConfig needs n_heads to be a multiple of n_kv_heads (GQA groups query "
                f"heads over shared K/V heads); got n_heads={self.n_heads}, "
                f"n_kv_heads={self.n_kv_heads}. Choose n_kv_heads among the divisors of "
                f"{self.n_heads}."
            )
        if self.head_dim is None:
            if self.dim % self.n_heads != 0:
                raise ValueError(
                    "LlamaConfig derives head_dim = dim // n_heads, so dim must be divisible "
                    f"by n_heads; got dim={self.dim}, n_heads={self.n_heads}. Change one of "
                    "them or pass head_dim explicitly."
                )
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if cast(int, self.head_dim) % 2 != 0:
            raise ValueError(
                f"LlamaConfig needs a positive even head_dim (RoPE rotates feature pairs); got "
                f"head_dim={self.head_dim}."
            )

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The attention window of each layer (`None` = full causal attention)."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.n_layers
        return tuple(
            self.sliding_window if kind == "sliding_attention" else None
            for kind in self.layer_types
        )

    @property
    def window_runs(self) -> tuple[tuple[int, int, int | None], ...]:
        """`(first layer, number of layers, window)` of each run of consecutive layers with
        the same window: one `LayerStack` each in `Llama`."""
        runs, start = [], 0
        for window, group in itertools.groupby(self.windows):
            n = len(list(group))
            runs.append((start, n, window))
            start += n
        return tuple(runs)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "LlamaConfig":
        """A preset from `PRESETS` with some fields replaced.

        When `dim` or `n_heads` is overridden and `head_dim` is not, `head_dim` is derived
        again as `dim // n_heads`.

        **Arguments:**

        - `name`: a key of `PRESETS`.
        - `**overrides`: fields to replace, e.g. `vocab_size=512` or `remat="full"`.

        **Returns:** the new `LlamaConfig`.

        **Raises:** `ValueError` for an unknown preset (the message lists them); `TypeError`
        for an override that is not a field; and as the constructor for the new values.
        """
        preset = check_preset(PRESETS, name, overrides, "Llama")
        if ("dim" in overrides or "n_heads" in overrides) and "head_dim" not in overrides:
            overrides["head_dim"] = None
        return dataclasses.replace(preset, **overrides)


@final
class Llama(AbstractDecoder):
    """The Llama decoder. Call it as `model(tokens, positions, segment_ids) -> logits`.

    The attention window is static (it decides which blocks the attention skips), so the
    layers cannot all share one scanned body when their windows differ. `layers` is one
    `LayerStack` when every layer has the same window (any model without sliding layers,
    or Mistral's); with mixed `layer_types` it is a tuple of `LayerStack`s, one per run of
    consecutive layers with the same window, applied in order (e.g. Qwen2's full layers
    below `max_window_layers`, then its sliding ones: two scans). A pattern that alternates
    every layer thus compiles one body per layer.
    """

    embed: Float[Array, "vocab embed"]
    layers: LayerStack | tuple[LayerStack, ...]
    norm: RMSNorm
    lm_head: Float[Array, "embed vocab"] | None
    config: LlamaConfig = eqx.field(static=True)
    spec: ShardingSpec | None = eqx.field(static=True)

    # `config`, `key` and `spec` are checked below, with errors that say how to build them.
    def __init__(self, config: object, *, key: object, spec: object = None):
        """**Arguments:**

        - `config`: the `LlamaConfig`.
        - `key`: PRNG key for the initialisation (`jax.random.key(seed)`).
        - `spec`: the `ShardingSpec` handed to every attention call; `None` = one device.

        **Raises:** `TypeError` when `config` is not a `LlamaConfig`, `key` not a PRNG key
        or `spec` not a `ShardingSpec` (or `None`). The config's values were checked when it
        was built; the spec's fit to a batch is checked on each call.
        """
        check_model_args("Llama", config, LlamaConfig, key, spec)
        c, spec = cast(LlamaConfig, config), cast(ShardingSpec | None, spec)
        dtype = jnp.dtype(c.param_dtype)
        n_kv_heads, head_dim = cast(int, c.n_kv_heads), cast(int, c.head_dim)
        k_embed, k_layers, k_head = jax.random.split(cast(PRNGKeyArray, key), 3)
        rope = RoPE(head_dim, c.rope_theta, c.rope_scaling)
        out_std = c.init_std / math.sqrt(2 * c.n_layers)
        init: dict[str, Any] = dict(
            init_std=c.init_std, out_init_std=out_std, dtype=dtype, spec=spec
        )

        def make_layer(k, window):
            k_attn, k_mlp = jax.random.split(k)
            attn = SelfAttention(
                c.dim,
                c.n_heads,
                n_kv_heads,
                head_dim,
                rope=rope,
                key=k_attn,
                qkv_bias=c.attention_bias,
                qk_norm=c.qk_norm,
                norm_eps=c.norm_eps,
                window=window,
                **init,
            )
            mlp = SwiGLU(c.dim, c.hidden_dim, key=k_mlp, **init)
            return DecoderBlock(attn, mlp, dim=c.dim, norm_eps=c.norm_eps, dtype=dtype)

        self.embed, self.lm_head = _decoder.embed_and_head(c, k_embed, k_head, dtype)
        runs = c.window_runs
        keys = [k_layers] if len(runs) == 1 else list(jax.random.split(k_layers, len(runs)))
        stacks = tuple(
            LayerStack(
                functools.partial(make_layer, window=window), n, key=k, remat=c.remat, spec=spec
            )
            for (_, n, window), k in zip(runs, keys, strict=True)
        )
        self.layers = stacks[0] if len(stacks) == 1 else stacks
        self.norm = RMSNorm(c.dim, eps=c.norm_eps, dtype=dtype)
        self.config = c
        self.spec = spec

    def layer_stacks(self) -> tuple[LayerStack, ...]:
        """The layer stacks in order: one per run of equally windowed layers."""
        return self.layers if isinstance(self.layers, tuple) else (self.layers,)


# fmt: off
PRESETS: dict[str, LlamaConfig] = {
    # Byte-level tokenizer (256 bytes + 3 specials); small enough to train on a CPU.
    "tiny": LlamaConfig(
        vocab_size=259, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, hidden_dim=688,
        rope_theta=10000.0, max_seq_len=2048,
    ),
    "llama2-7b": LlamaConfig(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, hidden_dim=11008,
        norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096,
    ),
    "llama3.2-1b": LlamaConfig(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
        hidden_dim=8192, norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=Llama3RopeScaling(32.0, 1.0, 4.0, 8192), max_seq_len=131072,
        tie_embeddings=True,
    ),
    "llama3.1-8b": LlamaConfig(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336,
        norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 8192), max_seq_len=131072,
    ),
    # Mistral 7B v0.1: a 4096-token sliding window in every layer.
    "mistral-7b": LlamaConfig(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336,
        norm_eps=1e-5, rope_theta=10000.0, max_seq_len=32768, sliding_window=4096,
    ),
}
# fmt: on
"""The named configs `LlamaConfig.from_preset` starts from."""


# ---- Hugging Face checkpoints (format: models/_llama_hf.py) ------------------------------

_HF = _hf_io.HFFormat(Llama, LlamaConfig, _llama_hf, "Build it with Llama(config, ...).")


def from_hf(
    path,
    *,
    spec: object = None,  # checked, with an error that says how to build a ShardingSpec
    dtype: str | type | np.dtype | None = None,
    **overrides,
) -> Llama:
    """Load a Hugging Face Llama 2/3.x, Mistral, Qwen2 or Qwen3 causal-LM checkpoint.

    Reads `config.json` and `model.safetensors` (or the shards listed by
    `model.safetensors.index.json`) with `safetensors`, without torch. Every tensor is
    checked by name, shape and dtype before any data is read; then one tensor at a time is
    read, converted to `dtype` on the host and placed on its devices. Errors about the files
    name the file, and the key or tensor. Integral floats in `config.json` (`4096.0`) are
    read as ints. Sliding windows (Mistral's `sliding_window`; Qwen's `use_sliding_window`,
    `sliding_window`, `max_window_layers` and `layer_types`) become `sliding_window` and
    `layer_types` with transformers' semantics (see `models/_hf_windows.py`).

    **Arguments:**

    - `path`: the checkpoint directory (e.g. from `save_pretrained` or a Hub snapshot).
    - `spec`: the sharding spec of the returned model; each parameter is read straight into
      its shards under the spec's rules table (`eqx_longctx.param_shardings`): no device
      ever holds the whole model. `None` = one device.
    - `dtype`: parameter dtype (`"float32"`, `"bfloat16"`, `"float16"`); default the
      checkpoint's (`config.json` `dtype`/`torch_dtype`, else float32).
    - `**overrides`: fields of the `LlamaConfig` to replace, e.g. `remat`,
      `compute_dtype` (default `dtype`), `max_seq_len` (default `max_position_embeddings`),
      `rope_theta` or `rope_scaling` (to extend the context); an override that would change
      a weight's shape (`n_layers`, `dim`, ...) is a `ValueError`.

    **Returns:** the `Llama`; its `.config` is the equivalent `LlamaConfig`.

    **Raises:** `ValueError`, naming the file and the key or tensor, for a missing or
    damaged checkpoint, an unsupported `model_type` or architecture, config keys or values
    this family does not support, and missing, extra or wrong-shape tensors; `TypeError`
    when `path` is not a `str` or `os.PathLike`; `TypeError` or `ValueError` for `spec`,
    `dtype` or overrides that are not valid.
    """
    return _HF.from_hf(path, spec, dtype, overrides)


def config_from_hf(path, *, dtype: str | type | np.dtype | None = None, **overrides) -> LlamaConfig:
    """The `LlamaConfig` that `from_hf(path, dtype=dtype, **overrides)` would build, from
    `config.json` alone (no weights read).

    **Raises:** as `from_hf` for `config.json`, `dtype` and the overrides.
    """
    return _HF.config_from_hf(path, dtype, overrides)


def to_hf(model: object, path, *, max_shard_size: int | None = None) -> None:
    """Write `model` as a Hugging Face checkpoint (`config.json` + safetensors).

    The family follows the config: `qk_norm` gives Qwen3, `attention_bias` Qwen2, neither
    Llama, or Mistral when every layer has the sliding window (mixed `layer_types` need
    Qwen2 or Qwen3). `transformers.AutoModelForCausalLM.from_pretrained(path)` loads the
    result, and `from_hf` reads back the same `LlamaConfig`.

    **Arguments:**

    - `model`: the `Llama` to write (its parameters must be addressable from this process).
    - `path`: output directory, created if needed.
    - `max_shard_size`: bytes per safetensors file; `None` writes one `model.safetensors`.

    **Raises:** `TypeError` when `model` is not a `Llama` or `path` is not a path;
    `ValueError` when `path` exists and is not a directory, the model holds abstract
    shapes or parameters this process cannot address, or its config has no Hugging Face
    family (both `qk_norm` and `attention_bias`, or mixed `layer_types` with neither);
    `TypeError` or `ValueError` for a `max_shard_size` that is not a positive int.
    """
    _HF.to_hf(model, path, max_shard_size)


__all__ = [
    "PRESETS",
    "Llama",
    "Llama3RopeScaling",
    "LlamaConfig",
    "config_from_hf",
    "from_hf",
    "to_hf",
]
