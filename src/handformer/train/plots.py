"""The loss-curve PNG: train and validation loss against step, drawn from ``metrics.jsonl``.

Uses matplotlib's object API with the Agg canvas, never ``pyplot``: no display, no global
backend switch, safe in a headless job. Imported lazily, so ``import handformer`` stays fast.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from handformer.atomic import atomic_write_bytes

__all__ = ["plot_loss_curve", "read_metrics", "save_figure"]


def save_figure(fig: Any, path: str | Path, *, dpi: int | None = None) -> None:
    """Render a matplotlib figure to PNG and write it atomically (never a half-drawn file)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    atomic_write_bytes(path, buf.getvalue())


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl``; a torn last line (a crash mid-write) is skipped."""
    records = []
    path = Path(path)
    if not path.is_file():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _points(records: Iterable[dict[str, Any]], kind: str, key: str) -> tuple[list, list]:
    xs, ys = [], []
    for r in records:
        value = r.get(key)
        if r.get("kind") == kind and isinstance(value, int | float) and math.isfinite(value):
            xs.append(r["step"])
            ys.append(value)
    return xs, ys


def plot_loss_curve(records: Iterable[dict[str, Any]], path: str | Path, *,
                    title: str = "loss") -> None:
    """Write a PNG of train loss (``kind == "train"``) and validation loss (``"eval"``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = list(records)
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for kind, key, label, style in (("train", "loss", "train", "-"),
                                    ("eval", "val_loss", "validation", "o-")):
        xs, ys = _points(records, kind, key)
        if xs:
            ax.plot(xs, ys, style, label=label, markersize=3, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    save_figure(fig, path)
