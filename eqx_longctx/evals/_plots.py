"""The evals' pictures: the depth x length heatmap of a retrieval task, and the loss by
position curve."""

import pathlib
from typing import Any


def _figure(size: tuple[float, float]):
    """A figure not tied to pyplot (no backend is switched, so a notebook's inline plots
    keep working)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    return fig, fig.subplots()


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def plot_heatmap(table: dict[str, Any], path: str | pathlib.Path, title: str = "") -> None:
    """Draw one task's accuracy as the needle plot people know: depth (rows, 0 at the top)
    against length (columns), green for found, red for missed, each cell labelled.

    **Arguments:**

    - `table`: one task's entry of `accuracy_table` (`lengths`, `depths`, `accuracy`).
    - `path`: the PNG to write.
    - `title`: the figure's title.
    """
    import numpy as np

    lengths, depths = table["lengths"], table["depths"]
    acc = np.array([[np.nan if a is None else a for a in row] for row in table["accuracy"]], float)
    fig, ax = _figure((max(4.5, 2.2 + 0.9 * len(lengths)), max(3.0, 1.4 + 0.45 * len(depths))))
    image = ax.imshow(acc, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)), [_tokens(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth (0% = start)")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if not np.isnan(acc[i, j]):
                ax.text(j, i, f"{acc[i, j]:.0%}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="exact-match accuracy")
    ax.set_title(title or "retrieval accuracy", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_position_loss(
    curves: dict[int, dict[str, Any]], path: str | pathlib.Path, title: str = ""
) -> None:
    """Draw `position_loss`'s curves: mean loss (nats per token) against the middle of
    each position bucket, one line per length, log-scaled positions.

    **Arguments:**

    - `curves`: `position_loss`'s result (`{length: {"bucket_start", "bucket_end",
      "loss"}}`).
    - `path`: the PNG to write.
    - `title`: the figure's title.
    """
    fig, ax = _figure((6, 3.6))
    for length, c in sorted(curves.items()):
        middle = [(a + b) / 2 for a, b in zip(c["bucket_start"], c["bucket_end"], strict=True)]
        ax.plot(middle, c["loss"], marker="o", markersize=3, label=f"{_tokens(length)} tokens")
    ax.set_xscale("log")
    ax.set_xlabel("position in the sequence (tokens)")
    ax.set_ylabel("mean loss (nats per token)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "loss by position", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
