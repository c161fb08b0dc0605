"""handformer.models.quantize: a DecoderLM with int8 weights stays a DecoderLM — close to
float32 on every positional type × attention kernel, generating with its cache — and what
cannot be quantized is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from handformer.config import ClassifierConfig, ModelConfig
from handformer.generate import generate
from handformer.models.decoder_lm import DecoderLM
from handformer.models.encoder import EncoderClassifier
from handformer.models.quantize import (
    QuantizationError,
    apply_int8_layout,
    int8_layers,
    is_quantized,
    quantization_info,
    quantize_int8,
    warm_up_int8,
)
from handformer.nn.int8_native import native_status
from handformer.nn.quantized import Int8Linear
from tests.conftest import tiny_config

POSITIONALS = ["sinusoidal", "learned", "rope", "alibi"]
PATHS = ["manual", "sdpa", "tiled"]
# int8 rounds each weight by at most half a step of its row's range (1/254 of the largest
# |w|); through two layers of a random tiny model the logits move by ~2 % of their spread.
LOGIT_TOLERANCE = 0.05  # × the float32 logits' standard deviation


def dequantized_float_model(model: DecoderLM, quantized: nn.Module) -> DecoderLM:
    """``model`` with each quantized layer's float weight set to what its int8 weight and
    scale stand for: the float model the int8 one must equal up to float rounding."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name in int8_layers(quantized):
            layer = quantized.get_submodule(name)
            target = ref.get_submodule(name)
            if name == "lm_head" and ref.config.tie_weights:  # the quantized head is untied
                target.weight = nn.Parameter(layer.weight.clone())
            else:
                target.weight.copy_(layer.weight)
    return ref


@pytest.mark.parametrize("positional", POSITIONALS)
@pytest.mark.parametrize("path", PATHS)
def test_int8_forward_is_its_dequantized_model_and_close_to_float32(positional: str,
                                                                    path: str) -> None:
    model = DecoderLM(tiny_config(positional=positional, attention=path,
                                  n_kv_heads=2)).eval()
    quantized = quantize_int8(model)
    ids = torch.randint(0, 37, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :4] = False  # a left-padded row
    with torch.no_grad():
        want = model(ids, mask)
        got = quantized(ids, mask)
        exact = dequantized_float_model(model, quantized)(ids, mask)
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5)
    assert float((got - want).abs().max()) <= LOGIT_TOLERANCE * float(want.std())


def test_every_linear_is_quantized_and_the_tied_head_gets_its_own_int8_copy() -> None:
    model = DecoderLM(tiny_config())
    quantized = quantize_int8(model)
    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert int8_layers(quantized) == linears and "lm_head" in linears
    assert not any(type(m) is nn.Linear for m in quantized.modules())
    assert quantized.embed.token.weight.dtype == torch.float32  # a row per step: float
    assert isinstance(quantized, DecoderLM) and is_quantized(quantized)
    assert not is_quantized(model)  # the original is untouched (inplace=False)
    kept = quantize_int8(model, include_head=False)
    assert type(kept.lm_head) is nn.Linear
    assert kept.lm_head.weight is kept.embed.token.weight  # still tied


def test_inplace_converts_the_model_itself() -> None:
    model = DecoderLM(tiny_config())
    assert quantize_int8(model, inplace=True) is model and is_quantized(model)


def test_int8_weights_take_a_quarter_of_the_bytes_plus_a_scale_per_row() -> None:
    model = DecoderLM(tiny_config(d_model=64, n_heads=4))
    quantized = quantize_int8(model)
    for name in int8_layers(quantized):
        layer, linear = quantized.get_submodule(name), model.get_submodule(name)
        n, k = linear.weight.shape
        stored = layer.qweight.numel() * layer.qweight.element_size() + \
            layer.scale.numel() * layer.scale.element_size()
        assert stored == n * k + 4 * n  # against 4·N·K bytes in float32


@pytest.mark.slow  # may compile the fused kernel: ~10-20 s on a busy 2-core machine
def test_generate_with_a_quantized_model_decodes_with_its_cache() -> None:
    model = DecoderLM(tiny_config(positional="rope", max_len=24)).eval()
    quantized = quantize_int8(model)
    seconds, note = warm_up_int8(quantized, positions=(1, 5))  # a step, and K = 4 verified
    assert note is None and seconds >= 0
    # The C loop serves float32 rows and compiles nothing per shape; without it, the fused
    # kernel is compiled for both row counts.
    layers = [layer for layer in quantized.modules() if isinstance(layer, Int8Linear)]
    if native_status() is None:
        assert all(not layer._kernels for layer in layers)
    else:
        assert all({(1, torch.float32), (5, torch.float32)} <= set(layer._kernels)
                   for layer in layers)
    prompt = torch.randint(1, 37, (1, 5))
    cached = generate(quantized, prompt, 30, temperature=0)  # slides past the window too
    uncached = generate(quantized, prompt, 30, temperature=0, use_cache=False)
    assert cached.shape == (1, 35)
    assert torch.equal(cached, uncached)
    floats = generate(model, prompt, 30, temperature=0)
    assert float((floats == cached).float().mean()) >= 0.5  # random weights: near ties


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_damaged_weights_are_refused_naming_the_layer(bad: str) -> None:
    model = DecoderLM(tiny_config())
    with torch.no_grad():
        model.blocks[1].ffn.fc_out.weight[3, 0] = float(bad)
    with pytest.raises(QuantizationError, match=r"blocks\.1\.ffn\.fc_out\.weight"):
        quantize_int8(model)


def test_an_encoder_and_a_quantized_model_are_refused() -> None:
    encoder = EncoderClassifier(ClassifierConfig(ModelConfig(vocab_size=20, d_model=16,
                                                             n_heads=2, n_layers=1),
                                                 num_classes=3))
    with pytest.raises(QuantizationError, match=r"decoder language models.*EncoderClassifier"):
        quantize_int8(encoder)
    with pytest.raises(QuantizationError, match="already quantized"):
        quantize_int8(quantize_int8(DecoderLM(tiny_config())))


def test_the_recorded_layout_rebuilds_a_model_that_loads_the_int8_state() -> None:
    quantized = quantize_int8(DecoderLM(tiny_config()))
    info = quantization_info(quantized)
    assert info is not None and info["layers"] == int8_layers(quantized)
    assert quantization_info(DecoderLM(tiny_config())) is None
    empty = apply_int8_layout(DecoderLM(tiny_config()), info)
    empty.load_state_dict(quantized.state_dict(), strict=True)
    ids = torch.randint(0, 37, (1, 8))
    with torch.no_grad():
        assert torch.equal(empty(ids), quantized(ids))


@pytest.mark.parametrize("info, message", [
    ({"format": "int4"}, "expected format 'int8-weight-only'"),
    ({"format": "int8-weight-only", "layers": "lm_head"}, "list of layer names"),
    ({"format": "int8-weight-only", "layers": ["blocks.9.ffn.fc_in"]}, r"blocks\.9\.ffn"),
    ("int8", "expected format"),
])
def test_a_bad_layout_record_is_refused(info: object, message: str) -> None:
    with pytest.raises(QuantizationError, match=message):
        apply_int8_layout(DecoderLM(tiny_config()), info)
