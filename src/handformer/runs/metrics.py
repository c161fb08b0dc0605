"""A run's ``metrics.jsonl`` read back as a loss curve, forgiving torn or foreign lines."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LossCurve", "read_loss_curve"]


@dataclass
class LossCurve:
    """Points of ``metrics.jsonl``: train loss per logged step, validation loss per eval."""

    train: list[tuple[int, float]] = field(default_factory=list)
    val: list[tuple[int, float]] = field(default_factory=list)
    skipped_lines: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"train": [list(p) for p in self.train], "val": [list(p) for p in self.val],
                "skipped_lines": self.skipped_lines}



def _finite_number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def read_loss_curve(path: str | Path) -> LossCurve:
    """Parse ``metrics.jsonl``. A missing file gives an empty curve; torn or foreign lines
    (a crash mid-write, an unknown record) are counted in ``skipped_lines``, not fatal."""
    curve = LossCurve()
    path = Path(path)
    if not path.is_file():
        return curve
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            curve.skipped_lines += 1
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            curve.skipped_lines += 1
            continue
        step, kind = record["step"], record.get("kind")
        if kind == "train" and _finite_number(record.get("loss")):
            curve.train.append((step, float(record["loss"])))
        elif kind == "eval" and _finite_number(record.get("val_loss")):
            curve.val.append((step, float(record["val_loss"])))
    return curve
