"""How the routed token copies of an MoE layer reach their experts and come back.

Einsum letters as in `_moe.py`: `t` token, `k` routed slot of a token, `e` embed, `n` row
of the token copies (`tokens * top_k` of them), `d` device of the expert axis, `c` row of
the buffer sent to one device.

- `routed_experts`: every expert on this device. The copies are sorted by expert, each
  expert multiplies only its own rows (`jax.lax.ragged_dot`, or a scan over row tiles that
  each belong to one expert), and the results are unsorted and summed with the routing
  weights.
- `routed_experts_all_to_all`: expert parallelism, inside `shard_map`. This device holds
  `experts / D` consecutive experts of the `D` devices along the expert axis and its own
  tokens. The copies are sorted by expert (hence by the device that holds it) into one
  fixed-size buffer per destination, exchanged by `jax.lax.all_to_all`, computed by the
  local experts as above, sent back by the reverse all-to-all, then unsorted and combined.
  Shapes are static, so each buffer has room for the worst case (every copy going to one
  device) unless a capacity is given; padding rows are zero, belong to no expert and are
  never read back, so they change neither results nor gradients.

References: Lepikhin et al. 2020, "GShard" (arXiv:2006.16668), for all-to-all dispatch;
Gale et al. 2022, "MegaBlocks" (arXiv:2211.15841), for dropless grouped matmuls.
"""

import dataclasses
import math
from typing import final

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

GROUPED_MATMULS = ("auto", "ragged_dot", "scan")
"""How `MoE(grouped_matmul=...)` runs its experts: `"auto"` (`"ragged_dot"` on TPU, else
`"scan"`), `"ragged_dot"` (one grouped matmul) or `"scan"` (one expert at a time)."""


