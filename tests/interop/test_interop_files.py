"""A Hugging Face folder's damaged files are refused naming the file, never a bare parser
message or a safetensors traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from handformer.interop.files import read_config, read_weights
from handformer.interop.gpt2 import ConversionError


@pytest.mark.parametrize(("text", "message"), [
    ("{'hidden_size': 384}", "cannot read the model config"),
    ("[1, 2]", "expected a JSON object, got list"),
    ("", "cannot read the model config"),
])
def test_a_damaged_config_names_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConversionError, match=message) as info:
        read_config(path)
    assert str(path) in str(info.value)


def test_a_config_that_is_not_utf8_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ConversionError, match=r"config\.json"):
        read_config(path)


def test_weights_are_read_and_damaged_ones_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(2, 3)}, path)
    assert torch.equal(read_weights(path)["w"], torch.ones(2, 3))
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ConversionError, match="cannot read the weights") as info:
        read_weights(path)
    assert str(path) in str(info.value)
