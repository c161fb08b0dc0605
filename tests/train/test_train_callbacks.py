"""What a person watches: metrics.jsonl (continued on resume), the loss-curve PNG, and the
optional TensorBoard logger with a clear error when its package is missing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from handformer.train.callbacks import (
    LossCurvePlot,
    MetricsWriter,
    MissingExtraError,
    TensorBoardLogger,
)
from handformer.train.plots import plot_loss_curve, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_metrics_writer_starts_empty_and_writes_nan_as_null(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n')
    writer = MetricsWriter(path)
    assert path.read_text() == ""
    writer.on_log(1, {"step": 1, "loss": float("nan"), "lr": 0.1})
    writer.on_eval(1, {"step": 1, "val_loss": 2.0})
    lines = [json.loads(line) for line in path.read_text().splitlines()]  # strict JSON
    assert lines == [{"kind": "train", "step": 1, "loss": None, "lr": 0.1},
                     {"kind": "eval", "step": 1, "val_loss": 2.0}]


def test_metrics_writer_resume_keeps_history_up_to_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    records = [{"kind": "train", "step": s, "loss": 1.0 / s} for s in range(1, 8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "tr')  # torn
    writer = MetricsWriter(path, resume_step=5)
    assert read_metrics(path) == records[:5]
    writer.on_log(6, {"step": 6, "loss": 0.5})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5, 6]


def test_loss_curve_png_is_written_from_the_metrics(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"kind": "train", "step": s, "loss": 3.0 / s} for s in range(1, 20)]
    rows += [{"kind": "eval", "step": s, "val_loss": 3.2 / s} for s in (5, 10, 15)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = tmp_path / "loss_curve.png"
    LossCurvePlot(metrics, png).on_eval(15, {})
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss_curve.png", "metrics.jsonl"]
    plot_loss_curve([], tmp_path / "empty.png")  # nothing to draw is not an error
    assert (tmp_path / "empty.png").read_bytes().startswith(PNG_MAGIC)


def test_tensorboard_missing_gives_install_hint(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now fails
    with pytest.raises(MissingExtraError, match=r"pip install 'handformer\[tensorboard\]'"):
        TensorBoardLogger(tmp_path / "tb")
    assert not (tmp_path / "tb").exists()


def test_tensorboard_logger_writes_events(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(tmp_path / "tb")
    logger.on_log(1, {"step": 1, "loss": 2.5, "skipped": True})
    logger.on_eval(1, {"step": 1, "val_loss": 2.4})
    logger.on_end(None)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
