"""Mixture-of-experts feed-forward block: shared experts plus top-k routed SwiGLU experts.

Einsum letters: `b` batch, `s` sequence, `t` token (batch x sequence, flattened), `k` routed
slot of a token (`top_k` of them), `e` embed, `x` expert, `f` expert hidden width, `n` row
of the expert-sorted token copies (`tokens * top_k` of them), `g` expert group.

Routing follows DeepSeek: softmax scores with greedy or group-limited greedy top-k
(DeepSeek-V2), or sigmoid scores with a selection-only bias and group-limited top-k over the
sum of each group's two best scores (DeepSeek-V3, "noaux_tc"). The routed computation never
forms a `tokens x experts x embed` tensor: the `tokens * top_k` token copies are sorted by
expert and every expert multiplies only its own rows (`jax.lax.ragged_dot`, or a scan over
fixed-size row tiles that each belong to one expert). With `spec.expert_axis`, the experts
are split over that mesh axis and the token copies travel to them by all-to-all (expert
parallelism); `_moe_dispatch.py` holds both paths.

References: Dai et al. 2024, "DeepSeekMoE" (arXiv:2401.06066); DeepSeek-AI 2024,
"DeepSeek-V2" (arXiv:2405.04434) and "DeepSeek-V3 Technical Report" (arXiv:2412.19437).
"""

from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._checks import check_spec
from .._sharding import ShardingSpec
from .._types import Hidden
from ._mlp import SwiGLU
from ._moe_dispatch import (
    GROUPED_MATMULS,
    ClampedSwiGLU,
    resolve_grouped_matmul,
    routed_experts,
    routed_experts_all_to_all,
)

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc", "sigmoid")


def _none(x) -> bool:
    return x is None


def check_routing(
    owner: str, n_experts: int, top_k: int, topk_method: str, n_group: int, topk_group: int
) -> None:
    """Check that a routing rule can pick `top_k` of `n_experts` experts (see `MoE`).

    **Arguments:**

    - `owner`: the caller, named in the messages (e.g. `"MoE"` or `"DeepSeekConfig"`).
    - `n_experts`, `top_k`: routed experts, and how many each token uses.
    - `topk_method`: `"greedy"`, `"group_limited_greedy"`, `"noaux_tc"` or `"sigmoid"`.
    - `n_group`, `topk_group`: expert groups, and how many a token may use (group-limited
      methods only).

    **Raises:** `ValueError` for an unknown `topk_method`, a `top_k` not in
    `[1, n_experts]`, or, for group-limited routing, an `n_group` that does not divide the
    experts, a `topk_group` not in `[1, n_group]`, `top_k > topk_group` x experts per group,
    or (`"noaux_tc"`) groups of fewer than 2 experts.
    """
    if topk_method not in TOPK_METHODS:
        raise ValueError(f"{owner} topk_method must be one of {TOPK_METHODS}; got {topk_method!r}.")
    if not 1 <= top_k <= n_experts:
        raise ValueError(
            f"{owner} needs 1 <= top_k <= n_experts; got top_k={top_k}, n_experts={n_experts}."
        )
    if topk_method in ("greedy", "sigmoid"):
        return
    if n_group < 1 or n_experts % n_group:
        raise ValueError(
            f"{owner} topk_method={topk_method!r} splits the experts into n_group equal "
            f"groups; got n_experts={n_experts}, n_group={n_group}. Choose n_group "
            f"among the divisors of {n_experts}."
        )
    per_group = n_experts // n_group
    if not 1 <= topk_group <= n_group or top_k > topk_group * per_group:
        raise ValueError(
            f"{owner} group-limited routing needs 1 <= topk_group <= n_group and top_k <= "
            f"topk_group * experts per group; got top_k={top_k}, topk_group="
            f"{topk_group}, n_group={n_group}, experts per group={per_group}."
        )
    if topk_method == "noaux_tc" and per_group < 2:
        raise ValueError(
            f"{owner} topk_method='noaux_tc' rates each group by its two best experts, so "
            f"groups need >= 2 experts; got n_experts={n_experts}, n_group={n_group}."
        )


