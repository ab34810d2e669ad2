"""The whole-step planner's table and JSON record (`StepPlan.explain`, `step_record`)."""

from typing import Any

from .._units import gib, sec

_COLUMNS = (
    ("params", "params"),
    ("grads", "grads"),
    ("opt_state", "opt state"),
    ("batch", "batch"),
    ("activations", "activations"),
    ("layer_backward", "layer bwd"),
    ("attention", "(attention)"),
    ("logits", "logits"),
)


def step_table(plan: Any) -> str:
    """Every (strategy, remat) row of a `StepPlan` as an aligned table, then the choice."""
    pr = plan.problem
    mesh = ",".join(f"{k}={v}" for k, v in pr["mesh"].items())
    fsdp = ",".join(pr["fsdp_axes"]) or "none"
    lines = [
        f"train step: {pr['model']} {pr.get('preset', '')}, batch {pr['batch']} x seq "
        f"{pr['seq']} on mesh {mesh} (weights split over fsdp axes {fsdp}); per device "
        f"{pr['local_batch']} x {pr['local_seq']} tokens; parameters {pr['param_dtype']}, "
        f"compute {pr['compute_dtype']}; bytes per device",
    ]
    head = (
        "strategy", "remat", *(title for _, title in _COLUMNS), "device", "host", "FLOPs/dev",
        "time", "(attn time)", "MFU",
    )  # fmt: skip
    rows: list[tuple[str, ...]] = [head]
    for r in plan.rows:
        cells = [r.strategy, r.remat, *(gib(getattr(r, name)) for name, _ in _COLUMNS)]
        rows.append((
            *cells, gib(r.device), gib(r.host), f"{r.flops:.3g}", sec(r.time_s),
            sec(r.attention_s), f"{r.mfu:.1%}",
        ))  # fmt: skip
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    for row in rows:
        lines.append("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip())
    lines.append(
        "device = params + grads + opt state + batch + activations + max(layer bwd, logits) "
        "(opt state only at the update when offloaded); host = offloaded activations and state"
    )
    chip = f" ({pr['chip']})" if pr.get("chip") else ""
    lines.append(
        f"time = every layer's matmuls and attention (recomputation and exposed communication "
        f"included) on the busiest device at {pr['flops_per_s'] / 1e12:.4g} TFLOP/s and "
        f"{pr['bytes_per_s'] / 1e9:.4g} GB/s per link{chip}; model FLOPs per step "
        f"{pr['model_flops']:.3g} (6 x active params x tokens + causal attention + linear "
        f"attention's chunked form, no recomputation); MFU = model FLOPs / (time x "
        f"{pr['devices']} devices x FLOP/s)"
    )
    shown = plan.chosen.strategy if plan.chosen is not None else None
    for kind in pr.get("layers", []):
        runs = kind["runs"].get(shown) or next(iter(kind["runs"].values()), None)
        if runs is None:
            continue
        what = "global" if kind["window"] is None else f"local (window/chunk {kind['window']})"
        lines.append(
            f"{kind['layers']} {what} layers: {runs['runs']}, {gib(runs['comm_train_bytes'])} "
            "per device per layer (forward + backward)"
        )
    budget = pr["memory_budget_bytes"]
    where = f"budget {gib(budget)}" if budget is not None else "no budget"
    if plan.chosen is None:
        lines.append(f"{where}: nothing fits ({plan.reason})")
    else:
        c = plan.chosen
        lines.append(f"{where}: chosen {c.strategy}, remat={c.remat!r} ({plan.reason})")
    return "\n".join(lines)


def step_record(plan: Any, row: Any, compiled: Any = None) -> dict:
    """One JSON-able record of a planner run: the problem, the row predicted for the
    (strategy, remat) compiled or chosen, XLA's numbers when compiled, and every row."""
    record = dict(plan.problem)
    record.update(
        strategy=None if row is None else row.strategy,
        remat=None if row is None else row.remat,
        predicted_bytes_per_device=None if row is None else row.device,
        predicted_host_bytes=None if row is None else row.host,
        predicted_time_s=None if row is None else row.time_s,
        predicted_flops_per_device=None if row is None else row.flops,
        predicted_mfu=None if row is None else row.mfu,
        compiled_bytes_per_device=None if compiled is None else compiled.device,
        compiled_host_bytes=None if compiled is None else compiled.host,
        compiled=None if compiled is None else compiled._asdict(),
        breakdown=None if row is None else row.breakdown(),
        chosen=None
        if plan.chosen is None
        else {"strategy": plan.chosen.strategy, "remat": plan.chosen.remat},
        reason=plan.reason,
        rows=[
            dict(
                strategy=r.strategy,
                remat=r.remat,
                device=r.device,
                host=r.host,
                time_s=r.time_s,
                attention_s=r.attention_s,
                flops=r.flops,
                mfu=r.mfu,
                breakdown=r.breakdown(),
            )  # fmt: skip
            for r in plan.rows
        ],
    )
    return record
