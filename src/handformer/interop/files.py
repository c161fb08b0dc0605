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

from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from handformer.interop.gpt2 import ConversionError

__all__ = ["read_config", "read_weights"]


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
