"""resume_lm checks that a checkpoint's files belong together before anything is trained:
a tokenizer from another run (larger than the vocabulary, or one that would map the
training text to <unk>) and integer weights are refused, naming the file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from handformer.jobs.lm import resume_lm, train_lm
from handformer.tokenizers import CharTokenizer
from handformer.train.checkpoint import CheckpointError, list_checkpoints
from tests.train.helpers import toy_text
from tests.train.test_checkpoint import forge_marker

TEXT = toy_text(200)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lm")
    data = root / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    train_lm(TEXT, out_dir=root / "run", preset="tiny", data_source=str(data),
             train_overrides={"max_steps": 4, "eval_interval": 4, "log_interval": 1,
                              "eval_batches": 1, "device": "cpu", "loss_curve": False},
             progress=False, sample_tokens=1)
    return root / "run"


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def newest(run: Path) -> Path:
    return list_checkpoints(run / "checkpoints")[-1].path


def resume(run: Path) -> None:
    resume_lm(run, max_steps=8, progress=False, sample_tokens=1)


def test_another_runs_tokenizer_of_the_same_size_is_refused(run: Path) -> None:
    """Same number of ids, other characters: only the training text can tell."""
    checkpoint = newest(run)
    own = CharTokenizer.from_text(TEXT)
    other = CharTokenizer("ABCDEFGHIJKLMNOPQRSTUVWXYZ"[: len(own.stoi)])
    assert other.vocab_size == own.vocab_size
    other.save(checkpoint / "tokenizer.json")
    forge_marker(checkpoint)
    with pytest.raises(CheckpointError, match=r"tokenizer\.json lacks \d+ character\(s\) of "
                                              r"the training text.*<unk>"):
        resume(run)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(run: Path) -> None:
    checkpoint = newest(run)
    CharTokenizer.from_text(TEXT + "XYZ!?").save(checkpoint / "tokenizer.json")
    forge_marker(checkpoint)
    with pytest.raises(CheckpointError, match=r"tokenizer\.json has \d+ tokens but .*config\.json "
                                              r"says vocab_size="):
        resume(run)


def test_integer_weights_in_a_checkpoint_are_refused_before_training(run: Path) -> None:
    checkpoint = newest(run)
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["embed.token.weight"] = tensors["embed.token.weight"].long()
    save_file(tensors, checkpoint / "model.safetensors")
    forge_marker(checkpoint)
    with pytest.raises(CheckpointError, match=r"'embed\.token\.weight' holds I64"):
        resume(run)
    assert newest(run) == checkpoint  # nothing trained, nothing written
