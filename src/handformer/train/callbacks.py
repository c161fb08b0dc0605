"""Trainer callbacks for what a person watches: the metrics file, the loss-curve PNG, and
TensorBoard. Each implements any of ``on_log``, ``on_eval`` and ``on_end``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from handformer.atomic import atomic_write_text
from handformer.train.plots import plot_loss_curve, read_metrics

__all__ = [
    "LossCurvePlot", "MetricsWriter", "MissingExtraError", "TensorBoardLogger",
    "require_tensorboard",
]


class MissingExtraError(ImportError):
    """An optional feature was asked for but its package is not installed."""


def _jsonable(metrics: dict[str, Any]) -> dict[str, Any]:
    """NaN/Inf are not JSON: write them as null so every line stays parseable."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in metrics.items()}


class MetricsWriter:
    """One JSON line per log and evaluation event, appended and flushed as it happens.

    ``resume_step=None`` starts an empty file; a step keeps the records up to that step (the
    checkpoint being resumed) and drops the ones a killed run wrote after it, so the file
    continues as if the run had never stopped.
    """

    def __init__(self, path: str | Path, *, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            atomic_write_text(self.path, "")
        else:
            kept = [r for r in read_metrics(self.path)
                    if isinstance(r.get("step"), int) and r["step"] <= resume_step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def write(self, kind: str, metrics: dict[str, Any]) -> None:
        """Append one record ``{"kind": kind, **metrics}`` (NaN/Inf written as null)."""
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps({"kind": kind, **_jsonable(metrics)}) + "\n")

    def on_log(self, step: int, metrics: dict[str, Any]) -> None:
        self.write("train", metrics)

    def on_eval(self, step: int, metrics: dict[str, Any]) -> None:
        self.write("eval", metrics)


class LossCurvePlot:
    """Redraws ``loss_curve.png`` from ``metrics.jsonl`` at every evaluation, so the picture
    covers the whole run, resumed parts included."""

    def __init__(self, metrics_path: str | Path, png_path: str | Path, *,
                 title: str = "loss") -> None:
        self.metrics_path = Path(metrics_path)
        self.png_path = Path(png_path)
        self.title = title

    def on_eval(self, step: int, metrics: dict[str, Any]) -> None:
        plot_loss_curve(read_metrics(self.metrics_path), self.png_path, title=self.title)

    def on_end(self, result: Any) -> None:
        plot_loss_curve(read_metrics(self.metrics_path), self.png_path, title=self.title)


def require_tensorboard() -> Any:
    """``SummaryWriter``, or a ``MissingExtraError`` saying how to install it."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise MissingExtraError(
            "--tensorboard needs the 'tensorboard' package, which is not installed "
            f"({err}). Install it with: pip install 'handformer[tensorboard]'") from None
    return SummaryWriter


class TensorBoardLogger:
    """Scalars under ``train/`` and ``val/``. Needs the optional ``tensorboard`` package;
    ``resume_step`` drops events a killed run wrote after its last checkpoint."""

    def __init__(self, log_dir: str | Path, *, resume_step: int | None = None) -> None:
        summary_writer = require_tensorboard()
        # Events after the checkpoint's step came from the killed run: purge them.
        purge = None if resume_step is None else resume_step + 1
        self.writer = summary_writer(log_dir=str(log_dir), purge_step=purge)

    def _scalars(self, prefix: str, step: int, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def on_log(self, step: int, metrics: dict[str, Any]) -> None:
        self._scalars("train", step, metrics)

    def on_eval(self, step: int, metrics: dict[str, Any]) -> None:
        self._scalars("val", step, metrics)
        self.writer.flush()

    def on_end(self, result: Any) -> None:
        self.writer.close()
