"""Whole folders: a transformers GPT-2 folder becomes a run folder and back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from handformer.data.corpora import builtin_text
from handformer.interop.gpt2 import ConversionError
from handformer.interop.hf_folder import export_hf_folder, import_hf_folder
from handformer.models.decoder_lm import DecoderLM
from handformer.runs import load_run, save_run
from handformer.tokenizers import BPETokenizer, CharTokenizer
from tests.conftest import tiny_config

transformers = pytest.importorskip(
    "transformers", reason="the 'transformers' test extra is not installed "
    "(pip install -r requirements-dev.txt)")


def test_hf_folder_imports_as_a_run_and_generates(tmp_path: Path) -> None:
    tok = BPETokenizer.train(builtin_text()[:30_000], vocab_size=300)
    cfg = transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2,
                                  n_head=4, bos_token_id=None, eos_token_id=None)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    tok.save(tmp_path / "hf" / "tokenizer.json")

    run = import_hf_folder(tmp_path / "hf", tmp_path / "run")
    loaded = load_run(run, kind="lm")
    model, loaded_tok = loaded.model, loaded.tokenizer
    ids = torch.tensor([loaded_tok.encode("def main():")])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_run_exports_to_a_folder_transformers_loads(tmp_path: Path) -> None:
    tok = CharTokenizer.from_text("hello world")
    model = DecoderLM(tiny_config(vocab_size=tok.vocab_size, positional="learned",
                                  activation="gelu_tanh")).eval()
    save_run(tmp_path / "run", model, tok)
    out, _ = export_hf_folder(tmp_path / "run", tmp_path / "hf")
    assert not (out / "handformer_tokenizer.json").exists()  # a tokenizer.json every tool reads
    assert transformers.AutoTokenizer.from_pretrained(out)("hello")["input_ids"] == \
        tok.encode("hello")
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    ids = torch.tensor([tok.encode("hello")])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, model(ids), rtol=1e-4, atol=1e-4)


def test_folder_errors_name_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match=r"no config\.json"):
        import_hf_folder(tmp_path / "empty", tmp_path / "run")
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "config.json").write_text('{"model_type": "t5"}')
    with pytest.raises(ConversionError, match="model_type='t5'"):
        import_hf_folder(tmp_path / "t5", tmp_path / "run")
    (tmp_path / "bert").mkdir()  # BERT imports as an encoder run: its files must be there
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ConversionError, match=r"not a BERT-style folder: missing \['model"):
        import_hf_folder(tmp_path / "bert", tmp_path / "run")
    tok = CharTokenizer.from_text("abc")
    rope = DecoderLM(tiny_config(vocab_size=tok.vocab_size, positional="rope"))
    save_run(tmp_path / "rope", rope, tok)
    with pytest.raises(ConversionError, match="positional='rope'"):
        export_hf_folder(tmp_path / "rope", tmp_path / "out")


def test_an_int8_run_is_refused_naming_the_fp32_run_it_came_from(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from handformer.cli import main

    tok = CharTokenizer.from_text("hello world")
    save_run(tmp_path / "run", DecoderLM(tiny_config(vocab_size=tok.vocab_size,
                                                     positional="learned")), tok)
    assert main(["convert", "--quantize", "int8", str(tmp_path / "run"),
                 str(tmp_path / "int8")]) == 0
    capsys.readouterr()
    assert main(["convert", "--to", "hf", str(tmp_path / "int8"), str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err.strip()
    assert "holds int8 weights" in err and str((tmp_path / "run").resolve()) in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "hf").exists()
