"""A third model family, written as a package outside this repository would write one: from
the public API of `eqx_longctx`, `eqx_longctx.family` and `eqx_longctx.nn` only.

A GPT-style decoder: sinusoidal absolute positions added to the token embeddings (Vaswani
et al. 2017, "Attention Is All You Need", arXiv:1706.03762), pre-norm blocks of multi-head
causal attention (through `eqx_longctx.attention`, so every context-parallel strategy
serves it) and a GELU MLP, an RMSNorm before a tied output head. Its own layers name
their weights' dimensions in their annotations, so the library's rules table places them.

`tests/test_plugins.py` registers `FAMILY` through an `eqx_longctx.models` entry point (and
with `eqx_longctx.register_family`), trains it with the training CLI and plans it with the
step planner.

Einsum letters: `b` batch, `s` sequence, `e` embed, `h` heads, `d` head dim, `f` hidden.
"""

import dataclasses
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

import eqx_longctx
from eqx_longctx.family import AttentionShape, ModelFamily, ShardingSpec
from eqx_longctx.nn import AbstractDecoder, LayerStack, RMSNorm


@dataclasses.dataclass(frozen=True)
class ToyGPTConfig:
    """`n_layers` blocks of `n_heads` attention heads of `head_dim` and a GELU MLP of
    `hidden_dim` on a `dim`-wide residual stream."""

    vocab_size: int = 259
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    head_dim: int = 16
    hidden_dim: int = 128
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    remat: str = "none"
    param_dtype: str = "float32"
    compute_dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "hidden_dim"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"ToyGPTConfig.{name} must be positive; got {getattr(self, name)}."
                )

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "ToyGPTConfig":
        """A preset from `PRESETS` with some fields replaced."""
        if name not in PRESETS:
            raise ValueError(f"unknown ToyGPT preset {name!r}; choose one of {sorted(PRESETS)}.")
        return dataclasses.replace(PRESETS[name], **overrides)


PRESETS = {"tiny": ToyGPTConfig()}


@final
class CausalAttention(eqx.Module):
    """Multi-head causal self-attention: project, `eqx_longctx.attention`, project back."""

    wq: Float[Array, "embed heads head_dim"]
    wk: Float[Array, "embed heads head_dim"]
    wv: Float[Array, "embed heads head_dim"]
    wo: Float[Array, "heads head_dim embed"]
    spec: ShardingSpec | None = eqx.field(static=True)

    def __init__(self, c: ToyGPTConfig, *, key: PRNGKeyArray, spec: ShardingSpec | None):
        kq, kk, kv, k_out = jax.random.split(key, 4)
        dtype, shape = jnp.dtype(c.param_dtype), (c.dim, c.n_heads, c.head_dim)
        self.wq, self.wk, self.wv = (
            0.02 * jax.random.normal(k, shape, dtype) for k in (kq, kk, kv)
        )
        out_std = 0.02 / (2 * c.n_layers) ** 0.5
        self.wo = out_std * jax.random.normal(k_out, (c.n_heads, c.head_dim, c.dim), dtype)
        self.spec = spec

    def __call__(self, x, segment_ids):
        q, k, v = (
            jnp.einsum("bse,ehd->bshd", x, w.astype(x.dtype)) for w in (self.wq, self.wk, self.wv)
        )
        out = eqx_longctx.attention(q, k, v, spec=self.spec, causal=True, segment_ids=segment_ids)
        return jnp.einsum("bshd,hde->bse", out, self.wo.astype(x.dtype))


@final
class Block(eqx.Module):
    """`x + attn(norm(x))`, then `x + mlp(norm(x))` with a GELU MLP."""

    attn_norm: RMSNorm
    attn: CausalAttention
    mlp_norm: RMSNorm
    w_in: Float[Array, "embed hidden"]
    w_out: Float[Array, "hidden embed"]

    def __init__(self, c: ToyGPTConfig, *, key: PRNGKeyArray, spec: ShardingSpec | None):
        k_attn, k_in, k_out = jax.random.split(key, 3)
        dtype = jnp.dtype(c.param_dtype)
        self.attn_norm = RMSNorm(c.dim, eps=c.norm_eps, dtype=dtype)
        self.attn = CausalAttention(c, key=k_attn, spec=spec)
        self.mlp_norm = RMSNorm(c.dim, eps=c.norm_eps, dtype=dtype)
        self.w_in = 0.02 * jax.random.normal(k_in, (c.dim, c.hidden_dim), dtype)
        out_std = 0.02 / (2 * c.n_layers) ** 0.5
        self.w_out = out_std * jax.random.normal(k_out, (c.hidden_dim, c.dim), dtype)

    def __call__(self, x, positions, segment_ids):
        x = x + self.attn(self.attn_norm(x), segment_ids)
        h = jax.nn.gelu(jnp.einsum("bse,ef->bsf", self.mlp_norm(x), self.w_in.astype(x.dtype)))
        return x + jnp.einsum("bsf,fe->bse", h, self.w_out.astype(x.dtype))


@final
class ToyGPT(AbstractDecoder):
    """Token embeddings plus sinusoidal positions, a `LayerStack` of `Block`s, a final
    RMSNorm and the output head tied to the embeddings."""

    embed: Float[Array, "vocab embed"]
    layers: LayerStack
    norm: RMSNorm
    lm_head: None
    config: ToyGPTConfig = eqx.field(static=True)
    spec: ShardingSpec | None = eqx.field(static=True)

    def __init__(self, config: ToyGPTConfig, *, key: PRNGKeyArray, spec=None):
        c, dtype = config, jnp.dtype(config.param_dtype)
        k_embed, k_layers = jax.random.split(key)
        self.embed = 0.02 * jax.random.normal(k_embed, (c.vocab_size, c.dim), dtype)
        self.layers = LayerStack(
            lambda k: Block(c, key=k, spec=spec), c.n_layers, key=k_layers, remat=c.remat,
            spec=spec,
        )  # fmt: skip
        self.norm = RMSNorm(c.dim, eps=c.norm_eps, dtype=dtype)
        self.lm_head = None
        self.config, self.spec = c, spec

    def run_layers(self, x, positions, segment_ids):
        half = self.config.dim // 2
        freqs = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
        angles = positions[..., None].astype(jnp.float32) * freqs
        x = x + jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], -1).astype(x.dtype)
        return self.layers(x, positions, segment_ids)


class ToyGPTFamily(ModelFamily):
    """The `toygpt` family: what the trainer and the planner ask of it."""

    name = "toygpt"
    config = ToyGPTConfig
    model = ToyGPT
    presets = PRESETS

    def local_config(self, config: Any, *, tensor: int = 1, expert: int = 1) -> Any:
        c = config
        return dataclasses.replace(
            c, n_layers=1, n_heads=c.n_heads // tensor, hidden_dim=c.hidden_dim // tensor
        )

    def attention_shape(self, config: Any) -> AttentionShape:
        return AttentionShape(config.n_heads, config.n_heads, config.head_dim, config.head_dim)


FAMILY = ToyGPTFamily()
"""The plugin object an `eqx_longctx.models` entry point names: `third_family:FAMILY`."""
