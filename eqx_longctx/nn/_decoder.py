"""The decoder scaffolding every model family shares: token lookup, input checks, running
the layers under the sharding spec, and the (tied or untied) output head.

A family subclasses `AbstractDecoder`, declares its fields and says what its layers are:
`layer_stacks()` (the `LayerStack`s, in order: what training runs by default and what
inference walks), or `run_layers` for a forward that is more than its stacks in turn; the
public calls (`__call__`, `forward_embeddings`, `embed_tokens`, `check_tokens`,
`num_params`) come from here.
"""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int

from .._partition import param_pspecs
from .._sharding import ShardingSpec
from .._types import Hidden, Logits, Positions, SegmentIds, Tokens
from ._inputs import check_shapes, check_token_ids, prepare_inputs
from ._loss import softcap_logits
from ._norm import RMSNorm


class AbstractDecoder(eqx.Module):
    """A decoder-only transformer: embeddings, a stack of blocks, a final norm, logits.

    The base class of every model family (`models.llama.Llama`, `models.deepseek.DeepSeek`):
    a family declares the fields below and `layer_stacks()` (or overrides `run_layers`),
    and inherits the calls.

    - `embed`: `[vocab, embed]` token embeddings.
    - `norm`: the final `RMSNorm`.
    - `lm_head`: `[embed, vocab]` output head, or `None` when tied to `embed`.
    - `config`: the family's config; it must have `vocab_size`, `max_seq_len` and
      `compute_dtype`.
    - `spec`: the sharding spec, or `None` for one device.

    Two hooks a family may override: `embed_scale()` (a factor on the looked-up
    embeddings) and `logit_softcap()` (a `tanh` cap on the logits); both `None` here.
    """

    embed: eqx.AbstractVar[Float[Array, "vocab embed"]]
    norm: eqx.AbstractVar[RMSNorm]
    lm_head: eqx.AbstractVar[Float[Array, "embed vocab"] | None]
    config: eqx.AbstractVar[Any]
    spec: eqx.AbstractVar[ShardingSpec | None]

    def run_layers(self, x: Hidden, positions: Positions, segment_ids: SegmentIds | None) -> Hidden:
        """The blocks, from embeddings to the last hidden state (before the final norm): by
        default each of `layer_stacks()` in turn. A family whose forward is more than its
        stacks (positions added to the embeddings, say) overrides it; it then cannot
        generate unless `layer_stacks()` is still exactly what runs."""
        for stack in self.layer_stacks():
            x = stack(x, positions, segment_ids)
        return x

    def layer_stacks(self) -> tuple[Any, ...]:
        """The `LayerStack`s the model applies, in order: what `run_layers` runs by default
        and what inference (`eqx_longctx.generate`) walks to fill and read the KV cache.

        **Raises:** `NotImplementedError` for a family that does not say.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not list its layer stacks: implement layer_stacks() "
            "to return the LayerStacks the model applies, in order (or override run_layers "
            "for a forward that is more than them; such a model cannot generate)."
        )

    def embed_scale(self) -> float | None:
        """**Returns:** the factor the looked-up token embeddings are multiplied by, in the
        embedding's dtype (Gemma's `sqrt(dim)`), or `None` (the default) for none."""
        return None

    def logit_softcap(self) -> float | None:
        """**Returns:** the cap `c` of the logits, `c * tanh(logits / c)` (Gemma 2's
        final-logit soft-cap), or `None` (the default) for none. `head` applies it; a loss
        computed from [`hidden_states`][] and [`head_weight`][] must too
        (`eqx_longctx.nn.chunked_cross_entropy(..., softcap=...)`)."""
        return None

    def head(self, x: Hidden) -> Logits:
        """The final norm and output head: `[batch, seq, embed]` last hidden states (what
        `run_layers` returns) to `[batch, seq, vocab]` float32 logits (soft-capped by
        `logit_softcap()`, if set)."""
        x = self.norm(x.astype(self.config.compute_dtype))
        logits = jnp.einsum(
            "bse,ev->bsv", x, self.head_weight(), preferred_element_type=jnp.float32
        )
        return softcap_logits(logits, self.logit_softcap())

    def head_weight(self) -> Float[Array, "embed vocab"]:
        """**Returns:** the output head `[embed, vocab]` in the compute dtype and its compute
        layout (gathered over fsdp, the vocabulary split as the rules table says): `lm_head`,
        or the transposed token embedding of a tied model. With [`hidden_states`][] it is
        what `eqx_longctx.nn.chunked_cross_entropy` takes."""
        dtype = jnp.dtype(self.config.compute_dtype)
        if self.lm_head is None:
            return self._gathered("embed").astype(dtype).T
        return self._gathered("lm_head").astype(dtype)

    def head_pspec(self) -> PartitionSpec | None:
        """**Returns:** the partition spec of [`head_weight`][] under the spec (its second
        entry: the mesh axes the vocabulary is split over), or `None` without a spec."""
        if self.spec is None:
            return None
        pspecs = param_pspecs(self, gathered=True)
        if self.lm_head is None:
            vocab, embed = tuple(pspecs.embed)
            return PartitionSpec(embed, vocab)
        return PartitionSpec(*pspecs.lm_head)

    @property
    def _config_name(self) -> str:
        return type(self.config).__name__

    def num_params(self) -> int:
        """**Returns:** the number of parameters (works on `eqx.filter_eval_shape` output)."""
        return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(self))

    def check_tokens(self, tokens: Int[Array | np.ndarray, "..."]) -> None:
        """Check that every token id lies in `[0, vocab_size)`.

        Needs concrete values (call it outside `jit`); `__call__` runs it automatically
        whenever its tokens are concrete.

        **Raises:** `ValueError` for an id out of range, or for a tracer.
        """
        check_token_ids(tokens, self.config.vocab_size, self._config_name)

    def embed_tokens(self, tokens: Tokens) -> Hidden:
        """**Returns:** `[batch, seq, embed]` token embeddings in the compute dtype, times
        `embed_scale()` when set (ids are not checked here: see `check_tokens`).

        **Raises:** with fsdp axes, `ValueError` as `eqx_longctx.param_pspecs` when the
        embedding does not split over the spec's mesh.
        """
        x = jnp.take(self._gathered("embed"), tokens, axis=0)
        scale = self.embed_scale()
        if scale is not None:  # in the embedding's dtype, as Gemma's checkpoints compute it
            x = x * jnp.asarray(scale, jnp.float32).astype(x.dtype)
        return x.astype(self.config.compute_dtype)

    def _gathered(self, name: str) -> Array:
        """The embedding or output head in its compute layout (gathered over fsdp)."""
        weight = getattr(self, name)
        if self.spec is None or not self.spec.fsdp_axis:
            return weight
        return self.spec.place(weight, getattr(param_pspecs(self, gathered=True), name))

    def forward_embeddings(
        self, x: Hidden, positions: Positions, segment_ids: SegmentIds | None = None
    ) -> Logits:
        """Run the decoder on input embeddings (what `__call__` does after the lookup).

        **Arguments:**

        - `x`: `[batch, seq, embed]` input embeddings.
        - `positions`: `[batch, seq]` RoPE positions.
        - `segment_ids`: `[batch, seq]` packed-document ids, or `None`.

        **Returns:** `[batch, seq, vocab]` float32 logits.

        **Raises:** `ValueError` when `x` is not `[batch, seq, embed]` floating point, and as
        `eqx_longctx.nn.check_shapes` for the sequence length, positions, segment ids and
        the spec's mesh.
        """
        embed = self.embed.shape[-1]
        if x.ndim != 3 or x.shape[-1] != embed or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(
                f"x must be [batch, seq, embed={embed}] floating-point input embeddings; got "
                f"shape {tuple(x.shape)}, dtype {x.dtype}. Token ids go to the model's "
                "__call__ instead; embeddings come from embed_tokens(tokens)."
            )
        check_shapes(
            x.shape[:2], "x", positions, segment_ids,
            max_seq_len=self.config.max_seq_len, config_name=self._config_name, spec=self.spec,
        )  # fmt: skip
        if self.spec is None:
            return self._forward(x, positions, segment_ids)
        # The parameters go in as arguments, so that ones replicated over an Explicit mesh
        # turn Auto along with the activations.
        run = self.spec.auto_axes(type(self)._forward, self.spec.activation_pspec())
        return run(self, x, positions, segment_ids)

    def __call__(
        self,
        tokens: object,
        positions: object = None,
        segment_ids: object = None,
    ) -> Logits:
        """Validate the inputs (raising `ValueError`s, hence the loose annotations), then run.

        **Arguments:**

        - `tokens`: `[batch, seq]` token ids in `[0, vocab_size)` (a JAX or NumPy array, or
          nested lists); `seq <= max_seq_len`. Under a spec, `batch` must split evenly over
          its batch axis and `seq` over its sequence shards (and layout).
        - `positions`: `[batch, seq]` RoPE positions; default each token's original index
          (the spec's layout order on a mesh). Packed data passes positions that restart
          at 0 in each document.
        - `segment_ids`: `[batch, seq]` packed-document ids, or `None` (one document per
          row). Causal masking is by token index; attention never crosses segments.

        **Returns:** `[batch, seq, vocab]` float32 logits.

        **Raises:** as `eqx_longctx.nn.prepare_inputs`: `TypeError` for inputs that are not
        integer arrays; `ValueError` for a wrong rank, shape or dtype, an id out of range, a
        sequence longer than `max_seq_len`, or a batch or sequence that does not split over
        the spec's mesh.
        """
        return self._run(type(self)._embed_and_forward, tokens, positions, segment_ids)

    def hidden_states(
        self,
        tokens: object,
        positions: object = None,
        segment_ids: object = None,
    ) -> Hidden:
        """The final hidden states: what `__call__` computes before the output head (after
        the final norm), for losses that never hold the whole logits
        (`eqx_longctx.nn.chunked_cross_entropy` with [`head_weight`][]).

        **Arguments:** as `__call__`.

        **Returns:** `[batch, seq, embed]` hidden states in the compute dtype.

        **Raises:** as `__call__`.
        """
        return self._run(type(self)._embed_and_hidden, tokens, positions, segment_ids)

    def _run(self, fn, tokens, positions, segment_ids):
        tokens, positions, segment_ids = prepare_inputs(
            tokens,
            positions,
            segment_ids,
            spec=self.spec,
            vocab_size=self.config.vocab_size,
            max_seq_len=self.config.max_seq_len,
            config_name=self._config_name,
        )
        if self.spec is None:
            return fn(self, tokens, positions, segment_ids)
        # The lookup runs inside auto_axes too: a gather of replicated embeddings by tokens
        # sharded over an Explicit mesh needs no output-sharding annotation there.
        run = self.spec.auto_axes(fn, self.spec.activation_pspec())
        return run(self, tokens, positions, segment_ids)

    def _embed_and_forward(self, tokens, positions, segment_ids):
        return self._forward(self.embed_tokens(tokens), positions, segment_ids)

    def _embed_and_hidden(self, tokens, positions, segment_ids):
        x = self._last_hidden(self.embed_tokens(tokens), positions, segment_ids)
        return self.norm(x.astype(self.config.compute_dtype))

    def _forward(self, x, positions, segment_ids):
        return self.head(self._last_hidden(x, positions, segment_ids))

    def _last_hidden(self, x, positions, segment_ids):
        dtype = jnp.dtype(self.config.compute_dtype)
        if self.spec is not None:
            x = self.spec.place(x, self.spec.activation_pspec())
            positions = self.spec.place(positions, self.spec.token_pspec())
            if segment_ids is not None:
                segment_ids = self.spec.place(segment_ids, self.spec.token_pspec())
        return self.run_layers(x.astype(dtype), positions, segment_ids)
