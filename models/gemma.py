"""Gemma 2 and Gemma 3 (text): decoders of local (sliding-window) and global attention layers.

Einsum letters: none (the arithmetic lives in the layers of `eqx_longctx.nn`).

Tokens -> embedding times `sqrt(dim)` -> `n_layers` blocks -> RMSNorm -> LM head (the tied
embedding) -> float32 logits, soft-capped by `final_softcap` when set. Each block
normalises around both of its sublayers, `x + post_norm(attn(norm(x)))` and the same for
the MLP (four RMSNorms), and every norm scales by `1 + weight` (zero-centred). The MLP is
GeGLU (GELU's tanh approximation gating the up projection). The attention is GQA with
the score scale `query_pre_attn_scalar ** -0.5` and, when `attn_softcap` is set, scores
capped as `c * tanh(s / c)` before the softmax; `layer_types` says which layers are local
(`"sliding_attention"`: query `i` sees keys `j` with `0 <= i - j < sliding_window`) and
which global (`"full_attention"`).

- Gemma 2 alternates local and global layers and soft-caps the scores and the logits.
- Gemma 3 runs five local layers per global one, normalises each query and key head
  (zero-centred RMSNorm before RoPE), and rotates the local layers with their own RoPE
  base (`rope_local_theta`), the global ones with `rope_theta` and its linear
  `rope_scaling`.

Layers are grouped into one `LayerStack` per run of equal layers (`models/_hybrid.py`):
Gemma 2's alternation gives one stack per layer, Gemma 3's 5:1 pattern two per six
layers. References: Gemma Team 2024, "Gemma 2: Improving Open Language Models at a
Practical Size" (arXiv:2408.00118); Gemma Team 2025, "Gemma 3 Technical Report"
(arXiv:2503.19786); transformers' `Gemma2ForCausalLM` and `Gemma3ForCausalLM`.
"""

import dataclasses
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
    check_real,
)
from eqx_longctx.nn import (
    AbstractDecoder,
    DecoderBlock,
    LayerStack,
    LinearRopeScaling,
    RMSNorm,
    RoPE,
    SelfAttention,
    SwiGLU,
)

from . import _gemma_hf, _hf_io, _hybrid

SLIDING, FULL = "sliding_attention", "full_attention"


