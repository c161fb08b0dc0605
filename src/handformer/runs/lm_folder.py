"""Run folders: everything needed to use a trained model, and nothing that must be unpickled.

    RUN_DIR/
      model.safetensors   weights (tensors only)
      config.json         {"model": ModelConfig, "train": TrainConfig, ...}
      tokenizer.json      the tokenizer's vocabulary
      metrics.jsonl       one JSON object per logged / evaluated step
      summary.json, loss_curve.png, checkpoints/   written by ``lm_run`` (see checkpoint.py)

Every file is written to a temporary sibling and renamed into place, so a crash mid-save
leaves the previous file intact.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_model, save_model
from torch import nn

from handformer.config import ModelConfig, TrainConfig
from handformer.models.decoder_lm import DecoderLM
from handformer.tokenizers import Tokenizer, load_tokenizer
from handformer.atomic import atomic_write_text
from handformer.train.callbacks import MetricsWriter  # re-exported: it used to live here

__all__ = ["MetricsWriter", "RunFolderError", "load_run", "save_run"]

WEIGHTS, CONFIG, TOKENIZER, METRICS = (
    "model.safetensors", "config.json", "tokenizer.json", "metrics.jsonl")


class RunFolderError(ValueError):
    """A run folder that is missing, incomplete or damaged."""


def _atomic_save_weights(model: nn.Module, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_model(model, tmp)  # handles tied weights (stored once)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_run(
    run_dir: str | Path,
    model: nn.Module,
    model_config: ModelConfig,
    tokenizer: Tokenizer,
    train_config: TrainConfig | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config = {"model": model_config.to_dict(),
              "train": None if train_config is None else train_config.to_dict(),
              **(extra or {})}
    _atomic_save_weights(model, run_dir / WEIGHTS)
    atomic_write_text(run_dir / CONFIG, json.dumps(config, indent=2, sort_keys=True))
    tokenizer.save(run_dir / TOKENIZER)
    return run_dir


def load_run(run_dir: str | Path, *, device: str = "cpu") -> tuple[DecoderLM, Tokenizer,
                                                                     dict[str, Any]]:
    """Rebuild the model from ``config.json`` and load its weights; no pickle involved."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunFolderError(f"run folder not found: {run_dir}")
    missing = [n for n in (WEIGHTS, CONFIG, TOKENIZER) if not (run_dir / n).is_file()]
    if missing:
        raise RunFolderError(f"{run_dir} is not a complete run folder: missing {missing}")
    try:
        config = json.loads((run_dir / CONFIG).read_text(encoding="utf-8"))
        model_config = ModelConfig.from_dict(config["model"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise RunFolderError(f"{run_dir / CONFIG}: cannot read model config ({err})") from None
    try:
        tokenizer = load_tokenizer(run_dir / TOKENIZER)
    except (json.JSONDecodeError, KeyError, ValueError) as err:
        raise RunFolderError(f"{run_dir / TOKENIZER}: cannot read tokenizer ({err})") from None
    model = DecoderLM(model_config)
    try:
        load_model(model, run_dir / WEIGHTS, strict=True, device=device)
    except (SafetensorError, RuntimeError, OSError) as err:
        raise RunFolderError(f"{run_dir / WEIGHTS}: cannot load weights ({err})") from None
    model.to(device).eval()
    return model, tokenizer, config
