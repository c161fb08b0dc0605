"""The command line, run in-process: train a tiny model, sample from it, and fail clearly."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, load_model

from handformer.cli import main
from handformer.config import ModelConfig, TrainConfig
from handformer.models.decoder_lm import DecoderLM
from handformer.tokenizers import CharTokenizer
from handformer.train.checkpoint import list_checkpoints

SUBJECTS = ["the cat", "a dog", "my bird", "the fox", "one cow"]
VERBS = ["sees", "likes", "chases", "hears", "bites"]
OBJECTS = ["a ball", "the sun", "an apple", "big trees", "old boats"]


def tiny_corpus(n_chars: int = 20_000, seed: int = 0) -> str:
    """Simple sentences from a seeded random choice of words: deterministic, ~n_chars long."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_chars:
        sentence = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}.\n"
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny training run shared by the tests in this module."""
    return train_tiny(tmp_path_factory.mktemp("cli"), "--max-steps", "20", "--device", "cpu")


def train_tiny(folder: Path, *options: str) -> Path:
    """``handformer train --preset tiny`` on ``tiny_corpus()`` (written to ``folder``) with
    ``options``, into ``folder/run``; returns the run folder."""
    data = folder / "corpus.txt"
    data.write_text(tiny_corpus(), encoding="utf-8")
    out = folder / "run"
    code = main(["train", "--preset", "tiny", "--data", str(data), "--out", str(out),
                 "--no-progress", *options])
    assert code == 0
    return out


def generate_text(run: Path, capsys: pytest.CaptureFixture[str], seed: int = 0) -> str:
    """Run ``handformer generate`` and return what it printed."""
    capsys.readouterr()  # drop anything printed earlier
    code = main(["generate", "--run", str(run), "--prompt", "ab", "--max-new-tokens", "10",
                 "--seed", str(seed)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def test_tiny_corpus_is_deterministic() -> None:
    assert tiny_corpus() == tiny_corpus()
    assert 20_000 <= len(tiny_corpus()) < 20_100
    assert {"a", "b"} <= set(tiny_corpus())


def test_train_writes_a_complete_run_folder(trained_run: Path) -> None:
    for name in ("model.safetensors", "config.json", "tokenizer.json", "metrics.jsonl"):
        assert (trained_run / name).is_file(), name
    lines = (trained_run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    assert lines
    records = [json.loads(line) for line in lines]
    assert all(isinstance(r, dict) for r in records)
    assert {r["kind"] for r in records} <= {"train", "eval"}
    assert any(r["kind"] == "eval" for r in records)
    assert not list(trained_run.glob("*.tmp"))


def test_run_folder_rebuilds_without_pickle(trained_run: Path) -> None:
    config = json.loads((trained_run / "config.json").read_text(encoding="utf-8"))
    model_cfg = ModelConfig.from_dict(config["model"])
    train_cfg = TrainConfig.from_dict(config["train"])
    tokenizer = CharTokenizer.load(trained_run / "tokenizer.json")
    assert train_cfg.max_steps == 20
    assert model_cfg.vocab_size == tokenizer.vocab_size
    assert model_cfg.d_model == 32 and model_cfg.n_layers == 2  # the tiny preset
    tensors = load_file(trained_run / "model.safetensors")  # safetensors: no pickle involved
    model = DecoderLM(model_cfg)
    state = model.state_dict()
    assert set(tensors) <= set(state), sorted(set(tensors) - set(state))
    # Every tensor of the model is in the file: under its own name or, for a tied weight
    # (the LM head shares the embedding's), under the name of the tensor it is tied to.
    stored_as = {state[name].data_ptr(): name for name in tensors}
    source = {name: name if name in tensors else stored_as.get(t.data_ptr())
              for name, t in state.items()}
    assert all(source.values()), [name for name, src in source.items() if src is None]
    # What was saved is the trained model: the weights of the trainer's final checkpoint.
    final = list_checkpoints(trained_run / "checkpoints")[-1]
    assert final.step == 20
    trained = load_file(final.path / "model.safetensors")
    assert trained.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(tensor, trained[name]), name
    # Loading gives back exactly those tensors, every one of them.
    load_model(model, trained_run / "model.safetensors", strict=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, tensors[source[name]]), name


def test_generate_starts_with_prompt_and_is_seeded(trained_run: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    first = generate_text(trained_run, capsys, seed=0)
    second = generate_text(trained_run, capsys, seed=0)
    assert first.startswith("ab")
    assert first == second
    assert len(first.rstrip("\n")) <= 2 + 10


def test_train_missing_data_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no_such_corpus.txt"
    code = main(["train", "--data", str(missing), "--out", str(tmp_path / "run"),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1  # refused at run time (a file, a folder)
    assert str(missing) in err and "error" in err
    assert not (tmp_path / "run").exists()


def test_train_too_short_data_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "short.txt"
    data.write_text("just a few characters", encoding="utf-8")
    code = main(["train", "--preset", "tiny", "--data", str(data), "--out",
                 str(tmp_path / "run"), "--no-progress", "--max-steps", "1"])
    assert code == 1  # refused at run time (a file, a folder)
    assert "window" in capsys.readouterr().err


def test_generate_missing_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no_such_run"
    code = main(["generate", "--run", str(missing), "--prompt", "ab"])
    err = capsys.readouterr().err
    assert code == 1  # refused at run time (a file, a folder)
    assert str(missing) in err


def test_generate_incomplete_run_folder(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    code = main(["generate", "--run", str(tmp_path)])
    assert code == 1  # refused at run time (a file, a folder)
    assert "model.safetensors" in capsys.readouterr().err


def test_generate_in_bfloat16(trained_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    code = main(["generate", "--run", str(trained_run), "--prompt", "ab",
                 "--max-new-tokens", "10", "--temperature", "0", "--dtype", "bfloat16"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.startswith("ab") and len(captured.out.rstrip("\n")) > 2
