"""Files of a classifier or seq2seq run folder: weights and JSON, written atomically.

Each file is written to a temporary sibling and renamed into place, so a crash during a save
never leaves a half-written file; loading reads safetensors and JSON only, never a pickle.
(The decoder LM's run folder is ``train/run_folder.py``; this is the same pattern for the
models of ``models/encoder.py`` and ``models/seq2seq.py``.)
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

from handformer.atomic import atomic_write_text

__all__ = ["JsonlLog", "RunFilesError", "check_run_dir", "load_weights", "read_json",
           "save_weights", "write_json"]


class RunFilesError(ValueError):
    """A run folder that is missing, incomplete or damaged."""


def save_weights(model: nn.Module, path: Path) -> None:
    """``model.safetensors`` via a temporary sibling + rename (tied weights stored once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_model(model, tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_weights(model: nn.Module, path: Path, *, device: str = "cpu") -> None:
    try:
        load_model(model, path, strict=True, device=device)
    except (SafetensorError, RuntimeError, OSError) as err:
        raise RunFilesError(f"{path}: cannot load weights ({err})") from None


def write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True))


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise RunFilesError(f"{path}: cannot read JSON ({err})") from None


def check_run_dir(run_dir: str | Path, required: tuple[str, ...]) -> Path:
    """The folder as a Path, or a ``RunFilesError`` naming what is missing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunFilesError(f"run folder not found: {run_dir}")
    missing = [name for name in required if not (run_dir / name).is_file()]
    if missing:
        raise RunFilesError(f"{run_dir} is not a complete run folder: missing {missing}")
    return run_dir


class JsonlLog:
    """One JSON object per line, appended and flushed as it happens (``metrics.jsonl``)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("", encoding="utf-8")

    def write(self, kind: str, metrics: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps({"kind": kind, **metrics}) + "\n")
