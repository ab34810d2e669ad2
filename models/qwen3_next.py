"""Qwen3-Next and Qwen3.5: hybrid decoders of Gated DeltaNet and gated softmax attention.

Einsum letters: none (the arithmetic lives in the layers of `eqx_longctx.nn`).

Tokens -> embedding -> `n_layers` pre-norm blocks -> RMSNorm -> LM head -> float32 logits.
Each block is `x + mixer(norm(x))`, then `x + ffn(norm(x))`; `layer_types` says which
mixer each layer has:

- `"linear_attention"`: Gated DeltaNet (`eqx_longctx.nn.GatedDeltaNet`): a linear
  recurrence with a fixed-size state, no per-token cache;
- `"full_attention"`: gated softmax attention (`eqx_longctx.nn.SelfAttention` with
  `output_gate`): GQA with per-head zero-centred q/k RMSNorm, RoPE on the leading
  `partial_rotary_factor` of each head, and each head's output multiplied by
  `sigmoid(x @ wg)` before the output projection.

The feed-forward is a mixture of experts (softmax top-k routing, optionally renormalised,
and a shared expert gated by `sigmoid(x @ shared_gate)`) in the layers transformers makes
sparse (`n_experts > 0`, every `decoder_sparse_step`-th layer, not in `mlp_only_layers`),
else a dense SwiGLU. Every RMSNorm outside the DeltaNet scales by `1 + weight`
(zero-centred). Layers are grouped into one `LayerStack` per run of equal layers
(`models/_hybrid.py`): a 3:1 hybrid of 48 layers is 24 stacks.

Qwen3.5 is the same decoder with a differently packed checkpoint (and, for its dense
sizes, no experts); `checkpoint_format` says which one `to_hf` writes. References: Qwen
Team 2025, "Qwen3-Next" (transformers' `Qwen3NextForCausalLM`) and Qwen3.5 (transformers'
`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`); Yang et al. 2024, "Gated Delta Networks"
(arXiv:2412.06464); Qiu et al. 2025, "Gated Attention for Large Language Models"
(arXiv:2505.06708).
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
    DecoderBlock,
    GatedDeltaNet,
    LayerStack,
    MoE,
    RMSNorm,
    RoPE,
    SelfAttention,
    SwiGLU,
    check_routing,
)

from . import _hf_io, _hybrid, _qwen3_next_hf

LAYER_TYPES = ("linear_attention", "full_attention")
CHECKPOINT_FORMATS = ("qwen3_next", "qwen3_5")


@final
@no_type_check  # __post_init__ checks every field, with messages that name the fix
@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig:
    """Hyperparameters of a Qwen3-Next or Qwen3.5 model (hashable, so it can be a static
    field). Fields are checked on construction as `LlamaConfig`'s are.

    **Arguments:**

    - `vocab_size`, `dim`, `n_layers`: vocabulary, width, depth.
    - `n_heads`, `n_kv_heads`, `head_dim`: the softmax attention's query heads, key/value
      heads and head width.
    - `hidden_dim`: width of the dense SwiGLU layers (`intermediate_size`).
    - `linear_n_heads`, `linear_n_key_heads`: the DeltaNet's value heads and query/key
      heads; `linear_head_dim`, `linear_v_head_dim` their widths; `linear_conv_size` the
      short convolution's width.
    - `layer_types`: `"linear_attention"` or `"full_attention"` per layer; `None` = every
      `full_attention_interval`-th layer is full attention (as transformers derives it),
      filled in at construction.
    - `partial_rotary_factor`: the fraction of each head RoPE rotates (0.25).
    - `n_experts`, `top_k`, `moe_hidden_dim`: routed experts (0: every layer dense), per
      token, and each one's width; `shared_hidden_dim` the gated shared expert's width
      (0: none); `norm_topk_prob` renormalises the top-k softmax weights.
    - `decoder_sparse_step`, `mlp_only_layers`: which layers have experts, as transformers:
      layer `i` does when `n_experts > 0`, `(i + 1) % decoder_sparse_step == 0` and `i` is
      not in `mlp_only_layers`.
    - `norm_eps`, `rope_theta`, `max_seq_len`, `tie_embeddings`, `remat`, `param_dtype`,
      `compute_dtype`, `init_std`: as `LlamaConfig`'s. `rope_scaling` must be `None`.
    - `grouped_matmul`, `capacity_factor`: how the experts run (see `eqx_longctx.nn.MoE`).
    - `linear_chunk`: tokens per chunk of the gated delta rule.
    - `checkpoint_format`: `"qwen3_next"` or `"qwen3_5"`: the Hugging Face layout `to_hf`
      writes (Qwen3-Next's fused projections, or Qwen3.5's).

    **Raises:** `TypeError` for a field of the wrong type; `ValueError` for a size that is
    not positive, `n_heads` not a multiple of `n_kv_heads` (or `linear_n_heads` of
    `linear_n_key_heads`), `layer_types` that is not one of `LAYER_TYPES` per layer, a
    `partial_rotary_factor` that rotates no pair or more than the head, a `rope_scaling`,
    routing that cannot pick `top_k` experts, an `mlp_only_layers` index out of range, or
    a `remat`, dtype, `grouped_matmul` or `checkpoint_format` not among the choices.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    linear_n_heads: int
    linear_n_key_heads: int
    linear_head_dim: int
    linear_v_head_dim: int
    linear_conv_size: int = 4
    layer_types: tuple[str, ...] | None = None
    full_attention_interval: int = 4
    partial_rotary_factor: float = 0.25
    n_experts: int = 0
    top_k: int = 1
    moe_hidden_dim: int = 1
    shared_hidden_dim: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_eps: float = 1e-6
    rope_theta: float | int = 10000.0
    rope_scaling: None = None
    max_seq_len: int = 32768
    tie_embeddings: bool = False
    grouped_matmul: str = "auto"
    capacity_factor: float | None = None
    linear_chunk: int = 64
    checkpoint_format: str = "qwen3_next"
    remat: str = "none"
    param_dtype: str | type | np.dtype = "float32"
    compute_dtype: str | type | np.dtype = "float32"
    init_std: float = 0.02

    def __post_init__(self):
        if self.rope_scaling is not None:
            raise ValueError(
                "Qwen3NextConfig implements plain (partial) RoPE only; got rope_scaling="
                f"{self.rope_scaling!r}. Use rope_scaling=None."
            )
        check_decoder_config(self, scaling_cls=type(None))
        check_fields(
            self,
            ints=(
                "n_kv_heads", "head_dim", "linear_n_heads", "linear_n_key_heads",
                "linear_head_dim", "linear_v_head_dim", "linear_conv_size",
                "full_attention_interval", "top_k", "moe_hidden_dim", "decoder_sparse_step",
                "linear_chunk",
            ),
            non_negative_ints=("n_experts", "shared_hidden_dim"),
            positive_reals=("partial_rotary_factor",),
            bools=("norm_topk_prob",),
        )  # fmt: skip
        name = "Qwen3NextConfig"
        for heads, groups in (("n_heads", "n_kv_heads"), ("linear_n_heads", "linear_n_key_heads")):
            if getattr(self, heads) % getattr(self, groups):
                raise ValueError(
                    f"{name} needs {heads} to be a multiple of {groups}; got {heads}="
                    f"{getattr(self, heads)}, {groups}={getattr(self, groups)}."
                )
        rotary = self.rotary_dim
        if not (2 <= rotary <= self.head_dim and rotary % 2 == 0):
            raise ValueError(
                f"{name} rotates int(head_dim * partial_rotary_factor) features, which must "
                f"be even and in [2, head_dim]; got head_dim={self.head_dim}, "
                f"partial_rotary_factor={self.partial_rotary_factor} ({rotary} features)."
            )
        types = self.layer_types
        if types is None:
            every = self.full_attention_interval
            types = tuple(LAYER_TYPES[(i + 1) % every == 0] for i in range(self.n_layers))
        if isinstance(types, str) or not isinstance(types, list | tuple):
            raise TypeError(f"{name}.layer_types must be a tuple of {LAYER_TYPES} or None.")
        if len(types) != self.n_layers or not set(types) <= set(LAYER_TYPES):
            raise ValueError(
                f"{name}.layer_types needs one of {LAYER_TYPES} per layer ({self.n_layers}); "
                f"got {tuple(types)}."
            )
        object.__setattr__(self, "layer_types", tuple(types))
        only = self.mlp_only_layers
        if not isinstance(only, list | tuple) or not all(
            isinstance(i, int) and 0 <= i < self.n_layers for i in only
        ):
            raise ValueError(
                f"{name}.mlp_only_layers must list layer indices in [0, {self.n_layers}); "
                f"got {only!r}."
            )
        object.__setattr__(self, "mlp_only_layers", tuple(sorted(set(only))))
        check_choice(self.grouped_matmul, f"{name}.grouped_matmul", GROUPED_MATMULS)
        check_choice(self.checkpoint_format, f"{name}.checkpoint_format", CHECKPOINT_FORMATS)
        if self.capacity_factor is not None:
            check_real(self.capacity_factor, f"{name}.capacity_factor", positive=True)
        if self.n_experts:
            check_routing(name, self.n_experts, self.top_k, "greedy", 1, 1)

    @property
    def rotary_dim(self) -> int:
        """The features of each head RoPE rotates: `int(head_dim * partial_rotary_factor)`."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Whether each layer's feed-forward is the mixture of experts."""
        return tuple(
            self.n_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
            for i in range(self.n_layers)
        )

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's kind, `"<layer type>/<moe|dense>"`: one `LayerStack` per run."""
        assert self.layer_types is not None  # filled in at construction
        return tuple(
            f"{t}/{'moe' if m else 'dense'}"
            for t, m in zip(self.layer_types, self.moe_layers, strict=True)
        )

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "Qwen3NextConfig":
        """A preset from `PRESETS` or `QWEN3_5_PRESETS` with some fields replaced. When
        `n_layers` is overridden and `layer_types` is not, `layer_types` is derived again.

        **Returns:** the new `Qwen3NextConfig`.

        **Raises:** `ValueError` for an unknown preset (the message lists them); `TypeError`
        for an override that is not a field; and as the constructor for the new values.
        """
        preset = check_preset({**PRESETS, **QWEN3_5_PRESETS}, name, overrides, "Qwen3-Next")
        if "n_layers" in overrides and "layer_types" not in overrides:
            overrides["layer_types"] = None
        return dataclasses.replace(preset, **overrides)


