"""An int8 run folder: saved with its int8 weights and scales, loaded without quantizing
again, refused clearly where it does not fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from handformer.config import ModelConfig
from handformer.models.decoder_lm import DecoderLM
from handformer.models.quantize import is_quantized, quantize_int8
from handformer.runs import RunFolderError, load_run, save_run
from handformer.runs.quantized import write_quantized_run
from handformer.tokenizers import CharTokenizer

TOK = CharTokenizer.from_text("abcdefgh ")
SHAPE = dict(vocab_size=TOK.vocab_size, d_model=16, n_heads=2, n_layers=1, max_len=12)


def float_run(path: Path) -> DecoderLM:
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(**SHAPE))
    save_run(path, model, TOK, extra={"data": {"source": "test"}})
    return model


def test_a_quantized_model_round_trips_bit_for_bit(tmp_path: Path) -> None:
    quantized = quantize_int8(DecoderLM(ModelConfig(**SHAPE)))
    save_run(tmp_path / "run", quantized, TOK)
    stored = load_file(tmp_path / "run" / "model.safetensors")
    assert stored["blocks.0.ffn.fc_in.qweight"].dtype == torch.int8
    assert "blocks.0.ffn.fc_in.weight" not in stored and "lm_head.qweight" in stored
    run = load_run(tmp_path / "run")
    assert is_quantized(run.model) and run.config["quantization"]["format"] == "int8-weight-only"
    want, got = quantized.state_dict(), run.model.state_dict()
    assert set(want) == set(got)
    assert all(torch.equal(want[k], got[k]) for k in want)
    ids = torch.randint(0, TOK.vocab_size, (1, 6))
    with torch.no_grad():
        assert torch.equal(quantized.eval()(ids), run.model(ids))


def test_convert_writes_a_loadable_int8_copy_and_leaves_the_source(tmp_path: Path) -> None:
    model = float_run(tmp_path / "src")
    before = {p.name: p.read_bytes() for p in (tmp_path / "src").iterdir()}
    out = write_quantized_run(tmp_path / "src", tmp_path / "int8")
    assert {p.name: p.read_bytes() for p in (tmp_path / "src").iterdir()} == before
    run = load_run(out, kind="lm")
    assert is_quantized(run.model)
    assert run.config["data"] == {"source": "test"}  # the source's records travel along
    assert run.config["quantized_from"] == str((tmp_path / "src").resolve())
    expected = quantize_int8(model).state_dict()
    assert all(torch.equal(expected[k], v) for k, v in run.model.state_dict().items())
    # Written again into the folder it wrote: a finished run is replaced only on request.
    with pytest.raises(RunFolderError, match=r"finished \(int8 copy of .*--overwrite"):
        write_quantized_run(tmp_path / "src", tmp_path / "int8")
    write_quantized_run(tmp_path / "src", tmp_path / "int8", overwrite=True)


def test_convert_refuses_its_source_a_quantized_source_and_a_foreign_folder(
        tmp_path: Path) -> None:
    float_run(tmp_path / "src")
    with pytest.raises(RunFolderError, match="is the source run"):
        write_quantized_run(tmp_path / "src", tmp_path / "src")
    write_quantized_run(tmp_path / "src", tmp_path / "int8")
    with pytest.raises(RunFolderError, match="already quantized"):
        write_quantized_run(tmp_path / "int8", tmp_path / "again")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine", encoding="utf-8")
    with pytest.raises(RunFolderError):
        write_quantized_run(tmp_path / "src", foreign)
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_a_damaged_record_or_weights_of_the_wrong_dtype_are_refused(tmp_path: Path) -> None:
    save_run(tmp_path / "run", quantize_int8(DecoderLM(ModelConfig(**SHAPE))), TOK)
    config_path = tmp_path / "run" / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["quantization"]["layers"].append("blocks.7.ffn.fc_in")
    config_path.write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(RunFolderError, match=r"config\.json.*blocks\.7\.ffn\.fc_in"):
        load_run(tmp_path / "run")
    config["quantization"]["layers"].pop()
    config_path.write_text(json.dumps(config), encoding="utf-8")
    weights = tmp_path / "run" / "model.safetensors"
    tensors = load_file(weights)
    tensors["lm_head.qweight"] = tensors["lm_head.qweight"].long()  # would wrap on load
    save_file(tensors, weights)
    with pytest.raises(RunFolderError, match=r"lm_head\.qweight.*I64.*torch\.int8"):
        load_run(tmp_path / "run")
    del config["quantization"]  # int8 weights, but a config that says float
    config_path.write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(RunFolderError, match="qweight"):
        load_run(tmp_path / "run")
