"""Multi-head latent attention (MLA), with decoupled RoPE and YaRN frequency scaling.

Einsum letters: `b` batch, `s` sequence, `e` embed, `h` heads, `d` query/key head dim
(`qk_nope_head_dim + qk_rope_head_dim`), `n` the fused key-nope + value width of the
up-projection, `v` value head dim, `c` key/value latent rank, `r` query latent rank.

Keys and values are compressed into one small latent per token (`kv_lora_rank` wide) plus
one rotary key shared by every head (`qk_rope_head_dim` wide); each head's key ("nope" part)
and value are linear up-projections of the latent. RoPE is "decoupled": only the last
`qk_rope_head_dim` features of queries and keys are rotated, so the up-projection stays
position-free.

References: DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and Efficient
Mixture-of-Experts Language Model" (arXiv:2405.04434); Peng et al. 2023, "YaRN: Efficient
Context Window Extension of Large Language Models" (arXiv:2309.00071).
"""

import dataclasses
import math
from typing import final, no_type_check

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._checks import check_bool, check_instance, check_int, check_real, check_spec
from .._sharding import ShardingSpec
from .._types import Heads, Hidden, Positions, SegmentIds
from ..attention import latent_attention
from ._norm import RMSNorm


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@final
@no_type_check  # __post_init__ checks every field, with messages that name the fix
@dataclasses.dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN RoPE scaling (Hugging Face `rope_type="yarn"`), with DeepSeek's `mscale` terms.

    Frequency `i` of a `head_dim`-wide rotation with base `theta` is blended between the
    original (`extrapolation`) and `factor`-times slower (`interpolation`) by a linear ramp
    over the dimensions whose wavelength count over `original_max_position_embeddings` falls
    between `beta_fast` and `beta_slow` rotations (ramp bounds floored/ceiled when
    `truncate`).

    Two magnitudes go with it, as in Hugging Face transformers:

    - `rotary_factor()`: multiplies cos and sin (so the rotated query and key parts):
      `attention_factor` if given, else `m(factor, mscale) / m(factor, mscale_all_dim)` when
      both are set, else `m(factor, 1)`, with `m(f, a) = 0.1 * a * ln(f) + 1` (1 if f <= 1).
      DeepSeek's checkpoints set `mscale == mscale_all_dim`, making it 1.
    - `softmax_scale_factor()`: multiplies the softmax scale `1/sqrt(qk_head_dim)`:
      `m(factor, mscale_all_dim) ** 2` when `mscale_all_dim` is set, else 1 (DeepSeek's
      attention-temperature correction).

    **Arguments:**

    - `factor`: context extension factor (40 for DeepSeek-V2/V3).
    - `original_max_position_embeddings`: pre-training context length (4096).
    - `beta_fast`, `beta_slow`: rotation counts bounding the blended band (32 and 1).
    - `mscale`, `mscale_all_dim`: DeepSeek's magnitude terms, or `None`.
    - `attention_factor`: explicit cos/sin multiplier, or `None` to derive it.
    - `truncate`: round the ramp bounds outward to whole dimensions (the default).

    **Raises:** `TypeError` for a field of the wrong type; `ValueError` unless `factor >= 1`,
    `0 < beta_slow < beta_fast`, `attention_factor` is positive or `None`, and
    `original_max_position_embeddings` is a positive int.
    """

    factor: float | int
    original_max_position_embeddings: int
    beta_fast: float | int = 32.0
    beta_slow: float | int = 1.0
    mscale: float | int | None = None
    mscale_all_dim: float | int | None = None
    attention_factor: float | int | None = None
    truncate: bool = True

    def __post_init__(self):
        for name in (
            "factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None or name == "factor":
                object.__setattr__(self, name, check_real(value, f"YarnRopeScaling.{name}"))
        original = check_int(
            self.original_max_position_embeddings,
            "YarnRopeScaling.original_max_position_embeddings",
            fix=" DeepSeek-V2/V3 use 4096.",
        )
        object.__setattr__(self, "original_max_position_embeddings", original)
        object.__setattr__(self, "truncate", check_bool(self.truncate, "YarnRopeScaling.truncate"))
        if not self.factor >= 1:
            raise ValueError(
                f"YarnRopeScaling needs factor >= 1 (it stretches the context); got "
                f"factor={self.factor}. DeepSeek-V2/V3 use 40."
            )
        if not 0 < self.beta_slow < self.beta_fast:
            raise ValueError(
                "YarnRopeScaling needs 0 < beta_slow < beta_fast (rotation counts bounding the "
                f"blended band); got beta_slow={self.beta_slow}, beta_fast={self.beta_fast}. "
                "The defaults are 1 and 32."
            )
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(
                f"YarnRopeScaling needs attention_factor > 0 or None; got {self.attention_factor}."
            )

    def frequencies(self, head_dim: int, theta: float) -> np.ndarray:
        """**Returns:** `[head_dim / 2]` float64 YaRN frequencies for base `theta`."""
        exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
        extrapolation = 1.0 / theta**exponents
        interpolation = extrapolation / self.factor
        old = float(self.original_max_position_embeddings)

        def correction_dim(rotations: float) -> float:
            return head_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # the reference's guard against a zero-width ramp
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        keep = 1.0 - ramp  # 1: original frequency, 0: interpolated
        return interpolation * (1 - keep) + extrapolation * keep

    def rotary_factor(self) -> float:
        """**Returns:** the multiplier of cos and sin (Hugging Face's `attention_factor`)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return _yarn_mscale(self.factor, 1.0)

    def softmax_scale_factor(self) -> float:
        """**Returns:** the multiplier of the softmax scale (`mscale_all_dim` correction)."""
        if not self.mscale_all_dim:
            return 1.0
        return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2


@final
class DecoupledRoPE(eqx.Module):
    """Rotary embedding of the rotary part of MLA queries and keys, optionally YaRN-scaled.

    With `interleaved=True` (DeepSeek's layout, the only one of DeepSeek-V2 and the default
    of V3) frequency `i` rotates the neighbouring features `(2i, 2i + 1)`; with `False` it
    rotates `(i, i + head_dim/2)` (Hugging Face "rotate_half"). The rotated values are
    multiplied by the scaling's `rotary_factor()`. Holds no arrays.
    """

    head_dim: int = eqx.field(static=True)
    theta: float = eqx.field(static=True)
    scaling: YarnRopeScaling | None = eqx.field(static=True)
    interleaved: bool = eqx.field(static=True)

    def __init__(
        self,
        head_dim: int,
        theta: float | int,
        scaling: YarnRopeScaling | None = None,
        *,
        interleaved: bool = True,
    ):
        """**Arguments:**

        - `head_dim`: number of rotated features (`qk_rope_head_dim`, even).
        - `theta`: base of the frequency ladder.
        - `scaling`: optional YaRN scaling.
        - `interleaved`: rotate neighbouring feature pairs (DeepSeek) instead of halves.

        **Raises:** `TypeError` when `scaling` is not a `YarnRopeScaling` (or `None`) or an
        argument has the wrong type; `ValueError` unless `head_dim` is positive and even and
        `theta > 0`.
        """
        self.head_dim = check_int(head_dim, "DecoupledRoPE head_dim", minimum=None)
        self.theta = check_real(theta, "DecoupledRoPE theta")
        check_instance(
            scaling, "DecoupledRoPE scaling", YarnRopeScaling, "Build YarnRopeScaling(...).",
            none_ok=True,
        )  # fmt: skip
        self.scaling = scaling
        self.interleaved = check_bool(interleaved, "DecoupledRoPE interleaved")

    def __check_init__(self):
        if self.head_dim <= 0 or self.head_dim % 2 != 0:
            raise ValueError(
                f"DecoupledRoPE rotates pairs of features, so head_dim must be a positive even "
                f"number; got head_dim={self.head_dim}. DeepSeek uses qk_rope_head_dim=64."
            )
        if not self.theta > 0:
            raise ValueError(f"DecoupledRoPE needs a positive base theta; got {self.theta}.")

    def frequencies(self) -> np.ndarray:
        """**Returns:** `[head_dim / 2]` float64 rotation frequencies, scaling applied."""
        if self.scaling is not None:
            return self.scaling.frequencies(self.head_dim, self.theta)
        exponents = np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim
        return 1.0 / self.theta**exponents

    def __call__(self, x: Heads, positions: Positions) -> Heads:
        """**Arguments:**

        - `x`: `[batch, seq, heads, head_dim]` rotary parts of queries or keys.
        - `positions`: `[batch, seq]` integer positions.

        **Returns:** the rotated `x` (same layout, shape and dtype); computed in float32.
        """
        inv_freq = jnp.asarray(self.frequencies(), jnp.float32)
        angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq
        factor = 1.0 if self.scaling is None else self.scaling.rotary_factor()
        cos, sin = factor * jnp.cos(angles), factor * jnp.sin(angles)
        x32 = x.astype(jnp.float32)
        if self.interleaved:
            x1, x2 = x32[..., 0::2], x32[..., 1::2]
            pairs = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
            rotated = pairs.reshape(x.shape)
        else:
            half = self.head_dim // 2
            x1, x2 = x32[..., :half], x32[..., half:]
            rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return rotated.astype(x.dtype)


@final
class MultiHeadLatentAttention(eqx.Module):
    """DeepSeek's multi-head latent attention (MLA), causal self-attention.

    Per token: queries come from `x` directly (`wq`) or through a normalised low-rank latent
    (`wq_a`, `q_norm`, `wq_b`); `wkv_a` projects `x` to the key/value latent and the rotary
    key; the latent is RMS-normalised. The computation is split into three steps so that a
    context-parallel strategy can communicate the latent (`kv_lora_rank + qk_rope_head_dim`
    numbers per token) instead of per-head keys and values:

    - `queries(x, positions)`: `[batch, seq, heads, qk_head_dim]` queries `[q_nope, q_rope]`.
    - `latent(x, positions)`: the normalised latent `[batch, seq, kv_lora_rank]` and the
      rotated rotary key `[batch, seq, qk_rope_head_dim]`, one per token.
    - `up_project((latent, k_rope))`: per-head keys `[k_nope, k_rope]` (the rotary key
      broadcast over heads) and values `[batch, seq, heads, v_head_dim]`.

    `__call__` chains them and calls `eqx_longctx.attention` with the softmax scale
    `softmax_scale` (`qk_head_dim ** -0.5`, times the YaRN correction).

    Under a spec's `tensor_axis` the heads split over it, as in DeepSeek's own tensor
    parallelism: the per-head weights (`wq` or `wq_b`, `wkv_b`, `wo`) split by their `heads`
    axis through the rules table, while `wq_a`, `wkv_a` (the latent and the shared rotary
    key) and the norms are whole on every tensor shard; `wo` ends in one all-reduce over the
    tensor axis, as `SelfAttention`'s does.
    """

    wq: Float[Array, "embed heads qk_head_dim"] | None
    wq_a: Float[Array, "embed q_lora_rank"] | None
    q_norm: RMSNorm | None
    wq_b: Float[Array, "q_lora_rank heads qk_head_dim"] | None
    wkv_a: Float[Array, "embed latent_and_rope"]
    kv_norm: RMSNorm
    wkv_b: Float[Array, "kv_lora_rank heads nope_and_v"]
    wo: Float[Array, "heads v_head_dim embed"]
    rope: DecoupledRoPE
    n_heads: int = eqx.field(static=True)
    qk_nope_head_dim: int = eqx.field(static=True)
    qk_rope_head_dim: int = eqx.field(static=True)
    v_head_dim: int = eqx.field(static=True)
    kv_lora_rank: int = eqx.field(static=True)
    softmax_scale: float = eqx.field(static=True)
    spec: ShardingSpec | None = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        n_heads: int,
        *,
        kv_lora_rank: int,
        q_lora_rank: int | None,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rope: DecoupledRoPE,
        key: PRNGKeyArray,
        norm_eps: float = 1e-6,
        init_std: float = 0.02,
        out_init_std: float | None = None,
        dtype=jnp.float32,
        spec=None,
    ):
        """**Arguments:**

        - `dim`: model width (`embed`).
        - `n_heads`: attention heads (every head has its own key and value).
        - `kv_lora_rank`: width of the key/value latent.
        - `q_lora_rank`: width of the query latent, or `None` to project queries directly.
        - `qk_nope_head_dim`, `qk_rope_head_dim`: position-free and rotary widths of each
          query/key head.
        - `v_head_dim`: width of each value head.
        - `rope`: the rotary embedding of the `qk_rope_head_dim` part.
        - `key`: PRNG key for the normal initialisation.
        - `norm_eps`: epsilon of the latent RMSNorms.
        - `init_std`, `out_init_std`: standard deviations of the input projections and of
          the output projection (default `init_std`).
        - `dtype`: parameter dtype.
        - `spec`: the sharding spec passed to `eqx_longctx.attention`; `None` = one device.

        **Raises:** `TypeError` when `spec` is not a `ShardingSpec` (or `None`); `ValueError`
        for a width that is not positive, or when `rope.head_dim` differs from
        `qk_rope_head_dim`.
        """
        check_spec(spec, "MultiHeadLatentAttention")
        for name, value in (
            ("dim", dim),
            ("n_heads", n_heads),
            ("kv_lora_rank", kv_lora_rank),
            ("qk_nope_head_dim", qk_nope_head_dim),
            ("v_head_dim", v_head_dim),
        ):
            if value <= 0:
                raise ValueError(f"MultiHeadLatentAttention needs {name} > 0; got {value}.")
        if q_lora_rank is not None and q_lora_rank <= 0:
            raise ValueError(
                f"MultiHeadLatentAttention needs q_lora_rank > 0, or None for a direct query "
                f"projection; got q_lora_rank={q_lora_rank}."
            )
        out_init_std = init_std if out_init_std is None else out_init_std
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        kq, kqa, kqb, kkva, kkvb, ko = jax.random.split(key, 6)

        def normal(k, shape, std=init_std):
            return std * jax.random.normal(k, shape, dtype)

        if q_lora_rank is None:
            self.wq = normal(kq, (dim, n_heads, qk_head_dim))
            self.wq_a = self.wq_b = self.q_norm = None
        else:
            self.wq = None
            self.wq_a = normal(kqa, (dim, q_lora_rank))
            self.q_norm = RMSNorm(q_lora_rank, eps=norm_eps, dtype=dtype)
            self.wq_b = normal(kqb, (q_lora_rank, n_heads, qk_head_dim))
        self.wkv_a = normal(kkva, (dim, kv_lora_rank + qk_rope_head_dim))
        self.kv_norm = RMSNorm(kv_lora_rank, eps=norm_eps, dtype=dtype)
        self.wkv_b = normal(kkvb, (kv_lora_rank, n_heads, qk_nope_head_dim + v_head_dim))
        self.wo = normal(ko, (n_heads, v_head_dim, dim), out_init_std)
        self.rope = rope
        self.n_heads = n_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        correction = 1.0 if rope.scaling is None else rope.scaling.softmax_scale_factor()
        self.softmax_scale = qk_head_dim**-0.5 * correction
        self.spec = spec

    def __check_init__(self):
        if self.rope.head_dim != self.qk_rope_head_dim:
            raise ValueError(
                "MultiHeadLatentAttention's RoPE must rotate the qk_rope_head_dim features; got "
                f"qk_rope_head_dim={self.qk_rope_head_dim} but rope.head_dim="
                f"{self.rope.head_dim}. Build DecoupledRoPE({self.qk_rope_head_dim}, ...)."
            )
        if (self.wq is None) == (self.wq_b is None):
            raise ValueError(
                "MultiHeadLatentAttention projects queries either directly (wq) or through a "
                "latent (wq_a, q_norm, wq_b), not both or neither; build it with q_lora_rank="
                "None or an int."
            )

    @property
    def qk_head_dim(self) -> int:
        """Width of each query/key head: `qk_nope_head_dim + qk_rope_head_dim`."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def q_lora_rank(self) -> int | None:
        """Width of the query latent, or `None` for a direct query projection."""
        return None if self.wq_a is None else self.wq_a.shape[-1]

    def queries(
        self, x: Hidden, positions: Positions
    ) -> Float[Array, "batch seq heads qk_head_dim"]:
        """Queries of `x` (`[batch, seq, embed]`, normalised) at RoPE `positions`.

        **Returns:** `[batch, seq, heads, qk_head_dim]` queries `[q_nope, rotated q_rope]`.
        """
        dtype = x.dtype
        if self.wq is not None:
            q = jnp.einsum("bse,ehd->bshd", x, self.wq.astype(dtype))
        else:
            assert self.wq_a is not None and self.q_norm is not None and self.wq_b is not None
            q = self.q_norm(jnp.einsum("bse,er->bsr", x, self.wq_a.astype(dtype)))
            q = jnp.einsum("bsr,rhd->bshd", q, self.wq_b.astype(dtype))
        q_nope, q_rope = q[..., : self.qk_nope_head_dim], q[..., self.qk_nope_head_dim :]
        return jnp.concatenate([q_nope, self.rope(q_rope, positions)], axis=-1)

    def latent(
        self, x: Hidden, positions: Positions
    ) -> tuple[Float[Array, "batch seq kv_lora_rank"], Float[Array, "batch seq qk_rope_head_dim"]]:
        """What keys and values are made of: the only per-token state a strategy needs.

        **Arguments:**

        - `x`: `[batch, seq, embed]` (normalised) activations.
        - `positions`: `[batch, seq]` RoPE positions.

        **Returns:** `(latent, k_rope)`: the RMS-normalised key/value latent
        `[batch, seq, kv_lora_rank]` and the rotated rotary key `[batch, seq,
        qk_rope_head_dim]` (shared by all heads).
        """
        compressed = jnp.einsum("bse,ec->bsc", x, self.wkv_a.astype(x.dtype))
        latent = self.kv_norm(compressed[..., : self.kv_lora_rank])
        k_rope = self.rope(compressed[..., None, self.kv_lora_rank :], positions)[:, :, 0]
        return latent, k_rope

    def up_project(
        self,
        latent: tuple[
            Float[Array, "batch kv_seq kv_lora_rank"], Float[Array, "batch kv_seq qk_rope_head_dim"]
        ],
    ) -> tuple[
        Float[Array, "batch kv_seq heads qk_head_dim"],
        Float[Array, "batch kv_seq heads v_head_dim"],
    ]:
        """Per-head keys and values from the latent (position-free: runs on any token block).

        `latent` is the pair `(latent, k_rope)` that `latent()` returns.

        **Returns:** `(k, v)`: keys `[k_nope, k_rope]` (the rotary key broadcast over heads)
        and values.
        """
        return self.up_projection()(latent)

    def up_projection(self) -> "LatentUpProjection":
        """The up-projection as a module holding only its weight (what the context-parallel
        strategies replicate over the sequence axes, split over heads on a tensor axis, and
        differentiate on every device)."""
        return LatentUpProjection(self.wkv_b, self.qk_nope_head_dim, self.qk_rope_head_dim)

    def __call__(
        self, x: Hidden, positions: Positions, segment_ids: SegmentIds | None = None
    ) -> Hidden:
        """**Arguments:**

        - `x`: `[batch, seq, embed]` (normalised) activations.
        - `positions`: `[batch, seq]` RoPE positions.
        - `segment_ids`: `[batch, seq]` packed-document ids, or `None` (one document).

        **Returns:** `[batch, seq, embed]` in the dtype of `x`.

        **Raises:** as `eqx_longctx.latent_attention`: `ValueError` when the batch, sequence
        or heads (over the tensor axis, and again over a Ulysses axis) do not split over the
        spec's mesh, or `segment_ids` is not `[batch, seq]` integers.
        """
        # Context-parallel strategies move the latent (kv_lora_rank + qk_rope_head_dim per
        # token), not per-head K/V; each device up-projects the tokens it holds.
        out = latent_attention(
            self.queries(x, positions),
            self.latent(x, positions),
            self.up_projection(),
            spec=self.spec,
            causal=True,
            segment_ids=segment_ids,
            scale=self.softmax_scale,
        )
        return jnp.einsum("bshv,hve->bse", out, self.wo.astype(x.dtype))


@final
class LatentUpProjection(eqx.Module):
    """MLA's up-projection: latent `(c_kv, k_rope)` -> per-head `(k, v)`.

    Einsum letters: `b` batch, `s` tokens, `c` latent rank, `h` heads, `n` per-head
    no-RoPE key + value width.
    """

    wkv_b: Float[Array, "kv_lora_rank heads nope_plus_v"]
    qk_nope_head_dim: int = eqx.field(static=True)
    qk_rope_head_dim: int = eqx.field(static=True)

    def __call__(self, latent):
        c_kv, k_rope = latent
        kv = jnp.einsum("bsc,chn->bshn", c_kv, self.wkv_b.astype(c_kv.dtype))
        k_nope, v = kv[..., : self.qk_nope_head_dim], kv[..., self.qk_nope_head_dim :]
        shape = (*k_nope.shape[:3], self.qk_rope_head_dim)
        k_rope = jnp.broadcast_to(k_rope[:, :, None, :], shape)
        return jnp.concatenate([k_nope, k_rope.astype(k_nope.dtype)], axis=-1), v