def make_block(config: object, kind: str, *, key: PRNGKeyArray, spec: object = None):
    """One block of `kind` (an entry of `config.kinds`): DeltaNet or gated attention, then
    the experts or a dense SwiGLU, with zero-centred norms.

    **Returns:** the `eqx_longctx.nn.DecoderBlock`.

    **Raises:** `TypeError` when `config` is not a `Qwen3NextConfig`; `ValueError` for an
    unknown `kind` or heads or experts the spec's mesh does not split.
    """
    check_instance(config, "models.qwen3_next.make_block's config", Qwen3NextConfig,
                   "Build one with Qwen3NextConfig.from_preset(name).")  # fmt: skip
    c, spec = cast(Qwen3NextConfig, config), cast(ShardingSpec | None, spec)
    mixer, ffn = kind.split("/") if kind.count("/") == 1 else (kind, "")
    if mixer not in LAYER_TYPES or ffn not in ("moe", "dense"):
        raise ValueError(f"unknown Qwen3-Next layer kind {kind!r}; see Qwen3NextConfig.kinds.")
    dtype = jnp.dtype(c.param_dtype)
    init: dict[str, Any] = dict(
        init_std=c.init_std, out_init_std=c.init_std / math.sqrt(2 * c.n_layers), dtype=dtype,
        spec=spec,
    )  # fmt: skip
    k_mix, k_ffn = jax.random.split(key)
    if mixer == "linear_attention":
        attn = GatedDeltaNet(
            c.dim, c.linear_n_heads, c.linear_n_key_heads, c.linear_head_dim,
            c.linear_v_head_dim, key=k_mix, conv_size=c.linear_conv_size, norm_eps=c.norm_eps,
            chunk=c.linear_chunk, **init,
        )  # fmt: skip
    else:
        attn = SelfAttention(
            c.dim, c.n_heads, c.n_kv_heads, c.head_dim, rope=RoPE(c.rotary_dim, c.rope_theta),
            key=k_mix, qk_norm=True, norm_eps=c.norm_eps, norm_zero_centred=True,
            output_gate=True, **init,
        )  # fmt: skip
    if ffn == "moe":
        mlp = MoE(
            c.dim, c.moe_hidden_dim, c.n_experts, c.top_k, key=k_ffn,
            n_shared=1 if c.shared_hidden_dim else 0, shared_hidden_dim=c.shared_hidden_dim or None,
            shared_gate=True, norm_topk_prob=c.norm_topk_prob, grouped_matmul=c.grouped_matmul,
            capacity_factor=c.capacity_factor, **init,
        )  # fmt: skip
    else:
        mlp = SwiGLU(c.dim, c.hidden_dim, key=k_ffn, **init)
    return DecoderBlock(
        attn, mlp, dim=c.dim, norm_eps=c.norm_eps, dtype=dtype, zero_centred_norms=True
    )


