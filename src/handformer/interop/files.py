"""A Hugging Face folder's files, read with errors that name the file.

A damaged ``config.json`` or ``model.safetensors`` is a ``ConversionError`` saying which file
and what is wrong with it. Read bare, the first gave only the JSON parser's "Expecting
property name ... line 1 column 2" (no file named) and the second a ``SafetensorError``
traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from handformer.interop.errors import ConversionError

__all__ = ["INDEX_FILE", "read_config", "read_folder_weights", "read_weights"]

INDEX_FILE = "model.safetensors.index.json"  # how the Hub shards a large checkpoint


def read_config(path: Path, what: str = "the model config") -> dict[str, Any]:
    """The JSON object in ``path`` (a ``config.json``, or the ``what`` named in errors: e.g.
    a ``tokenizer.json``); ``ConversionError`` for unreadable text or another type."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConversionError(f"{path}: cannot read {what} ({err})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_weights(path: Path) -> dict[str, Tensor]:
    """Every tensor in the safetensors file ``path``."""
    try:
        return load_file(path)
    except (SafetensorError, OSError) as err:
        raise ConversionError(f"{path}: cannot read the weights ({err}); the file is "
                              "damaged or not a safetensors file") from None


def _shard_files(folder: Path) -> list[Path]:
    """The shards ``model.safetensors.index.json`` names: plain file names inside ``folder``
    (an index is a file someone else wrote: ``../`` or an absolute path is refused), each
    present."""
    index_path = folder / INDEX_FILE
    index = read_config(index_path, "the shard index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConversionError(f"{index_path}: no 'weight_map' object naming each tensor's file")
    names = sorted({str(v) for v in weight_map.values()})
    for name in names:
        if Path(name).name != name or name in (".", ".."):
            raise ConversionError(f"{index_path}: shard {name!r} is not a file name inside "
                                  f"{folder}")
        if not (folder / name).is_file():
            raise ConversionError(f"{index_path} names the shard {name}, which is missing "
                                  f"from {folder}")
    return [folder / name for name in names]


def read_folder_weights(folder: Path) -> dict[str, Tensor]:
    """Every tensor of a Hugging Face folder, as the Hub serves it: ``model.safetensors``,
    shards listed by ``model.safetensors.index.json``, or ``pytorch_model.bin`` (read with
    ``weights_only=True``: no arbitrary objects unpickled). bf16 and fp16 tensors are widened
    to fp32 one at a time, as they are read; other dtypes are kept (for the callers' checks)."""
    single, binary = folder / "model.safetensors", folder / "pytorch_model.bin"
    if single.is_file():
        files = [single]
    elif (folder / INDEX_FILE).is_file():
        files = _shard_files(folder)
    elif binary.is_file():
        try:
            state = torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as err:  # pickle refusals and corrupt files surface as many types
            raise ConversionError(f"{binary}: refused or unreadable ({err})") from None
        if not isinstance(state, dict):
            raise ConversionError(f"{binary}: expected a dict of tensors, got "
                                  f"{type(state).__name__}")
        return {k: _widen(v) for k, v in state.items()}
    else:
        raise ConversionError(f"{folder} has no model.safetensors, {INDEX_FILE} or "
                              "pytorch_model.bin")
    state: dict[str, Tensor] = {}
    for path in files:
        for key, tensor in read_weights(path).items():
            if key in state:
                raise ConversionError(f"{path}: tensor {key!r} is stored in two shards")
            state[key] = _widen(tensor)
    return state


def _widen(tensor: Any) -> Any:
    """A half-precision float tensor → fp32 (handformer's weights); anything else unchanged."""
    if isinstance(tensor, Tensor) and tensor.dtype in (torch.bfloat16, torch.float16):
        return tensor.float()
    return tensor
