"""train.tensor_file: a safetensors file checked against a module from its header alone —
names (tied weights once), shapes, float dtypes — and the checkpoint loader that uses it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file, save_model
from torch import nn

from handformer.train.checkpoint import CheckpointError, load_weights
from handformer.train.tensor_file import TensorFileError, check_tensor_file, read_header
from tests.train.helpers import make_trainer, train_config
from tests.train.test_checkpoint import forge_marker


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("count", torch.zeros(2, dtype=torch.long))


def saved(tmp_path: Path, **change: torch.Tensor) -> Path:
    path = tmp_path / "w.safetensors"
    tensors = {"embed.weight": torch.randn(7, 4), "count": torch.zeros(2, dtype=torch.long),
               **change}
    save_file({k: v for k, v in tensors.items() if v is not None}, path)
    return path


def test_a_matching_file_passes_and_the_header_is_read_without_the_data(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_model(Tied(), str(path))  # stores the tied weight once
    check_tensor_file(Tied(), path)
    with torch.device("meta"):
        check_tensor_file(Tied(), path)  # a skeleton is enough
    assert read_header(path)["count"] == ("I64", (2,))


@pytest.mark.parametrize(("change", "needles"), [
    ({"embed.weight": torch.randn(9, 4)}, ["'embed.weight'", "(9, 4)", "(7, 4)", "vocab=7?"]),
    ({"embed.weight": torch.ones(7, 4, dtype=torch.int64)}, ["I64", "floating-point"]),
    ({"embed.weight": torch.ones(7, 4, dtype=torch.bool)}, ["BOOL", "floating-point"]),
    ({"count": torch.zeros(2)}, ["'count'", "F32", "torch.int64"]),
    ({"embed.weight": None}, ["missing ['embed.weight']"]),
    ({"blocks.3.extra": torch.zeros(1)}, ["unexpected ['blocks.3.extra']", "n_layers"]),
    ({"head.weight": torch.randn(7, 4)}, ["['embed.weight', 'head.weight']", "tie_weights"]),
], ids=["shape", "int-weight", "bool-weight", "float-buffer", "missing", "unexpected", "untied"])
def test_mismatches_name_the_file_the_tensor_and_both_sides(
        change: dict, needles: list[str], tmp_path: Path) -> None:
    path = saved(tmp_path, **change)
    with pytest.raises(TensorFileError) as info:
        check_tensor_file(Tied(), path, fields={"vocab": 7, "width": 4})
    message = str(info.value)
    for needle in [str(path), "does not fit the model", *needles]:
        assert needle in message, f"{needle!r} missing from: {message}"


def test_unreadable_and_missing_files_are_named(tmp_path: Path) -> None:
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 3)
    with pytest.raises(TensorFileError, match="not a readable safetensors file"):
        check_tensor_file(Tied(), junk)
    with pytest.raises(TensorFileError, match="missing"):
        check_tensor_file(Tied(), tmp_path / "nowhere.safetensors")


def test_the_checkpoint_loader_refuses_integer_weights_before_loading(tmp_path: Path) -> None:
    trainer = make_trainer(train_config(max_steps=2, eval_interval=2), ckpt_dir=tmp_path / "ck")
    trainer.fit()
    checkpoint = sorted((tmp_path / "ck").glob("step-*"))[-1]
    tensors = load_file(checkpoint / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].long()
    save_file(tensors, checkpoint / "model.safetensors")
    forge_marker(checkpoint)
    fresh = make_trainer(train_config(max_steps=2))
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: does not fit.*{name}.*I64"):
        load_weights(fresh.model, checkpoint)
    assert all(torch.equal(before[k], v) for k, v in fresh.model.state_dict().items())
