"""Open a run folder for exploring: the model, its tokenizer, its config and its loss curve.

Two kinds of run:

* ``"lm"`` — a language-model run written by ``handformer train`` (``config.json`` holds
  ``{"model": ModelConfig, ...}``); loaded through ``train.run_folder.load_run``.
* ``"classifier"`` — an encoder classifier run written by ``handformer classify train``
  (``config.json`` holds ``{"classifier": ClassifierConfig, ...}``, plus ``labels.json``);
  recognised by that key and loaded through ``classify_run.load_classifier_run``.

Nothing here trains or writes: a run folder is only read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torch import nn

from handformer.tokenizers import Tokenizer
from handformer.runs.lm_folder import RunFolderError, load_run

__all__ = ["ExploreRun", "LossCurve", "RunFolderError", "load_explore_run", "read_loss_curve"]

RunKind = Literal["lm", "classifier"]
WEIGHTS, CONFIG, TOKENIZER, METRICS, SUMMARY = (
    "model.safetensors", "config.json", "tokenizer.json", "metrics.jsonl", "summary.json")


@dataclass
class LossCurve:
    """Points of ``metrics.jsonl``: train loss per logged step, validation loss per eval."""

    train: list[tuple[int, float]] = field(default_factory=list)
    val: list[tuple[int, float]] = field(default_factory=list)
    skipped_lines: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"train": [list(p) for p in self.train], "val": [list(p) for p in self.val],
                "skipped_lines": self.skipped_lines}


@dataclass
class ExploreRun:
    """A loaded run. ``model`` is in eval mode; ``labels`` is empty for an LM run."""

    run_dir: Path
    kind: RunKind
    model: nn.Module
    tokenizer: Tokenizer
    config: dict[str, Any]
    model_config: Any  # ModelConfig of the attention stack (the encoder's for a classifier)
    loss_curve: LossCurve
    summary: dict[str, Any] | None = None
    labels: list[str] = field(default_factory=list)
    pooling: str | None = None


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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RunFolderError(f"{path}: cannot read JSON ({err})") from None
    if not isinstance(data, dict):
        raise RunFolderError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _load_classifier(run_dir: Path, device: str) -> tuple[nn.Module, Tokenizer, Any,
                                                         list[str], str]:
    """Model, tokenizer, encoder ModelConfig, labels and pooling of a classifier run."""
    from handformer.jobs.classify import load_classifier_run

    try:
        loaded = load_classifier_run(run_dir, device=device)
    except ValueError as err:  # DatasetError / RunFilesError, each naming the file
        raise RunFolderError(str(err)) from None
    cfg = loaded.model.config
    return loaded.model, loaded.tokenizer, cfg.encoder, list(loaded.labels.labels), cfg.pooling


def load_explore_run(run_dir: str | Path, *, device: str = "cpu") -> ExploreRun:
    """Load an LM or classifier run folder; ``RunFolderError`` says what is missing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunFolderError(f"run folder not found: {run_dir}")
    missing = [n for n in (WEIGHTS, CONFIG, TOKENIZER) if not (run_dir / n).is_file()]
    if missing:
        raise RunFolderError(f"{run_dir} is not a complete run folder: missing {missing}")
    config = _read_json(run_dir / CONFIG)
    summary_path = run_dir / SUMMARY
    summary = _read_json(summary_path) if summary_path.is_file() else config.get("summary")
    curve = read_loss_curve(run_dir / METRICS)
    if isinstance(config.get("classifier"), dict):
        model, tokenizer, model_cfg, labels, pooling = _load_classifier(run_dir, device)
        return ExploreRun(run_dir, "classifier", model, tokenizer, config, model_cfg, curve,
                          summary, labels, pooling)
    if not isinstance(config.get("model"), dict):
        detail = ("it is a seq2seq run, which the explorer does not show (yet)"
                  if "seq2seq" in config else f"its top-level keys are {sorted(config)}")
        raise RunFolderError(f"{run_dir / CONFIG} describes neither a language model ('model') "
                             f"nor a classifier ('classifier'): {detail}")
    model, tokenizer, config = load_run(run_dir, device=device)
    return ExploreRun(run_dir, "lm", model, tokenizer, config, model.config, curve, summary)