@final
@no_type_check  # __post_init__ checks every field, with messages that name the fix
@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    """Hyperparameters of a Gemma 2 or Gemma 3 text model (hashable, so it can be a static
    field). Fields are checked on construction as `LlamaConfig`'s are.

    **Arguments:**

    - `vocab_size`, `dim`, `n_layers`, `n_heads`, `hidden_dim`: vocabulary, width, depth,
      query heads, GeGLU width.
    - `n_kv_heads`, `head_dim`: key/value heads (default `n_heads`) and the width of each
      head (default `dim // n_heads`), filled in at construction.
    - `sliding_window`, `layer_types`: the local layers' window and each layer's kind
      (`"sliding_attention"` or `"full_attention"`), as `LlamaConfig`'s; `None` layer types
      = every layer slides when `sliding_window` is set, else none.
    - `rope_theta`, `rope_scaling`: the global layers' RoPE base and optional
      `LinearRopeScaling`.
    - `rope_local_theta`: the local layers' RoPE base; `None` = `rope_theta` (Gemma 2).
      Local layers are never scaled.
    - `query_pre_attn_scalar`: the scores are scaled by its inverse square root; `None` =
      `head_dim`.
    - `attn_softcap`: cap `c` of the scaled scores, `c * tanh(s / c)` (Gemma 2: 50), or
      `None`.
    - `final_softcap`: cap of the logits (Gemma 2: 30), or `None`.
    - `qk_norm`: zero-centred RMSNorm over each query and key head before RoPE (Gemma 3).
    - `norm_eps`, `max_seq_len`, `tie_embeddings`, `remat`, `param_dtype`,
      `compute_dtype`, `init_std`: as `LlamaConfig`'s.

    **Raises:** `TypeError` for a field of the wrong type; `ValueError` for a size that is
    not positive, `n_heads` not a multiple of `n_kv_heads`, an odd `head_dim`, a RoPE base,
    scalar or cap that is not a positive number, and `layer_types` / `sliding_window` as
    `LlamaConfig`.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    hidden_dim: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_theta: float | int = 10000.0
    rope_scaling: LinearRopeScaling | None = None
    rope_local_theta: float | int | None = None
    query_pre_attn_scalar: float | int | None = None
    attn_softcap: float | int | None = None
    final_softcap: float | int | None = None
    qk_norm: bool = False
    norm_eps: float = 1e-6
    max_seq_len: int = 8192
    tie_embeddings: bool = True
    remat: str = "none"
    param_dtype: str | type | np.dtype = "float32"
    compute_dtype: str | type | np.dtype = "float32"
    init_std: float = 0.02

    def __post_init__(self):
        check_decoder_config(self, scaling_cls=LinearRopeScaling)
        check_fields(self, optional_ints=("n_kv_heads", "head_dim"), bools=("qk_norm",))
        check_layer_windows(self)
        name = "GemmaConfig"
        for field in ("rope_local_theta", "query_pre_attn_scalar", "attn_softcap", "final_softcap"):
            value = getattr(self, field)
            if value is not None:
                fix = " Use None to leave it unset."
                value = check_real(value, f"{name}.{field}", positive=True, fix=fix)
                object.__setattr__(self, field, value)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.n_heads % cast(int, self.n_kv_heads):
            raise ValueError(
                f"{name} needs n_heads to be a multiple of n_kv_heads; got n_heads="
                f"{self.n_heads}, n_kv_heads={self.n_kv_heads}. Choose n_kv_heads among the "
                f"divisors of {self.n_heads}."
            )
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(
                    f"{name} derives head_dim = dim // n_heads, so dim must be divisible by "
                    f"n_heads; got dim={self.dim}, n_heads={self.n_heads}. Pass head_dim."
                )
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if cast(int, self.head_dim) % 2:
            raise ValueError(
                f"{name} needs an even head_dim (RoPE rotates feature pairs); got "
                f"head_dim={self.head_dim}."
            )

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The attention window of each layer (`None` = a global layer)."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.n_layers
        return tuple(self.sliding_window if t == SLIDING else None for t in self.layer_types)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's kind, `"sliding_attention"` or `"full_attention"`: one
        `LayerStack` per run."""
        return tuple(FULL if w is None else SLIDING for w in self.windows)

    @property
    def score_scale(self) -> float:
        """The attention's score scale, `query_pre_attn_scalar ** -0.5`."""
        return float(self.query_pre_attn_scalar or cast(int, self.head_dim)) ** -0.5

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "GemmaConfig":
        """A preset from `PRESETS` or `GEMMA3_PRESETS` with some fields replaced. When
        `n_layers` is overridden and `layer_types` is not, the preset's pattern (every
        second layer global for Gemma 2, every sixth for Gemma 3) is laid out again.

        **Returns:** the new `GemmaConfig`.

        **Raises:** `ValueError` for an unknown preset (the message lists them); `TypeError`
        for an override that is not a field; and as the constructor for the new values.
        """
        preset = check_preset({**PRESETS, **GEMMA3_PRESETS}, name, overrides, "Gemma")
        if "n_layers" in overrides and "layer_types" not in overrides:
            every = 6 if preset.qk_norm else 2
            overrides["layer_types"] = pattern(overrides["n_layers"], every)
        if ("dim" in overrides or "n_heads" in overrides) and "head_dim" not in overrides:
            overrides["head_dim"] = None
        return dataclasses.replace(preset, **overrides)


def pattern(n_layers: int, every: int) -> tuple[str, ...]:
    """**Returns:** the layer types of `n_layers` layers of which every `every`-th is global
    (layer `i` is global when `(i + 1) % every == 0`), as transformers derives them."""
    return tuple(FULL if (i + 1) % every == 0 else SLIDING for i in range(n_layers))


def make_block(config: GemmaConfig, kind: str, *, key: PRNGKeyArray, spec=None) -> DecoderBlock:
    """One block of `kind` (`"sliding_attention"` or `"full_attention"`): local or global
    attention with its RoPE, GeGLU, four zero-centred norms.

    **Returns:** the `eqx_longctx.nn.DecoderBlock`.
    """
    c = config
    dtype = jnp.dtype(c.param_dtype)
    head_dim = cast(int, c.head_dim)
    init: dict[str, Any] = dict(
        init_std=c.init_std, out_init_std=c.init_std / math.sqrt(2 * c.n_layers), dtype=dtype,
        spec=spec,
    )  # fmt: skip
    if kind == SLIDING:
        window, rope = c.sliding_window, RoPE(head_dim, c.rope_local_theta or c.rope_theta)
    else:
        window, rope = None, RoPE(head_dim, c.rope_theta, c.rope_scaling)
    k_attn, k_mlp = jax.random.split(key)
    attn = SelfAttention(
        c.dim, c.n_heads, cast(int, c.n_kv_heads), head_dim, rope=rope, key=k_attn,
        qk_norm=c.qk_norm, norm_eps=c.norm_eps, norm_zero_centred=True, window=window,
        softcap=c.attn_softcap, scale=c.score_scale, **init,
    )  # fmt: skip
    mlp = SwiGLU(c.dim, c.hidden_dim, key=k_mlp, activation="gelu_tanh", **init)
    return DecoderBlock(
        attn, mlp, dim=c.dim, norm_eps=c.norm_eps, dtype=dtype, zero_centred_norms=True,
        post_norms=True,
    )  # fmt: skip


