"""Kimi Linear: a hybrid of Kimi Delta Attention and multi-head latent attention layers,
with mixture-of-experts feed-forwards, and its presets.

Einsum letters: none (the arithmetic lives in the layers of `eqx_longctx.nn`).

Tokens -> embedding -> `n_layers` pre-norm blocks -> RMSNorm -> LM head -> float32 logits.
Each block is `x + attn(norm(x))`, then `x + ffn(norm(x))`:

- `attn` is Kimi Delta Attention (`KimiDeltaAttention`: the gated delta rule with a decay
  per key channel, a linear-time layer with a fixed-size state) on the layers
  `layer_types` marks `"linear_attention"`, and multi-head latent attention
  (`MultiHeadLatentAttention`) without any position encoding (NoPE: the "rotary" part of
  its queries and keys is not rotated) on the `"full_attention"` ones; Kimi-Linear-48B
  has three KDA layers to one MLA layer;
- `ffn` is a SwiGLU on the first `first_k_dense` layers, and shared + routed SwiGLU
  experts after them, routed as DeepSeek-V3 does: sigmoid scores, a selection-only bias,
  group-limited top-k, the weights renormalised and scaled by `routed_scaling_factor`.

Each run of consecutive layers of one kind (attention and feed-forward) is one
`LayerStack`, run with `lax.scan` (`models/_hybrid.py`).

Everything is computed as transformers' `KimiLinearForCausalLM` (5.x) computes it.

Reference: Kimi Team 2025, "Kimi Linear: An Expressive, Efficient Attention Architecture"
(arXiv:2510.26692).
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
    DTYPES,
    REMAT_POLICIES,
    ShardingSpec,
    check_choice,
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
    KimiDeltaAttention,
    LayerStack,
    MoE,
    MultiHeadLatentAttention,
    RMSNorm,
    SwiGLU,
    check_routing,
)

from . import _hf_io, _hybrid, _kimi_linear_hf

# transformers builds the q/kv latent norms of the MLA layers with their default epsilon,
# whatever `rms_norm_eps` says.
LATENT_NORM_EPS = 1e-6
ATTENTION_KINDS = _kimi_linear_hf.ATTENTION_KINDS
"""The `layer_types` entries: `"linear_attention"` (KDA) and `"full_attention"` (MLA)."""


@final
@no_type_check  # __post_init__ checks every field, with messages that name the fix
@dataclasses.dataclass(frozen=True)
class KimiLinearConfig:
    """Hyperparameters of a Kimi Linear model (hashable, so it can be a static field).

    Fields are checked on construction as `DeepSeekConfig`'s are (`TypeError` for a wrong
    type, `ValueError` for a wrong value, naming the field), and the routing rule against
    the experts (`eqx_longctx.nn.check_routing`).

    **Arguments:**

    - `vocab_size`, `dim`, `n_layers`: vocabulary, width, depth.
    - `n_heads`: heads of the MLA layers.
    - `hidden_dim`: SwiGLU width of the dense blocks.
    - `moe_hidden_dim`: SwiGLU width of each routed expert (the shared block is
      `n_shared_experts * moe_hidden_dim` wide).
    - `n_routed_experts`, `n_shared_experts`, `top_k`: routed experts, shared experts,
      routed experts per token.
    - `first_k_dense`: number of leading dense blocks (the rest are MoE blocks).
    - `kv_lora_rank`, `q_lora_rank`: MLA's key/value latent width; query latent width or
      `None` (direct query projection, as Kimi-Linear-48B).
    - `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`: MLA's per-head query/key widths
      (the second is DeepSeek's rotary part, here unrotated: it may be 0) and value width.
    - `layer_types`: each layer's attention, `"linear_attention"` (KDA) or
      `"full_attention"` (MLA), `n_layers` of them; `None`: Kimi-Linear-48B's pattern,
      MLA on every fourth layer (the 4th, 8th, ...) and on the last.
    - `linear_n_heads`, `linear_head_dim`: heads and head width of the KDA layers (keys and
      values alike; also the rank of their gate projections).
    - `conv_size`: width of the KDA layers' short convolutions.
    - `n_group`, `topk_group`: expert groups, and how many a token may use.
    - `norm_topk_prob`, `routed_scaling_factor`: post-processing of the routing weights.
    - `norm_eps`: epsilon of the block and final RMSNorms and of KDA's output norm.
    - `max_seq_len`: longest sequence the model accepts.
    - `tie_embeddings`: reuse the token embedding as the LM head.
    - `linear_chunk`: tokens per chunk of the KDA layers' chunked gated delta rule.
    - `grouped_matmul`: how experts run, `"auto"`, `"ragged_dot"` or `"scan"` (see `MoE`).
    - `capacity_factor`: under expert parallelism, the per-device token-copy capacity as a
      multiple of the even share; `None` = dropless (see `MoE`).
    - `remat`: `"none"`, `"full"`, `"dots"` or `"offload"` (see
      `eqx_longctx.nn.LayerStack`).
    - `param_dtype`, `compute_dtype`: `"float32"`, `"bfloat16"` or `"float16"`; logits
      are always float32, routing and KDA's gates and rule run in float32.
    - `init_std`: standard deviation of the normal initialisation; output projections use
      `init_std / sqrt(2 * n_layers)`.

    **Raises:** each message names the field.

    - `TypeError` for a size that is not an int, a real field (`norm_eps`, `init_std`,
      `routed_scaling_factor`, `capacity_factor`) that is not a number, or a flag that is
      not a bool.
    - `ValueError` for a size that is not positive (`n_shared_experts`, `first_k_dense`
      and `qk_rope_head_dim` may be 0), a real field that is not finite and positive, a
      `remat`, dtype or `grouped_matmul` not among the choices, `first_k_dense > n_layers`,
      `layer_types` not `n_layers` entries of `ATTENTION_KINDS`, a `top_k` not in
      `[1, n_routed_experts]`, or an `n_group` that does not divide the experts into groups
      of at least 2, a `topk_group` not in `[1, n_group]` or `top_k > topk_group` x
      experts per group.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    hidden_dim: int
    moe_hidden_dim: int
    n_routed_experts: int
    n_shared_experts: int
    top_k: int
    first_k_dense: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    layer_types: tuple[str, ...] | None = None
    linear_n_heads: int = 32
    linear_head_dim: int = 128
    conv_size: int = 4
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float | int = 1.0
    norm_eps: float = 1e-5
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    linear_chunk: int = 64
    grouped_matmul: str = "auto"
    capacity_factor: float | None = None
    remat: str = "none"
    param_dtype: str | type | np.dtype = "float32"
    compute_dtype: str | type | np.dtype = "float32"
    init_std: float = 0.02

    def __post_init__(self):
        check_fields(
            self,
            ints=(
                "vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "max_seq_len",
                "moe_hidden_dim", "n_routed_experts", "top_k", "kv_lora_rank",
                "qk_nope_head_dim", "v_head_dim", "linear_n_heads", "linear_head_dim",
                "conv_size", "n_group", "topk_group", "linear_chunk",
            ),
            optional_ints=("q_lora_rank",),
            non_negative_ints=("n_shared_experts", "first_k_dense", "qk_rope_head_dim"),
            positive_reals=("norm_eps", "init_std", "routed_scaling_factor"),
            bools=("tie_embeddings", "norm_topk_prob"),
        )  # fmt: skip
        check_choice(self.remat, "KimiLinearConfig.remat", REMAT_POLICIES)
        for name in ("param_dtype", "compute_dtype"):
            value = getattr(self, name)
            try:
                dtype_name = jnp.dtype(value).name
            except Exception:  # jnp.dtype raises TypeError or ValueError, by input
                dtype_name = repr(value)
            if dtype_name not in DTYPES:
                raise ValueError(f"KimiLinearConfig.{name} must be one of {DTYPES}; got {value!r}.")
            object.__setattr__(self, name, dtype_name)
        if self.first_k_dense > self.n_layers:
            raise ValueError(
                "KimiLinearConfig needs first_k_dense <= n_layers (the first first_k_dense of "
                f"the n_layers blocks are dense); got first_k_dense={self.first_k_dense}, "
                f"n_layers={self.n_layers}."
            )
        types = self.layer_types
        if isinstance(types, list):
            types = tuple(types)
        if types is not None and (
            not isinstance(types, tuple) or len(types) != self.n_layers
            or not set(types) <= set(ATTENTION_KINDS)
        ):  # fmt: skip
            raise ValueError(
                f"KimiLinearConfig.layer_types must be n_layers={self.n_layers} entries, each "
                f"one of {ATTENTION_KINDS}, or None (Kimi-Linear-48B's pattern); got {types!r}."
            )
        object.__setattr__(self, "layer_types", types)
        check_choice(self.grouped_matmul, "KimiLinearConfig.grouped_matmul", GROUPED_MATMULS)
        if self.capacity_factor is not None:
            check_real(
                self.capacity_factor, "KimiLinearConfig.capacity_factor", positive=True,
                fix=" Use None (dropless) or a factor such as 1.25.",
            )  # fmt: skip
        check_routing(
            "KimiLinearConfig", self.n_routed_experts, self.top_k, "noaux_tc", self.n_group,
            self.topk_group,
        )  # fmt: skip

    @property
    def n_moe_layers(self) -> int:
        """Number of MoE blocks: `n_layers - first_k_dense`."""
        return self.n_layers - self.first_k_dense

    @property
    def attention_types(self) -> tuple[str, ...]:
        """Each layer's attention: `layer_types`, or where it is `None` Kimi-Linear-48B's
        pattern, MLA (`"full_attention"`) on every fourth layer and on the last, KDA
        (`"linear_attention"`) on the others."""
        if self.layer_types is not None:
            return self.layer_types
        n = self.n_layers
        return tuple(
            "full_attention" if (i + 1) % 4 == 0 or i == n - 1 else "linear_attention"
            for i in range(n)
        )

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's kind, `"{attention}/{ffn}"` (e.g. `"linear_attention/moe"`): the
        layers of one kind share a body; each run of them is one `LayerStack`."""
        return _kimi_linear_hf.layer_kinds(self)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "KimiLinearConfig":
        """A preset from `PRESETS` with some fields replaced.

        **Arguments:**

        - `name`: a key of `PRESETS`.
        - `**overrides`: fields to replace, e.g. `n_layers=4` (a preset with explicit
          `layer_types` needs new ones, or `layer_types=None` for the default pattern).

        **Returns:** the new `KimiLinearConfig`.

        **Raises:** `ValueError` for an unknown preset (the message lists them); `TypeError`
        for an override that is not a field; and as the constructor for the new values.
        """
        preset = check_preset(PRESETS, name, overrides, "Kimi Linear")
        return dataclasses.replace(preset, **overrides)


def make_block(
    config: object, kind: str, *, key: PRNGKeyArray, spec: object = None
) -> DecoderBlock:
    """One Kimi Linear block: `x + attn(norm(x))`, then `x + ffn(norm(x))`.

    **Arguments:**

    - `config`: the `KimiLinearConfig`.
    - `kind`: `"{attention}/{ffn}"`, one of `config.layer_kinds`' values: `attention`
      `"linear_attention"` (a `KimiDeltaAttention`) or `"full_attention"` (a NoPE
      `MultiHeadLatentAttention`), `ffn` `"dense"` (a `SwiGLU`) or `"moe"` (an `MoE`).
    - `key`: PRNG key.
    - `spec`: the sharding spec, or `None` for one device.

    **Returns:** the `eqx_longctx.nn.DecoderBlock`.

    **Raises:** `TypeError` when `config` is not a `KimiLinearConfig` or `spec` not a
    `ShardingSpec` (or `None`); `ValueError` for an unknown `kind`, and as `MoE` and
    `KimiDeltaAttention` for experts or KDA heads that do not split over the spec's expert
    or tensor axis.
    """
    check_instance(config, "models.kimi_linear.make_block's config", KimiLinearConfig,
                   "Build one with KimiLinearConfig.from_preset(name).")  # fmt: skip
    c, spec = cast(KimiLinearConfig, config), cast(ShardingSpec | None, spec)
    attn_kind, _, ffn = kind.partition("/")
    if attn_kind not in ATTENTION_KINDS or ffn not in ("dense", "moe"):
        raise ValueError(
            f"Kimi Linear block kinds are '{{attention}}/{{ffn}}' with attention one of "
            f"{ATTENTION_KINDS} and ffn 'dense' or 'moe'; got {kind!r}."
        )
    dtype = jnp.dtype(c.param_dtype)
    out_std = c.init_std / math.sqrt(2 * c.n_layers)
    init: dict[str, Any] = dict(init_std=c.init_std, out_init_std=out_std, dtype=dtype, spec=spec)
    k_attn, k_mlp = jax.random.split(key)
    if attn_kind == "linear_attention":
        attn = KimiDeltaAttention(
            c.dim, c.linear_n_heads, c.linear_head_dim, key=k_attn, conv_size=c.conv_size,
            norm_eps=c.norm_eps, chunk=c.linear_chunk, **init,
        )  # fmt: skip
    else:
        attn = MultiHeadLatentAttention(
            c.dim, c.n_heads, kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
            v_head_dim=c.v_head_dim, rope=None, key=k_attn, norm_eps=LATENT_NORM_EPS, **init,
        )  # fmt: skip
    if ffn == "moe":
        mlp = MoE(
            c.dim, c.moe_hidden_dim, c.n_routed_experts, c.top_k, key=k_mlp,
            n_shared=c.n_shared_experts, topk_method="noaux_tc", n_group=c.n_group,
            topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor, grouped_matmul=c.grouped_matmul,
            capacity_factor=c.capacity_factor, **init,
        )  # fmt: skip
    else:
        mlp = SwiGLU(c.dim, c.hidden_dim, key=k_mlp, **init)
    return DecoderBlock(attn, mlp, dim=c.dim, norm_eps=c.norm_eps, dtype=dtype)


@final
class KimiLinear(AbstractDecoder):
    """The Kimi Linear decoder. Call it as `model(tokens, positions, segment_ids)`."""

    embed: Float[Array, "vocab embed"]
    stacks: tuple[LayerStack, ...]
    norm: RMSNorm
    lm_head: Float[Array, "embed vocab"] | None
    config: KimiLinearConfig = eqx.field(static=True)
    spec: ShardingSpec | None = eqx.field(static=True)

    # `config`, `key` and `spec` are checked below, with errors that say how to build them.
    def __init__(self, config: object, *, key: object, spec: object = None):
        """**Arguments:**

        - `config`: the `KimiLinearConfig`.
        - `key`: PRNG key for the initialisation (`jax.random.key(seed)`).
        - `spec`: the `ShardingSpec` handed to every attention and MoE call; `None` = one
          device.

        **Raises:** `TypeError` when `config` is not a `KimiLinearConfig`, `key` not a PRNG
        key or `spec` not a `ShardingSpec` (or `None`); `ValueError` when the spec's expert
        axis does not divide `n_routed_experts` or its tensor axis the KDA heads.
        """
        check_model_args("KimiLinear", config, KimiLinearConfig, key, spec)
        c, spec = cast(KimiLinearConfig, config), cast(ShardingSpec | None, spec)
        dtype = jnp.dtype(c.param_dtype)
        self.embed, self.lm_head, self.stacks = _hybrid.kind_layers(
            c, c.layer_kinds, make_block, key=cast(PRNGKeyArray, key), spec=spec
        )
        self.norm = RMSNorm(c.dim, eps=c.norm_eps, dtype=dtype)
        self.config = c
        self.spec = spec

    def layer_stacks(self) -> tuple[LayerStack, ...]:
        """The layer stacks in order: one per run of consecutive layers of one kind."""
        return self.stacks


# Kimi-Linear-48B's layers: MLA on the 4th, 8th, ..., 24th and the 27th (last) layer.
_KIMI_48B_TYPES = tuple(
    "full_attention" if i + 1 in (4, 8, 12, 16, 20, 24, 27) else "linear_attention"
    for i in range(27)
)

# fmt: off
PRESETS: dict[str, KimiLinearConfig] = {
    # Byte-level tokenizer (256 bytes + 3 specials); the default layer pattern over 3 layers
    # (KDA, KDA, MLA), the first dense and the others MoE: every kind of layer, small
    # enough for a CPU; n_layers=2 keeps every kind (KDA dense, MLA MoE).
    "tiny": KimiLinearConfig(
        vocab_size=259, dim=128, n_layers=3, n_heads=4, hidden_dim=256, moe_hidden_dim=64,
        n_routed_experts=8, n_shared_experts=1, top_k=2, first_k_dense=1, kv_lora_rank=32,
        q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        layer_types=None, linear_n_heads=4, linear_head_dim=32, conv_size=4, n_group=2,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.446, max_seq_len=2048,
    ),
    # moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json (also -Base): 27 layers, KDA
    # (32 heads of 128) with MLA (32 heads, NoPE) on layers 4, 8, ..., 24 and 27 (1-based),
    # 256 routed experts of 1024 + 1 shared, 8 per token, the first layer dense.
    "kimi-linear-48b-a3b": KimiLinearConfig(
        vocab_size=163840, dim=2304, n_layers=27, n_heads=32, hidden_dim=9216,
        moe_hidden_dim=1024, n_routed_experts=256, n_shared_experts=1, top_k=8,
        first_k_dense=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, layer_types=_KIMI_48B_TYPES, linear_n_heads=32,
        linear_head_dim=128, conv_size=4, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.446, norm_eps=1e-5, max_seq_len=1048576,
    ),
}
# fmt: on
"""The named configs `KimiLinearConfig.from_preset` starts from."""


# ---- Hugging Face checkpoints (format: models/_kimi_linear_hf.py) ------------------------

_HF = _hf_io.HFFormat(
    KimiLinear, KimiLinearConfig, _kimi_linear_hf, "Build it with KimiLinear(...)."
)


def from_hf(
    path,
    *,
    spec: object = None,  # checked, with an error that says how to build a ShardingSpec
    dtype: str | type | np.dtype | None = None,
    **overrides,
) -> KimiLinear:
    """Load a Hugging Face Kimi Linear causal-LM checkpoint (Moonshot's, or one transformers
    wrote).

    Reads `config.json` and the safetensors files without torch; every tensor is checked by
    name and shape before any data is read, then placed one at a time. Every `config.json`
    key is either used, checked to have the value the zoo implements, or known not to change
    the forward pass; anything else is a `ValueError`.

    **Arguments:**

    - `path`: the checkpoint directory.
    - `spec`: the sharding spec of the returned model: each parameter is read straight into
      its shards (`eqx_longctx.param_shardings`); `None` = one device.
    - `dtype`: parameter dtype; default the checkpoint's (`dtype`/`torch_dtype`, else
      float32).
    - `**overrides`: fields of the `KimiLinearConfig` to replace, e.g. `remat`,
      `compute_dtype` (default `dtype`), `max_seq_len` (default `model_max_length`),
      `linear_chunk`, `grouped_matmul` or `capacity_factor`; an override that would change
      a weight's shape (`n_layers`, `layer_types`, ...) is a `ValueError`.

    **Returns:** the `KimiLinear` model; its `.config` is the equivalent `KimiLinearConfig`.

    **Raises:** `ValueError`, naming the file and the key or tensor, for a missing or
    damaged checkpoint, an unsupported `model_type` or architecture, config keys or values
    this family does not support, and missing, extra or wrong-shape tensors; `TypeError`
    when `path` is not a `str` or `os.PathLike`; `TypeError` or `ValueError` for `spec`,
    `dtype` or overrides that are not valid.
    """
    return _HF.from_hf(path, spec, dtype, overrides)


def config_from_hf(
    path, *, dtype: str | type | np.dtype | None = None, **overrides
) -> KimiLinearConfig:
    """The `KimiLinearConfig` that `from_hf(path, dtype=dtype, **overrides)` would build,
    from `config.json` alone (no weights read).

    **Raises:** as `from_hf` for `config.json`, `dtype` and the overrides.
    """
    return _HF.config_from_hf(path, dtype, overrides)


def to_hf(model: object, path, *, max_shard_size: int | None = None) -> None:
    """Write `model` as a Hugging Face checkpoint (`config.json` + safetensors) in
    Moonshot's layout, which transformers' `KimiLinearForCausalLM` loads.

    **Arguments:**

    - `model`: the `KimiLinear` model (its parameters must be addressable from this
      process).
    - `path`: output directory, created if needed.
    - `max_shard_size`: bytes per safetensors file; `None` writes one `model.safetensors`.

    **Raises:** `TypeError` when `model` is not a `KimiLinear` or `path` is not a path;
    `ValueError` when `path` exists and is not a directory, or the model holds abstract
    shapes or parameters this process cannot address; `TypeError` or `ValueError` for a
    `max_shard_size` that is not a positive int.
    """
    _HF.to_hf(model, path, max_shard_size)


__all__ = [
    "ATTENTION_KINDS",
    "PRESETS",
    "KimiLinear",
    "KimiLinearConfig",
    "config_from_hf",
    "from_hf",
    "make_block",
    "to_hf",
]
