"""A run folder opened for exploring: the loaded run (``handformer.runs.load_run``) plus what
the page shows beside the model — its loss curve, its summary, its labels.

Language-model and classifier runs can be explored; a seq2seq run is refused by name
(``RunFolderError``).
Nothing here trains or writes: a run folder is only read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torch import nn

from handformer.runs import load_run
from handformer.runs.files import METRICS, SUMMARY, read_json
from handformer.runs.metrics import LossCurve, read_loss_curve
from handformer.tokenizers import Tokenizer

__all__ = ["ExploreRun", "load_explore_run"]


@dataclass
class ExploreRun:
    """A loaded run. ``model`` is in eval mode; ``labels`` is empty for an LM run."""

    run_dir: Path
    kind: Literal["lm", "classifier"]
    model: nn.Module
    tokenizer: Tokenizer
    config: dict[str, Any]
    model_config: Any  # ModelConfig of the attention stack (the encoder's for a classifier)
    loss_curve: LossCurve
    summary: dict[str, Any] | None = None
    labels: list[str] = field(default_factory=list)
    pooling: str | None = None


def load_explore_run(run_dir: str | Path, *, device: str = "cpu") -> ExploreRun:
    """Load an LM or classifier run folder; ``RunFolderError`` says what is missing."""
    run = load_run(run_dir, device=device, kind=("lm", "classifier"))
    summary_path = run.run_dir / SUMMARY
    summary = read_json(summary_path) if summary_path.is_file() else run.config.get("summary")
    curve = read_loss_curve(run.run_dir / METRICS)
    if run.kind == "classifier":
        cfg = run.model.config  # ClassifierConfig
        assert run.labels is not None
        return ExploreRun(run.run_dir, "classifier", run.model, run.tokenizer, run.config,
                          cfg.encoder, curve, summary, list(run.labels.labels), cfg.pooling)
    return ExploreRun(run.run_dir, "lm", run.model, run.tokenizer, run.config,
                      run.model.config, curve, summary)