@final
class MoE(eqx.Module):
    """`shared(x) + sum_k weight_k * expert_{index_k}(x)` over the top-k routed experts.

    Every expert (and the shared block, `n_shared * hidden_dim` wide) is a bias-free SwiGLU.
    Routing runs in float32:

    - `"greedy"`: `scores = softmax(x @ router)`; the `top_k` best experts, weighted by
      their scores.
    - `"group_limited_greedy"`: the experts form `n_group` equal groups; each group is rated
      by its best score, the `topk_group` best groups are kept (other scores set to 0),
      then as `"greedy"`.
    - `"noaux_tc"`: `scores = sigmoid(x @ router)`; selection uses `scores + score_bias`,
      groups are rated by the sum of their two best biased scores (others set to -inf),
      and the chosen experts are weighted by their unbiased scores.

    - `"sigmoid"`: `scores = sigmoid(x @ router)`; the `top_k` best experts, weighted by
      their scores (Llama 4).

    Then the weights are divided by their sum if `norm_topk_prob`, and multiplied by
    `routed_scaling_factor`. With `weight_inputs` (Llama 4) a token's weight scales the
    expert's input instead of its output: `sum_k expert_{index_k}(weight_k * x)`.

    With `shared_gate` (Qwen2-MoE, Qwen3-Next), the shared block's output is multiplied by
    a per-token gate, `sigmoid(x @ shared_gate)`, before it is added.

    GPT-OSS's experts: `router_bias` adds a learned bias to the router logits (greedy
    routing with `norm_topk_prob` is then its softmax over the top-k logits),
    `expert_bias` gives every routed expert biases on its three projections, and
    `activation=ClampedSwiGLU(alpha, limit)` replaces their `silu(gate) * up`.

    With a sharding spec, each device routes its own tokens. Without `spec.expert_axis`,
    it computes them against replicated expert weights, with no communication. With it
    (expert parallelism), the routed experts are split over that axis, `experts / D`
    consecutive ones on each of its `D` devices, and each token copy travels by all-to-all
    to the device of its expert and back (see `_moe_dispatch.py`). This is exact (dropless)
    by default, at the price of a receive buffer with room for `D` times this device's
    `tokens * top_k` copies; `capacity_factor` bounds it. The router and the shared experts
    are not split over the expert axis.
    """

    router: Float[Array, "embed experts"]
    score_bias: Float[Array, " experts"] | None
    router_bias: Float[Array, " experts"] | None
    w_gate: Float[Array, "experts embed hidden"]
    w_up: Float[Array, "experts embed hidden"]
    w_down: Float[Array, "experts hidden embed"]
    b_gate: Float[Array, "experts hidden"] | None
    b_up: Float[Array, "experts hidden"] | None
    b_down: Float[Array, "experts embed"] | None
    shared: SwiGLU | None
    shared_gate: Float[Array, " embed"] | None
    top_k: int = eqx.field(static=True)
    topk_method: str = eqx.field(static=True)
    n_group: int = eqx.field(static=True)
    topk_group: int = eqx.field(static=True)
    norm_topk_prob: bool = eqx.field(static=True)
    routed_scaling_factor: float = eqx.field(static=True)
    grouped_matmul: str = eqx.field(static=True)
    tile: int = eqx.field(static=True)
    capacity_factor: float | None = eqx.field(static=True)
    weight_inputs: bool = eqx.field(static=True)
    activation: ClampedSwiGLU | None = eqx.field(static=True)
    spec: ShardingSpec | None = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        n_experts: int,
        top_k: int,
        *,
        key: PRNGKeyArray,
        n_shared: int = 0,
        shared_hidden_dim: int | None = None,
        shared_gate: bool = False,
        topk_method: str = "greedy",
        n_group: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = False,
        routed_scaling_factor: float = 1.0,
        grouped_matmul: str = "auto",
        tile: int = 128,
        capacity_factor: float | None = None,
        router_bias: bool = False,
        expert_bias: bool = False,
        activation: ClampedSwiGLU | None = None,
        weight_inputs: bool = False,
        init_std: float = 0.02,
        out_init_std: float | None = None,
        dtype=jnp.float32,
        spec=None,
    ):
        """**Arguments:**

        - `dim`: model width (`embed`).
        - `hidden_dim`: SwiGLU width of each expert.
        - `n_experts`, `top_k`: routed experts, and how many each token uses.
        - `key`: PRNG key for the normal initialisation.
        - `n_shared`: shared experts, fused into one SwiGLU `n_shared * hidden_dim` wide
          (0: none).
        - `shared_hidden_dim`: the shared SwiGLU's width instead (with `n_shared > 0`).
        - `shared_gate`: gate the shared block's output by `sigmoid(x @ shared_gate)` (a
          learned `[embed]` vector, initialised as the router).
        - `topk_method`, `n_group`, `topk_group`: the routing rule (see the class docstring).
        - `norm_topk_prob`, `routed_scaling_factor`: post-processing of the routing weights.
        - `grouped_matmul`: `"ragged_dot"` (`jax.lax.ragged_dot`: one grouped matmul, native
          on TPU; other backends lower it through a dense `experts x rows` expansion),
          `"scan"` (a scan over row tiles of `tile` rows, each belonging to one expert) or
          `"auto"` (`"ragged_dot"` on TPU, else `"scan"`).
        - `tile`: rows per tile of the `"scan"` path.
        - `capacity_factor`: under expert parallelism only: `None` (dropless, the
          default) or how many token copies each device may send to each device of the
          expert axis, as a multiple of the perfectly balanced load: `ceil(capacity_factor
          * tokens * top_k / D)`, `tokens` being the device's own. Copies beyond it are
          dropped, as in GShard and MaxText (they add nothing to the output); `D` or more
          never drops. Without `spec.expert_axis` it has no effect.
        - `router_bias`: a learned `[experts]` bias on the router logits; zero-initialised.
        - `expert_bias`: biases on each routed expert's gate, up and down projections;
          zero-initialised.
        - `activation`: the routed experts' gated activation; `None` = `silu(gate) * up`,
          or a `ClampedSwiGLU` (GPT-OSS).
        - `weight_inputs`: the routing weights scale each expert's input, not its output
          (Llama 4).
        - `init_std`, `out_init_std`: standard deviations of the router and input
          projections, and of the output projections (default `init_std`).
        - `dtype`: parameter dtype.
        - `spec`: the sharding spec, or `None` for one device.

        **Raises:** `TypeError` when `spec` is not a `ShardingSpec` (or `None`); `ValueError`
        for a width or expert count that is not positive, an unknown `topk_method` or
        `grouped_matmul`, a `top_k` the routing rule cannot pick (group sizes included),
        `tile < 1`, `capacity_factor <= 0`, or `n_experts` not divisible by the expert axis.
        """
        check_spec(spec, "MoE")
        for name, value in (("dim", dim), ("hidden_dim", hidden_dim), ("n_experts", n_experts)):
            if value <= 0:
                raise ValueError(f"MoE needs {name} > 0; got {name}={value}.")
        out_init_std = init_std if out_init_std is None else out_init_std
        k_router, k_gate, k_up, k_down, k_shared = jax.random.split(key, 5)
        self.router = init_std * jax.random.normal(k_router, (dim, n_experts), dtype)
        self.score_bias = jnp.zeros((n_experts,), dtype) if topk_method == "noaux_tc" else None
        shape = (n_experts, dim, hidden_dim)
        self.w_gate = init_std * jax.random.normal(k_gate, shape, dtype)
        self.w_up = init_std * jax.random.normal(k_up, shape, dtype)
        self.w_down = out_init_std * jax.random.normal(k_down, (n_experts, hidden_dim, dim), dtype)
        self.router_bias = jnp.zeros((n_experts,), dtype) if router_bias else None
        self.b_gate = self.b_up = self.b_down = None
        if expert_bias:
            self.b_gate = jnp.zeros((n_experts, hidden_dim), dtype)
            self.b_up = jnp.zeros((n_experts, hidden_dim), dtype)
            self.b_down = jnp.zeros((n_experts, dim), dtype)
        if activation is not None and not isinstance(activation, ClampedSwiGLU):
            raise TypeError(
                f"MoE activation must be None (SwiGLU) or a ClampedSwiGLU; got {activation!r}."
            )
        self.activation = activation
        self.weight_inputs = bool(weight_inputs)
        self.shared = self.shared_gate = None
        if n_shared:
            if shared_gate:
                k_sgate = jax.random.fold_in(key, 5)  # the other weights' keys as without it
                self.shared_gate = init_std * jax.random.normal(k_sgate, (dim,), dtype)
            self.shared = SwiGLU(
                dim,
                n_shared * hidden_dim if shared_hidden_dim is None else shared_hidden_dim,
                key=k_shared,
                init_std=init_std,
                out_init_std=out_init_std,
                dtype=dtype,
                spec=spec,
            )
        self.top_k = top_k
        self.topk_method = topk_method
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = bool(norm_topk_prob)
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.grouped_matmul = grouped_matmul
        self.tile = tile
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.spec = spec

    def __check_init__(self):
        check_routing(
            "MoE", self.router.shape[-1], self.top_k, self.topk_method, self.n_group,
            self.topk_group,
        )  # fmt: skip
        if self.grouped_matmul not in GROUPED_MATMULS:
            raise ValueError(
                f"MoE grouped_matmul must be one of {GROUPED_MATMULS}; got {self.grouped_matmul!r}."
            )
        if self.tile < 1:
            raise ValueError(f"MoE needs tile >= 1 rows; got tile={self.tile}.")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"MoE needs capacity_factor > 0 (or None: dropless); got capacity_factor="
                f"{self.capacity_factor}."
            )
        spec = self.spec
        if spec is not None and spec.expert_axis is not None:
            size = spec.axis_size(spec.expert_axis)
            if self.n_experts % size:
                raise ValueError(
                    f"MoE splits its routed experts over expert_axis {spec.expert_axis!r} of "
                    f"size {size}, so n_experts must be divisible by {size}; got n_experts="
                    f"{self.n_experts}. Use an expert axis whose size divides {self.n_experts}, "
                    "or move those devices to another axis."
                )

    @property
    def n_experts(self) -> int:
        """Number of routed experts."""
        return self.router.shape[-1]

    def route(
        self, x: Float[Array, "tokens embed"]
    ) -> tuple[Int[Array, "tokens top_k"], Float[Array, "tokens top_k"]]:
        """Choose the experts of each token.

        **Arguments:**

        - `x`: `[tokens, embed]` (normalised) activations.

        **Returns:** `(indices, weights)`: int32 expert ids and float32 weights, `[tokens,
        top_k]` each.
        """
        logits = jnp.einsum("te,ex->tx", x.astype(jnp.float32), self.router.astype(jnp.float32))
        if self.router_bias is not None:
            logits = logits + self.router_bias.astype(jnp.float32)
        if self.topk_method == "noaux_tc":
            assert self.score_bias is not None
            scores = jax.nn.sigmoid(logits)
            choice = scores + self.score_bias.astype(jnp.float32)
        elif self.topk_method == "sigmoid":
            scores = choice = jax.nn.sigmoid(logits)
        else:
            scores = choice = jax.nn.softmax(logits, axis=-1)
        if self.topk_method not in ("greedy", "sigmoid"):
            grouped = choice.reshape(*choice.shape[:-1], self.n_group, -1)
            if self.topk_method == "noaux_tc":
                group_scores = lax.top_k(grouped, 2)[0].sum(-1)
            else:
                group_scores = grouped.max(-1)
            _, best_groups = lax.top_k(group_scores, self.topk_group)
            keep = jnp.any(jax.nn.one_hot(best_groups, self.n_group, dtype=bool), axis=-2)
            fill = -jnp.inf if self.topk_method == "noaux_tc" else 0.0
            choice = jnp.where(keep[..., None], grouped, fill).reshape(choice.shape)
            if self.topk_method != "noaux_tc":
                scores = choice  # group-limited greedy weights by the masked scores
        _, indices = lax.top_k(choice, self.top_k)
        weights = jnp.take_along_axis(scores, indices, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return indices.astype(jnp.int32), weights * self.routed_scaling_factor

    def __call__(self, x: Hidden) -> Hidden:
        """**Arguments:**

        - `x`: `[batch, seq, embed]` (normalised) activations.

        **Returns:** `[batch, seq, embed]` in the dtype of `x`.
        """
        if self.spec is None:
            return self._local(x)
        if self.spec.expert_axis is not None:
            return self._expert_parallel(x)
        spec = self.spec
        act = spec.activation_pspec()
        routed = eqx.tree_at(lambda m: (m.shared, m.shared_gate), self, (None, None), is_leaf=_none)
        params, static = eqx.partition(routed, eqx.is_array)

        def local(params, x):
            return eqx.combine(params, static)._local(x)

        # Routing is per token and the routed experts' weights are replicated: each device
        # computes its own tokens, with no communication. The shared experts run outside,
        # on the spec's sharding of `x` (split over a tensor axis like any SwiGLU).
        mapped = jax.shard_map(
            local,
            mesh=spec.compute_mesh(),
            in_specs=(PartitionSpec(), act),
            out_specs=act,
            check_vma=False,
        )
        out = mapped(params, spec.place(x, act))
        return out if self.shared is None else out + self._shared(x)

    def _local(self, x):
        b, s, e = x.shape
        rows, indices, weights = self._routed_rows(x.reshape(b * s, e))
        w, biases = self._experts(x.dtype)
        method = resolve_grouped_matmul(self.grouped_matmul)
        out = routed_experts(rows, indices, weights, *w, method=method, tile=self.tile,
                             biases=biases, act=self.activation)  # fmt: skip
        out = self._sum_copies(out, b * s).reshape(b, s, e)
        return out if self.shared is None else out + self._shared(x)

    def _routed_rows(self, tokens):
        """`(rows, indices, weights)` to dispatch: `tokens` and their routing, or with
        `weight_inputs` each token's `top_k` copies scaled by their weights, one expert
        each with weight 1 (`_sum_copies` adds them up)."""
        indices, weights = self.route(tokens)
        if not self.weight_inputs:
            return tokens, indices, weights
        n = indices.size
        rows = tokens[:, None, :] * weights[..., None].astype(tokens.dtype)
        return rows.reshape(n, -1), indices.reshape(n, 1), jnp.ones((n, 1), jnp.float32)

    def _sum_copies(self, out, tokens: int):
        """The routed output of each token: `out` as dispatched (`_routed_rows`)."""
        if not self.weight_inputs:
            return out
        return out.reshape(tokens, -1, out.shape[-1]).astype(jnp.float32).sum(1).astype(out.dtype)

    def _experts(self, dtype):
        """The routed experts' `(w_gate, w_up, w_down)` and biases (or `None`) in `dtype`."""
        w = tuple(a.astype(dtype) for a in (self.w_gate, self.w_up, self.w_down))
        if self.b_gate is None or self.b_up is None or self.b_down is None:
            return w, None
        return w, tuple(b.astype(dtype) for b in (self.b_gate, self.b_up, self.b_down))

    def _shared(self, x):
        """The shared block's output, gated if `shared_gate`."""
        assert self.shared is not None
        out = self.shared(x)
        if self.shared_gate is None:
            return out
        gate = jnp.einsum("bse,e->bs", x, self.shared_gate.astype(x.dtype))
        return out * jax.nn.sigmoid(gate)[..., None]

    def _expert_parallel(self, x):
        """The routed experts split over `spec.expert_axis`, tokens sent to them by
        all-to-all; the shared experts run outside, on the spec's sharding of `x`."""
        spec = self.spec
        assert spec is not None and spec.expert_axis is not None
        axis = spec.expert_axis
        spec.check_batch(x.shape[0], "the MoE input's batch")
        act = spec.activation_pspec()

        def split(m):  # the arrays split over the expert axis
            biases = () if m.b_gate is None else (m.b_gate, m.b_up, m.b_down)
            return (m.w_gate, m.w_up, m.w_down, *biases)

        # Gathered out of any fsdp/tensor split, still split over the experts: the weights
        # never travel, the tokens do.
        experts = tuple(spec.place(w, PartitionSpec(axis)) for w in split(self))
        routed = eqx.tree_at(split, self, experts)
        routed = eqx.tree_at(
            lambda m: (m.shared, m.shared_gate), routed, (None, None), is_leaf=_none
        )
        params, static = eqx.partition(routed, eqx.is_array)
        in_specs = jax.tree.map(lambda _: PartitionSpec(), params)
        in_specs = eqx.tree_at(split, in_specs, (PartitionSpec(axis),) * len(experts))
        method = resolve_grouped_matmul(self.grouped_matmul)

        def local(params, x):
            moe = eqx.combine(params, static)
            b, s, e = x.shape
            rows, indices, weights = moe._routed_rows(x.reshape(b * s, e))
            w, biases = moe._experts(x.dtype)
            out = routed_experts_all_to_all(
                rows, indices, weights, *w, axis=axis, n_experts=self.n_experts,
                method=method, tile=self.tile, capacity_factor=self.capacity_factor,
                biases=biases, act=self.activation,
            )  # fmt: skip
            return moe._sum_copies(out, b * s).reshape(b, s, e)

        mapped = jax.shard_map(
            local,
            mesh=spec.compute_mesh(),
            in_specs=(in_specs, act),
            out_specs=act,
            check_vma=False,
        )
        out = mapped(params, spec.place(x, act))
        return out if self.shared is None else out + self._shared(x)
