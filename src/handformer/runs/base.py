"""Runs that start from another model: the base they record, and LoRA runs that store only
their adapters.

A fine-tuned run folder's ``config.json`` names its base under ``"base"``: the folder's
resolved path and the SHA-256 of its ``model.safetensors``. A run trained with LoRA also holds
``"lora"`` (rank, alpha, dropout, targets and the ``trainable`` parameters besides the
adapters, such as a new classification head), and its ``model.safetensors`` holds only those
tensors; every load rebuilds the model from the base, checks that the base's weights are
still the ones the run started from (a changed base would silently be another model), puts
the adapters on and loads them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from handformer.models.encoder import EncoderClassifier
from handformer.nn.lora import LoRAConfig, LoRAError, apply_lora, lora_state_dict
from handformer.runs.files import CONFIG, WEIGHTS, RunFolderError

__all__ = ["BASE_KEY", "LORA_KEY", "base_record", "check_base", "copy_base_weights",
           "load_adapter", "lora_from_config", "weights_sha256"]

BASE_KEY = "base"
LORA_KEY = "lora"


def weights_sha256(folder: str | Path) -> str:
    """SHA-256 of ``folder/model.safetensors``, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(Path(folder) / WEIGHTS, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def base_record(folder: str | Path, kind: str) -> dict[str, Any]:
    """What a run records of the base it started from."""
    folder = Path(folder).resolve()
    return {"path": str(folder), "sha256": weights_sha256(folder), "kind": kind}


def check_base(record: Any, where: Path) -> Path:
    """The recorded base folder, once its weights are known to be unchanged; otherwise one
    ``RunFolderError`` naming ``where`` (the config that records it) and the base."""
    if not isinstance(record, dict) or not isinstance(record.get("path"), str):
        raise RunFolderError(f"{where}: {BASE_KEY!r} must record the base folder's path and "
                             f"weights hash; got {record!r}")
    folder = Path(record["path"])
    if not (folder / WEIGHTS).is_file() or not (folder / CONFIG).is_file():
        raise RunFolderError(f"{where}: its base {folder} is gone or is not a run folder (no "
                             f"{WEIGHTS} / {CONFIG}); this run stores only its adapters and "
                             "needs that base back")
    now = weights_sha256(folder)
    if now != record.get("sha256"):
        raise RunFolderError(f"{where}: the weights of its base {folder / WEIGHTS} changed since "
                             f"the run started (sha256 {str(record.get('sha256'))[:12]}… then, "
                             f"{now[:12]}… now); its adapters belong to the old weights")
    return folder


def lora_from_config(config: dict[str, Any], where: Path) -> tuple[LoRAConfig, list[str]]:
    """(the LoRA recipe, the trainable prefixes) a run's ``config.json`` records."""
    record = config.get(LORA_KEY)
    try:
        assert isinstance(record, dict)
        trainable = [str(p) for p in record.get("trainable", [])]
        return LoRAConfig.from_dict(record), trainable
    except (AssertionError, KeyError, TypeError, ValueError) as err:
        raise RunFolderError(f"{where}: {LORA_KEY!r} is not a LoRA recipe ({err})") from None


def copy_base_weights(model: nn.Module, base: nn.Module) -> None:
    """Fill ``model``'s trunk with ``base``'s weights: an LM from an LM, a classifier's
    encoder from an encoder, an LM (its body, without the vocabulary head) or another
    classifier (its encoder; the new head stays as it is)."""
    target = model.encoder if isinstance(model, EncoderClassifier) else model
    source = base.encoder if isinstance(base, EncoderClassifier) else base
    state = dict(source.state_dict())
    if target is not model:  # a classifier's trunk has no vocabulary head
        state.pop("lm_head.weight", None)
    missing, unexpected = target.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RunFolderError(f"the base's weights do not fit this model: missing "
                             f"{sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}")


def load_adapter(model: nn.Module, lora: LoRAConfig, trainable: list[str], path: Path,
                 device: str = "cpu") -> None:
    """Put LoRA on ``model`` and load its adapters (and trainable tensors) from ``path``:
    exactly the names ``lora_state_dict`` gives, no more, no fewer."""
    try:
        apply_lora(model, lora, trainable=trainable)
    except LoRAError as err:
        raise RunFolderError(f"{path.parent / CONFIG}: {err}") from None
    expected = lora_state_dict(model, trainable=trainable)
    try:
        stored = load_file(str(path), device=device)
    except (SafetensorError, OSError) as err:
        raise RunFolderError(f"{path}: cannot read the adapters ({err})") from None
    missing, unexpected = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
    if missing or unexpected:
        raise RunFolderError(f"{path}: the adapters do not fit the recorded LoRA recipe: missing "
                             f"{missing[:4]}, unexpected {unexpected[:4]}")
    for name, tensor in stored.items():
        if tuple(tensor.shape) != tuple(expected[name].shape) or not tensor.is_floating_point():
            raise RunFolderError(f"{path}: {name} is {tensor.dtype} {tuple(tensor.shape)}; the "
                                 f"recipe needs {tuple(expected[name].shape)} floats")
    with torch.no_grad():
        own = dict(model.state_dict(keep_vars=True))
        for name, tensor in stored.items():
            own[name].copy_(tensor)
