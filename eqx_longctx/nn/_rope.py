"""Rotary position embeddings, with the Llama 3.1 frequency scaling.

Einsum letters: `b` batch, `s` sequence, `f` frequency (head_dim / 2).

Convention: Hugging Face "rotate_half". Frequency `i` rotates the pair of features
`(i, i + head_dim/2)` (first half against second half), not interleaved neighbours
`(2i, 2i+1)` as in the original Meta code; checkpoints converted by Hugging Face permute
their q/k projections to match this.

References: Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position
Embedding" (arXiv:2104.09864); Llama Team 2024, "The Llama 3 Herd of Models"
(arXiv:2407.21783) for the long-context frequency scaling.
"""

import dataclasses
import math
from typing import final, no_type_check

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .._checks import check_instance, check_int, check_real
from .._types import Heads, Positions


@final
@no_type_check  # __post_init__ checks every field, with messages that name the fix
@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 RoPE frequency scaling (Hugging Face `rope_type="llama3"`).

    With `old = original_max_position_embeddings` and wavelength `w = 2*pi / freq`:
    frequencies with `w < old / high_freq_factor` are kept, those with
    `w > old / low_freq_factor` are divided by `factor`, and the ones in between are
    blended linearly in `old / w`:
    `s = (old / w - low_freq_factor) / (high_freq_factor - low_freq_factor)`,
    `freq' = (1 - s) * freq / factor + s * freq`.

    **Arguments:**

    - `factor`: how much the low frequencies are slowed down (8 for Llama 3.1, 32 for 3.2).
    - `low_freq_factor`, `high_freq_factor`: bounds of the blended band (1 and 4).
    - `original_max_position_embeddings`: context length of pre-training (8192).

    **Raises:** `TypeError` for a field of the wrong type; `ValueError` unless `factor >= 1`,
    `0 < low_freq_factor < high_freq_factor` and `original_max_position_embeddings` is a
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
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "Llama3RopeScaling needs 0 < low_freq_factor < high_freq_factor (the blend "
                f"divides by their difference); got low_freq_factor={self.low_freq_factor}, "
                f"high_freq_factor={self.high_freq_factor}. Llama 3.1 uses 1 and 4."
            )

    def apply(self, inv_freq: np.ndarray) -> np.ndarray:
        """Scale rotary frequencies (radians per position) as in Llama 3.1.

        **Arguments:**

        - `inv_freq`: `[head_dim / 2]` unscaled frequencies.

        **Returns:** the scaled frequencies, same shape, float64.
        """
        inv_freq = np.asarray(inv_freq, np.float64)
        old = float(self.original_max_position_embeddings)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        out = np.where(wavelen > old / self.low_freq_factor, inv_freq / self.factor, blended)
        return np.where(wavelen < old / self.high_freq_factor, inv_freq, out)


@final
class RoPE(eqx.Module):
    """Rotary position embedding of queries or keys at explicit token positions.

    Holds no arrays: the frequencies are a compile-time constant derived from the static
    configuration, so a stack of layers carries no per-layer copies of them.
    """

    head_dim: int = eqx.field(static=True)
    theta: float = eqx.field(static=True)
    scaling: Llama3RopeScaling | None = eqx.field(static=True)

    def __init__(self, head_dim: int, theta: float | int, scaling: Llama3RopeScaling | None = None):
        """**Arguments:**

        - `head_dim`: size of each query/key head (even).
        - `theta`: base of the geometric frequency ladder (`freq_i = theta**(-2i/head_dim)`).
        - `scaling`: optional Llama 3.1 long-context frequency scaling.

        **Raises:** `TypeError` when `scaling` is not a `Llama3RopeScaling` (or `None`) or a
        number has the wrong type; `ValueError` unless `head_dim` is positive and even and
        `theta > 0`.
        """
        self.head_dim = check_int(head_dim, "RoPE head_dim", minimum=None)
        self.theta = check_real(theta, "RoPE theta")
        check_instance(
            scaling,
            "RoPE scaling",
            Llama3RopeScaling,
            "Build Llama3RopeScaling(...).",
            none_ok=True,
        )
        self.scaling = scaling

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
        exponents = np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim
        inv_freq = 1.0 / (float(self.theta) ** exponents)
        if self.scaling is not None:
            inv_freq = self.scaling.apply(inv_freq)
        return inv_freq

    def __call__(self, x: Heads, positions: Positions) -> Heads:
        """Rotate each feature pair `(i, i + head_dim/2)` by `positions * freq_i`.

        **Arguments:**

        - `x`: `[batch, seq, heads, head_dim]` queries or keys.
        - `positions`: `[batch, seq]` integer positions (they restart at 0 in each packed
          document, so RoPE sees the position inside the document).

        **Returns:** the rotated `x`, same shape and dtype; the rotation runs in float32.
        """
        inv_freq = jnp.asarray(self.frequencies(), jnp.float32)
        angles = jnp.einsum("bs,f->bsf", positions.astype(jnp.float32), inv_freq)
        cos = jnp.cos(angles)[:, :, None, :]
        sin = jnp.sin(angles)[:, :, None, :]
        half = self.head_dim // 2
        x32 = x.astype(jnp.float32)
        x1, x2 = x32[..., :half], x32[..., half:]
        rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return rotated.astype(x.dtype)
