"""Multi-head latent attention (MLA), with decoupled RoPE (`eqx_longctx.nn.RoPE`).

Einsum letters: `b` batch, `s` sequence, `e` embed, `h` heads, `d` query/key head dim
(`qk_nope_head_dim + qk_rope_head_dim`), `n` the fused key-nope + value width of the
up-projection, `v` value head dim, `c` key/value latent rank, `r` query latent rank.

Keys and values are compressed into one small latent per token (`kv_lora_rank` wide) plus
one rotary key shared by every head (`qk_rope_head_dim` wide); each head's key ("nope" part)
and value are linear up-projections of the latent. RoPE is "decoupled": only the last
`qk_rope_head_dim` features of queries and keys are rotated, so the up-projection stays
position-free.
With `rope=None` nothing is rotated (NoPE, as Kimi Linear's MLA layers): the
`qk_rope_head_dim` features are still computed, and the shared key part still broadcast over
heads, but they carry no position.

References: DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and Efficient
Mixture-of-Experts Language Model" (arXiv:2405.04434); Peng et al. 2023, "YaRN: Efficient
Context Window Extension of Large Language Models" (arXiv:2309.00071).
"""

from typing import ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._checks import check_spec
from .._sharding import ShardingSpec
from .._types import Hidden, Positions, SegmentIds
from ..attention import decode_attention, latent_attention
from ._norm import RMSNorm
from ._rope import RoPE, RotaryTables


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
    rope: RoPE | None
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
        rope: RoPE | None,
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
        - `rope`: the rotary embedding of the `qk_rope_head_dim` part, or `None` for no
          position encoding (NoPE: that part is used unrotated; `qk_rope_head_dim` may
          then be 0).
        - `key`: PRNG key for the normal initialisation.
        - `norm_eps`: epsilon of the latent RMSNorms.
        - `init_std`, `out_init_std`: standard deviations of the input projections and of
          the output projection (default `init_std`).
        - `dtype`: parameter dtype.
        - `spec`: the sharding spec passed to `eqx_longctx.attention`; `None` = one device.

        **Raises:** `TypeError` when `spec` is not a `ShardingSpec` (or `None`); `ValueError`
        for a width that is not positive (`qk_rope_head_dim` negative), or when
        `rope.head_dim` differs from `qk_rope_head_dim`.
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
        scaling = None if rope is None else rope.scaling
        correction = 1.0 if scaling is None else scaling.softmax_scale_factor()
        self.softmax_scale = qk_head_dim**-0.5 * correction
        self.spec = spec

    def __check_init__(self):
        if self.qk_rope_head_dim < 0:
            raise ValueError(
                "MultiHeadLatentAttention needs qk_rope_head_dim >= 0; got "
                f"qk_rope_head_dim={self.qk_rope_head_dim}."
            )
        if self.rope is not None and self.rope.head_dim != self.qk_rope_head_dim:
            raise ValueError(
                "MultiHeadLatentAttention's RoPE must rotate the qk_rope_head_dim features; got "
                f"qk_rope_head_dim={self.qk_rope_head_dim} but rope.head_dim="
                f"{self.rope.head_dim}. Build RoPE({self.qk_rope_head_dim}, ...)."
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
        self, x: Hidden, positions: Positions | RotaryTables
    ) -> Float[Array, "batch seq heads qk_head_dim"]:
        """Queries of `x` (`[batch, seq, embed]`, normalised) at RoPE `positions` (or their
        `rotary_tables`).

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
        return jnp.concatenate([q_nope, self._rotate(q_rope, positions)], axis=-1)

    def latent(
        self, x: Hidden, positions: Positions | RotaryTables
    ) -> tuple[Float[Array, "batch seq kv_lora_rank"], Float[Array, "batch seq qk_rope_head_dim"]]:
        """What keys and values are made of: the only per-token state a strategy needs.

        **Arguments:**

        - `x`: `[batch, seq, embed]` (normalised) activations.
        - `positions`: `[batch, seq]` RoPE positions, or their `rotary_tables`.

        **Returns:** `(latent, k_rope)`: the RMS-normalised key/value latent
        `[batch, seq, kv_lora_rank]` and the rotated rotary key `[batch, seq,
        qk_rope_head_dim]` (shared by all heads).
        """
        compressed = jnp.einsum("bse,ec->bsc", x, self.wkv_a.astype(x.dtype))
        latent = self.kv_norm(compressed[..., : self.kv_lora_rank])
        k_rope = self._rotate(compressed[..., None, self.kv_lora_rank :], positions)[:, :, 0]
        return latent, k_rope

    def _rotate(self, x, positions):
        return x if self.rope is None else self.rope(x, positions)

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
        self,
        x: Hidden,
        positions: Positions | RotaryTables,
        segment_ids: SegmentIds | None = None,
    ) -> Hidden:
        """**Arguments:**

        - `x`: `[batch, seq, embed]` (normalised) activations.
        - `positions`: `[batch, seq]` RoPE positions, or their tables
          (`rotary_tables(positions)`).
        - `segment_ids`: `[batch, seq]` packed-document ids, or `None` (one document).

        **Returns:** `[batch, seq, embed]` in the dtype of `x`.

        **Raises:** as `eqx_longctx.latent_attention`: `ValueError` when the batch, sequence
        or heads (over the tensor axis, and again over a Ulysses axis) do not split over the
        spec's mesh, or `segment_ids` is not `[batch, seq]` integers.
        """
        return self.prefill(x, positions, segment_ids)[0]

    def rotary_tables(self, positions: Positions) -> RotaryTables | None:
        """**Returns:** this layer's RoPE tables at `positions`, which `__call__` accepts in
        their place (`LayerStack` computes them once for all its layers); `None` without
        RoPE (the positions are then passed on, unused)."""
        return None if self.rope is None else self.rope.tables(positions)

    # ---- inference (eqx_longctx.inference): the cache holds the latent and rotary key ----

    cache_split_heads: ClassVar[bool] = False
    """The cached latent is shared by every head: whole on every tensor shard."""
    window: ClassVar[None] = None
    """MLA attends every earlier token (no sliding window)."""

    def cache_shapes(self) -> tuple[tuple[int, int], ...]:
        """**Returns:** `(heads, dim)` of the one array cached per token: the normalised
        latent and the rotated rotary key side by side, `kv_lora_rank + qk_rope_head_dim`
        wide (576 for DeepSeek-V3), never per-head keys and values."""
        return ((1, self.kv_lora_rank + self.qk_rope_head_dim),)

    def prefill(
        self,
        x: Hidden,
        positions: Positions | RotaryTables,
        segment_ids: SegmentIds | None = None,
        *,
        impl=None,
    ) -> tuple[Hidden, tuple[Array]]:
        """`__call__`, also returning what the KV cache keeps of these tokens; `impl` is the
        block implementation (as `eqx_longctx.latent_attention`'s; `None`: the spec's).

        **Returns:** `(out, (latent,))`: the layer's output and `[batch, seq, 1,
        kv_lora_rank + qk_rope_head_dim]`, the normalised latent and the rotated rotary key.
        """
        # Context-parallel strategies move the latent (kv_lora_rank + qk_rope_head_dim per
        # token), not per-head K/V; each device up-projects the tokens it holds.
        tables = self._tables(positions)  # once for the queries and the keys
        latent = self.latent(x, tables)
        out = latent_attention(
            self.queries(x, tables),
            latent,
            self.up_projection(),
            spec=self.spec,
            causal=True,
            segment_ids=segment_ids,
            scale=self.softmax_scale,
            impl=impl,
        )
        out = jnp.einsum("bshv,hve->bse", out, self.wo.astype(x.dtype))
        return out, (jnp.concatenate(latent, axis=-1)[:, :, None, :],)

    def _tables(self, positions):
        return positions if self.rope is None else self.rope.tables(positions)

    def decode(
        self, x: Hidden, positions: Positions, cache: tuple, cache_positions, *, impl
    ) -> tuple[Hidden, tuple[Array]]:
        """One new token per row against the cached latents, absorbed: the keys' up-projection
        is folded into the queries, so attention runs in the latent space (one shared K/V
        "head" of `kv_lora_rank + qk_rope_head_dim` features whose values are the latent);
        the latent outputs are merged over the devices first, and the values'
        up-projection runs once after the merge.

        **Arguments:** as [`SelfAttention.decode`][eqx_longctx.nn.SelfAttention.decode].

        **Returns:** `(out, (latent,))`: the output and the new token's cache entry.
        """
        dtype = x.dtype
        tables = self._tables(positions)
        q = self.queries(x, tables)
        new = jnp.concatenate(self.latent(x, tables), axis=-1)[:, :, None, :]
        nope = self.qk_nope_head_dim
        w_uk, w_uv = self.wkv_b[..., :nope].astype(dtype), self.wkv_b[..., nope:].astype(dtype)
        q_latent = jnp.einsum("bshn,chn->bshc", q[..., :nope], w_uk)
        q = jnp.concatenate([q_latent, q[..., nope:]], axis=-1)
        out = decode_attention(
            q, (new,), cache, cache_positions, positions, spec=self.spec, impl=impl,
            scale=self.softmax_scale, split_heads=False, value_dim=self.kv_lora_rank,
        )  # fmt: skip
        out = jnp.einsum("bshc,chv->bshv", out, w_uv)
        return jnp.einsum("bshv,hve->bse", out, self.wo.astype(dtype)), (new,)


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