@final
class Qwen3Next(AbstractDecoder):
    """The Qwen3-Next / Qwen3.5 decoder. Call it as `model(tokens, positions, segment_ids)`.

    `layers` holds one `LayerStack` per run of equal layers (`config.kinds`), in order.
    """

    embed: Float[Array, "vocab embed"]
    layers: tuple[LayerStack, ...]
    norm: RMSNorm
    lm_head: Float[Array, "embed vocab"] | None
    config: Qwen3NextConfig = eqx.field(static=True)
    spec: ShardingSpec | None = eqx.field(static=True)

    # `config`, `key` and `spec` are checked below, with errors that say how to build them.
    def __init__(self, config: object, *, key: object, spec: object = None):
        """**Arguments:**

        - `config`: the `Qwen3NextConfig`.
        - `key`: PRNG key for the initialisation (`jax.random.key(seed)`).
        - `spec`: the `ShardingSpec` of every layer; `None` = one device.

        **Raises:** `TypeError` when `config` is not a `Qwen3NextConfig`, `key` not a PRNG
        key or `spec` not a `ShardingSpec` (or `None`); `ValueError` when the spec's tensor
        or expert axis does not divide the heads or experts.
        """
        check_model_args("Qwen3Next", config, Qwen3NextConfig, key, spec)
        c, spec = cast(Qwen3NextConfig, config), cast(ShardingSpec | None, spec)
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


