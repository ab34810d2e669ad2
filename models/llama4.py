"""Llama 4 (text): chunked and NoPE attention layers, experts interleaved with dense layers.

Einsum letters: none (the arithmetic lives in the layers of `eqx_longctx.nn`).

Tokens -> embedding -> `n_layers` pre-norm blocks -> RMSNorm -> LM head -> float32 logits.
Each block is `x + attn(norm(x))`, then `x + ffn(norm(x))`. Three layers in four
(`no_rope_layers[i] == 1`) rotate queries and keys with RoPE in Meta's interleaved-pair
form, normalise each query and key head to unit RMS after it (`use_qk_norm`), and attend
only within their own `attention_chunk_size`-token chunk (`layer_types`:
`"chunked_attention"`); the fourth is a global layer without position embedding (NoPE)
whose queries grow with the position, `1 + attn_scale * log(1 + floor((p + 1) /
floor_scale))` (`attn_temperature_tuning`). The feed-forward is a mixture of experts in
`moe_layers` (a top-`top_k` sigmoid router whose score scales the chosen expert's input,
plus an always-on shared expert, all SwiGLUs `moe_hidden_dim` wide), else a dense SwiGLU
`hidden_dim` wide. Layers are grouped into one `LayerStack` per run of equal layers
(`models/_hybrid.py`).

References: Meta AI 2025, "The Llama 4 herd" (transformers' `Llama4ForCausalLM`); Nakanishi
2025, "Scalable-Softmax Is Superior for Attention" (arXiv:2501.19399), the temperature of
the NoPE layers; Kazemnejad et al. 2023, "The Impact of Positional Encoding on Length
Generalization in Transformers" (arXiv:2305.19466), NoPE.
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
    LayerStack,
    Llama3RopeScaling,
    MoE,
    RMSNorm,
    RoPE,
    SelfAttention,
    SwiGLU,
    check_routing,
)

from . import _hf_io, _hybrid, _llama4_hf

LAYER_TYPES = ("chunked_attention", "full_attention")


def _indices(value, n: int, name: str) -> tuple[int, ...]:
    """`value` as sorted unique layer indices in `[0, n)`, or a `ValueError` naming `name`."""
    if not isinstance(value, list | tuple) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in value
    ):
        raise ValueError(f"Llama4Config.{name} must list layer indices in [0, {n}); got {value!r}.")
    return tuple(sorted(set(value)))


@final
@no_type_check  # __post_init__ checks every field, with messages that name the fix
@dataclasses.dataclass(frozen=True)
class Llama4Config:
    """Hyperparameters of a Llama 4 text model (hashable, so it can be a static field).
    Fields are checked on construction as `LlamaConfig`'s are; the per-layer patterns are
    filled in, as transformers derives them, when left `None`.

    **Arguments:**

    - `vocab_size`, `dim`, `n_layers`, `n_heads`, `n_kv_heads`, `head_dim`: vocabulary,
      width, depth, query heads, key/value heads, head width.
    - `hidden_dim`: width of the dense SwiGLU layers (`intermediate_size_mlp`).
    - `moe_hidden_dim`: width of each routed expert and of the shared expert
      (`intermediate_size`).
    - `n_experts`, `top_k`: routed experts, and how many each token uses.
    - `moe_layers`: the layers with experts; `None` = every `interleave_moe_layer_step`-th
      (layers `step - 1, 2 * step - 1, ...`).
    - `no_rope_layers`: per layer, 1 for a RoPE layer and 0 for a NoPE one (transformers'
      convention); `None` = every `no_rope_layer_interval`-th layer is NoPE.
    - `attention_chunk_size`: the chunk of the chunked layers (query `i` sees keys `j <=
      i` with `i // C == j // C`), or `None`.
    - `layer_types`: `"chunked_attention"` or `"full_attention"` per layer; `None` = the
      RoPE layers are chunked when `attention_chunk_size` is set.
    - `use_qk_norm`: RoPE layers RMS-normalise each query and key head (no learned scale).
    - `attn_temperature_tuning`, `floor_scale`, `attn_scale`: NoPE layers scale the query at
      position `p` by `1 + attn_scale * log(1 + floor((p + 1) / floor_scale))`.
    - `norm_eps`, `rope_theta`, `rope_scaling` (a `Llama3RopeScaling` or `None`),
      `max_seq_len`, `tie_embeddings`, `remat`, `param_dtype`, `compute_dtype`,
      `init_std`: as `LlamaConfig`'s.
    - `grouped_matmul`, `capacity_factor`: how the experts run (see `eqx_longctx.nn.MoE`).

    **Raises:** `TypeError` for a field of the wrong type; `ValueError` for a size that is
    not positive, `n_heads` not a multiple of `n_kv_heads`, an odd `head_dim`, a `top_k`
    not in `[1, n_experts]`, a per-layer pattern of the wrong length or values, chunked
    layers without `attention_chunk_size`, or a `remat`, dtype or `grouped_matmul` not
    among the choices.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    moe_hidden_dim: int
    n_experts: int = 16
    top_k: int = 1
    moe_layers: tuple[int, ...] | None = None
    interleave_moe_layer_step: int = 1
    no_rope_layers: tuple[int, ...] | None = None
    no_rope_layer_interval: int = 4
    attention_chunk_size: int | None = 8192
    layer_types: tuple[str, ...] | None = None
    use_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: float | int = 8192.0
    attn_scale: float = 0.1
    norm_eps: float = 1e-5
    rope_theta: float | int = 500000.0
    rope_scaling: Llama3RopeScaling | None = None
    max_seq_len: int = 131072
    tie_embeddings: bool = False
    grouped_matmul: str = "auto"
    capacity_factor: float | None = None
    remat: str = "none"
    param_dtype: str | type | np.dtype = "float32"
    compute_dtype: str | type | np.dtype = "float32"
    init_std: float = 0.02

    def __post_init__(self):
        name, n = "Llama4Config", self.n_layers
        check_decoder_config(self, scaling_cls=Llama3RopeScaling)
        check_fields(
            self,
            ints=(
                "n_kv_heads", "head_dim", "moe_hidden_dim", "n_experts", "top_k",
                "interleave_moe_layer_step", "no_rope_layer_interval",
            ),
            optional_ints=("attention_chunk_size",),
            positive_reals=("floor_scale", "attn_scale"),
            bools=("use_qk_norm", "attn_temperature_tuning"),
        )  # fmt: skip
        if self.n_heads % self.n_kv_heads or self.head_dim % 2:
            raise ValueError(
                f"{name} needs n_heads a multiple of n_kv_heads and an even head_dim (RoPE "
                f"rotates pairs); got n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}."
            )
        step, every = self.interleave_moe_layer_step, self.no_rope_layer_interval
        moe = self.moe_layers
        moe = tuple(range(step - 1, n, step)) if moe is None else _indices(moe, n, "moe_layers")
        object.__setattr__(self, "moe_layers", moe)
        rope = self.no_rope_layers
        rope = tuple(int((i + 1) % every != 0) for i in range(n)) if rope is None else rope
        if not isinstance(rope, list | tuple) or len(rope) != n or set(rope) - {0, 1}:
            raise ValueError(
                f"{name}.no_rope_layers needs 1 (RoPE) or 0 (NoPE) for each of the {n} layers; "
                f"got {rope!r}."
            )
        rope = tuple(int(r) for r in rope)
        object.__setattr__(self, "no_rope_layers", rope)
        chunk = self.attention_chunk_size
        types = self.layer_types
        if types is None:
            types = tuple(LAYER_TYPES[not (r and chunk is not None)] for r in rope)
        if not isinstance(types, list | tuple) or len(types) != n or set(types) - set(LAYER_TYPES):
            raise ValueError(
                f"{name}.layer_types needs one of {LAYER_TYPES} for each of the {n} layers; got "
                f"{types!r}."
            )
        if chunk is None and "chunked_attention" in types:
            raise ValueError(
                f"{name} has chunked layers (layer_types) but attention_chunk_size=None; set "
                "the chunk or make every layer 'full_attention'."
            )
        object.__setattr__(self, "layer_types", tuple(types))
        check_choice(self.grouped_matmul, f"{name}.grouped_matmul", GROUPED_MATMULS)
        if self.capacity_factor is not None:
            check_real(self.capacity_factor, f"{name}.capacity_factor", positive=True)
        check_routing(name, self.n_experts, self.top_k, "sigmoid", 1, 1)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's kind, `"<rope|nope>/<chunked|full>/<moe|dense>"`: one `LayerStack`
        per run."""
        assert self.no_rope_layers is not None and self.layer_types is not None
        moe = set(self.moe_layers or ())
        return tuple(
            f"{'rope' if r else 'nope'}/{t.split('_')[0]}/{'moe' if i in moe else 'dense'}"
            for i, (r, t) in enumerate(zip(self.no_rope_layers, self.layer_types, strict=True))
        )

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "Llama4Config":
        """A preset from `PRESETS` with some fields replaced. When `n_layers` is overridden,
        the per-layer patterns not overridden are derived again.

        **Raises:** `ValueError` for an unknown preset (the message lists them); `TypeError`
        for an override that is not a field; and as the constructor for the new values.
        """
        preset = check_preset(PRESETS, name, overrides, "Llama 4")
        if "n_layers" in overrides:
            for key in ("moe_layers", "no_rope_layers", "layer_types"):
                overrides.setdefault(key, None)
        return dataclasses.replace(preset, **overrides)


def make_block(config: object, kind: str, *, key: PRNGKeyArray, spec: object = None):
    """One block of `kind` (an entry of `config.kinds`).

    **Returns:** the `eqx_longctx.nn.DecoderBlock`: a `SelfAttention` (RoPE, chunks and q/k
    norm, or NoPE with the query temperature), then a `MoE` or a `SwiGLU`.

    **Raises:** `TypeError` when `config` is not a `Llama4Config`; `ValueError` for an
    unknown `kind` or heads or experts the spec's mesh does not split.
    """
    check_instance(config, "models.llama4.make_block's config", Llama4Config,
                   "Build one with Llama4Config.from_preset(name).")  # fmt: skip
    c, spec = cast(Llama4Config, config), cast(ShardingSpec | None, spec)
    parts = kind.split("/")
    if len(parts) != 3 or parts[0] not in ("rope", "nope") or parts[1] not in ("chunked", "full"):
        raise ValueError(f"unknown Llama 4 layer kind {kind!r}; see Llama4Config.kinds.")
    pos, mask, ffn = parts
    dtype = jnp.dtype(c.param_dtype)
    init: dict[str, Any] = dict(
        init_std=c.init_std, out_init_std=c.init_std / math.sqrt(2 * c.n_layers), dtype=dtype,
        spec=spec,
    )  # fmt: skip
    k_attn, k_ffn = jax.random.split(key)
    rope = pos == "rope"
    temperature = (c.floor_scale, c.attn_scale) if c.attn_temperature_tuning and not rope else None
    attn = SelfAttention(
        c.dim, c.n_heads, c.n_kv_heads, c.head_dim, key=k_attn, norm_eps=c.norm_eps,
        rope=RoPE(c.head_dim, c.rope_theta, c.rope_scaling, interleaved=True) if rope else None,
        chunk=c.attention_chunk_size if mask == "chunked" else None,
        qk_l2_norm=c.use_qk_norm and rope, query_temperature=temperature, **init,
    )  # fmt: skip
    if ffn == "moe":
        mlp = MoE(
            c.dim, c.moe_hidden_dim, c.n_experts, c.top_k, key=k_ffn, n_shared=1,
            topk_method="sigmoid", weight_inputs=True, grouped_matmul=c.grouped_matmul,
            capacity_factor=c.capacity_factor, **init,
        )  # fmt: skip
    else:
        mlp = SwiGLU(c.dim, c.hidden_dim, key=k_ffn, **init)
    return DecoderBlock(attn, mlp, dim=c.dim, norm_eps=c.norm_eps, dtype=dtype)


@final
class Llama4(AbstractDecoder):
    """The Llama 4 text decoder. Call it as `model(tokens, positions, segment_ids)`.

    `layers` holds one `LayerStack` per run of equal layers (`config.kinds`), in order:
    Scout's three chunked RoPE layers and one NoPE layer make 24 stacks of 48 layers.
    """

    embed: Float[Array, "vocab embed"]
    layers: tuple[LayerStack, ...]
    norm: RMSNorm
    lm_head: Float[Array, "embed vocab"] | None
    config: Llama4Config = eqx.field(static=True)
    spec: ShardingSpec | None = eqx.field(static=True)

    # `config`, `key` and `spec` are checked below, with errors that say how to build them.
    def __init__(self, config: object, *, key: object, spec: object = None):
        """**Arguments:**

        - `config`: the `Llama4Config`.
        - `key`: PRNG key for the initialisation (`jax.random.key(seed)`).
        - `spec`: the `ShardingSpec` of every layer; `None` = one device.

        **Raises:** `TypeError` when `config` is not a `Llama4Config`, `key` not a PRNG key
        or `spec` not a `ShardingSpec` (or `None`); `ValueError` when the spec's tensor or
        expert axis does not divide the heads or experts.
        """
        check_model_args("Llama4", config, Llama4Config, key, spec)
        c, spec = cast(Llama4Config, config), cast(ShardingSpec | None, spec)
        dtype = jnp.dtype(c.param_dtype)
        self.embed, self.lm_head, self.layers = _hybrid.kind_layers(
            c, c.kinds, make_block, key=cast(PRNGKeyArray, key), spec=spec
        )
        self.norm = RMSNorm(c.dim, eps=c.norm_eps, dtype=dtype)
        self.config = c
        self.spec = spec

    def layer_stacks(self) -> tuple[LayerStack, ...]:
        """The layer stacks in order: one per run of equal layers."""
        return self.layers


# fmt: off
PRESETS: dict[str, Llama4Config] = {
    # Byte-level tokenizer (256 bytes + 3 specials); chunks of 128 tokens and a temperature
    # floor of 64, so that both act at the trainer's 256 tokens; experts every other layer.
    "tiny": Llama4Config(
        vocab_size=259, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
        hidden_dim=256, moe_hidden_dim=128, n_experts=4, top_k=1, interleave_moe_layer_step=2,
        attention_chunk_size=128, floor_scale=64, rope_theta=10000.0, max_seq_len=2048,
    ),
    # meta-llama/Llama-4-Scout-17B-16E(-Instruct)'s text_config: 48 layers of width 5120,
    # 40 query / 8 key-value heads of 128, 16 experts of 8192 (top 1) and a shared one in
    # every layer, chunks of 8192, NoPE every fourth layer, Llama 3 RoPE scaling of 16 with
    # both band factors 1 from 8192 tokens, rope_theta 5e5, a 10M-token context.
    "llama-4-scout": Llama4Config(
        vocab_size=202048, dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, head_dim=128,
        hidden_dim=16384, moe_hidden_dim=8192, n_experts=16, top_k=1,
        attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1, norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=Llama3RopeScaling(16.0, 1.0, 1.0, 8192),
        max_seq_len=10485760,
    ),
}
# fmt: on
"""The named configs `Llama4Config.from_preset` starts from."""


# ---- Hugging Face checkpoints (format: models/_llama4_hf.py) -----------------------------

_HF = _hf_io.HFFormat(Llama4, Llama4Config, _llama4_hf, "Build it with Llama4(config, ...).")


def from_hf(
    path,
    *,
    spec: object = None,  # checked, with an error that says how to build a ShardingSpec
    dtype: str | type | np.dtype | None = None,
    **overrides,
) -> Llama4:
    """Load a Hugging Face Llama 4 text checkpoint (`model_type` `llama4_text`,
    `Llama4ForCausalLM`), or the text part of a `llama4` vision-language checkpoint
    (`Llama4ForConditionalGeneration`: its `text_config` and its `language_model.*`
    weights; the vision tower and projector are skipped).

    Reads as `models.llama.from_hf` does: every tensor checked by name, shape and dtype
    before any data is read, then each parameter read straight into its shards. The
    experts' fused `gate_up_proj` is split on the host. transformers' complex RoPE rotates
    neighbouring pairs, which the zoo's RoPE does with `interleaved=True`: the q/k weights
    are read as they are.

    **Arguments:**

    - `path`: the checkpoint directory.
    - `spec`: the sharding spec of the returned model, or `None` for one device.
    - `dtype`: parameter dtype; default the checkpoint's.
    - `**overrides`: fields of the `Llama4Config` to replace that do not change a weight's
      shape (`remat`, `compute_dtype`, `max_seq_len`, `attention_chunk_size`, ...).

    **Returns:** the `Llama4`; its `.config` is the equivalent `Llama4Config`.

    **Raises:** `ValueError`, naming the file and the key or tensor, for a missing or
    damaged checkpoint, an unsupported `model_type` or architecture, config keys or values
    this family does not support, and missing, extra or wrong-shape tensors; `TypeError`
    when `path` is not a `str` or `os.PathLike`; `TypeError` or `ValueError` for `spec`,
    `dtype` or overrides that are not valid.
    """
    return _HF.from_hf(path, spec, dtype, overrides)


def config_from_hf(
    path, *, dtype: str | type | np.dtype | None = None, **overrides
) -> Llama4Config:
    """The `Llama4Config` that `from_hf(path, dtype=dtype, **overrides)` would build, from
    `config.json` alone (no weights read).

    **Raises:** as `from_hf` for `config.json`, `dtype` and the overrides.
    """
    return _HF.config_from_hf(path, dtype, overrides)


def to_hf(model: object, path, *, max_shard_size: int | None = None) -> None:
    """Write `model` as a Hugging Face `Llama4ForCausalLM` checkpoint (`config.json` +
    safetensors, `model_type` `llama4_text`) that
    `transformers.AutoModelForCausalLM.from_pretrained` loads; weights bit for bit (the
    experts' gate and up projections joined into `gate_up_proj`).

    **Arguments:**

    - `model`: the `Llama4` (its parameters must be addressable from this process).
    - `path`: output directory, created if needed.
    - `max_shard_size`: bytes per safetensors file; `None` writes one `model.safetensors`.

    **Raises:** `TypeError` when `model` is not a `Llama4` or `path` is not a path;
    `ValueError` when `path` exists and is not a directory or the model holds abstract
    shapes or parameters this process cannot address; `TypeError` or `ValueError` for a
    `max_shard_size` that is not a positive int.
    """
    _HF.to_hf(model, path, max_shard_size)


__all__ = [
    "LAYER_TYPES",
    "PRESETS",
    "Llama4",
    "Llama4Config",
    "config_from_hf",
    "from_hf",
    "make_block",
    "to_hf",
]
