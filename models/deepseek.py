"""DeepSeek-V2 / DeepSeek-V3 decoder-only mixture-of-experts language models, with presets.

Einsum letters: `b` batch, `s` sequence, `e` embed, `v` vocabulary.

Tokens -> embedding -> `first_k_dense` dense blocks, then `n_layers - first_k_dense` MoE
blocks -> RMSNorm -> LM head -> float32 logits. Every block is pre-norm: `x + MLA(norm(x))`,
then `x + FFN(norm(x))`, where MLA is multi-head latent attention (low-rank key/value latent,
optional low-rank queries, decoupled RoPE with YaRN scaling) and FFN a SwiGLU (dense blocks)
or shared + routed SwiGLU experts (MoE blocks). The dense and the MoE blocks are two stacks,
each run with `lax.scan`.

DeepSeek-V2 routes with softmax scores (greedy or group-limited greedy top-k); DeepSeek-V3
with sigmoid scores, a selection-only bias and group-limited top-k ("noaux_tc").

References: DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and Efficient
Mixture-of-Experts Language Model" (arXiv:2405.04434); DeepSeek-AI 2024, "DeepSeek-V3
Technical Report" (arXiv:2412.19437).
"""

import dataclasses
import functools
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
    MoE,
    MultiHeadLatentAttention,
    RMSNorm,
    RoPE,
    SwiGLU,
    check_routing,
)
from eqx_longctx.nn import YarnRopeScaling as YarnRopeScaling

from . import _decoder, _deepseek_hf, _hf_io

# DeepSeek's reference code and transformers build the q/kv latent norms with their default
# epsilon, whatever `rms_norm_eps` says.
LATENT_NORM_EPS = 1e-6


