"""``handformer.models.packing``: the probe picks a library from what it measured, packing
replaces every float32 linear layer, and a packed decoder computes what it computed."""

from __future__ import annotations

import pytest
import torch

import handformer.models.packing as packing
from handformer.config import ModelConfig
from handformer.models.decoder_lm import DecoderLM
from handformer.models.packing import MatmulChoice, choose_matmul, pack_linears, packed_layers
from handformer.models.quantize import quantize_int8
from handformer.nn.packed import PackedLinear, onednn_packing_available

needs_onednn = pytest.mark.skipif(not onednn_packing_available(),
                                  reason="this torch build has no oneDNN")


def _model(**overrides) -> DecoderLM:
    torch.manual_seed(0)
    config = dict(vocab_size=40, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_len=32)
    return DecoderLM(ModelConfig.from_dict({**config, **overrides})).eval()


@needs_onednn
@pytest.mark.parametrize("tied", [False, True])
def test_a_packed_decoder_gives_the_logits_it_gave(tied: bool) -> None:
    model = _model(tie_weights=tied)
    names = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    ids = torch.randint(0, 40, (3, 17))
    with torch.inference_mode():
        before = model(ids)
        assert pack_linears(model) is model
        after = model(ids)
    assert packed_layers(model) == names and len(names) == 2 * 4 + 1  # 4 a block + the head
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_the_probe_picks_by_its_own_figures(monkeypatch) -> None:
    model = _model()
    choice = choose_matmul(model, 8)
    if not onednn_packing_available():
        assert choice == MatmulChoice("blas", "this torch build has no oneDNN")
        return
    assert choice.reason == "measured" and choice.rows == 8 and choice.layers == 9
    blas, onednn = (sum(choice.seconds[name]) for name in ("blas", "onednn"))  # type: ignore[index]
    assert choice.matmul == ("onednn" if onednn <= 0.9 * blas else "blas")
    assert choice.line().startswith(f"float32 matrix products: {choice.matmul} — measured "
                                    "over 9 layers")
    assert not packed_layers(model)  # the probe packs copies and leaves the model alone
    # Stub the clock: a library whose passes take a tenth of the time is picked.
    times = iter([1.0, 2.0, 0.1, 0.2])
    monkeypatch.setattr(packing, "_best_pass", lambda layers, inputs: next(times))
    assert choose_matmul(model, 8).matmul == "onednn"
    times = iter([1.0, 2.0, 0.95, 1.9])  # 5 % faster: within noise, BLAS stays
    assert choose_matmul(model, 8).matmul == "blas"


def test_nothing_to_pack_keeps_blas_and_says_why(monkeypatch) -> None:
    int8 = quantize_int8(_model())
    assert choose_matmul(int8, 8) == MatmulChoice(
        "blas", "the model has no float32 CPU linear layers")
    assert choose_matmul(_model().to(torch.bfloat16), 8).matmul == "blas"
    monkeypatch.setattr(packing, "onednn_packing_available", lambda: False)
    choice = choose_matmul(_model(), 8)
    assert choice == MatmulChoice("blas", "this torch build has no oneDNN")
    assert choice.line() == "float32 matrix products: blas (this torch build has no oneDNN)"
    assert not any(isinstance(m, PackedLinear) for m in int8.modules())
