"""The planner's result, `Plan`, and the table `Plan.explain()` prints."""

from typing import NamedTuple

from .._units import gib, sec


class Plan(NamedTuple):
    """What the planner (`choose_strategy`, `explain`) predicts for every strategy, and
    the one it picks.

    - `strategy`: the choice: the spec's own strategy, or under `"auto"` the planner's.
    - `reason`: why, in one sentence.
    - `costs`: strategy -> its predicted cost, in `STRATEGY_ORDER`: whether the shapes
      divide as it needs (`feasible`, `runnable`, `reason`), per-device memory
      (`memory_forward`, `memory_train`) and communication (`comm_forward`, `comm_train`)
      in bytes, load `balance`, and `compute_s`, `exposed_s`, `time_s` in seconds.
    - `problem`: the shapes, mesh sizes and constants the prediction used.
    """

    strategy: str
    reason: str
    costs: dict  # strategy -> StrategyCost, in STRATEGY_ORDER
    problem: dict  # the shapes, mesh sizes and constants the prediction used

    def explain(self) -> str:
        """**Returns:** a table of every strategy's predicted cost, then the choice and its
        reason, as text."""
        return table(self)


def table(pl: Plan) -> str:
    """Every strategy's predicted cost as an aligned table, then the choice and its reason."""
    pr = pl.problem
    mesh = ",".join(f"{k}={v}" for k, v in pr["mesh"].items())
    lines = [
        f"attention batch={pr['batch']} seq={pr['seq']} heads={pr['q_heads']}/"
        f"{pr['kv_heads']} head_dim={pr['head_dim']} {pr['dtype']} causal={pr['causal']} on "
        f"mesh {mesh}, load_balance={pr['load_balance']}; per device; roofline "
        f"{pr['flops_per_s'] / 1e12:g} TFLOP/s, {pr['bytes_per_s'] / 1e9:g} GB/s",
    ]
    head = (
        "strategy",
        "degree",
        "mem fwd",
        "mem f+b",
        "comm fwd",
        "comm f+b",
        "balance",
        "compute",
        "exposed",
        "time",
        "note",
    )
    rows: list[tuple[str, ...]] = [head]
    for c in pl.costs.values():
        if not c.feasible:
            rows.append((c.strategy, c.degree, "-", "-", "-", "-", "-", "-", "-", "-", c.reason))
            continue
        rows.append(
            (
                c.strategy,
                c.degree,
                gib(c.memory_forward),
                gib(c.memory_train),
                gib(sum(c.comm_forward.values())),
                gib(sum(c.comm_train.values())),
                f"{c.balance:.2f}",
                sec(c.compute_s),
                sec(c.exposed_s),
                sec(c.time_s),
                c.reason,
            )
        )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head) - 1)]
    for r in rows:
        cells = [str(x).ljust(w) for x, w in zip(r[:-1], widths, strict=True)]
        lines.append("  ".join(cells + [str(r[-1])]).rstrip())
    mode = "forward + backward" if pr["backward"] else "forward"
    lines.append(f"memory budget {gib(pr['memory_budget_bytes'])}; time is {mode}")
    lines.append(f"chosen: {pl.strategy} ({pl.reason})")
    return "\n".join(lines)
