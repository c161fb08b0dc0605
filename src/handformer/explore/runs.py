"""Open a run folder for exploring: the model, its tokenizer, its config and its loss curve.

Two kinds of run:

* ``"lm"`` — a language-model run written by ``handformer train`` (``config.json`` holds
  ``{"model": ModelConfig, ...}``); loaded through ``train.run_folder.load_run``.
* ``"classifier"`` — an encoder classifier run, in the layout ``handformer classify train``
  writes: ``config.json`` holds ``{"classifier": ClassifierConfig, ...}`` and
  ``labels.json`` ``{"labels": [...]}`` in class-id order. The weights are read from
  ``model.safetensors`` (no unpickling) into ``handformer.models.encoder.EncoderClassifier``.
  Without ``labels.json`` the classes are called ``class 0`` … ``class K-1``.

Nothing here trains or writes: a run folder is only read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torch import nn

from handformer.tokenizers import Tokenizer, load_tokenizer
from handformer.train.run_folder import RunFolderError, load_run

__all__ = ["ExploreRun", "LossCurve", "RunFolderError", "load_explore_run", "read_loss_curve"]

RunKind = Literal["lm", "classifier"]
WEIGHTS, CONFIG, TOKENIZER, METRICS, SUMMARY, LABELS = (
    "model.safetensors", "config.json", "tokenizer.json", "metrics.jsonl", "summary.json",
    "labels.json")


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


def _classifier_section(config: dict[str, Any]) -> dict[str, Any] | None:
    section = config.get("classifier")
    return section if isinstance(section, dict) else None


def _labels(run_dir: Path, num_classes: int) -> list[str]:
    path = run_dir / LABELS
    if not path.is_file():
        return [f"class {i}" for i in range(num_classes)]
    found = _read_json(path).get("labels")
    if not isinstance(found, list) or len(found) != num_classes:
        raise RunFolderError(f"{path}: expected {{\"labels\": [...]}} with {num_classes} "
                             f"labels, one per class; got {found!r:.200}")
    return [str(label) for label in found]


def _load_classifier(run_dir: Path, config: dict[str, Any], section: dict[str, Any],
                     device: str) -> tuple[nn.Module, Tokenizer, Any, list[str], str]:
    try:
        from handformer.models.encoder import ClassifierConfig, EncoderClassifier
    except ImportError as err:
        raise RunFolderError(f"{run_dir} is a classifier run, but this handformer has no "
                             f"encoder classifier (handformer.models.encoder: {err})") from None
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    try:
        cfg = ClassifierConfig.from_dict(section)
    except (KeyError, TypeError, ValueError) as err:
        raise RunFolderError(f"{run_dir / CONFIG}: cannot read classifier config ({err})"
                             ) from None
    try:
        tokenizer = load_tokenizer(run_dir / TOKENIZER)
    except (json.JSONDecodeError, KeyError, ValueError) as err:
        raise RunFolderError(f"{run_dir / TOKENIZER}: cannot read tokenizer ({err})") from None
    model = EncoderClassifier(cfg)
    try:
        load_model(model, run_dir / WEIGHTS, strict=True, device=device)
    except (SafetensorError, RuntimeError, OSError) as err:
        raise RunFolderError(f"{run_dir / WEIGHTS}: cannot load weights ({err})") from None
    model.to(device).eval()
    return model, tokenizer, cfg.encoder, _labels(run_dir, cfg.num_classes), cfg.pooling


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
    section = _classifier_section(config)
    if section is not None:
        model, tokenizer, model_cfg, labels, pooling = _load_classifier(
            run_dir, config, section, device)
        return ExploreRun(run_dir, "classifier", model, tokenizer, config, model_cfg, curve,
                          summary, labels, pooling)
    model, tokenizer, config = load_run(run_dir, device=device)
    return ExploreRun(run_dir, "lm", model, tokenizer, config, model.config, curve, summary)