# fmt: off
PRESETS: dict[str, Qwen3NextConfig] = {
    # Byte-level tokenizer (256 bytes + 3 specials); 3 DeltaNet layers and 1 gated-attention
    # layer, experts in all but the first: small enough to train on a CPU.
    "tiny": Qwen3NextConfig(
        vocab_size=259, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
        hidden_dim=256, linear_n_heads=4, linear_n_key_heads=2, linear_head_dim=32,
        linear_v_head_dim=32, n_experts=8, top_k=2, moe_hidden_dim=64, shared_hidden_dim=64,
        mlp_only_layers=(0,), max_seq_len=2048,
    ),
    # Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (transformers' Qwen3NextConfig defaults
    # are this model's, but for intermediate_size 5120, rope_theta 1e7 and a 262144 context).
    "qwen3-next-80b-a3b": Qwen3NextConfig(
        vocab_size=151936, dim=2048, n_layers=48, n_heads=16, n_kv_heads=2, head_dim=256,
        hidden_dim=5120, linear_n_heads=32, linear_n_key_heads=16, linear_head_dim=128,
        linear_v_head_dim=128, n_experts=512, top_k=10, moe_hidden_dim=512,
        shared_hidden_dim=512, norm_eps=1e-6, rope_theta=10_000_000, max_seq_len=262144,
    ),
}
QWEN3_5_PRESETS: dict[str, Qwen3NextConfig] = {
    # As Qwen3-Next's tiny, dense (Qwen3.5's small sizes have no experts). The names differ
    # from the qwen3_next family's, as both families share Qwen3NextConfig.from_preset.
    "qwen3.5-tiny": Qwen3NextConfig(
        vocab_size=259, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
        hidden_dim=256, linear_n_heads=4, linear_n_key_heads=2, linear_head_dim=32,
        linear_v_head_dim=32, max_seq_len=2048, checkpoint_format="qwen3_5",
    ),
    # transformers' Qwen3_5TextConfig defaults, which its docstring calls the Qwen3.5-9B
    # configuration; rope_theta 1e7 and the 262144 context as Qwen3.5's model cards state.
    "qwen3.5-9b": Qwen3NextConfig(
        vocab_size=248320, dim=4096, n_layers=32, n_heads=16, n_kv_heads=4, head_dim=256,
        hidden_dim=12288, linear_n_heads=32, linear_n_key_heads=16, linear_head_dim=128,
        linear_v_head_dim=128, rope_theta=10_000_000, max_seq_len=262144,
        checkpoint_format="qwen3_5",
    ),
    # Qwen/Qwen3.5-27B's model card: 64 layers (3 DeltaNet : 1 attention), width 5120,
    # 24 query / 4 key-value heads of 256, SwiGLU 17408, vocabulary 248320, 262144 tokens,
    # rope_theta 1e7. The DeltaNet's 48 value / 16 key heads of 128 and its kernel of 4:
    # the text_config of Qwen3.5-27B (and of Qwen3.6-27B, the same shape), checked
    # 2026-12-06 against several public copies of its config.json.
    "qwen3.5-27b": Qwen3NextConfig(
        vocab_size=248320, dim=5120, n_layers=64, n_heads=24, n_kv_heads=4, head_dim=256,
        hidden_dim=17408, linear_n_heads=48, linear_n_key_heads=16, linear_head_dim=128,
        linear_v_head_dim=128, rope_theta=10_000_000, max_seq_len=262144,
        checkpoint_format="qwen3_5",
    ),
}
# fmt: on
"""The named configs of the `qwen3_next` family (`PRESETS`) and the `qwen3_5` family
(`QWEN3_5_PRESETS`); `Qwen3NextConfig.from_preset` reads both."""


