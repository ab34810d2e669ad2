"""What a run reports: metrics as JSON lines, the loss-curve plot drawn from them, and
the result a run ends with."""

import dataclasses
import json
import math
import pathlib
from typing import Any


class MetricsLog:
    """Append-only JSON-lines log: one object per line, each with `split` and `step`.

    **Arguments:**

    - `path`: the `.jsonl` file (created on first write).
    """

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)

    def read(self) -> list[dict[str, Any]]:
        """**Returns:** every record, in file order (a torn last line is dropped)."""
        if not self.path.exists():
            return []
        records = []
        for line in self.path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
        return records

    def truncate_after(self, step: int) -> None:
        """Keep only records with `step <= step`, so a resumed run continues the curve."""
        kept = [r for r in self.read() if r.get("step", 0) <= step]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def reset(self) -> None:
        """Delete the log."""
        self.path.unlink(missing_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record and flush it to disk."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")


def plot_metrics(records: list[dict[str, Any]], path: str | pathlib.Path, title: str = "") -> None:
    """Draw train and validation loss against step (and the learning rate), in bits per
    byte when the records have them (a byte tokenizer), else in bits per token.

    **Arguments:**

    - `records`: as read by [`MetricsLog.read`][].
    - `path`: the `.png` to write.
    - `title`: figure title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, unit = ("bpb", "bits per byte")
    if not any(r.get("bpb") is not None for r in records):
        key, unit = ("bits_per_token", "bits per token")
    train = [r for r in records if r.get("split") == "train" and r.get(key) is not None]
    val = [r for r in records if r.get("split") == "val" and r.get(key) is not None]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        steps = [r["step"] for r in train]
        bits = [r[key] for r in train]
        ax.plot(steps, bits, color="tab:blue", alpha=0.3, lw=0.8)
        ax.plot(steps, _ema(bits, 0.9), color="tab:blue", lw=1.6, label="train (EMA 0.9)")
    if val:
        ax.plot(
            [r["step"] for r in val],
            [r[key] for r in val],
            "o-",
            color="tab:orange",
            lw=1.6,
            label="validation",
        )
    ax.set_xlabel("step")
    ax.set_ylabel(unit)
    ax.grid(alpha=0.3)
    if train and any(r.get("lr") is not None for r in train):
        lr_ax = ax.twinx()
        lr_ax.plot(
            [r["step"] for r in train],
            [math.nan if r.get("lr") is None else r["lr"] for r in train],
            color="gray",
            lw=0.8,
            ls="--",
            label="learning rate",
        )
        lr_ax.set_ylabel("learning rate", color="gray")
    if train or val:
        ax.legend(loc="upper right")
    ax.set_title(title)
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _ema(values: list[float], decay: float) -> list[float]:
    out, avg = [], None
    for v in values:
        avg = v if avg is None else decay * avg + (1 - decay) * v
        out.append(avg)
    return out


def describe_loss(record: dict[str, Any]) -> str:
    """**Returns:** e.g. `"1.2345 nats/token, 1.7810 bits/token, 1.7902 bits/byte"` (bits
    per byte only when the record has them: a byte tokenizer)."""
    text = f"{record['loss']:.4f} nats/token, {record['bits_per_token']:.4f} bits/token"
    if record.get("bpb") is not None:
        text += f", {record['bpb']:.4f} bits/byte"
    return text


@dataclasses.dataclass
class TrainResult:
    """What a run ended with.

    - `status`: `"completed"`, `"nonfinite"` (stopped by `on_nonfinite="stop"`),
      `"interrupted"` (stopped early by `run(stop_at=...)`), `"preempted"` (stopped by
      SIGTERM at a step boundary, with a checkpoint saved at `step`) or `"nothing_to_do"`
      (resumed at or past `config.steps`: nothing trained, see `Trainer.nothing_to_do`).
    - `step`: completed steps (a step that stopped the run does not count);
      `skipped_steps`: updates dropped as non-finite by `on_nonfinite="skip"`.
    - `wall_time`: seconds, including earlier segments of a resumed run.
    - `val`: the last validation record (see `evaluate`: `loss` in nats per token,
      `bits_per_token`, and for a byte tokenizer `bpb`), or `None`.
    - `model`, `opt_state`: the final (last finite) state.
    - `metrics_path`, `plot_path`, `checkpoint_dir`, `checkpoint_steps`: where things are.
    """

    status: str
    step: int
    skipped_steps: int
    wall_time: float
    val: dict[str, float] | None
    model: Any
    opt_state: Any
    metrics_path: pathlib.Path
    plot_path: pathlib.Path
    checkpoint_dir: pathlib.Path
    checkpoint_steps: list[int]

    def summary(self) -> str:
        """**Returns:** a few human-readable lines about the run."""
        val = "n/a" if self.val is None else describe_loss(self.val)
        return "\n".join(
            [
                f"status:        {self.status}",
                f"steps:         {self.step} ({self.skipped_steps} skipped as non-finite)",
                f"wall time:     {self.wall_time:.1f} s",
                f"val loss:      {val}",
                f"metrics:       {self.metrics_path}",
                f"loss curve:    {self.plot_path}",
                f"checkpoints:   {self.checkpoint_dir} (steps {self.checkpoint_steps})",
            ]
        )
