"""GPT-OSS: a mixture-of-experts decoder whose attention has learned sinks and alternates
sliding-window and full layers, with presets.

Einsum letters: none (the arithmetic lives in the layers of `eqx_longctx.nn`).

Tokens -> embedding -> `n_layers` x (RMSNorm -> GQA self-attention -> residual; RMSNorm ->
experts -> residual) -> RMSNorm -> LM head -> float32 logits. What sets it apart:

- **Attention sinks**: one learned logit per query head joins every softmax denominator
  and carries no value (`SelfAttention(sinks=True)`; `eqx_longctx.attention` adds it once
  after the partial results are merged, so every strategy and layout takes it).
- **Sliding and full layers**: `layer_types` says which layers see only the last
  `sliding_window` (128) keys; by default they alternate, sliding first. Each run of equal
  layers is one `LayerStack` (`models/_hybrid.py`), so an alternating model has one
  stack per layer; the sliding layers' KV cache is a ring of about the window.
- **Biases** on the q, k, v and output projections (`attention_bias`).
- **Experts in every layer**: a router with a bias picks the `top_k` largest logits and
  weighs the chosen experts by their softmax (`MoE` with `norm_topk_prob`: the same
  weights); each expert has biases and the clamped SwiGLU `ClampedSwiGLU(swiglu_alpha,
  swiglu_limit)`. No shared expert and no dense MLP.
- **YaRN** RoPE (`YarnRopeScaling`: factor 32 over a 4096-token pre-training context).

References: OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card" (arXiv:2508.10925);
Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks"
(arXiv:2309.17453); Peng et al. 2023, "YaRN" (arXiv:2309.00071); transformers'
`GptOssForCausalLM`.
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
    check_choice,
    check_decoder_config,
    check_fields,
    check_instance,
    check_model_args,
    check_preset,
    check_real,
)
from eqx_longctx.nn import (
    GROUPED_MATMULS,
    AbstractDecoder,
    ClampedSwiGLU,
    DecoderBlock,
    LayerStack,
    MoE,
    RMSNorm,
    RoPE,
    SelfAttention,
    YarnRopeScaling,
    check_routing,
)

from . import _gpt_oss_hf, _hf_io, _hybrid

LAYER_TYPES = ("sliding_attention", "full_attention")


@final
@no_type_check  # __post_init__ checks every field, with messages that name the fix
@dataclasses.dataclass(frozen=True)
class GptOssConfig:
    """Hyperparameters of a GPT-OSS model (hashable, so it can be a static field). Fields
    are checked on construction as `LlamaConfig`'s are.

    **Arguments:**

    - `vocab_size`, `dim`, `n_layers`: vocabulary, width, depth.
    - `n_heads`, `n_kv_heads`, `head_dim`: query heads, key/value heads, head width.
    - `hidden_dim`: each expert's width (`intermediate_size`).
    - `n_experts`, `top_k`: routed experts per layer, and how many each token uses.
    - `sliding_window`: the window `W` of the sliding layers (query `i` sees keys `j` with
      `0 <= i - j < W`), or `None` when no layer slides.
    - `layer_types`: `"sliding_attention"` or `"full_attention"` per layer; `None` =
      alternating, sliding first (transformers' default) when there is a window, else all
      full; filled in at construction.
    - `attention_bias`: biases on the q, k, v and output projections.
    - `swiglu_alpha`, `swiglu_limit`: the experts' `ClampedSwiGLU`.
    - `norm_eps`, `rope_theta`, `rope_scaling` (a `YarnRopeScaling` or `None`),
      `max_seq_len`, `tie_embeddings`, `remat`, `param_dtype`, `compute_dtype`,
      `init_std`: as `LlamaConfig`'s.
    - `grouped_matmul`, `capacity_factor`: how the experts run (see `eqx_longctx.nn.MoE`).

    **Raises:** `TypeError` for a field of the wrong type; `ValueError` for a size that is
    not positive, `n_heads` not a multiple of `n_kv_heads`, an odd `head_dim`, a `top_k`
    not in `[1, n_experts]`, `layer_types` not one of `LAYER_TYPES` per layer, sliding
    layers without a `sliding_window` (or a window no layer uses), or a `remat`, dtype or
    `grouped_matmul` not among the choices.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    n_experts: int
    top_k: int
    sliding_window: int | None = 128
    layer_types: tuple[str, ...] | None = None
    attention_bias: bool = True
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    norm_eps: float = 1e-5
    rope_theta: float | int = 150000.0
    rope_scaling: YarnRopeScaling | None = None
    max_seq_len: int = 131072
    tie_embeddings: bool = False
    grouped_matmul: str = "auto"
    capacity_factor: float | None = None
    remat: str = "none"
    param_dtype: str | type | np.dtype = "float32"
    compute_dtype: str | type | np.dtype = "float32"
    init_std: float = 0.02

    def __post_init__(self):
        name = "GptOssConfig"
        check_decoder_config(self, scaling_cls=YarnRopeScaling)
        check_fields(
            self,
            ints=("n_kv_heads", "head_dim", "n_experts", "top_k"),
            optional_ints=("sliding_window",),
            positive_reals=("swiglu_alpha", "swiglu_limit"),
            bools=("attention_bias",),
        )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"{name} needs n_heads to be a multiple of n_kv_heads; got n_heads="
                f"{self.n_heads}, n_kv_heads={self.n_kv_heads}."
            )
        if self.head_dim % 2:
            raise ValueError(
                f"{name} needs an even head_dim (RoPE rotates feature pairs); got "
                f"head_dim={self.head_dim}."
            )
        types = self.layer_types
        if types is None:
            kinds = LAYER_TYPES if self.sliding_window is not None else LAYER_TYPES[1:]
            types = tuple(kinds[i % len(kinds)] for i in range(self.n_layers))
        if isinstance(types, str) or not isinstance(types, list | tuple):
            raise TypeError(f"{name}.layer_types must be a tuple of {LAYER_TYPES} or None.")
        if len(types) != self.n_layers or not set(types) <= set(LAYER_TYPES):
            raise ValueError(
                f"{name}.layer_types needs one of {LAYER_TYPES} per layer ({self.n_layers}); "
                f"got {tuple(types)}."
            )
        object.__setattr__(self, "layer_types", tuple(types))
        sliding = "sliding_attention" in types
        if sliding != (self.sliding_window is not None):
            raise ValueError(
                f"{name}.sliding_window={self.sliding_window} with "
                f"{types.count('sliding_attention')} sliding layer(s): sliding layers need a "
                "window and a window needs sliding layers. Set both, or neither."
            )
        check_choice(self.grouped_matmul, f"{name}.grouped_matmul", GROUPED_MATMULS)
        if self.capacity_factor is not None:
            check_real(self.capacity_factor, f"{name}.capacity_factor", positive=True)
        check_routing(name, self.n_experts, self.top_k, "greedy", 1, 1)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The attention window of each layer (`None` = full causal attention)."""
        assert self.layer_types is not None  # filled in at construction
        return tuple(
            self.sliding_window if t == "sliding_attention" else None for t in self.layer_types
        )

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "GptOssConfig":
        """A preset from `PRESETS` with some fields replaced. When `n_layers` or
        `sliding_window` is overridden and `layer_types` is not, `layer_types` is derived
        again.

        **Returns:** the new `GptOssConfig`.

        **Raises:** `ValueError` for an unknown preset (the message lists them); `TypeError`
        for an override that is not a field; and as the constructor for the new values.
        """
        preset = check_preset(PRESETS, name, overrides, "GPT-OSS")
        if {"n_layers", "sliding_window"} & set(overrides) and "layer_types" not in overrides:
            overrides["layer_types"] = None
        return dataclasses.replace(preset, **overrides)


def make_block(config: object, kind: str, *, key: PRNGKeyArray, spec: object = None):
    """One block of `kind` (an entry of `config.layer_types`): sliding or full attention
    with sinks and biases, then the experts.

    **Returns:** the `eqx_longctx.nn.DecoderBlock`.

    **Raises:** `TypeError` when `config` is not a `GptOssConfig`; `ValueError` for an
    unknown `kind` or heads or experts the spec's mesh does not split.
    """
    check_instance(config, "models.gpt_oss.make_block's config", GptOssConfig,
                   "Build one with GptOssConfig.from_preset(name).")  # fmt: skip
    c, spec = cast(GptOssConfig, config), cast(ShardingSpec | None, spec)
    if kind not in LAYER_TYPES:
        raise ValueError(f"unknown GPT-OSS layer kind {kind!r}; choose one of {LAYER_TYPES}.")
    dtype = jnp.dtype(c.param_dtype)
    init: dict[str, Any] = dict(
        init_std=c.init_std, out_init_std=c.init_std / math.sqrt(2 * c.n_layers), dtype=dtype,
        spec=spec,
    )  # fmt: skip
    k_attn, k_mlp = jax.random.split(key)
    attn = SelfAttention(
        c.dim, c.n_heads, c.n_kv_heads, c.head_dim,
        rope=RoPE(c.head_dim, c.rope_theta, c.rope_scaling), key=k_attn,
        qkv_bias=c.attention_bias, output_bias=c.attention_bias, sinks=True,
        window=c.sliding_window if kind == "sliding_attention" else None, **init,
    )  # fmt: skip
    mlp = MoE(
        c.dim, c.hidden_dim, c.n_experts, c.top_k, key=k_mlp, norm_topk_prob=True,
        router_bias=True, expert_bias=True,
        activation=ClampedSwiGLU(c.swiglu_alpha, c.swiglu_limit),
        grouped_matmul=c.grouped_matmul, capacity_factor=c.capacity_factor, **init,
    )  # fmt: skip
    return DecoderBlock(attn, mlp, dim=c.dim, norm_eps=c.norm_eps, dtype=dtype)


@final
class GptOss(AbstractDecoder):
    """The GPT-OSS decoder. Call it as `model(tokens, positions, segment_ids) -> logits`.

    `layers` holds one `LayerStack` per run of equal layers (`config.layer_types`), in
    order.
    """

    embed: Float[Array, "vocab embed"]
    layers: tuple[LayerStack, ...]
    norm: RMSNorm
    lm_head: Float[Array, "embed vocab"] | None
    config: GptOssConfig = eqx.field(static=True)
    spec: ShardingSpec | None = eqx.field(static=True)

    # `config`, `key` and `spec` are checked below, with errors that say how to build them.
    def __init__(self, config: object, *, key: object, spec: object = None):
        """**Arguments:**

        - `config`: the `GptOssConfig`.
        - `key`: PRNG key for the initialisation (`jax.random.key(seed)`).
        - `spec`: the `ShardingSpec` of every layer; `None` = one device.

        **Raises:** `TypeError` when `config` is not a `GptOssConfig`, `key` not a PRNG key
        or `spec` not a `ShardingSpec` (or `None`); `ValueError` when the spec's tensor or
        expert axis does not divide the heads or experts.
        """
        check_model_args("GptOss", config, GptOssConfig, key, spec)
        c, spec = cast(GptOssConfig, config), cast(ShardingSpec | None, spec)
        dtype = jnp.dtype(c.param_dtype)
        kinds = cast(tuple[str, ...], c.layer_types)
        self.embed, self.lm_head, self.layers = _hybrid.kind_layers(
            c, kinds, make_block, key=cast(PRNGKeyArray, key), spec=spec
        )
        self.norm = RMSNorm(c.dim, eps=c.norm_eps, dtype=dtype)
        self.config = c
        self.spec = spec

    def layer_stacks(self) -> tuple[LayerStack, ...]:
        """The layer stacks in order: one per run of equal layers."""
        return self.layers


# The released models' RoPE: YaRN stretching a 4096-token pre-training context 32 times,
# its ramp bounds not rounded (truncate false).
_YARN = _gpt_oss_hf.HF_DEFAULT_YARN

# fmt: off
PRESETS: dict[str, GptOssConfig] = {
    # Byte-level tokenizer (256 bytes + 3 specials); 4 layers (sliding, full, sliding,
    # full) of 8 experts: small enough to train on a CPU.
    "tiny": GptOssConfig(
        vocab_size=259, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
        hidden_dim=128, n_experts=8, top_k=2, rope_scaling=_YARN, max_seq_len=2048,
    ),
    # openai/gpt-oss-20b's config.json (its experts stored in MXFP4; these are the shapes):
    # 24 layers, width 2880, 64 query / 8 key-value heads of 64, 32 experts of 2880, top 4.
    "gpt-oss-20b": GptOssConfig(
        vocab_size=201088, dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, head_dim=64,
        hidden_dim=2880, n_experts=32, top_k=4, sliding_window=128, norm_eps=1e-5,
        rope_theta=150000.0, rope_scaling=_YARN, max_seq_len=131072,
    ),
    # openai/gpt-oss-120b's config.json (transformers' GptOssConfig defaults): 36 layers of
    # 128 experts, otherwise as gpt-oss-20b.
    "gpt-oss-120b": GptOssConfig(
        vocab_size=201088, dim=2880, n_layers=36, n_heads=64, n_kv_heads=8, head_dim=64,
        hidden_dim=2880, n_experts=128, top_k=4, sliding_window=128, norm_eps=1e-5,
        rope_theta=150000.0, rope_scaling=_YARN, max_seq_len=131072,
    ),
}
# fmt: on
"""The named configs `GptOssConfig.from_preset` starts from."""


# ---- Hugging Face checkpoints (format: models/_gpt_oss_hf.py) ----------------------------

_HF = _hf_io.HFFormat(GptOss, GptOssConfig, _gpt_oss_hf, "Build it with GptOss(config, ...).")


def from_hf(
    path,
    *,
    spec: object = None,  # checked, with an error that says how to build a ShardingSpec
    dtype: str | type | np.dtype | None = None,
    **overrides,
) -> GptOss:
    """Load a Hugging Face GPT-OSS causal-LM checkpoint (`model_type` `gpt_oss`,
    `GptOssForCausalLM`) with unquantized weights.

    Reads as `models.llama.from_hf` does: every tensor checked by name, shape and dtype
    before any data is read, then each parameter read straight into its shards. The
    experts' interleaved `gate_up_proj` (and its bias) is split into the gate and up
    projections on the host. `config.json` keys transformers defaults (`layer_types`,
    `rope_parameters`) get transformers' defaults.

    **Arguments:**

    - `path`: the checkpoint directory.
    - `spec`: the sharding spec of the returned model, or `None` for one device.
    - `dtype`: parameter dtype; default the checkpoint's.
    - `**overrides`: fields of the `GptOssConfig` to replace that do not change a weight's
      shape (`remat`, `compute_dtype`, `max_seq_len`, `grouped_matmul`, ...).

    **Returns:** the `GptOss`; its `.config` is the equivalent `GptOssConfig`.

    **Raises:** `ValueError`, naming the file and the key or tensor, for a missing or
    damaged checkpoint, an unsupported `model_type` or architecture, config keys or values
    this family does not support (a `quantization_config`: MXFP4 experts; attention
    dropout; a RoPE other than YaRN or plain), and missing, extra or wrong-shape tensors;
    `TypeError` when `path` is not a `str` or `os.PathLike`; `TypeError` or `ValueError`
    for `spec`, `dtype` or overrides that are not valid.
    """
    return _HF.from_hf(path, spec, dtype, overrides)


def config_from_hf(
    path, *, dtype: str | type | np.dtype | None = None, **overrides
) -> GptOssConfig:
    """The `GptOssConfig` that `from_hf(path, dtype=dtype, **overrides)` would build, from
    `config.json` alone (no weights read).

    **Raises:** as `from_hf` for `config.json`, `dtype` and the overrides.
    """
    return _HF.config_from_hf(path, dtype, overrides)


def to_hf(model: object, path, *, max_shard_size: int | None = None) -> None:
    """Write `model` as a Hugging Face checkpoint (`config.json` + safetensors) that
    `transformers.AutoModelForCausalLM.from_pretrained` loads as `GptOssForCausalLM`;
    `from_hf` reads back the same `GptOssConfig`. The experts' gate and up projections
    are interleaved into `gate_up_proj` on the devices first (one extra copy of them).

    **Arguments:**

    - `model`: the `GptOss` (its parameters must be addressable from this process).
    - `path`: output directory, created if needed.
    - `max_shard_size`: bytes per safetensors file; `None` writes one `model.safetensors`.

    **Raises:** `TypeError` when `model` is not a `GptOss` or `path` is not a path;
    `ValueError` when `path` exists and is not a directory, or the model holds abstract
    shapes or parameters this process cannot address; `TypeError` or `ValueError` for a
    `max_shard_size` that is not a positive int.
    """
    _HF.to_hf(model, path, max_shard_size)


__all__ = [
    "LAYER_TYPES",
    "PRESETS",
    "GptOss",
    "GptOssConfig",
    "config_from_hf",
    "from_hf",
    "make_block",
    "to_hf",
]
