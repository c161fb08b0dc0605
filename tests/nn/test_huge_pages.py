"""``nn.huge_pages``: tensors back to back in one 2 MiB-aligned region, each its own storage,
and ``quantize_int8`` laying a model's int8 weights there in the order a step reads them."""

from __future__ import annotations

import copy
import gc
import itertools
import sys

import pytest
import torch
from safetensors.torch import load_model, save_model

from handformer.config import ModelConfig
from handformer.models.decoder_lm import DecoderLM
from handformer.models.quantize import apply_int8_layout, quantization_info, quantize_int8
from handformer.nn import huge_pages
from handformer.nn.kv_cache import DecoderCache, KVCache
from handformer.nn.quantized import Int8Linear

pytestmark = pytest.mark.skipif(not huge_pages.huge_pages_supported(),
                                reason=f"no madvise(MADV_HUGEPAGE) on {sys.platform}")

MIB = 1 << 20


def _qweights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [m.qweight for m in model.modules() if isinstance(m, Int8Linear)]


def _model(d_model: int = 256, n_layers: int = 4) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(ModelConfig(vocab_size=97, d_model=d_model, n_heads=4, n_layers=n_layers,
                                 max_len=32, positional="learned")).eval()


def test_pack_copies_back_to_back_each_with_its_own_storage() -> None:
    torch.manual_seed(0)
    tensors = [torch.randint(-127, 128, (700, 1000), dtype=torch.int8),
               torch.randint(-127, 128, (3, 5), dtype=torch.int8),
               torch.randint(-127, 128, (1500, 1000), dtype=torch.int8)]
    copies = huge_pages.pack(tensors)
    assert copies is not None and len(copies) == 3
    ptrs = [c.data_ptr() for c in copies]
    assert ptrs[0] % huge_pages.HUGE_PAGE == 0  # the region starts on a huge page
    assert all(p % 64 == 0 for p in ptrs)
    assert ptrs[1] == ptrs[0] + 700_032 and ptrs[2] == ptrs[1] + 64  # in order, 64-aligned
    for c, t in zip(copies, tensors, strict=True):
        assert torch.equal(c, t) and c.shape == t.shape and c.data_ptr() != t.data_ptr()
        assert c.untyped_storage().nbytes() == t.numel()  # its own bytes, not the region's


def test_a_copy_outlives_the_others_and_is_writable() -> None:
    tensors = [torch.full((MIB,), 1.0), torch.full((MIB,), 2.0)]  # 8 MiB of float32
    copies = huge_pages.pack(tensors)
    assert copies is not None
    kept = copies[1]
    del copies, tensors
    gc.collect()
    assert float(kept.sum()) == 2.0 * MIB
    kept.mul_(3.0)
    assert float(kept[0]) == 6.0


def test_pack_declines_what_it_cannot_lay_out() -> None:
    big = torch.zeros(3 * MIB, dtype=torch.int8)
    assert huge_pages.pack([]) is None
    assert huge_pages.pack([torch.zeros(MIB, dtype=torch.int8)]) is None  # under one huge page
    assert huge_pages.pack([big, torch.zeros(4, 4).t()]) is None  # not contiguous
    assert huge_pages.pack([big, torch.zeros(4)]) is None  # two dtypes
    assert huge_pages.pack([big, torch.zeros(0, dtype=torch.int8)]) is None  # an empty one
    assert huge_pages.zeros([(3 * MIB,), (0,)], torch.int8) is None
    zeros = huge_pages.zeros([(2, MIB), (5,)], torch.float32)
    assert zeros is not None and [tuple(z.shape) for z in zeros] == [(2, MIB), (5,)]
    assert all(float(z.abs().sum()) == 0.0 for z in zeros)


def test_quantize_lays_the_int8_weights_in_reading_order_and_keeps_the_result() -> None:
    model = _model()
    unpacked = quantize_int8(model)
    for layer in unpacked.modules():  # the same quantization, in torch's own memory
        if isinstance(layer, Int8Linear):
            layer.qweight = layer.qweight.clone()
    packed = quantize_int8(model)
    qs = _qweights(packed)
    names = [n for n, m in packed.named_modules() if isinstance(m, Int8Linear)]
    assert names[:4] == ["blocks.0.self_attn.in_proj", "blocks.0.self_attn.out_proj",
                         "blocks.0.ffn.fc_in", "blocks.0.ffn.fc_out"]
    ptrs = [q.data_ptr() for q in qs]
    assert ptrs[0] % huge_pages.HUGE_PAGE == 0 and ptrs == sorted(ptrs)
    for a, b in itertools.pairwise(qs):  # each right after the one before
        assert b.data_ptr() - a.data_ptr() == (a.numel() + 63) // 64 * 64
    ids = torch.randint(0, 97, (1, 9))
    with torch.inference_mode():
        assert torch.equal(packed(ids), unpacked(ids))
    small = quantize_int8(_model(d_model=64, n_layers=1))  # under 2 MiB: left where it is
    assert _qweights(small)[0].untyped_storage().nbytes() == _qweights(small)[0].numel()


def test_a_packed_model_saves_loads_and_copies_like_any(tmp_path: object) -> None:
    packed = quantize_int8(_model())
    path = f"{tmp_path}/model.safetensors"
    save_model(packed, path)
    target = apply_int8_layout(_model(), quantization_info(packed))  # packed, zero weights
    before = [q.data_ptr() for q in _qweights(target)]
    load_model(target, path)
    assert [q.data_ptr() for q in _qweights(target)] == before  # loaded in place
    for a, b in zip(_qweights(target), _qweights(packed), strict=True):
        assert torch.equal(a, b)
    twin = copy.deepcopy(packed)
    assert all(torch.equal(a, b) for a, b in zip(_qweights(twin), _qweights(packed),
                                                 strict=True))


def test_a_cpu_decoder_cache_lays_its_layers_back_to_back() -> None:
    cache = DecoderCache(3, 1, 4, 1024, 64)  # 3 layers of 2 MiB of float32
    ptrs = [layer.buffer.data_ptr() for layer in cache.layers]
    assert ptrs[0] % huge_pages.HUGE_PAGE == 0
    assert ptrs[1] - ptrs[0] == ptrs[2] - ptrs[1] == 2 * MIB
    assert all(float(layer.buffer.abs().sum()) == 0.0 for layer in cache.layers)
    cache.layers[1].update(torch.ones(1, 8, 2, 64), 5)
    assert float(cache.layers[1].buffer.sum()) == 8 * 2 * 64
    assert float(cache.layers[0].buffer.sum()) == 0
    small = DecoderCache(2, 1, 2, 16, 8)  # under one huge page: torch's own zeros
    assert small.layers[0].buffer.untyped_storage().nbytes() == 2 * 2 * 16 * 8 * 4
    with pytest.raises(ValueError, match="KV buffer of shape"):
        KVCache(1, 2, 16, 8, buffer=torch.zeros(1, 4, 15, 8))


def test_a_mapping_the_system_refuses_leaves_torch_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    assert huge_pages.zeros([(3 * MIB,)], torch.int8) is None
    model = quantize_int8(_model())  # still quantizes, in torch's own memory
    q = _qweights(model)[0]
    assert q.untyped_storage().nbytes() == q.numel()
    cache = DecoderCache(3, 1, 4, 1024, 64)
    assert cache.layers[0].buffer.untyped_storage().nbytes() == 4 * 8 * 1024 * 64
