"""Rotary position embeddings: one module, two pair conventions, pluggable frequency scaling.

Einsum letters: `b` batch, `s` sequence, `f` frequency (head_dim / 2).

Conventions: with `interleaved=False` (Hugging Face "rotate_half", used by Llama, Qwen and
Mistral checkpoints) frequency `i` rotates the features `(i, i + head_dim/2)`; with
`interleaved=True` (DeepSeek's layout, and the original Meta code) it rotates the
neighbours `(2i, 2i + 1)`.

Scalings (all `AbstractRopeScaling`): `Llama3RopeScaling` (Llama 3.1), `YarnRopeScaling`
(YaRN, with DeepSeek's magnitude terms) and `LinearRopeScaling` (position interpolation).
A scaling gives the frequencies, a multiplier of cos and sin, and a multiplier of the
softmax scale for attention layers that apply one.

References: Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position
Embedding" (arXiv:2104.09864); Llama Team 2024, "The Llama 3 Herd of Models"
(arXiv:2407.21783); Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large
Language Models" (arXiv:2309.00071).
"""

import abc
import dataclasses
import math
from typing import final, no_type_check

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

from .._checks import check_bool, check_instance, check_int, check_real
from .._types import Heads, Positions


def _plain_frequencies(head_dim: int, theta: float) -> np.ndarray:
    """`theta ** (-2i / head_dim)` for `i < head_dim / 2`, float64."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    return 1.0 / float(theta) ** exponents


class AbstractRopeScaling(abc.ABC):
    """How a RoPE scaling changes the rotation: what `RoPE` asks of its `scaling`.

    A scaling is a frozen (hashable) dataclass, so it can sit in a static field.
    """

    @abc.abstractmethod
    def frequencies(self, head_dim: int, theta: float) -> np.ndarray:
        """**Returns:** `[head_dim / 2]` float64 scaled frequencies (radians per position)
        of a `head_dim`-wide rotation with base `theta`."""

    def rotary_factor(self) -> float:
        """**Returns:** the multiplier of cos and sin (1 unless the scaling says otherwise)."""
        return 1.0

    def softmax_scale_factor(self) -> float:
        """**Returns:** the multiplier of the softmax scale, for attention layers that apply
        one (`MultiHeadLatentAttention` does, as DeepSeek; `SelfAttention` does not, as
        transformers' Llama and Qwen); 1 unless the scaling says otherwise."""
        return 1.0


@final
@no_type_check  # __post_init__ checks every field, with messages that name the fix
@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling(AbstractRopeScaling):
    """Llama 3.1 RoPE frequency scaling (Hugging Face `rope_type="llama3"`).

    With `old = original_max_position_embeddings` and wavelength `w = 2*pi / freq`:
    frequencies with `w < old / high_freq_factor` are kept, those with
    `w > old / low_freq_factor` are divided by `factor`, and the ones in between are
    blended linearly in `old / w`:
    `s = (old / w - low_freq_factor) / (high_freq_factor - low_freq_factor)`,
    `freq' = (1 - s) * freq / factor + s * freq`. Equal band factors cut without a blend
    (Llama 4 Scout: both 1).

    **Arguments:**

    - `factor`: how much the low frequencies are slowed down (8 for Llama 3.1, 32 for 3.2).
    - `low_freq_factor`, `high_freq_factor`: bounds of the blended band (1 and 4).
    - `original_max_position_embeddings`: context length of pre-training (8192).

    **Raises:** `TypeError` for a field of the wrong type; `ValueError` unless `factor >= 1`,
    `0 < low_freq_factor <= high_freq_factor` and `original_max_position_embeddings` is a
    positive int.
    """

    factor: float | int
    low_freq_factor: float | int
    high_freq_factor: float | int
    original_max_position_embeddings: int

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = check_real(getattr(self, name), f"Llama3RopeScaling.{name}")
            object.__setattr__(self, name, value)
        original = check_int(
            self.original_max_position_embeddings,
            "Llama3RopeScaling.original_max_position_embeddings",
            fix=" Llama 3.1 uses 8192.",
        )
        object.__setattr__(self, "original_max_position_embeddings", original)
        if not self.factor >= 1:
            raise ValueError(
                f"Llama3RopeScaling needs factor >= 1 (it divides the low frequencies to "
                f"stretch the context); got factor={self.factor}. Use e.g. 8 (Llama 3.1)."
            )
        if not 0 < self.low_freq_factor <= self.high_freq_factor:
            raise ValueError(
                "Llama3RopeScaling needs 0 < low_freq_factor <= high_freq_factor (the bounds "
                f"of the blended band); got low_freq_factor={self.low_freq_factor}, "
                f"high_freq_factor={self.high_freq_factor}. Llama 3.1 uses 1 and 4."
            )

    def frequencies(self, head_dim: int, theta: float) -> np.ndarray:
        """**Returns:** `[head_dim / 2]` float64 frequencies for base `theta`, scaled as in
        Llama 3.1."""
        inv_freq = _plain_frequencies(head_dim, theta)
        old = float(self.original_max_position_embeddings)
        wavelen = 2 * math.pi / inv_freq
        span = self.high_freq_factor - self.low_freq_factor  # 0: no band to blend in
        smooth = (old / wavelen - self.low_freq_factor) / span if span else 0.0 * inv_freq
        blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        out = np.where(wavelen > old / self.low_freq_factor, inv_freq / self.factor, blended)
        return np.where(wavelen < old / self.high_freq_factor, inv_freq, out)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@final
@no_type_check  # __post_init__ checks every field, with messages that name the fix
@dataclasses.dataclass(frozen=True)
class YarnRopeScaling(AbstractRopeScaling):
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
        extrapolation = _plain_frequencies(head_dim, theta)
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
@no_type_check  # __post_init__ checks the field, with a message that names the fix
@dataclasses.dataclass(frozen=True)
class LinearRopeScaling(AbstractRopeScaling):
    """Linear RoPE scaling, position interpolation (Hugging Face `rope_type="linear"`):
    every frequency divided by `factor`, so that position `p` turns as `p / factor` would.

    **Arguments:**

    - `factor`: how much slower every frequency turns (8 on Gemma 3's global layers).

    **Raises:** `TypeError` for a `factor` that is not a number; `ValueError` unless
    `factor >= 1`.
    """

    factor: float | int

    def __post_init__(self):
        object.__setattr__(self, "factor", check_real(self.factor, "LinearRopeScaling.factor"))
        if not self.factor >= 1:
            raise ValueError(
                f"LinearRopeScaling needs factor >= 1 (it divides every frequency to stretch "
                f"the context); got factor={self.factor}. Gemma 3 uses 8."
            )

    def frequencies(self, head_dim: int, theta: float) -> np.ndarray:
        """**Returns:** `[head_dim / 2]` float64 frequencies for base `theta`, each divided
        by `factor`."""
        return _plain_frequencies(head_dim, theta) / self.factor


@final
class RotaryTables(eqx.Module):
    """The cos and sin of every token's rotation angles, `[batch, seq, head_dim / 2]`
    float32 each (the scaling's `rotary_factor` applied): what `RoPE` computes from
    positions, computed once and passed in their place.

    `RoPE.tables(positions)` makes them; `RoPE.__call__` and the attention layers accept
    them wherever they take RoPE positions. `LayerStack` computes them once per forward for
    all its layers (and the backward's recomputation), where each layer would otherwise
    compute them again: libm's `sincosf` was 2.4% of the main job's CPU time.
    """

    cos: Float[Array, "batch seq half"]
    sin: Float[Array, "batch seq half"]


@final
class RoPE(eqx.Module):
    """Rotary position embedding of queries or keys at explicit token positions.

    Rotates pairs of features by `positions * freq_i`: the pairs `(i, i + head_dim/2)`
    (Hugging Face "rotate_half"), or `(2i, 2i + 1)` with `interleaved`. The frequencies are
    `theta ** (-2i / head_dim)`, or the `scaling`'s; the rotated values are multiplied by
    `scaling.rotary_factor()`.

    Holds no arrays: the frequencies are a compile-time constant derived from the static
    configuration, so a stack of layers carries no per-layer copies of them.
    """

    head_dim: int = eqx.field(static=True)
    theta: float = eqx.field(static=True)
    scaling: AbstractRopeScaling | None = eqx.field(static=True)
    interleaved: bool = eqx.field(static=True)

    def __init__(
        self,
        head_dim: int,
        theta: float | int,
        scaling: AbstractRopeScaling | None = None,
        *,
        interleaved: bool = False,
    ):
        """**Arguments:**

        - `head_dim`: number of rotated features (even): the whole query/key head, or
          MLA's `qk_rope_head_dim`.
        - `theta`: base of the geometric frequency ladder (`freq_i = theta**(-2i/head_dim)`).
        - `scaling`: optional frequency scaling, e.g. `Llama3RopeScaling` or
          `YarnRopeScaling`.
        - `interleaved`: rotate neighbouring feature pairs (DeepSeek) instead of halves.

        **Raises:** `TypeError` when `scaling` is not an `AbstractRopeScaling` (or `None`) or
        an argument has the wrong type; `ValueError` unless `head_dim` is positive and even
        and `theta > 0`.
        """
        self.head_dim = check_int(head_dim, "RoPE head_dim", minimum=None)
        self.theta = check_real(theta, "RoPE theta")
        check_instance(
            scaling,
            "RoPE scaling",
            AbstractRopeScaling,
            "Build Llama3RopeScaling(...) or YarnRopeScaling(...).",
            none_ok=True,
        )
        self.scaling = scaling
        self.interleaved = check_bool(interleaved, "RoPE interleaved")

    def __check_init__(self):
        if self.head_dim <= 0 or self.head_dim % 2 != 0:
            raise ValueError(
                f"RoPE rotates pairs of features, so head_dim must be a positive even number; "
                f"got head_dim={self.head_dim}. Choose an even head_dim (e.g. 64 or 128)."
            )
        if not self.theta > 0:
            raise ValueError(
                f"RoPE needs a positive base theta; got theta={self.theta}. Llama 2 uses "
                "10000, Llama 3 uses 500000."
            )

    def frequencies(self) -> np.ndarray:
        """**Returns:** `[head_dim / 2]` float64 rotation frequencies, scaling applied."""
        if self.scaling is not None:
            return self.scaling.frequencies(self.head_dim, self.theta)
        return _plain_frequencies(self.head_dim, self.theta)

    def tables(self, positions: Positions | RotaryTables) -> RotaryTables:
        """**Returns:** the cos and sin tables of `positions` (`[batch, seq]` integers), to
        pass in their place to every rotation at those positions; tables given as
        `positions` are returned as they are."""
        if isinstance(positions, RotaryTables):
            return positions
        inv_freq = jnp.asarray(self.frequencies(), jnp.float32)
        angles = jnp.einsum("bs,f->bsf", positions.astype(jnp.float32), inv_freq)
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        factor = 1.0 if self.scaling is None else self.scaling.rotary_factor()
        if factor != 1.0:
            cos, sin = factor * cos, factor * sin
        # The tables go through a barrier, so they are computed once per token and
        # frequency: fused into the rotation, XLA:CPU computed them again for every head.
        cos, sin = lax.optimization_barrier((cos, sin))
        return RotaryTables(cos, sin)

    def __call__(self, x: Heads, positions: Positions | RotaryTables) -> Heads:
        """Rotate each feature pair of frequency `i` by `positions * freq_i`.

        **Arguments:**

        - `x`: `[batch, seq, heads, head_dim]` queries or keys.
        - `positions`: `[batch, seq]` integer positions (they restart at 0 in each packed
          document, so RoPE sees the position inside the document), or their
          `RotaryTables` (`tables(positions)`).

        **Returns:** the rotated `x`, same shape and dtype; the rotation runs in float32.

        **Raises:** `ValueError` when `RotaryTables` do not match `x`'s batch and sequence
        or this RoPE's `head_dim / 2` frequencies.
        """
        tables = self.tables(positions)
        cos, sin = tables.cos, tables.sin
        want = (*x.shape[:2], self.head_dim // 2)
        if cos.shape != want:
            raise ValueError(
                f"RotaryTables of shape {cos.shape} cannot rotate x of shape {x.shape} with "
                f"this RoPE (head_dim={self.head_dim}): they must be [batch, seq, head_dim / "
                f"2] = {want}. Make them with this RoPE's tables(positions) for these tokens."
            )
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
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
