"""Llama 2 / Llama 3 decoder-only language model, with presets.

Einsum letters: `b` batch, `s` sequence, `e` embed, `v` vocabulary.

Tokens -> embedding -> `n_layers` x (RMSNorm -> GQA self-attention with RoPE -> residual;
RMSNorm -> SwiGLU -> residual) -> RMSNorm -> LM head (or the tied embedding) -> float32
logits. References: Touvron et al. 2023, "Llama 2" (arXiv:2307.09288); Llama Team 2024,
"The Llama 3 Herd of Models" (arXiv:2407.21783).
"""

import dataclasses
import math
from typing import cast, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqx_longctx import ShardingSpec, layout_order
from eqx_longctx._types import Hidden, Logits, Positions, SegmentIds, Tokens
from eqx_longctx.nn import REMAT_POLICIES, DecoderBlock, LayerStack, RMSNorm, RoPE
from eqx_longctx.nn import Llama3RopeScaling as Llama3RopeScaling

_DTYPES = ("float32", "bfloat16", "float16")


@final
@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters of a Llama model (hashable, so it can be a static field).

    **Arguments:**

    - `vocab_size`, `dim`, `n_layers`, `n_heads`: vocabulary, width, depth, query heads.
    - `hidden_dim`: SwiGLU width.
    - `n_kv_heads`: key/value heads (default `n_heads`: MHA; fewer is GQA, 1 is MQA).
    - `head_dim`: width of each head (default `dim // n_heads`, filled in at construction).
    - `norm_eps`: RMSNorm epsilon.
    - `rope_theta`, `rope_scaling`: RoPE base and optional Llama 3.1 frequency scaling.
    - `max_seq_len`: longest sequence the model accepts.
    - `tie_embeddings`: reuse the token embedding as the LM head.
    - `attention_bias`: biases on the q/k/v projections (Qwen2-style).
    - `remat`: `"none"`, `"full"` or `"dots"` (see `eqx_longctx.nn.LayerStack`).
    - `param_dtype`, `compute_dtype`: `"float32"`, `"bfloat16"` or `"float16"`; logits
      are always float32.
    - `init_std`: standard deviation of the normal initialisation; output projections use
      `init_std / sqrt(2 * n_layers)`.
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
    rope_scaling: Llama3RopeScaling | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    attention_bias: bool = False
    remat: str = "none"
    param_dtype: str | type | np.dtype = "float32"
    compute_dtype: str | type | np.dtype = "float32"
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"LlamaConfig.{name} must be positive; got {name}={getattr(self, name)}."
                )
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads != 0:
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
        if self.head_dim <= 0 or self.head_dim % 2 != 0:
            raise ValueError(
                f"LlamaConfig needs a positive even head_dim (RoPE rotates feature pairs); got "
                f"head_dim={self.head_dim}."
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(
                f"LlamaConfig.remat must be one of {REMAT_POLICIES}; got remat={self.remat!r}."
            )
        for name in ("param_dtype", "compute_dtype"):
            value = getattr(self, name)
            try:
                dtype_name = jnp.dtype(value).name
            except TypeError:
                dtype_name = repr(value)
            if dtype_name not in _DTYPES:
                raise ValueError(f"LlamaConfig.{name} must be one of {_DTYPES}; got {value!r}.")
            object.__setattr__(self, name, dtype_name)
        if not self.norm_eps > 0 or not self.rope_theta > 0 or not self.init_std > 0:
            raise ValueError(
                "LlamaConfig needs norm_eps, rope_theta and init_std > 0; got "
                f"norm_eps={self.norm_eps}, rope_theta={self.rope_theta}, "
                f"init_std={self.init_std}."
            )
        object.__setattr__(self, "rope_theta", float(self.rope_theta))

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "LlamaConfig":
        """A preset from `PRESETS` with some fields replaced.

        When `dim` or `n_heads` is overridden and `head_dim` is not, `head_dim` is derived
        again as `dim // n_heads`.

        **Arguments:**

        - `name`: a key of `PRESETS`.
        - `**overrides`: fields to replace, e.g. `vocab_size=512` or `remat="full"`.

        **Returns:** the new `LlamaConfig`.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown Llama preset {name!r}; choose one of {sorted(PRESETS)}.")
        if ("dim" in overrides or "n_heads" in overrides) and "head_dim" not in overrides:
            overrides["head_dim"] = None
        return dataclasses.replace(PRESETS[name], **overrides)


@final
class Llama(eqx.Module):
    """The Llama decoder. Call it as `model(tokens, positions, segment_ids) -> logits`."""

    embed: Float[Array, "vocab embed"]
    layers: LayerStack
    norm: RMSNorm
    lm_head: Float[Array, "embed vocab"] | None
    config: LlamaConfig = eqx.field(static=True)
    spec: ShardingSpec | None = eqx.field(static=True)

    def __init__(self, config: LlamaConfig, *, key: PRNGKeyArray, spec=None):
        """**Arguments:**

        - `config`: the hyperparameters.
        - `key`: PRNG key for the initialisation.
        - `spec`: the sharding spec handed to every attention call; `None` = one device.
        """
        c = config
        dtype = jnp.dtype(c.param_dtype)
        n_kv_heads, head_dim = cast(int, c.n_kv_heads), cast(int, c.head_dim)
        k_embed, k_layers, k_head = jax.random.split(key, 3)
        rope = RoPE(head_dim, c.rope_theta, c.rope_scaling)
        out_std = c.init_std / math.sqrt(2 * c.n_layers)

        def make_layer(k):
            return DecoderBlock(
                c.dim,
                c.n_heads,
                n_kv_heads,
                head_dim,
                c.hidden_dim,
                rope=rope,
                key=k,
                norm_eps=c.norm_eps,
                qkv_bias=c.attention_bias,
                init_std=c.init_std,
                out_init_std=out_std,
                dtype=dtype,
                spec=spec,
            )

        self.embed = c.init_std * jax.random.normal(k_embed, (c.vocab_size, c.dim), dtype)
        self.layers = LayerStack(make_layer, c.n_layers, key=k_layers, remat=c.remat)
        self.norm = RMSNorm(c.dim, eps=c.norm_eps, dtype=dtype)
        if c.tie_embeddings:
            self.lm_head = None
        else:
            self.lm_head = c.init_std * jax.random.normal(k_head, (c.dim, c.vocab_size), dtype)
        self.config = config
        self.spec = spec

    def num_params(self) -> int:
        """**Returns:** the number of parameters (works on `eqx.filter_eval_shape` output)."""
        return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(self))

    def check_tokens(self, tokens: Int[Array | np.ndarray, "..."]) -> None:
        """Raise `ValueError` if a concrete token id lies outside `[0, vocab_size)`.

        Needs concrete values (call it outside `jit`); `__call__` runs it automatically
        whenever its tokens are concrete.
        """
        if isinstance(tokens, jax.core.Tracer):
            raise ValueError(
                "check_tokens needs concrete token ids, but got a tracer (called inside jit, "
                "grad or vmap). Check the batch before entering the transformed function."
            )
        ids = np.asarray(tokens)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, vocab_size={self.config.vocab_size}); got ids in "
                f"[{ids.min()}, {ids.max()}]. Use a tokenizer that matches the model, or "
                "build the model with LlamaConfig(vocab_size=...) large enough."
            )

    def embed_tokens(self, tokens: Tokens) -> Hidden:
        """**Returns:** `[batch, seq, embed]` token embeddings in the compute dtype."""
        return jnp.take(self.embed, tokens, axis=0).astype(self.config.compute_dtype)

    def forward_embeddings(
        self, x: Hidden, positions: Positions, segment_ids: SegmentIds | None = None
    ) -> Logits:
        """Run the decoder on input embeddings (what `__call__` does after the lookup).

        **Arguments:**

        - `x`: `[batch, seq, embed]` input embeddings.
        - `positions`: `[batch, seq]` RoPE positions.
        - `segment_ids`: `[batch, seq]` packed-document ids, or `None`.

        **Returns:** `[batch, seq, vocab]` float32 logits.
        """
        self._check_shapes(x.shape[:2], "x", positions, segment_ids)
        if self.spec is None:
            return self._forward(x, positions, segment_ids)
        logits_pspec = self.spec.activation_pspec()
        return self.spec.auto_axes(self._forward, logits_pspec)(x, positions, segment_ids)

    def _forward(self, x, positions, segment_ids):
        dtype = jnp.dtype(self.config.compute_dtype)
        if self.spec is not None:
            x = self.spec.place(x, self.spec.activation_pspec())
            positions = self.spec.place(positions, self.spec.token_pspec())
            if segment_ids is not None:
                segment_ids = self.spec.place(segment_ids, self.spec.token_pspec())
        x = self.layers(x.astype(dtype), positions, segment_ids)
        x = self.norm(x)
        if self.lm_head is None:
            return jnp.einsum(
                "bse,ve->bsv", x, self.embed.astype(dtype), preferred_element_type=jnp.float32
            )
        return jnp.einsum(
            "bse,ev->bsv", x, self.lm_head.astype(dtype), preferred_element_type=jnp.float32
        )

    def __call__(
        self,
        tokens: Array | np.ndarray,
        positions: Array | np.ndarray | None = None,
        segment_ids: Array | np.ndarray | None = None,
    ) -> Logits:
        """Validate the inputs (raising `ValueError`s, hence the loose annotations), then run.

        **Arguments:**

        - `tokens`: `[batch, seq]` token ids in `[0, vocab_size)`; `seq <= max_seq_len`.
        - `positions`: `[batch, seq]` RoPE positions; default `0..seq-1` in every row
          (packed data passes positions that restart at 0 in each document).
        - `segment_ids`: `[batch, seq]` packed-document ids, or `None` (one document per
          row). Causal masking is by token index; attention never crosses segments.

        **Returns:** `[batch, seq, vocab]` float32 logits.
        """
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2:
            raise ValueError(
                f"tokens must have rank 2, laid out [batch, seq]; got shape "
                f"{tuple(tokens.shape)}. Add a batch axis with tokens[None] for one sequence."
            )
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"tokens must be integer ids; got dtype {tokens.dtype}. Cast with "
                ".astype(jnp.int32)."
            )
        if positions is None:
            # Tokens arrive in the spec's layout order: each one's RoPE position is its
            # original index.
            batch, seq = tokens.shape
            order = np.arange(seq) if self.spec is None else layout_order(self.spec, seq)
            positions = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (batch, seq))
        positions = jnp.asarray(positions)
        segment_ids = None if segment_ids is None else jnp.asarray(segment_ids)
        self._check_shapes(tokens.shape, "tokens", positions, segment_ids)
        if not isinstance(tokens, jax.core.Tracer):
            self.check_tokens(tokens)
        return self.forward_embeddings(self.embed_tokens(tokens), positions, segment_ids)

    def _check_shapes(self, batch_seq, what, positions, segment_ids) -> None:
        batch, seq = batch_seq
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"sequence length must be <= max_seq_len={self.config.max_seq_len}; got "
                f"{what} of shape {tuple(batch_seq)} (seq={seq}). Split the sequence or build "
                "the model with a larger LlamaConfig(max_seq_len=...)."
            )
        for name, ids in (("positions", positions), ("segment_ids", segment_ids)):
            if ids is None:
                continue
            if tuple(ids.shape) != (batch, seq):
                raise ValueError(
                    f"{name} must have the [batch, seq] shape of the {what}, "
                    f"{(batch, seq)}; got {tuple(ids.shape)}."
                )
            if not jnp.issubdtype(ids.dtype, jnp.integer):
                raise ValueError(
                    f"{name} must be integers; got dtype {ids.dtype}. Cast with .astype(jnp.int32)."
                )


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
}
# fmt: on

__all__ = ["PRESETS", "Llama", "Llama3RopeScaling", "LlamaConfig"]
