"""`plan`: every strategy's predicted cost for one attention call, and the choice of `"auto"`.

The cost model is `_cost.py`; the table `Plan.explain()` prints is `_explain.py`.
"""

import inspect
from typing import Any, no_type_check

import jax.numpy as jnp
import numpy as np

from .._checks import check_bool, check_int, check_memory_budget, check_real, check_spec
from .._sharding import ShardingSpec
from ._cost import (
    DEFAULT_BYTES_PER_S,
    DEFAULT_FLOPS_PER_S,
    STRATEGY_ORDER,
    Problem,
    common_problem,
    strategy_cost,
)
from ._explain import Plan, gib, sec
from ._impls import resolve_block_impl
from ._tiling_policy import block_size, tile_bytes, token_positions, zigzag_halves
from ._validate import check_attention_inputs, check_layout, check_options, check_variants

# Budget for one attention call's activations: this fraction of device memory when the
# device reports it, else the constant (a quarter of a 16 GiB chip). The rest holds weights,
# optimizer state and the other layers' activations.
MEMORY_FRACTION = 0.25
DEFAULT_MEMORY_BUDGET = 4 * 2**30
# "auto" keeps the simplest strategy (fewest collectives, in STRATEGY_ORDER) whose predicted
# time is within this fraction of the best: per-hop overheads (merges, synchronisation) of
# ring and usp are not priced, so a saving smaller than this is not worth them.
TIE_FRACTION = 0.05


@no_type_check  # validated eagerly, with errors that say what to fix
def plan(
    spec: ShardingSpec,
    *,
    batch: int,
    seq: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    v_head_dim: int | None = None,
    dtype: Any = jnp.float32,
    causal: bool = True,
    window: int | None = None,
    chunk: int | None = None,
    segment_ids: bool = False,
    backward: bool = True,
    memory_budget_bytes: int | float | None = None,
    flops_per_s: int | float = DEFAULT_FLOPS_PER_S,
    bytes_per_s: int | float = DEFAULT_BYTES_PER_S,
    where: str = "plan",
) -> Plan:
    """Predict every strategy's memory, communication, balance and time; choose one.

    **Arguments:**

    - `spec`: the `ShardingSpec` (mesh sizes, token layout; `strategy="auto"` lets the model
      choose, any other strategy is kept and the table shows the alternatives).
    - `batch`, `seq`, `q_heads`, `kv_heads`, `head_dim`, `v_head_dim`: global shapes.
    - `dtype`: of q, k, v (any NumPy/JAX dtype or its name).
    - `causal`, `segment_ids`: the masks (segment ids add int32 traffic next to positions).
    - `window`: a sliding window (needs `causal`): work counts only the block pairs within
      it, and the ring only the hops it reaches (`ring_hops`). On the contiguous and
      zig-zag layouts such a local layer runs as a neighbour exchange (`_halo.py`) where
      `"ring"` or `"all_gather"` would send whole shards: those rows price the exchange,
      and their note says so.
    - `chunk`: chunked attention (needs `causal`), priced like `window`.
    - `backward`: choose by forward + backward cost (training) rather than forward alone.
    - `memory_budget_bytes`: per-device budget for one call; default `MEMORY_FRACTION` of
      the device's memory when it reports it, else `DEFAULT_MEMORY_BUDGET`.
    - `flops_per_s`, `bytes_per_s`: roofline constants of the target device.
    - `where`: the name error messages give: the public function the caller called
      (`choose_strategy`, `explain`, `plan_train_step`).

    **Returns:** a `Plan`; `print(plan(...).explain())` shows the table.

    **Raises:** `TypeError` and `ValueError` as `choose_strategy`.
    """
    check_spec(spec, where, none_ok=False)
    shape = dict(batch=batch, seq=seq, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim)
    for name, value in shape.items():
        check_int(value, f"{where}: {name}")
    if v_head_dim is not None:
        check_int(v_head_dim, f"{where}: v_head_dim")
    for name, value in (("segment_ids", segment_ids), ("backward", backward)):
        check_bool(value, f"{where}: {name}")
    window = check_options(where, None, causal, None, window)
    _, chunk = check_variants(where, causal, None, chunk)
    check_memory_budget(memory_budget_bytes, where)
    check_real(flops_per_s, f"{where}: flops_per_s", positive=True)
    check_real(bytes_per_s, f"{where}: bytes_per_s", positive=True)
    try:
        e = int(np.dtype(dtype).itemsize)
    except TypeError as err:
        raise TypeError(
            f"{where}: dtype must be a NumPy/JAX dtype or its name; got {dtype!r}."
        ) from err
    dv = head_dim if v_head_dim is None else v_head_dim
    if memory_budget_bytes is None:
        memory_budget_bytes = _default_budget(spec)
    nb, nt = spec.batch_parallel_size, spec.axis_size(spec.tensor_axis)
    p = Problem(
        nb, nt, spec.context_parallel_size, batch, seq, q_heads, kv_heads, head_dim, dv, e,
        bool(causal), bool(segment_ids), block_size(spec, seq), tile_bytes(spec), window,
        # priced only where the implementation `spec` runs on its platform splits them
        zigzag_halves(spec, seq, causal)
        and resolve_block_impl(spec=spec, lowering=False).splits_zigzag_halves, chunk,
    )  # fmt: skip
    common = common_problem(spec, p)
    order = None if common else token_positions(spec, seq)
    costs = {}
    for name in STRATEGY_ORDER:
        costs[name] = strategy_cost(
            name, spec, p, order, common, backward, flops_per_s, bytes_per_s
        )
    chosen, reason = choose(spec, costs, backward, int(memory_budget_bytes))
    problem = dict(
        batch=batch,
        seq=seq,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=dv,
        dtype=str(np.dtype(dtype)),
        causal=bool(causal),
        window=window,
        chunk=chunk,
        segment_ids=bool(segment_ids),
        backward=bool(backward),
        mesh=dict(spec.mesh.shape),
        load_balance=spec.load_balance,
        memory_budget_bytes=int(memory_budget_bytes),
        flops_per_s=flops_per_s,
        bytes_per_s=bytes_per_s,
    )
    return Plan(strategy=chosen, reason=reason, costs=costs, problem=problem)


