"""Every language-model preset leaves as ONNX, and as a Hugging Face family that transformers
loads with its own class (the same logits). A block no family has (LayerNorm, GELU, RoPE and
QK-norm together — the default's before it took Qwen3's) is refused naming the closest family,
and ``train --family`` gives it a twin (README, Take it elsewhere)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from handformer.config import PRESETS, ModelConfig
from handformer.interop.families import pick_family
from handformer.interop.hf_folder import export_hf_folder
from handformer.models.decoder_lm import DecoderLM
from handformer.runs import save_run
from handformer.tokenizers import CharTokenizer

transformers = pytest.importorskip(
    "transformers", reason="the 'transformers' test extra is not installed "
    "(pip install -r requirements-dev.txt)")

TEXT = "The quick brown fox jumps over the lazy dog.\n"
# A GPT-2 block with RoPE and QK-norm: what no family expresses.
NO_TWIN = dict(d_model=32, n_heads=4, n_layers=2, max_len=16, positional="rope",
               norm_type="layernorm", activation="gelu", qk_norm=True)


def _run(preset: str, folder: Path) -> DecoderLM:
    return _save(PRESETS[preset].model, folder)


def _save(fields: dict[str, object], folder: Path) -> DecoderLM:
    tok = CharTokenizer.from_text(TEXT)
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=tok.vocab_size, **fields)).eval()
    save_run(folder, model, tok)
    return model


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_converts_to_a_hugging_face_family(preset: str, tmp_path: Path) -> None:
    model = _run(preset, tmp_path / "run")
    out, family = export_hf_folder(tmp_path / "run", tmp_path / "hf")
    assert family == pick_family(model.config)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_exports_to_onnx(preset: str, tmp_path: Path) -> None:
    ort = pytest.importorskip("onnxruntime", reason="the 'onnx' test extra is not installed")
    from handformer.interop.onnx_export import export_onnx

    model = _run(preset, tmp_path / "run")
    path = export_onnx(tmp_path / "run", tmp_path / "lm.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    (logits,) = session.run(["logits"], {"input_ids": ids.numpy()})
    with torch.no_grad():
        assert abs(logits - model(ids).numpy()).max() <= 1e-4


def test_a_block_without_a_twin_is_refused_and_its_family_version_leaves(
        tmp_path: Path) -> None:
    from handformer.interop.errors import ConversionError
    from handformer.interop.families import FAMILY_ARCHITECTURE

    _save(NO_TWIN, tmp_path / "run")
    with pytest.raises(ConversionError, match=r"maps onto no Hugging Face family .* closest is "):
        export_hf_folder(tmp_path / "run", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    tok = CharTokenizer.from_text(TEXT)
    twin = ModelConfig(vocab_size=tok.vocab_size, **{**NO_TWIN, **FAMILY_ARCHITECTURE["qwen3"]})
    save_run(tmp_path / "twin", DecoderLM(twin), tok)
    assert export_hf_folder(tmp_path / "twin", tmp_path / "hf")[1] == "qwen3"