@final
@no_type_check  # __post_init__ checks every field, with messages that name the fix
@dataclasses.dataclass(frozen=True)
class DeepSeekConfig:
    """Hyperparameters of a DeepSeek-V2/V3 model (hashable, so it can be a static field).

    Fields are checked on construction as `LlamaConfig`'s are (`TypeError` for a wrong type,
    `ValueError` for a wrong value, naming the field), and the routing rule against the
    experts (`eqx_longctx.nn.check_routing`).

    **Arguments:**

    - `vocab_size`, `dim`, `n_layers`, `n_heads`: vocabulary, width, depth, attention heads.
    - `hidden_dim`: SwiGLU width of the dense blocks.
    - `moe_hidden_dim`: SwiGLU width of each routed expert (the shared block is
      `n_shared_experts * moe_hidden_dim` wide).
    - `n_routed_experts`, `n_shared_experts`, `top_k`: routed experts, shared experts,
      routed experts per token.
    - `first_k_dense`: number of leading dense blocks (the rest are MoE blocks).
    - `kv_lora_rank`, `q_lora_rank`: key/value latent width; query latent width or `None`
      (direct query projection, as DeepSeek-V2-Lite).
    - `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`: per-head widths of the
      position-free and rotary query/key parts, and of the values.
    - `topk_method`: `"greedy"`, `"group_limited_greedy"` (V2, softmax scores) or
      `"noaux_tc"` (V3, sigmoid scores + selection bias); see `eqx_longctx.nn.MoE`.
    - `n_group`, `topk_group`: expert groups, and how many a token may use.
    - `norm_topk_prob`, `routed_scaling_factor`: post-processing of the routing weights.
    - `norm_eps`: epsilon of the block and final RMSNorms.
    - `rope_theta`, `rope_scaling`: RoPE base and optional YaRN scaling.
    - `rope_interleave`: rotate neighbouring feature pairs (DeepSeek's layout).
    - `max_seq_len`: longest sequence the model accepts.
    - `tie_embeddings`: reuse the token embedding as the LM head.
    - `grouped_matmul`: how experts run, `"auto"`, `"ragged_dot"` or `"scan"` (see `MoE`).
    - `capacity_factor`: under expert parallelism, the per-device token-copy capacity as a
      multiple of the even share (copies beyond it are dropped, as in MaxText); `None` =
      dropless (see `MoE`).
    - `remat`: `"none"`, `"full"`, `"dots"` or `"offload"` (layer inputs kept in host
      memory; see `eqx_longctx.nn.LayerStack`).
    - `param_dtype`, `compute_dtype`: `"float32"`, `"bfloat16"` or `"float16"`; logits
      are always float32, routing runs in float32.
    - `init_std`: standard deviation of the normal initialisation; output projections use
      `init_std / sqrt(2 * n_layers)`.

    **Raises:** each message names the field.

    - `TypeError` for a size that is not an int, a real field (`norm_eps`, `rope_theta`,
      `init_std`, `routed_scaling_factor`, `capacity_factor`) that is not a number, a flag
      that is not a bool, or a `rope_scaling` that is not a `YarnRopeScaling` (or `None`).
    - `ValueError` for a size that is not positive (`n_shared_experts` and `first_k_dense`
      may be 0), a real field that is not finite and positive, a `remat`, dtype,
      `grouped_matmul` or `topk_method` not among the choices, `first_k_dense > n_layers`,
      an odd `qk_rope_head_dim`, a `top_k` not in `[1, n_routed_experts]`, or group-limited
      routing with an `n_group` that does not divide the experts, a `topk_group` not in
      `[1, n_group]`, `top_k > topk_group` x experts per group, or (`"noaux_tc"`) groups
      of fewer than 2 experts.
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
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float | int = 1.0
    norm_eps: float = 1e-6
    rope_theta: float | int = 10000.0
    rope_scaling: YarnRopeScaling | None = None
    rope_interleave: bool = True
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    grouped_matmul: str = "auto"
    capacity_factor: float | None = None
    remat: str = "none"
    param_dtype: str | type | np.dtype = "float32"
    compute_dtype: str | type | np.dtype = "float32"
    init_std: float = 0.02

    def __post_init__(self):
        check_decoder_config(self, scaling_cls=YarnRopeScaling)
        check_fields(
            self,
            ints=(
                "moe_hidden_dim", "n_routed_experts", "top_k", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group",
            ),
            optional_ints=("q_lora_rank",),
            non_negative_ints=("n_shared_experts", "first_k_dense"),
            positive_reals=("routed_scaling_factor",),
            bools=("norm_topk_prob", "rope_interleave"),
        )  # fmt: skip
        if self.first_k_dense > self.n_layers:
            raise ValueError(
                "DeepSeekConfig needs first_k_dense <= n_layers (the first first_k_dense of the "
                f"n_layers blocks are dense); got first_k_dense={self.first_k_dense}, "
                f"n_layers={self.n_layers}."
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                "DeepSeekConfig needs an even qk_rope_head_dim (RoPE rotates feature pairs); "
                f"got {self.qk_rope_head_dim}."
            )
        check_choice(self.grouped_matmul, "DeepSeekConfig.grouped_matmul", GROUPED_MATMULS)
        if self.capacity_factor is not None:
            check_real(
                self.capacity_factor, "DeepSeekConfig.capacity_factor", positive=True,
                fix=" Use None (dropless) or a factor such as 1.25.",
            )  # fmt: skip
        check_routing(
            "DeepSeekConfig", self.n_routed_experts, self.top_k, self.topk_method, self.n_group,
            self.topk_group,
        )  # fmt: skip

    @property
    def n_moe_layers(self) -> int:
        """Number of MoE blocks: `n_layers - first_k_dense`."""
        return self.n_layers - self.first_k_dense

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "DeepSeekConfig":
        """A preset from `PRESETS` with some fields replaced.

        **Arguments:**

        - `name`: a key of `PRESETS`.
        - `**overrides`: fields to replace, e.g. `n_layers=4`.

        **Returns:** the new `DeepSeekConfig`.

        **Raises:** `ValueError` for an unknown preset (the message lists them); `TypeError`
        for an override that is not a field; and as the constructor for the new values.
        """
        return dataclasses.replace(check_preset(PRESETS, name, overrides, "DeepSeek"), **overrides)


def make_block(
    config: object, *, moe: bool, key: PRNGKeyArray, spec: object = None
) -> DecoderBlock:
    """One DeepSeek block: `x + mla(norm(x))`, then `x + ffn(norm(x))`, where the FFN is
    a SwiGLU (dense blocks) or an MoE.

    **Arguments:**

    - `config`: the `DeepSeekConfig`.
    - `moe`: build the MoE feed-forward (else the dense SwiGLU).
    - `key`: PRNG key.
    - `spec`: the sharding spec, or `None` for one device.

    **Returns:** the `eqx_longctx.nn.DecoderBlock` with a `MultiHeadLatentAttention` as its
    `attn` and a `SwiGLU` or `MoE` as its `mlp`.

    **Raises:** `TypeError` when `config` is not a `DeepSeekConfig` or `spec` not a
    `ShardingSpec` (or `None`); with `moe`, `ValueError` when the spec's expert axis does
    not divide `n_routed_experts`; and as `MultiHeadLatentAttention` and `MoE` for values a
    `DeepSeekConfig` has already checked.
    """
    check_instance(config, "models.deepseek.make_block's config", DeepSeekConfig,
                   "Build one with DeepSeekConfig.from_preset(name).")  # fmt: skip
    c, spec = cast(DeepSeekConfig, config), cast(ShardingSpec | None, spec)
    dtype = jnp.dtype(c.param_dtype)
    out_std = c.init_std / math.sqrt(2 * c.n_layers)
    init: dict[str, Any] = dict(init_std=c.init_std, out_init_std=out_std, dtype=dtype, spec=spec)
    k_attn, k_mlp = jax.random.split(key)
    rope = RoPE(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling, interleaved=c.rope_interleave)
    attn = MultiHeadLatentAttention(
        c.dim,
        c.n_heads,
        kv_lora_rank=c.kv_lora_rank,
        q_lora_rank=c.q_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        rope=rope,
        key=k_attn,
        norm_eps=LATENT_NORM_EPS,
        **init,
    )
    if moe:
        mlp = MoE(
            c.dim,
            c.moe_hidden_dim,
            c.n_routed_experts,
            c.top_k,
            key=k_mlp,
            n_shared=c.n_shared_experts,
            topk_method=c.topk_method,
            n_group=c.n_group,
            topk_group=c.topk_group,
            norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor,
            grouped_matmul=c.grouped_matmul,
            capacity_factor=c.capacity_factor,
            **init,
        )
    else:
        mlp = SwiGLU(c.dim, c.hidden_dim, key=k_mlp, **init)
    return DecoderBlock(attn, mlp, dim=c.dim, norm_eps=c.norm_eps, dtype=dtype)


@final
class DeepSeek(AbstractDecoder):
    """The DeepSeek-V2/V3 decoder. Call it as `model(tokens, positions, segment_ids)`."""

    embed: Float[Array, "vocab embed"]
    dense_layers: LayerStack | None
    moe_layers: LayerStack | None
    norm: RMSNorm
    lm_head: Float[Array, "embed vocab"] | None
    config: DeepSeekConfig = eqx.field(static=True)
    spec: ShardingSpec | None = eqx.field(static=True)

    # `config`, `key` and `spec` are checked below, with errors that say how to build them.
    def __init__(self, config: object, *, key: object, spec: object = None):
        """**Arguments:**

        - `config`: the `DeepSeekConfig`.
        - `key`: PRNG key for the initialisation (`jax.random.key(seed)`).
        - `spec`: the `ShardingSpec` handed to every attention and MoE call; `None` = one
          device.

        **Raises:** `TypeError` when `config` is not a `DeepSeekConfig`, `key` not a PRNG key
        or `spec` not a `ShardingSpec` (or `None`); `ValueError` when the spec's expert axis
        does not divide `n_routed_experts` (see `eqx_longctx.nn.MoE`).
        """
        check_model_args("DeepSeek", config, DeepSeekConfig, key, spec)
        c, spec = cast(DeepSeekConfig, config), cast(ShardingSpec | None, spec)
        dtype = jnp.dtype(c.param_dtype)
        k_embed, k_dense, k_moe, k_head = jax.random.split(cast(PRNGKeyArray, key), 4)
        self.embed, self.lm_head = _decoder.embed_and_head(c, k_embed, k_head, dtype)

        def stack(n: int, moe: bool, k_stack: PRNGKeyArray) -> LayerStack | None:
            """The stack of `n` dense or MoE blocks (`None` if `n == 0`)."""
            if not n:
                return None
            block = functools.partial(make_block, c, moe=moe, spec=spec)
            return LayerStack(lambda k: block(key=k), n, key=k_stack, remat=c.remat, spec=spec)

        self.dense_layers = stack(c.first_k_dense, False, k_dense)
        self.moe_layers = stack(c.n_moe_layers, True, k_moe)
        self.norm = RMSNorm(c.dim, eps=c.norm_eps, dtype=dtype)
        self.config = c
        self.spec = spec

    def layer_stacks(self) -> tuple[LayerStack, ...]:
        """The layer stacks in order: the dense blocks, then the MoE blocks."""
        return tuple(s for s in (self.dense_layers, self.moe_layers) if s is not None)


# DeepSeek's long-context YaRN setting (both V2 and V3 extend 4k pre-training to 160k).
_YARN_V2 = YarnRopeScaling(40.0, 4096, 32.0, 1.0, mscale=0.707, mscale_all_dim=0.707)
_YARN_V3 = YarnRopeScaling(40.0, 4096, 32.0, 1.0, mscale=1.0, mscale_all_dim=1.0)

# fmt: off
PRESETS: dict[str, DeepSeekConfig] = {
    # Byte-level tokenizer (256 bytes + 3 specials); V3-style routing, small enough for a CPU.
    "tiny": DeepSeekConfig(
        vocab_size=259, dim=128, n_layers=3, n_heads=4, hidden_dim=256, moe_hidden_dim=64,
        n_routed_experts=8, n_shared_experts=1, top_k=2, first_k_dense=1, kv_lora_rank=32,
        q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        topk_method="noaux_tc", n_group=2, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, max_seq_len=2048,
    ),
    "deepseek-v2-lite": DeepSeekConfig(
        vocab_size=102400, dim=2048, n_layers=27, n_heads=16, hidden_dim=10944,
        moe_hidden_dim=1408, n_routed_experts=64, n_shared_experts=2, top_k=6, first_k_dense=1,
        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
        routed_scaling_factor=1.0, norm_eps=1e-6, rope_theta=10000.0, rope_scaling=_YARN_V2,
        max_seq_len=163840,
    ),
    "deepseek-v3": DeepSeekConfig(
        vocab_size=129280, dim=7168, n_layers=61, n_heads=128, hidden_dim=18432,
        moe_hidden_dim=2048, n_routed_experts=256, n_shared_experts=1, top_k=8, first_k_dense=3,
        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True,
        routed_scaling_factor=2.5, norm_eps=1e-6, rope_theta=10000.0, rope_scaling=_YARN_V3,
        max_seq_len=163840,
    ),
}
# fmt: on
"""The named configs `DeepSeekConfig.from_preset` starts from."""


# ---- Hugging Face checkpoints (format: models/_deepseek_hf.py) ---------------------------

_HF = _hf_io.HFFormat(DeepSeek, DeepSeekConfig, _deepseek_hf, "Build it with DeepSeek(...).")


def from_hf(
    path,
    *,
    spec: object = None,  # checked, with an error that says how to build a ShardingSpec
    dtype: str | type | np.dtype | None = None,
    **overrides,
) -> DeepSeek:
    """Load a Hugging Face DeepSeek-V2 or DeepSeek-V3 causal-LM checkpoint.

    Reads `config.json` and the safetensors files without torch; every tensor is checked by
    name and shape before any data is read, then placed one at a time. Every `config.json`
    key is either used, checked to have the value the zoo implements, or known not to change
    the forward pass (auxiliary-loss and parallelism settings); anything else is a
    `ValueError`. The multi-token-prediction modules of DeepSeek-V3 checkpoints
    (`num_nextn_predict_layers` extra layers after the last one) are not part of the
    next-token logits and are skipped.

    **Arguments:**

    - `path`: the checkpoint directory.
    - `spec`: the sharding spec of the returned model: each parameter is read straight into
      its shards under the spec's rules table (`eqx_longctx.param_shardings`), so no
      device ever holds the whole model; `None` = one device.
    - `dtype`: parameter dtype; default the checkpoint's (`dtype`/`torch_dtype`, else
      float32).
    - `**overrides`: fields of the `DeepSeekConfig` to replace, e.g. `remat`,
      `compute_dtype` (default `dtype`), `max_seq_len` (default `max_position_embeddings`),
      `grouped_matmul`, `capacity_factor`, `rope_theta` or `rope_scaling`; an override
      that would change a weight's shape (`n_layers`, `n_routed_experts`, ...) is a
      `ValueError`.

    **Returns:** the `DeepSeek` model; its `.config` is the equivalent `DeepSeekConfig`.

    **Raises:** `ValueError`, naming the file and the key or tensor, for a missing or
    damaged checkpoint, an unsupported `model_type` or architecture, config keys or values
    this family does not support, and missing, extra or wrong-shape tensors; `TypeError`
    when `path` is not a `str` or `os.PathLike`; `TypeError` or `ValueError` for `spec`,
    `dtype` or overrides that are not valid.
    """
    return _HF.from_hf(path, spec, dtype, overrides)


def config_from_hf(
    path, *, dtype: str | type | np.dtype | None = None, **overrides
) -> DeepSeekConfig:
    """The `DeepSeekConfig` that `from_hf(path, dtype=dtype, **overrides)` would build,
    from `config.json` alone (no weights read).

    **Raises:** as `from_hf` for `config.json`, `dtype` and the overrides.
    """
    return _HF.config_from_hf(path, dtype, overrides)


def to_hf(model: object, path, *, max_shard_size: int | None = None) -> None:
    """Write `model` as a Hugging Face checkpoint (`config.json` + safetensors).

    `topk_method="noaux_tc"` writes DeepSeek-V3 (`DeepseekV3ForCausalLM`), the softmax
    routings DeepSeek-V2 (`DeepseekV2ForCausalLM`).

    **Arguments:**

    - `model`: the `DeepSeek` model (its parameters must be addressable from this process).
    - `path`: output directory, created if needed.
    - `max_shard_size`: bytes per safetensors file; `None` writes one `model.safetensors`.

    **Raises:** `TypeError` when `model` is not a `DeepSeek` or `path` is not a path;
    `ValueError` when `path` exists and is not a directory, the model holds abstract
    shapes or parameters this process cannot address, or it would be written as
    DeepSeek-V2 (`topk_method` other than `"noaux_tc"`) with `norm_topk_prob=True` or
    `rope_interleave=False`, which that model does not support; `TypeError` or
    `ValueError` for a `max_shard_size` that is not a positive int.
    """
    _HF.to_hf(model, path, max_shard_size)


__all__ = [
    "PRESETS",
    "DeepSeek",
    "DeepSeekConfig",
    "YarnRopeScaling",
    "config_from_hf",
    "from_hf",
    "make_block",
    "to_hf",
]