_SHAPES = ("batch", "seq", "q_heads", "kv_heads", "head_dim")  # required by plan and explain
_KEYWORDS = tuple(
    name
    for name, p in inspect.signature(plan).parameters.items()
    if p.kind is p.KEYWORD_ONLY and name != "where"
)
_OPTIONS = tuple(k for k in _KEYWORDS if k not in (*_SHAPES, "v_head_dim", "dtype"))


def _check_keywords(
    where: str, given: dict, allowed: tuple, required: tuple = (), note: str = ""
) -> None:
    """Raise `TypeError` naming `where` (not `plan`) for an unknown or missing keyword."""
    unknown = [k for k in given if k not in allowed]
    if unknown:
        raise TypeError(
            f"{where} got unknown keyword argument(s) {', '.join(map(repr, unknown))}; it "
            f"takes {', '.join(allowed)}{note}."
        )
    missing = [k for k in required if k not in given]
    if missing:
        raise TypeError(
            f"{where} needs the keyword argument(s) {', '.join(missing)}: the global shapes "
            f"{', '.join(required)} of one attention call are required; got "
            f"{', '.join(given) or 'none'}."
        )


@no_type_check  # validated eagerly, with errors that say what to fix
def choose_strategy(spec: ShardingSpec, q: Any, k: Any, v: Any = None, **kwargs) -> Plan:
    """Predict every context-parallel strategy's cost for one attention call, and choose.

    The choice is what `strategy="auto"` runs: the simplest strategy (fewest collectives)
    within `TIE_FRACTION` (5%) of the fastest among those that fit the memory budget. A spec
    with another strategy keeps it; the plan still prices the alternatives.

    **Arguments:**

    - `spec`: the `ShardingSpec` (mesh sizes, token layout, strategy).
    - `q`, `k`, `v`: arrays or `jax.ShapeDtypeStruct`s of global shape
      `[batch, seq, heads, head_dim]`; only their shapes and `q`'s dtype are read. `v`
      defaults to `k`'s shape.
    - `causal`: causal masking (default `True`).
    - `window`: a sliding window in tokens (needs `causal`), or `None`: work counts only the
      block pairs within it, and the ring only the hops it reaches.
    - `segment_ids`: whether the call passes segment ids (they add int32 traffic; default
      `False`).
    - `backward`: choose by forward + backward cost (training; the default) rather than
      forward alone.
    - `memory_budget_bytes`: per-device budget for the call; default `MEMORY_FRACTION` (a
      quarter) of the device's memory when it reports it, else `DEFAULT_MEMORY_BUDGET`
      (4 GiB).
    - `flops_per_s`, `bytes_per_s`: roofline constants of the target device.

    **Returns:** a `Plan`; `print(plan.explain())` shows the table.

    **Raises:** `TypeError` for a keyword other than those above, when `spec` is not a
    `ShardingSpec`, `q`, `k` or `v` has no `shape` and `dtype`, `causal`, `segment_ids` or
    `backward` is not a bool, `window` not an int, or a budget or roofline constant not a
    real number; `ValueError` when `q`, `k`
    or `v` is not of rank 4, a dimension is not positive, `window < 1` or is set without
    `causal`, or a budget or roofline constant is not finite and `> 0`.
    """
    where = "choose_strategy"
    _check_keywords(where, kwargs, _OPTIONS, note=" (the shapes and dtype come from q, k, v)")
    arrays = {"q": q, "k": k} | ({} if v is None else {"v": v})
    for name, x in arrays.items():
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(
                f"{where} needs q, k, v as arrays or jax.ShapeDtypeStructs (it reads their "
                f"shapes and q's dtype); got {name} of type {type(x).__name__}. Pass "
                f"jnp.asarray({name}), or jax.ShapeDtypeStruct(shape, dtype) to allocate nothing."
            )
    check_layout(where, **arrays)
    try:  # the shapes attention() would accept, so that the plan is of a call that can run
        check_attention_inputs(q, k, k if v is None else v, None)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    b, s, hq, d = q.shape
    dv = d if v is None else v.shape[-1]
    shape = dict(batch=b, seq=s, q_heads=hq, kv_heads=k.shape[2], head_dim=d, v_head_dim=dv)
    return plan(spec, dtype=q.dtype, **shape, **kwargs, where=where)