# ---- Hugging Face checkpoints (format: models/_qwen3_next_hf.py) -------------------------

_HF = _hf_io.HFFormat(Qwen3Next, Qwen3NextConfig, _qwen3_next_hf, "Build it with Qwen3Next(...).")


def from_hf(
    path,
    *,
    spec: object = None,  # checked, with an error that says how to build a ShardingSpec
    dtype: str | type | np.dtype | None = None,
    **overrides,
) -> Qwen3Next:
    """Load a Hugging Face Qwen3-Next, Qwen3.5 or Qwen3.5-MoE causal-LM checkpoint
    (`model_type` `qwen3_next`, `qwen3_5_text`, `qwen3_5_moe_text`, or the text part of a
    `qwen3_5` / `qwen3_5_moe` vision-language checkpoint: its `text_config` and its
    `model.language_model.*` weights; the vision tower and the multi-token-prediction
    layers are skipped). Experts are read one tensor per expert, as save_pretrained
    writes them.

    Reads as `models.llama.from_hf` does: every tensor checked by name, shape and dtype
    before any data is read, then each parameter read straight into its shards. Fused
    Hugging Face projections (Qwen3-Next's `in_proj_qkvz`, the attention's query + gate
    `q_proj`, the short convolution's `conv1d`) are split on the host.

    **Arguments:**

    - `path`: the checkpoint directory.
    - `spec`: the sharding spec of the returned model, or `None` for one device.
    - `dtype`: parameter dtype; default the checkpoint's.
    - `**overrides`: fields of the `Qwen3NextConfig` to replace that do not change a
      weight's shape (`remat`, `compute_dtype`, `max_seq_len`, `linear_chunk`, ...).

    **Returns:** the `Qwen3Next`; its `.config` is the equivalent `Qwen3NextConfig`.

    **Raises:** `ValueError`, naming the file and the key or tensor, for a missing or
    damaged checkpoint, an unsupported `model_type` or architecture, config keys or values
    this family does not support, and missing, extra or wrong-shape tensors; `TypeError`
    when `path` is not a `str` or `os.PathLike`; `TypeError` or `ValueError` for `spec`,
    `dtype` or overrides that are not valid.
    """
    return _HF.from_hf(path, spec, dtype, overrides)


def config_from_hf(
    path, *, dtype: str | type | np.dtype | None = None, **overrides
) -> Qwen3NextConfig:
    """The `Qwen3NextConfig` that `from_hf(path, dtype=dtype, **overrides)` would build,
    from `config.json` alone (no weights read).

    **Raises:** as `from_hf` for `config.json`, `dtype` and the overrides.
    """
    return _HF.config_from_hf(path, dtype, overrides)


def to_hf(model: object, path, *, max_shard_size: int | None = None) -> None:
    """Write `model` as a Hugging Face checkpoint (`config.json` + safetensors) that
    `transformers.AutoModelForCausalLM.from_pretrained` loads: `Qwen3NextForCausalLM` for
    `checkpoint_format="qwen3_next"`, else `Qwen3_5ForCausalLM` (or
    `Qwen3_5MoeForCausalLM` with experts). Weights are written bit for bit (the fused
    Hugging Face tensors are concatenated on the devices first, one extra copy of them).

    **Arguments:**

    - `model`: the `Qwen3Next` (its parameters must be addressable from this process).
    - `path`: output directory, created if needed.
    - `max_shard_size`: bytes per safetensors file; `None` writes one `model.safetensors`.

    **Raises:** `TypeError` when `model` is not a `Qwen3Next` or `path` is not a path;
    `ValueError` when `path` exists and is not a directory, the model holds abstract
    shapes or parameters this process cannot address, or its config has no Hugging Face
    form (experts without a shared expert; Qwen3.5 experts not in every layer or without
    `norm_topk_prob`);
    `TypeError` or `ValueError` for a `max_shard_size` that is not a positive int.
    """
    _HF.to_hf(model, path, max_shard_size)


__all__ = [
    "CHECKPOINT_FORMATS",
    "LAYER_TYPES",
    "PRESETS",
    "QWEN3_5_PRESETS",
    "Qwen3Next",
    "Qwen3NextConfig",
    "config_from_hf",
    "from_hf",
    "make_block",
    "to_hf",
]