@final
class Gemma(AbstractDecoder):
    """The Gemma 2 / Gemma 3 text decoder. Call it as `model(tokens, positions,
    segment_ids) -> logits`.

    `layers` holds one `LayerStack` per run of equal layers (`config.kinds`), in order.
    The token embeddings are multiplied by `sqrt(dim)` (`embed_scale`) and the logits
    soft-capped by `config.final_softcap` (`logit_softcap`), also in the trainer's chunked
    loss.
    """

    embed: Float[Array, "vocab embed"]
    layers: tuple[LayerStack, ...]
    norm: RMSNorm
    lm_head: Float[Array, "embed vocab"] | None
    config: GemmaConfig = eqx.field(static=True)
    spec: ShardingSpec | None = eqx.field(static=True)

    # `config`, `key` and `spec` are checked below, with errors that say how to build them.
    def __init__(self, config: object, *, key: object, spec: object = None):
        """**Arguments:**

        - `config`: the `GemmaConfig`.
        - `key`: PRNG key for the initialisation (`jax.random.key(seed)`).
        - `spec`: the `ShardingSpec` of every layer; `None` = one device.

        **Raises:** `TypeError` when `config` is not a `GemmaConfig`, `key` not a PRNG key
        or `spec` not a `ShardingSpec` (or `None`).
        """
        check_model_args("Gemma", config, GemmaConfig, key, spec)
        c, spec = cast(GemmaConfig, config), cast(ShardingSpec | None, spec)
        dtype = jnp.dtype(c.param_dtype)
        self.embed, self.lm_head, self.layers = _hybrid.kind_layers(
            c, c.kinds, make_block, key=cast(PRNGKeyArray, key), spec=spec
        )
        self.norm = RMSNorm(c.dim, eps=c.norm_eps, dtype=dtype, zero_centred=True)
        self.config = c
        self.spec = spec

    def layer_stacks(self) -> tuple[LayerStack, ...]:
        """The layer stacks in order: one per run of equal layers."""
        return self.layers

    def embed_scale(self) -> float:
        """**Returns:** `sqrt(dim)`, the factor of the token embeddings."""
        return self.config.dim**0.5

    def logit_softcap(self) -> float | None:
        """**Returns:** `config.final_softcap`, the logits' soft-cap (`None`: none)."""
        return self.config.final_softcap


# fmt: off
PRESETS: dict[str, GemmaConfig] = {
    # Byte-level tokenizer (256 bytes + 3 specials), Gemma 2's layout at a CPU's size.
    "tiny": GemmaConfig(
        vocab_size=259, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64,
        hidden_dim=768, sliding_window=512, layer_types=pattern(4, 2),
        query_pre_attn_scalar=64, attn_softcap=50.0, final_softcap=30.0, max_seq_len=2048,
    ),
    # config.json of google/gemma-2-9b
    "gemma-2-9b": GemmaConfig(
        vocab_size=256000, dim=3584, n_layers=42, n_heads=16, n_kv_heads=8, head_dim=256,
        hidden_dim=14336, sliding_window=4096, layer_types=pattern(42, 2),
        query_pre_attn_scalar=256, attn_softcap=50.0, final_softcap=30.0, max_seq_len=8192,
    ),
}
GEMMA3_PRESETS: dict[str, GemmaConfig] = {
    # Gemma 3's layout at a CPU's size (names differ from the gemma2 family's: both share
    # GemmaConfig.from_preset).
    "gemma3-tiny": GemmaConfig(
        vocab_size=259, dim=256, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=64,
        hidden_dim=768, sliding_window=256, layer_types=pattern(6, 6), rope_theta=1e6,
        rope_scaling=LinearRopeScaling(8.0), rope_local_theta=1e4, query_pre_attn_scalar=64,
        qk_norm=True, max_seq_len=4096,
    ),
    # The text_config of google/gemma-3-4b-pt (transformers' Gemma3TextConfig defaults
    # for the keys it leaves out: 8 heads, 4 K/V heads of 256, the vocabulary).
    "gemma-3-4b": GemmaConfig(
        vocab_size=262208, dim=2560, n_layers=34, n_heads=8, n_kv_heads=4, head_dim=256,
        hidden_dim=10240, sliding_window=1024, layer_types=pattern(34, 6), rope_theta=1e6,
        rope_scaling=LinearRopeScaling(8.0), rope_local_theta=1e4, query_pre_attn_scalar=256,
        qk_norm=True, max_seq_len=131072,
    ),
    # The text_config of google/gemma-3-27b-pt.
    "gemma-3-27b": GemmaConfig(
        vocab_size=262208, dim=5376, n_layers=62, n_heads=32, n_kv_heads=16, head_dim=128,
        hidden_dim=21504, sliding_window=1024, layer_types=pattern(62, 6), rope_theta=1e6,
        rope_scaling=LinearRopeScaling(8.0), rope_local_theta=1e4, query_pre_attn_scalar=168,
        qk_norm=True, max_seq_len=131072,
    ),
}
# fmt: on
"""The named configs of the `gemma2` family (`PRESETS`) and the `gemma3_text` family
(`GEMMA3_PRESETS`); `GemmaConfig.from_preset` reads both."""