@final
@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's expert activation, in place of SwiGLU's `silu(gate) * up`: the gate
    clamped above at `limit`, the up projection to `[-limit, limit]`, then
    `gate * sigmoid(alpha * gate) * (up + 1)`. Frozen (hashable): a static field of `MoE`.

    **Arguments:**

    - `alpha`: the sigmoid's gain (GPT-OSS: 1.702).
    - `limit`: the clamp (GPT-OSS: 7.0).
    """

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: Array, up: Array) -> Array:
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return gate * jax.nn.sigmoid(self.alpha * gate) * (up + 1)


def resolve_grouped_matmul(method: str) -> str:
    """`"auto"` -> `"ragged_dot"` on TPU (native there), else `"scan"`."""
    if method == "auto":
        return "ragged_dot" if jax.default_backend() == "tpu" else "scan"
    return method


def routed_experts(
    tokens: Float[Array, "tokens embed"],
    indices: Int[Array, "tokens top_k"],
    weights: Float[Array, "tokens top_k"],
    w_gate: Float[Array, "experts embed hidden"],
    w_up: Float[Array, "experts embed hidden"],
    w_down: Float[Array, "experts hidden embed"],
    *,
    method: str,
    tile: int,
    biases: tuple[Array, ...] | None = None,
    act: ClampedSwiGLU | None = None,
) -> Float[Array, "tokens embed"]:
    """`sum_k weights[t, k] * expert_{indices[t, k]}(tokens[t])`, every expert local.

    **Arguments:**

    - `tokens`: `[tokens, embed]` activations.
    - `indices`, `weights`: the routing, `[tokens, top_k]` each (see `MoE.route`).
    - `w_gate`, `w_up`, `w_down`: the experts' SwiGLU weights, in the compute dtype.
    - `method`: `"ragged_dot"` or `"scan"`; `tile`: rows per tile of `"scan"`.
    - `biases`: the experts' `(gate [experts, hidden], up [experts, hidden], down
      [experts, embed])` biases, or `None`.
    - `act`: the gated activation of `gate` and `up`; `None` = SwiGLU's `silu(gate) * up`.

    **Returns:** `[tokens, embed]` in the dtype of `tokens`.
    """
    t, top_k = indices.shape
    rows = indices.reshape(-1)  # row n = token n // top_k, slot n % top_k
    y = _experts_by_row(tokens, jnp.arange(t * top_k) // top_k, rows, w_gate, w_up, w_down,
                        method=method, tile=tile, biases=biases, act=act)  # fmt: skip
    return _combine(y.reshape(t, top_k, -1), weights, tokens.dtype)


def routed_experts_all_to_all(
    tokens: Float[Array, "tokens embed"],
    indices: Int[Array, "tokens top_k"],
    weights: Float[Array, "tokens top_k"],
    w_gate: Float[Array, "local_experts embed hidden"],
    w_up: Float[Array, "local_experts embed hidden"],
    w_down: Float[Array, "local_experts hidden embed"],
    *,
    axis: str,
    n_experts: int,
    method: str,
    tile: int,
    capacity_factor: float | None = None,
    biases: tuple[Array, ...] | None = None,
    act: ClampedSwiGLU | None = None,
) -> Float[Array, "tokens embed"]:
    """The same as `routed_experts`, with the experts split over mesh axis `axis`.

    Call inside `shard_map`: `tokens` and the routing are this device's, the weights are
    its `experts / D` consecutive experts (device `d` of the `D` along `axis` holds experts
    `d * experts / D` onwards).

    **Arguments:** as `routed_experts` (the biases this device's experts'), and

    - `axis`: the expert mesh axis.
    - `n_experts`: the number of experts over all devices.
    - `capacity_factor`: `None` (dropless: room for every copy in each buffer) or the
      room, in copies, for each destination: `ceil(capacity_factor * tokens * top_k / D)`;
      copies beyond it are dropped (they add nothing), those of the higher-numbered
      experts first, then of the later tokens.

    **Returns:** `[tokens, embed]` in the dtype of `tokens`.
    """
    t, top_k = indices.shape
    n = t * top_k
    local = w_gate.shape[0]
    n_dev = n_experts // local
    room = n if capacity_factor is None else min(n, math.ceil(capacity_factor * n / n_dev))
    rows = indices.reshape(-1)
    order = jnp.argsort(rows, stable=True)  # by expert, hence by destination device
    counts = jnp.bincount(rows // local, length=n_dev)
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(room)
    valid = slot[None, :] < counts[:, None]  # [d, c]
    sorted_pos = jnp.minimum(starts[:, None] + slot[None, :], n - 1)
    send_row = order[sorted_pos]
    send_x = jnp.where(valid[..., None], tokens[send_row // top_k], 0)
    dest = jnp.arange(n_dev, dtype=rows.dtype)[:, None]
    # The receiver's local expert of each row; `local` (no expert) marks padding.
    send_expert = jnp.where(valid, rows[send_row] - dest * local, local)

    def exchange(a):
        return lax.all_to_all(a, axis, 0, 0, tiled=True)

    recv_x, recv_expert = exchange(send_x), exchange(send_expert)  # [d, c, ...] by source
    recv_y = _experts_by_row(
        recv_x.reshape(n_dev * room, -1), jnp.arange(n_dev * room), recv_expert.reshape(-1),
        w_gate, w_up, w_down, method=method, tile=tile, biases=biases, act=act,
    )  # fmt: skip
    back = exchange(recv_y.reshape(n_dev, room, -1))  # back[d, c]: the result of send_x[d, c]
    rank = _inverse(order) - starts[rows // local]  # each row's place in its buffer
    y = jnp.where((rank < room)[:, None], back[rows // local, jnp.minimum(rank, room - 1)], 0)
    return _combine(y.reshape(t, top_k, -1), weights, tokens.dtype)


def _combine(y, weights, dtype):
    return jnp.einsum("tke,tk->te", y.astype(jnp.float32), weights).astype(dtype)


def _inverse(order):
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def _experts_by_row(
    x, row_source, row_expert, w_gate, w_up, w_down, *, method, tile, biases=None, act=None
):
    """Row `n` is `x[row_source[n]]` for expert `row_expert[n]` -> `[rows, embed]`.

    A `row_expert` of `experts` (one past the last) marks a padding row: it belongs to no
    expert and its result is zero.
    """
    n_experts = w_gate.shape[0]
    order = jnp.argsort(row_expert, stable=True)  # padding rows last
    group_sizes = jnp.bincount(row_expert, length=n_experts).astype(jnp.int32)
    sorted_x = x[row_source[order]]
    if method == "ragged_dot":
        sorted_y = _experts_ragged_dot(
            sorted_x, group_sizes, row_expert[order], w_gate, w_up, w_down, biases, act
        )
    else:
        sorted_y = _experts_tiled(
            sorted_x, group_sizes, row_expert[order], w_gate, w_up, w_down, tile=tile,
            biases=biases, act=act,
        )  # fmt: skip
    return sorted_y[_inverse(order)]


def _glu(gate, up, act):
    return jax.nn.silu(gate) * up if act is None else act(gate, up)


def _swiglu_rows(x, w_gate, w_up, w_down, biases=None, act=None):
    """One expert's rows; `biases` its `(gate, up, down)` biases, or `None`."""
    gate, up = jnp.dot(x, w_gate), jnp.dot(x, w_up)
    if biases is not None:
        gate, up = gate + biases[0], up + biases[1]
    out = jnp.dot(_glu(gate, up, act), w_down)
    return out if biases is None else out + biases[2]


def _experts_ragged_dot(x, group_sizes, row_expert, w_gate, w_up, w_down, biases, act):
    """`[rows, embed]` sorted by expert (`row_expert` each row's) -> `[rows, embed]`, one
    ragged matmul per weight (rows past `sum(group_sizes)` come out zero)."""
    gate = lax.ragged_dot(x, w_gate, group_sizes)
    up = lax.ragged_dot(x, w_up, group_sizes)
    if biases is None:
        return lax.ragged_dot(_glu(gate, up, act), w_down, group_sizes)
    n_experts = w_gate.shape[0]
    expert = jnp.minimum(row_expert, n_experts - 1)
    gate, up = gate + biases[0][expert], up + biases[1][expert]
    out = lax.ragged_dot(_glu(gate, up, act), w_down, group_sizes) + biases[2][expert]
    return jnp.where((row_expert < n_experts)[:, None], out, 0)


def _experts_tiled(
    x, group_sizes, row_expert, w_gate, w_up, w_down, *, tile, biases=None, act=None
):
    """The same as `_experts_ragged_dot`, as a scan over tiles of `tile` rows.

    Each expert's rows are padded to a whole number of tiles, so every tile belongs to one
    expert; the number of tiles has the static bound `ceil(rows / tile) + experts`, and
    tiles past the used ones are skipped. Tiles are at most `rows // experts` rows, so the
    padded copy of the rows is at most twice their size. Padding rows (`row_expert ==
    experts`, sorted last) go to a spare row and come out zero.
    """
    n_rows, e = x.shape
    n_experts = group_sizes.shape[0]
    tile = max(1, min(tile, n_rows // n_experts))
    n_tiles = -(-n_rows // tile) + min(n_experts, n_rows)
    padded = (group_sizes + tile - 1) // tile * tile
    padded_ends = jnp.cumsum(padded)
    starts = jnp.cumsum(group_sizes) - group_sizes
    expert = jnp.minimum(row_expert, n_experts - 1)
    rank = jnp.arange(n_rows, dtype=jnp.int32) - starts[expert]
    spare = n_tiles * tile
    dest = jnp.where(row_expert < n_experts, padded_ends[expert] - padded[expert] + rank, spare)
    tiles = jnp.zeros((spare + 1, e), x.dtype).at[dest].set(x)[:spare].reshape(n_tiles, tile, e)
    tile_start = jnp.arange(n_tiles, dtype=padded_ends.dtype) * tile
    tile_expert = jnp.minimum(
        jnp.searchsorted(padded_ends, tile_start, side="right"), n_experts - 1
    )
    used = tile_start < padded_ends[-1]

    def body(_, inputs):
        rows, expert, is_used = inputs

        def compute(rows):
            def pick(a):
                return lax.dynamic_index_in_dim(a, expert, keepdims=False)

            b = None if biases is None else tuple(pick(a) for a in biases)
            return _swiglu_rows(rows, pick(w_gate), pick(w_up), pick(w_down), b, act)

        return None, lax.cond(is_used, compute, jnp.zeros_like, rows)

    _, out = lax.scan(body, None, (tiles, tile_expert, used))
    out = jnp.concatenate([out.reshape(spare, e), jnp.zeros((1, e), out.dtype)])
    return out[dest]
