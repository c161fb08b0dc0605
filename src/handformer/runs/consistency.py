"""Do a run folder's files belong together? Checked at every load, before the weights are read.

A run folder is three files written by one job, but nothing stops a person from copying in
another run's ``tokenizer.json`` or ``model.safetensors``. Loaded anyway, the mismatch shows up
far from its cause: ids past the embedding (an HTTP 500 in the explorer, a conversion that
"succeeds"), training resumed on text mapped to ``<unk>``, integer tensors cast into float
weights. So every loader (``load_run``; ``resume_lm`` for checkpoints) checks:

* ``check_tokenizer_fits`` — the tokenizer has no more ids than each vocabulary of the model,
  and, for handformer's own character tokenizer, exactly as many (see its docstring);
* ``check_weights_fit`` — the weights file's header against a *skeleton* of the model built
  on the ``meta`` device from the config: names, shapes and float dtypes
  (``train.tensor_file``). Nothing is allocated until the config and the file agree, so a
  damaged config cannot ask for terabytes before it is found out.

Each error names the file(s) and the config field, with both numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from handformer.config import ClassifierConfig, ModelConfig, Seq2SeqConfig
from handformer.nn.init import skip_init
from handformer.runs.files import RunFolderError
from handformer.tokenizers import CharTokenizer, Tokenizer
from handformer.train.tensor_file import TensorFileError, check_tensor_file

__all__ = ["build_skeleton", "check_tokenizer_fits", "check_weights_fit", "config_fields",
           "vocab_fields"]

ModelsConfig = ModelConfig | ClassifierConfig | Seq2SeqConfig


def config_fields(config: Any, prefix: str = "") -> dict[str, int]:
    """A config's integer fields, nested ones as ``encoder.vocab_size``: the numbers an error
    can name when a tensor's size differs."""
    found: dict[str, int] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            found.update(config_fields(value, f"{prefix}{f.name}."))
        elif isinstance(value, int) and not isinstance(value, bool):
            found[f"{prefix}{f.name}"] = value
    return found


def vocab_fields(config: ModelsConfig) -> dict[str, int]:
    """Each vocabulary a tokenizer must fit: ``{"vocab_size": V}`` for an LM,
    ``encoder.vocab_size`` for a classifier, both sides' for a seq2seq model."""
    return {name: value for name, value in config_fields(config).items()
            if name.split(".")[-1] == "vocab_size"}


def check_tokenizer_fits(tokenizer: Tokenizer, config: ModelsConfig, tokenizer_path: Path,
                         config_path: Path, *,
                         error: type[ValueError] = RunFolderError) -> None:
    """``error`` when the tokenizer and the model's vocabulary do not fit together.

    The rule: a tokenizer LARGER than a vocabulary is always refused (it produces ids the
    model has no embedding for). A SMALLER one is refused only for handformer's own
    ``CharTokenizer``, whose size is exact by construction (every run's ``vocab_size`` is
    its tokenizer's size), so fewer ids means it is another run's: the model would sample ids
    it cannot decode. A Hugging Face-style tokenizer may legitimately be smaller — published
    models pad their vocabulary (Qwen3: 151669 tokens, ``vocab_size`` 151936)."""
    size_now = tokenizer.vocab_size
    for name, size in vocab_fields(config).items():
        if size_now > size:
            raise error(
                f"{tokenizer_path} has {size_now} tokens but {config_path} says "
                f"{name}={size}: ids {size}..{size_now - 1} have no embedding; "
                "the tokenizer belongs to another model (copy the one saved with these weights)")
        if size_now < size and isinstance(tokenizer, CharTokenizer):
            raise error(
                f"{tokenizer_path} has {size_now} tokens but {config_path} says {name}={size}: "
                "a character tokenizer is exactly as large as the vocabulary it was trained "
                f"with, so ids {size_now}..{size - 1} would decode to nothing; the tokenizer "
                "belongs to another model (copy the one saved with these weights)")


def build_skeleton(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` on the ``meta`` device: every parameter's name, shape and dtype, no
    memory and no random start (a 10-billion-parameter config builds in milliseconds)."""
    with torch.device("meta"), skip_init():
        return build()


def check_weights_fit(skeleton: nn.Module, weights_path: Path, config_path: Path, *,
                      error: type[ValueError] = RunFolderError) -> None:
    """``error`` unless the weights file holds exactly the tensors ``skeleton`` (a model built
    from ``config_path``'s config) needs, with its shapes and float dtypes."""
    config = getattr(skeleton, "config", None)
    fields: Mapping[str, int] = (config_fields(config) if dataclasses.is_dataclass(config)
                                 else {})
    try:
        check_tensor_file(skeleton, weights_path, fields=fields)
    except TensorFileError as err:
        raise error(f"{weights_path}: cannot load weights that do not fit {config_path}: "
                    f"{err.detail}") from None