# ---- Hugging Face checkpoints (format: models/_gemma_hf.py) ------------------------------

_HF = _hf_io.HFFormat(Gemma, GemmaConfig, _gemma_hf, "Build it with Gemma(config, ...).")


def from_hf(
    path,
    *,
    spec: object = None,  # checked, with an error that says how to build a ShardingSpec
    dtype: str | type | np.dtype | None = None,
    **overrides,
) -> Gemma:
    """Load a Hugging Face Gemma 2 or Gemma 3 text checkpoint: `model_type` `gemma2`
    (`Gemma2ForCausalLM`), `gemma3_text` (`Gemma3ForCausalLM`), or the text model of a
    `gemma3` vision-language checkpoint (`Gemma3ForConditionalGeneration`: its
    `text_config` and its language model's weights, under `model.language_model.` as
    transformers 5 writes them or `language_model.model.` as the Hub's checkpoints do; the
    vision tower and the projector are skipped).

    Reads as `models.llama.from_hf` does: every tensor checked by name, shape and dtype
    before any data is read, then each parameter read straight into its shards. Keys the
    checkpoint leaves out take transformers' defaults for its model type; RoPE is read
    from `rope_parameters` (per layer type for Gemma 3) or the older `rope_theta`,
    `rope_scaling` and `rope_local_base_freq`.

    **Arguments:**

    - `path`: the checkpoint directory.
    - `spec`: the sharding spec of the returned model, or `None` for one device.
    - `dtype`: parameter dtype; default the checkpoint's.
    - `**overrides`: fields of the `GemmaConfig` to replace that do not change a weight's
      shape (`remat`, `compute_dtype`, `max_seq_len`, `rope_theta`, ...).

    **Returns:** the `Gemma`; its `.config` is the equivalent `GemmaConfig`.

    **Raises:** `ValueError`, naming the file and the key or tensor, for a missing or
    damaged checkpoint, an unsupported `model_type` or architecture, config keys or values
    this family does not support (attention biases, bidirectional attention, another
    activation or RoPE type, a soft-cap transformers would ignore), and missing, extra or
    wrong-shape tensors; `TypeError` when `path` is not a `str` or `os.PathLike`;
    `TypeError` or `ValueError` for `spec`, `dtype` or overrides that are not valid.
    """
    return _HF.from_hf(path, spec, dtype, overrides)


def config_from_hf(path, *, dtype: str | type | np.dtype | None = None, **overrides) -> GemmaConfig:
    """The `GemmaConfig` that `from_hf(path, dtype=dtype, **overrides)` would build, from
    `config.json` alone (no weights read).

    **Raises:** as `from_hf` for `config.json`, `dtype` and the overrides.
    """
    return _HF.config_from_hf(path, dtype, overrides)


def to_hf(model: object, path, *, max_shard_size: int | None = None) -> None:
    """Write `model` as a Hugging Face checkpoint (`config.json` + safetensors) that
    `transformers.AutoModelForCausalLM.from_pretrained` loads: `Gemma3ForCausalLM`
    (`gemma3_text`) when the config has `qk_norm`, else `Gemma2ForCausalLM` (`gemma2`).
    `from_hf` reads back the same `GemmaConfig`.

    **Arguments:**

    - `model`: the `Gemma` (its parameters must be addressable from this process).
    - `path`: output directory, created if needed.
    - `max_shard_size`: bytes per safetensors file; `None` writes one `model.safetensors`.

    **Raises:** `TypeError` when `model` is not a `Gemma` or `path` is not a path;
    `ValueError` when `path` exists and is not a directory, the model holds abstract
    shapes or parameters this process cannot address, or its config has no Hugging Face
    form (Gemma 2 with a local RoPE base or a RoPE scaling, Gemma 3 with an attention
    soft-cap); `TypeError` or `ValueError` for a `max_shard_size` that is not a positive
    int.
    """
    _HF.to_hf(model, path, max_shard_size)


__all__ = [
    "GEMMA3_PRESETS",
    "PRESETS",
    "Gemma",
    "GemmaConfig",
    "config_from_hf",
    "from_hf",
    "make_block",
    "pattern",
    "to_hf",
]