@no_type_check  # validated eagerly, with errors that say what to fix
def explain(spec: ShardingSpec, **shape) -> str:
    """The cost table of every strategy and the choice, as text (`Plan.explain()`).

    **Arguments:**

    - `spec`: the `ShardingSpec`.
    - `batch`, `seq`, `q_heads`, `kv_heads`, `head_dim` (keywords, required),
      `v_head_dim` (default `head_dim`): the global shapes of one attention call.
    - `dtype`: of q, k, v (a NumPy/JAX dtype or its name; default float32).
    - `causal`, `window`, `segment_ids`, `backward`, `memory_budget_bytes`,
      `flops_per_s`, `bytes_per_s`: as for `choose_strategy`.

    **Returns:** the table, one line per strategy, then the choice and its reason.

    **Raises:** `TypeError` for a missing shape or an unknown keyword, a shape that is not
    an int, a `dtype` that is not a dtype, and as `choose_strategy`; `ValueError` as
    `choose_strategy`.
    """
    _check_keywords("explain", shape, _KEYWORDS, required=_SHAPES)
    return plan(spec, **shape, where="explain").explain()


def resolve_strategy(spec: ShardingSpec, q: Any, k: Any, window: int | None = None) -> str:
    """The strategy a call runs: the spec's, or for `"auto"` the one `choose_strategy`
    picks for these shapes (its cost model counts the sliding `window`)."""
    if spec.strategy != "auto":
        return spec.strategy
    return choose_strategy(spec, q, k, window=window).strategy


def _default_budget(spec: ShardingSpec) -> int:
    try:
        stats = spec.mesh.devices.flat[0].memory_stats() or {}
    except Exception:  # some backends raise instead of returning None
        stats = {}
    limit = stats.get("bytes_limit")
    return int(limit * MEMORY_FRACTION) if limit else DEFAULT_MEMORY_BUDGET


def choose(spec, costs, backward: bool, budget: int) -> tuple[str, str]:
    """(strategy, reason): the spec's fixed strategy, or for `"auto"` the simplest one
    within `TIE_FRACTION` of the fastest among those that fit `budget`."""
    mem = (lambda c: c.memory_train) if backward else (lambda c: c.memory_forward)
    if spec.strategy != "auto":
        c = costs[spec.strategy]
        note = f"; {gib(mem(c))} of the {gib(budget)} budget" if c.feasible else ""
        return spec.strategy, f"fixed by ShardingSpec(strategy={spec.strategy!r}){note}"
    ok = [c for c in costs.values() if c.feasible and c.runnable]
    if not ok:
        why = "; ".join(f"{c.strategy}: {c.reason}" for c in costs.values())
        return "ring", f"no strategy fits these shapes ({why}); ring reports the error"
    fits = [c for c in ok if mem(c) <= budget]
    if not fits:
        c = min(ok, key=mem)
        return c.strategy, (
            f"nothing fits the {gib(budget)} budget; {c.strategy} needs the least ({gib(mem(c))})"
        )
    best = min(fits, key=lambda c: c.time_s)
    pick = next(c for c in fits if c.time_s <= best.time_s * (1 + TIE_FRACTION))  # simplest
    over = [f"{c.strategy} ({gib(mem(c))})" for c in ok if mem(c) > budget]
    why = f"over the {gib(budget)} memory budget: {', '.join(over)}; " if over else ""
    time = (
        f"{sec(pick.time_s)}: compute {sec(pick.compute_s)} + exposed communication "
        f"{sec(pick.exposed_s)}"
    )
    if pick is best:
        return pick.strategy, why + f"{pick.strategy} has the lowest predicted time ({time})"
    return pick.strategy, why + (
        f"{pick.strategy} ({time}) is within {TIE_FRACTION:.0%} of the fastest, "
        f"{best.strategy} ({sec(best.time_s)}), with fewer collectives"
    )
