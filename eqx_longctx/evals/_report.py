"""One eval, start to end: samples, generation, scores, position loss, the strategies check,
and the files (`results.json`, `samples.jsonl`, `heatmap-<task>.png`,
`position_loss.png`)."""

import json
import pathlib
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from ._plots import plot_heatmap, plot_position_loss
from ._runner import EvalModel, accuracy_table, check_lengths, run_samples, task_samples

STRATEGIES = ("all_gather", "ulysses", "ring", "usp")
LAYOUTS = ("none", "zigzag", "striped")


def check_strategies(
    em: EvalModel,
    samples: Sequence[Any],
    baseline: Sequence[dict[str, Any]],
    load: Callable[..., EvalModel],
    *,
    batch_size: int = 16,
) -> dict[str, Any]:
    """Run `samples` again under every strategy and layout of the model's mesh, and on one
    device; compare each greedy output, token for token, with `baseline`'s.

    **Arguments:**

    - `em`: the model as evaluated (its spec names the mesh).
    - `samples`, `baseline`: the samples and their records from `run_samples`.
    - `load(**placement) -> EvalModel`: the same model under other placement flags
      (`strategy=`, `load_balance=`, or `devices=1, mesh=None`).
    - `batch_size`: as `run_samples`'.

    **Returns:** `{"identical": bool, "runs": [{"strategy", "load_balance", "status":
    "identical" | "differs" | "not allowed", "differing": n, "reason"?}]}`.
    """
    spec = getattr(em.model, "spec", None)
    combos: list[dict[str, Any]] = [{"devices": 1, "mesh": None, "strategy": "one device"}]
    if spec is not None:
        combos += [{"strategy": s, "load_balance": lb} for s in STRATEGIES for lb in LAYOUTS]
    want = [r["output_ids"] for r in baseline]
    runs, identical = [], True
    for combo in combos:
        placement = dict(combo)
        label = {"strategy": combo["strategy"], "load_balance": combo.get("load_balance", "-")}
        if combo["strategy"] == "one device":
            placement["strategy"] = "ring"
        try:
            other = load(**placement)
        except ValueError as e:
            runs.append({**label, "status": "not allowed", "reason": str(e)})
            continue
        got = [r["output_ids"] for r in run_samples(other, samples, batch_size=batch_size)]
        differing = sum(a != b for a, b in zip(want, got, strict=True))
        identical &= differing == 0
        status = "identical" if differing == 0 else "differs"
        runs.append({**label, "status": status, "differing": differing})
    return {"identical": identical, "runs": runs}


def evaluate_and_write(
    em: EvalModel,
    out: pathlib.Path,
    *,
    tasks: Sequence[str],
    lengths: Sequence[int],
    depths: Sequence[float],
    samples: int,
    seed: int,
    batch_size: int = 16,
    documents: Callable[[], Sequence[str]] | None = None,
    position_rows: int = 8,
    progress: bool = True,
    check: Callable[..., EvalModel] | None = None,
    say: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Run `tasks` on `em` and write `out/results.json`, `out/samples.jsonl`, one
    `out/heatmap-<task>.png` per generation task, and `out/position_loss.png`.

    **Arguments:**

    - `em`: the model.
    - `out`: the output directory (made if missing).
    - `tasks`, `lengths`, `depths`, `samples`, `seed`: what to run (`samples` per length
      and depth, from `seed`).
    - `batch_size`: prompts per `generate` call.
    - `documents`: held-out texts for `position_loss` (called only if it runs).
    - `position_rows`: rows per length of `position_loss`.
    - `progress`: show a progress bar.
    - `check`: with it, run [`check_strategies`][] (`check` loads the model under other
      placement flags).
    - `say`: where the summary lines go.

    **Returns:** what `results.json` holds: `{"model", "placement", "seed", "samples",
    "tasks": {task: accuracy table}, "position_loss"?, "check_strategies"?}`.

    **Raises:** `ValueError` for a length above the model's `max_seq_len` or below a
    task's `min_length`, and as `position_loss`.
    """
    from ._position import position_loss

    check_lengths(em, tasks, lengths)
    out.mkdir(parents=True, exist_ok=True)
    todo = task_samples(em, tasks, lengths, depths, samples, seed)
    wrap: Callable[[Any], Any] | None = None
    if progress and todo:
        from tqdm.auto import tqdm

        wrap = partial(tqdm, desc="eval", unit="task x length", file=sys.stderr)
    records = run_samples(em, todo, batch_size=batch_size, progress=wrap)
    spec = getattr(em.model, "spec", None)
    result: dict[str, Any] = {
        "model": em.name,
        "placement": "one device" if spec is None else " ".join(repr(spec).split()),
        "seed": seed,
        "samples": samples,
        "tasks": accuracy_table(records),
    }
    for task, table in result["tasks"].items():
        plot_heatmap(table, out / f"heatmap-{task}.png", title=f"{task}: {em.name}")
        say(f"{task}: {table['overall']:.1%} exact match over {sum(map(sum, table['samples']))}")
        for depth, row in zip(table["depths"], table["accuracy"], strict=True):
            cells = "  ".join(f"{n}: {a:.0%}" for n, a in zip(table["lengths"], row, strict=True))
            say(f"  depth {depth:.2f}  {cells}")
    if "position_loss" in tasks:
        curves = position_loss(em, list(documents() if documents else []), lengths,
                               rows=position_rows)  # fmt: skip
        result["position_loss"] = {str(k): v for k, v in curves.items()}
        plot_position_loss(curves, out / "position_loss.png", title=f"loss by position: {em.name}")
        for length, c in curves.items():
            say(f"position_loss {length}: first bucket {c['loss'][0]:.3f}, last "
                f"{c['loss'][-1]:.3f} nats/token")  # fmt: skip
    if check is not None and todo:
        result["check_strategies"] = check_strategies(em, todo, records, check,
                                                      batch_size=batch_size)  # fmt: skip
        for run in result["check_strategies"]["runs"]:
            extra = run.get("reason") or f"{run.get('differing', 0)} of {len(todo)} outputs differ"
            say(f"check {run['strategy']:>10} {run['load_balance']:>8}: {run['status']} ({extra})")
    with open(out / "samples.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps({k: v for k, v in r.items() if k != "output_ids"}) + "\n")
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    say(f"results: {out / 'results.json'}")
    return result
