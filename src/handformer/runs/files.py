"""The files of a run folder, written whole or not at all, read without unpickling.

Every writer goes through a temporary sibling and a rename (``handformer.atomic``), so a
crash mid-save leaves the previous file intact; every reader takes safetensors and JSON
only. A folder that is missing, incomplete or damaged raises ``RunFolderError`` naming the
file and what is wrong with it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_model, save_file, save_model
from torch import Tensor, nn

from handformer.atomic import atomic_write_text, fsync_dir, fsync_file
from handformer.train.checkpoint import first_nonfinite

__all__ = [
    "CONFIG", "LABELS", "METRICS", "SUMMARY", "TOKENIZER", "WEIGHTS", "RunFolderError",
    "check_run_dir", "load_weights", "read_json", "save_weights", "write_json",
]

WEIGHTS, CONFIG, TOKENIZER, LABELS, METRICS, SUMMARY = (
    "model.safetensors", "config.json", "tokenizer.json", "labels.json", "metrics.jsonl",
    "summary.json")


class RunFolderError(ValueError):
    """A run folder that is missing, incomplete, damaged or of another kind."""


def save_weights(model: nn.Module, path: Path, *,
                 only: dict[str, Tensor] | None = None) -> None:
    """``model.safetensors`` via a temporary sibling + rename (tied weights stored once);
    with ``only``, just those tensors (a LoRA run's adapters). Weights holding NaN or Inf are
    refused (``RunFolderError``) before anything is written: they must never replace a run's
    good weights."""
    bad = first_nonfinite(model.state_dict() if only is None else only)
    if bad is not None:
        raise RunFolderError(f"{path}: not written: the weight {bad!r} holds NaN or Inf (the "
                             "model diverged); the file there, if any, is left as it was")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        if only is None:
            save_model(model, tmp)
        else:
            save_file({k: v.detach().contiguous() for k, v in only.items()}, tmp,
                      metadata={"format": "pt"})
        fsync_file(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def load_weights(model: nn.Module, path: Path, *, device: str = "cpu") -> None:
    """Every tensor of ``model`` from ``path``, strictly (no missing or unexpected names)."""
    try:
        load_model(model, path, strict=True, device=device)
    except (SafetensorError, RuntimeError, OSError) as err:
        raise RunFolderError(f"{path}: cannot load weights ({err})") from None


def write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True))


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; ``RunFolderError`` for unreadable text or another type."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RunFolderError(f"{path}: cannot read JSON ({err})") from None
    if not isinstance(data, dict):
        raise RunFolderError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def check_run_dir(run_dir: str | Path, required: tuple[str, ...]) -> Path:
    """The folder as a Path, or a ``RunFolderError`` naming what is missing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunFolderError(f"run folder not found: {run_dir}")
    missing = [name for name in required if not (run_dir / name).is_file()]
    if missing:
        raise RunFolderError(f"{run_dir} is not a complete run folder: missing {missing}")
    return run_dir
