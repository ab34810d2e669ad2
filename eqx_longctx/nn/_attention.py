"""Multi-head self-attention layer with grouped K/V heads (MHA, GQA, MQA).

Einsum letters: `b` batch, `s` sequence, `e` embed, `h` query heads, `k` kv heads,
`d` head dim.

References: Vaswani et al. 2017, "Attention Is All You Need" (arXiv:1706.03762); Shazeer
2019, "Fast Transformer Decoding" (multi-query, arXiv:1911.02150); Ainslie et al. 2023,
"GQA" (arXiv:2305.13245); Dehghani et al. 2023, "Scaling Vision Transformers to 22
Billion Parameters" (query/key normalisation, arXiv:2302.05442), as used by Qwen3.
"""

import math
from typing import ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._sharding import ShardingSpec
from .._types import Hidden, Positions, SegmentIds
from ..attention import attention, check_options, check_variants, decode_attention
from ._norm import RMSNorm
from ._rope import RoPE, RotaryTables


@final
class SelfAttention(eqx.Module):
    """Project to queries/keys/values, rotate q and k with RoPE, attend, project back.

    `n_heads == n_kv_heads` is MHA, `n_kv_heads == 1` is MQA, anything in between is GQA:
    query head `h` reads kv head `h // (n_heads // n_kv_heads)`. K/V are never repeated;
    `eqx_longctx.attention` groups the query heads itself. Projections are stored with the
    heads as their own axis (`wq: [embed, q_heads, head_dim]`), so a sharding spec can name
    the head axis directly. With `qk_norm`, queries and keys are RMS-normalised over each
    head's features (one learned `[head_dim]` scale for all heads) after the biases and
    before RoPE, as in Qwen3.

    Two options give Qwen3-Next's gated attention: `output_gate` multiplies each head's
    attention output by `sigmoid(x @ wg)` (a second query-shaped projection) before the
    output projection, and a `rope` narrower than the head rotates only the leading
    `rope.head_dim` features of each query and key (partial RoPE), passing the rest through.
    `norm_zero_centred` makes the q/k norms scale by `1 + weight` (`RMSNorm`'s
    `zero_centred`).

    The softmax variants of `eqx_longctx.attention` are options too: `sinks=True` learns one
    sink logit per query head (GPT-OSS; zero-initialised), `softcap` caps the scores
    (Gemma 2), `chunk` makes the attention chunked (Llama 4), and `scale` replaces
    `1/sqrt(head_dim)` (Gemma's `query_pre_attn_scalar ** -0.5`).

    Three more serve Llama 4: `rope=None` is a layer without position embedding (NoPE),
    `qk_l2_norm` RMS-normalises each query and key head with no learned scale after RoPE,
    and `query_temperature=(floor, strength)` multiplies the query at position `p` by
    `1 + strength * log(1 + floor((p + 1) / floor))`, so that the scores of far positions
    stay sharp (Nakanishi 2025, "Scalable-Softmax Is Superior for Attention",
    arXiv:2501.19399).
    """

    wq: Float[Array, "embed q_heads head_dim"]
    wk: Float[Array, "embed kv_heads head_dim"]
    wv: Float[Array, "embed kv_heads head_dim"]
    wo: Float[Array, "q_heads head_dim embed"]
    wg: Float[Array, "embed q_heads head_dim"] | None
    bq: Float[Array, "q_heads head_dim"] | None
    bk: Float[Array, "kv_heads head_dim"] | None
    bv: Float[Array, "kv_heads head_dim"] | None
    bo: Float[Array, " embed"] | None
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    sinks: Float[Array, " q_heads"] | None
    rope: RoPE | None
    n_heads: int = eqx.field(static=True)
    n_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    window: int | None = eqx.field(static=True)
    chunk: int | None = eqx.field(static=True)
    softcap: float | None = eqx.field(static=True)
    scale: float | None = eqx.field(static=True)
    qk_l2_norm_eps: float | None = eqx.field(static=True)
    query_temperature: tuple[float, float] | None = eqx.field(static=True)
    spec: ShardingSpec | None = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        rope: RoPE | None,
        key: PRNGKeyArray,
        qkv_bias: bool = False,
        output_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-5,
        norm_zero_centred: bool = False,
        output_gate: bool = False,
        causal: bool = True,
        window: int | None = None,
        chunk: int | None = None,
        softcap: float | None = None,
        sinks: bool = False,
        scale: float | None = None,
        qk_l2_norm: bool = False,
        query_temperature: tuple[float, float] | None = None,
        init_std: float = 0.02,
        out_init_std: float | None = None,
        dtype=jnp.float32,
        spec=None,
    ):
        """**Arguments:**

        - `dim`: model width (`embed`).
        - `n_heads`, `n_kv_heads`: query and key/value heads (`n_heads % n_kv_heads == 0`).
        - `head_dim`: width of each head (`n_heads * head_dim` need not equal `dim`).
        - `rope`: the rotary embedding applied to queries and keys: the whole head, or its
          leading `rope.head_dim` features when narrower (partial RoPE); `None`: none
          (a NoPE layer).
        - `key`: PRNG key for the normal initialisation.
        - `qkv_bias`: add learned biases to the q/k/v projections (Qwen2); zero-initialised.
        - `output_bias`: add a learned `[embed]` bias to the output projection (GPT-OSS,
          with `qkv_bias`); zero-initialised.
        - `qk_norm`: RMS-normalise each query and key head before RoPE (Qwen3).
        - `norm_eps`: epsilon of those norms (unused without `qk_norm` or `qk_l2_norm`).
        - `norm_zero_centred`: those norms scale by `1 + weight` (Qwen3-Next).
        - `output_gate`: gate each head's output by `sigmoid(x @ wg)` before the output
          projection (Qwen3-Next); `wg` is initialised as `wq`.
        - `causal`: query `i` attends keys `j <= i` (by token index).
        - `window`: sliding-window size `W` (needs `causal`): query `i` attends keys `j`
          with `0 <= i - j < W`; `None` = no window. Static, so that the attention skips
          the blocks outside the window.
        - `chunk`: chunked attention (needs `causal`): query `i` attends keys `j <= i` with
          `i // chunk == j // chunk`; `None` = no chunks (Llama 4).
        - `softcap`: cap on the scaled scores, `softcap * tanh(x / softcap)` (Gemma 2).
        - `sinks`: learn one sink logit per query head (`sinks`, `[q_heads]`,
          zero-initialised), joined to every softmax denominator (GPT-OSS).
        - `scale`: the score scale; `None` = `1/sqrt(head_dim)`.
        - `qk_l2_norm`: RMS-normalise each query and key head after RoPE, with no learned
          scale and epsilon `norm_eps` (Llama 4's RoPE layers).
        - `query_temperature`: `(floor, strength)`: multiply the query at position `p` by
          `1 + strength * log(1 + floor((p + 1) / floor))` (Llama 4's NoPE layers); `None`
          = no such scaling.
        - `init_std`, `out_init_std`: standard deviations of q/k/v and of the output
          projection (default `init_std`).
        - `dtype`: parameter dtype.
        - `spec`: the sharding spec passed to `eqx_longctx.attention`; `None` = one device.

        **Raises:** `TypeError` for a `spec` that is not a `ShardingSpec` or options of the wrong
        type; `ValueError` when `n_heads` is not a multiple of `n_kv_heads`, `rope.head_dim`
        exceeds `head_dim`, `window` or `chunk` is not a positive int or is set without
        `causal`, `softcap` is not a positive number, or `query_temperature` is not a pair
        of a positive floor and a finite strength.
        """
        self.window = check_options("SelfAttention", spec, causal, scale, window)
        self.softcap, self.chunk = check_variants("SelfAttention", causal, softcap, chunk)
        self.scale = None if scale is None else float(scale)
        self.qk_l2_norm_eps = float(norm_eps) if qk_l2_norm else None
        self.query_temperature = _check_temperature(query_temperature)
        self.sinks = jnp.zeros((n_heads,), dtype) if sinks else None
        out_init_std = init_std if out_init_std is None else out_init_std
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.wq = init_std * jax.random.normal(kq, (dim, n_heads, head_dim), dtype)
        self.wk = init_std * jax.random.normal(kk, (dim, n_kv_heads, head_dim), dtype)
        self.wv = init_std * jax.random.normal(kv, (dim, n_kv_heads, head_dim), dtype)
        self.wo = out_init_std * jax.random.normal(ko, (n_heads, head_dim, dim), dtype)
        self.wg = None
        if output_gate:
            kg = jax.random.fold_in(key, 4)  # the other weights' keys as without the gate
            self.wg = init_std * jax.random.normal(kg, (dim, n_heads, head_dim), dtype)
        if qkv_bias:
            self.bq = jnp.zeros((n_heads, head_dim), dtype)
            self.bk = jnp.zeros((n_kv_heads, head_dim), dtype)
            self.bv = jnp.zeros((n_kv_heads, head_dim), dtype)
        else:
            self.bq = self.bk = self.bv = None
        self.bo = jnp.zeros((dim,), dtype) if output_bias else None
        if qk_norm:
            self.q_norm, self.k_norm = (
                RMSNorm(head_dim, eps=norm_eps, dtype=dtype, zero_centred=norm_zero_centred)
                for _ in "qk"
            )
        else:
            self.q_norm = self.k_norm = None
        self.rope = rope
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.causal = causal
        self.spec = spec

    def __check_init__(self):
        if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                "SelfAttention needs n_heads to be a multiple of n_kv_heads (each kv head "
                f"serves a group of query heads); got n_heads={self.n_heads}, "
                f"n_kv_heads={self.n_kv_heads}. Choose n_kv_heads among the divisors of "
                f"{self.n_heads}."
            )
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError(
                "SelfAttention normalises queries and keys together: q_norm and k_norm must "
                f"both be set or both be None; got q_norm={self.q_norm is not None}, "
                f"k_norm={self.k_norm is not None}. Build it with qk_norm=True or False."
            )
        if self.rope is not None and self.rope.head_dim > self.head_dim:
            raise ValueError(
                "SelfAttention's RoPE must rotate the whole head or its leading features "
                f"(partial RoPE); got head_dim={self.head_dim} but rope.head_dim="
                f"{self.rope.head_dim}. Build RoPE(head_dim={self.head_dim}, ...) or narrower."
            )

    @property
    def qkv_bias(self) -> bool:
        """Whether the q/k/v projections have biases."""
        return self.bq is not None

    @property
    def output_gate(self) -> bool:
        """Whether each head's output is gated by `sigmoid(x @ wg)`."""
        return self.wg is not None

    @property
    def qk_l2_norm(self) -> bool:
        """Whether each query and key head is RMS-normalised, unscaled, after RoPE."""
        return self.qk_l2_norm_eps is not None

    @property
    def qk_norm(self) -> bool:
        """Whether each query and key head is RMS-normalised before RoPE."""
        return self.q_norm is not None

    def __call__(
        self,
        x: Hidden,
        positions: Positions | RotaryTables,
        segment_ids: SegmentIds | None = None,
    ) -> Hidden:
        """**Arguments:**

        - `x`: `[batch, seq, embed]` (normalised) activations.
        - `positions`: `[batch, seq]` integer positions for RoPE, or their tables
          (`rotary_tables(positions)`).
        - `segment_ids`: `[batch, seq]` packed-document ids, or `None` (one document).

        **Returns:** `[batch, seq, embed]` in the dtype of `x`.

        **Raises:** as `eqx_longctx.attention`: `ValueError` when the batch, sequence or
        heads do not split over the spec's mesh, or `segment_ids` is not `[batch, seq]`
        integers.
        """
        q, k, v = self._project(x, positions)
        return self._output(self._attend(q, k, v, segment_ids), x)

    def _project(self, x, positions):
        """Queries, keys and values of `x` at `positions`: biases, norms and RoPE applied."""
        dtype = x.dtype
        q = jnp.einsum("bse,ehd->bshd", x, self.wq.astype(dtype))
        k = jnp.einsum("bse,ekd->bskd", x, self.wk.astype(dtype))
        v = jnp.einsum("bse,ekd->bskd", x, self.wv.astype(dtype))
        if self.bq is not None and self.bk is not None and self.bv is not None:
            q = q + self.bq.astype(dtype)
            k = k + self.bk.astype(dtype)
            v = v + self.bv.astype(dtype)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if self.rope is not None:
            tables = self.rope.tables(positions)  # once for the queries and the keys
            q, k = self._rotate(q, tables), self._rotate(k, tables)
        if self.qk_l2_norm_eps is not None:
            q, k = (_unit_rms(x, self.qk_l2_norm_eps) for x in (q, k))
        if self.query_temperature is not None:
            floor, strength = self.query_temperature
            p = jnp.asarray(positions, jnp.float32)  # positions, never tables: see rotary_tables
            t = 1.0 + strength * jnp.log1p(jnp.floor((p + 1.0) / floor))
            q = (q * t[:, :, None, None]).astype(q.dtype)
        return q, k, v

    def _rotate(self, x, tables):
        assert self.rope is not None
        n = self.rope.head_dim
        if n == self.head_dim:
            return self.rope(x, tables)
        return jnp.concatenate([self.rope(x[..., :n], tables), x[..., n:]], axis=-1)

    def rotary_tables(self, positions: Positions) -> RotaryTables | None:
        """**Returns:** this layer's RoPE tables at `positions`, which `__call__` accepts in
        their place (`LayerStack` computes them once for all its layers); `None` when the
        layer has no RoPE or needs the positions themselves (`query_temperature`)."""
        if self.rope is None or self.query_temperature is not None:
            return None
        return self.rope.tables(positions)

    def _attend(self, q, k, v, segment_ids, impl=None):
        return attention(
            q, k, v, spec=self.spec, causal=self.causal, window=self.window, chunk=self.chunk,
            softcap=self.softcap, sinks=self.sinks, segment_ids=segment_ids, scale=self.scale,
            impl=impl,
        )  # fmt: skip

    def _output(self, out, x):
        if self.wg is not None:
            gate = jnp.einsum("bse,ehd->bshd", x, self.wg.astype(x.dtype))
            out = out * jax.nn.sigmoid(gate).astype(out.dtype)
        out = jnp.einsum("bshd,hde->bse", out, self.wo.astype(out.dtype))
        return out if self.bo is None else out + self.bo.astype(out.dtype)

    # ---- inference (eqx_longctx.inference): the cache holds K and V per KV head ----------

    cache_split_heads: ClassVar[bool] = True
    """The cached K/V heads split over the spec's tensor axis, like the layer's heads."""

    def cache_shapes(self) -> tuple[tuple[int, int], ...]:
        """**Returns:** `(heads, dim)` of each array cached per token: K and V per KV head
        (never repeated for GQA)."""
        return ((self.n_kv_heads, self.head_dim), (self.n_kv_heads, self.head_dim))

    def prefill(
        self,
        x: Hidden,
        positions: Positions,
        segment_ids: SegmentIds | None = None,
        *,
        impl=None,
    ) -> tuple[Hidden, tuple[Array, Array]]:
        """`__call__`, also returning what the KV cache keeps of these tokens; `impl` is the
        block implementation (as `eqx_longctx.attention`'s; `None`: the spec's).

        **Returns:** `(out, (k, v))`: the layer's output and the rotated keys and the values
        `[batch, seq, kv_heads, head_dim]`.
        """
        q, k, v = self._project(x, positions)
        return self._output(self._attend(q, k, v, segment_ids, impl), x), (k, v)

    def decode(
        self, x: Hidden, positions: Positions, cache: tuple, cache_positions, *, impl
    ) -> tuple[Hidden, tuple[Array, Array]]:
        """One new token per row against the cache (see `eqx_longctx.attention.decode_attention`).

        **Arguments:** `x` `[batch, n, embed]` the new token repeated on the spec's `n`
        sequence shards; `positions` `[batch, n]`; `cache` this layer's `(k, v)` and
        `cache_positions` `[batch, slots]`; `impl` the block implementation.

        **Returns:** `(out, (k, v))`: the output and the new token's cache entry.
        """
        q, k, v = self._project(x, positions)
        out = decode_attention(
            q, (k, v), cache, cache_positions, positions, spec=self.spec, impl=impl,
            window=self.window, chunk=self.chunk, softcap=self.softcap, sinks=self.sinks,
            scale=self.scale,
        )  # fmt: skip
        return self._output(out, x), (k, v)


def _unit_rms(x, eps: float):
    """`x / sqrt(mean(x**2) + eps)` over each head's features, in float32, cast back."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _check_temperature(value) -> tuple[float, float] | None:
    """`SelfAttention`'s `query_temperature`, checked: `None` or `(floor > 0, strength)`."""
    if value is None:
        return None
    ok = isinstance(value, tuple | list) and len(value) == 2
    ok = ok and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    if not ok or not (value[0] > 0 and math.isfinite(value[0]) and math.isfinite(value[1])):
        raise ValueError(
            "SelfAttention query_temperature must be None or (floor, strength) with a finite "
            f"floor > 0 and a finite strength; got {value!r}. Llama 4 uses (8192, 0.1)."
        )
    return float(value[0]), float(value[1])
