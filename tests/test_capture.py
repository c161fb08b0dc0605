"""handformer.capture, tested once for both of its users (doctor and explore): every layer's
weights and mask for a forward pass, whatever the kernel, and no trace left on the model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from handformer.capture import (
    allowed_mask,
    attention_modules,
    capture_attention,
    forced_attention_kind,
    self_attention_names,
)
from handformer.masks import causal_mask
from handformer.models.decoder_lm import DecoderLM
from handformer.nn.attention import ATTENTION_KINDS, MultiHeadAttention
from tests.conftest import tiny_config

B, H, V = 2, 4, 37  # tiny_config: 4 heads, vocabulary 37


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _model(**overrides: Any) -> DecoderLM:
    return DecoderLM(tiny_config(**overrides)).eval()


def _snapshot(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Every module's instance ``__dict__`` (by identity of its values) and kernel choice."""
    return {name: dict(vars(m)) for name, m in model.named_modules()}


def _assert_untouched(model: torch.nn.Module, before: dict[str, dict[str, Any]]) -> None:
    after = _snapshot(model)
    assert after.keys() == before.keys()
    for name, attrs in before.items():
        assert after[name].keys() == attrs.keys(), name  # no wrapper, no stored weights
        for key, value in attrs.items():
            assert after[name][key] is value or after[name][key] == value, (name, key)
    for m in attention_modules(model).values():
        assert m.forward.__func__ is type(m).forward  # the class's own forward again


# -- names ------------------------------------------------------------------------------------
def test_names_are_in_layer_order() -> None:
    model = _model(n_layers=3)
    names = ["blocks.0.self_attn", "blocks.1.self_attn", "blocks.2.self_attn"]
    assert list(attention_modules(model)) == names
    assert self_attention_names(model) == names
    mha = MultiHeadAttention(16, 2)
    assert list(attention_modules(mha)) == [""]  # a bare layer is its own only module
    assert self_attention_names(mha) == []  # called without context or not, no block name


# -- weights and masks --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_every_kernel_records_the_manual_weights(kind: str) -> None:
    """A fast kernel never forms the weights; captured, it yields exactly what the readable
    kernel computes on the same model, and its outputs do not change."""
    model = _model(attention=kind)
    ids = torch.randint(0, V, (B, 7))  # (B, T)
    with torch.no_grad():
        plain = model(ids)
        with capture_attention(model) as rec:
            captured = model(ids)
        with forced_attention_kind(model, "manual"), capture_attention(model) as reference:
            model(ids)
    torch.testing.assert_close(captured, plain)
    names = self_attention_names(model)
    assert rec.names == names == ["blocks.0.self_attn", "blocks.1.self_attn"]
    assert len(rec) == 2 and [r.name for r in rec] == names
    causal = causal_mask(7)  # (T, S)
    for name in names:
        record = rec.last(name)
        assert record.module is attention_modules(model)[name]
        assert record.self_attention
        assert record.weights.shape == (B, H, 7, 7)  # (B, H, T, S)
        assert record.x.shape == (B, 7, 32)  # (B, T, C) the layer's (pre-normed) input
        assert torch.equal(record.allowed, causal.expand(B, H, 7, 7))
        assert torch.all(record.weights[~record.allowed] == 0)  # masked: exactly zero
        torch.testing.assert_close(record.weights.sum(-1), torch.ones(B, H, 7))
        torch.testing.assert_close(record.weights, reference.last(name).weights)
        assert record.kwargs["is_causal"] is True and "cache" not in record.kwargs


def test_padding_and_causal_mask_is_rebuilt_per_row() -> None:
    model = _model(attention="sdpa")
    ids = torch.tensor([[0, 0, 5, 6, 7], [4, 5, 6, 7, 8]])  # (B, T); row 0 left-padded
    real = ids != 0  # (B, T)
    with torch.no_grad(), capture_attention(model) as rec:
        model(ids, padding_mask=real)
    expected = (real[:, None, None, :] & causal_mask(5)).expand(B, H, 5, 5)  # (B, H, T, S)
    for name in self_attention_names(model):
        record = rec.last(name)
        assert torch.equal(record.allowed, expected)
        assert torch.all(record.weights[~record.allowed] == 0)
        has_key = record.allowed.any(-1)  # (B, H, T): pad queries see nothing at all
        assert not has_key[0, :, :2].any() and has_key[0, :, 2:].all()
        sums = record.weights.sum(-1)
        torch.testing.assert_close(sums[has_key], torch.ones_like(sums[has_key]))
        assert torch.all(sums[~has_key] == 0)  # zeros, never NaN


def test_cached_steps_get_an_end_aligned_mask_over_padded_cache() -> None:
    """Two new queries after a left-padded cached prompt: query i sits at S - T + i and sees
    every real key up to itself — the mask a cached step must apply."""
    model = _model(attention="sdpa", positional="rope")
    prompt = torch.tensor([[0, 0, 5, 6], [4, 5, 6, 7]])  # (B, T0); row 0 left-padded
    new = torch.tensor([[8, 9], [9, 8]])  # (B, T)
    cache = model.make_cache(B)
    with torch.no_grad():
        model(prompt, padding_mask=prompt != 0, cache=cache)
        with capture_attention(model) as rec:
            model(new, cache=cache)
    key_real = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # (B, S)
    expected = key_real[:, None, None, :] & torch.tensor([[1, 1, 1, 1, 1, 0],
                                                          [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    for name in self_attention_names(model):
        record = rec.last(name)
        assert record.weights.shape == (B, H, 2, 6)  # (B, H, T, S): all cached keys
        assert torch.equal(record.allowed, expected.expand(B, H, 2, 6))
        assert torch.all(record.weights[~record.allowed] == 0)
        torch.testing.assert_close(record.weights.sum(-1), torch.ones(B, H, 2))


def test_a_cached_step_attends_like_the_last_row_of_the_full_pass() -> None:
    model = _model(attention="sdpa", positional="rope")
    ids = torch.randint(0, V, (1, 6))  # (B, T)
    with torch.no_grad():
        with capture_attention(model) as full:
            model(ids)
        cache = model.make_cache(1)
        model(ids[:, :5], cache=cache)
        with capture_attention(model) as step:
            model(ids[:, 5:], cache=cache)
    for name in self_attention_names(model):
        record = step.last(name)
        assert record.weights.shape == (1, H, 1, 6)  # (B, H, T, S)
        assert record.allowed.all()  # one query at the end sees every cached key
        torch.testing.assert_close(record.weights[:, :, 0], full.last(name).weights[:, :, -1])


def test_allowed_mask_end_aligns_a_causal_mask_and_broadcasts_padding() -> None:
    weights = torch.zeros(1, 2, 2, 4)  # (B, H, T, S): two queries after two cached keys
    allowed = allowed_mask(weights, torch.tensor([[[[False, True, True, True]]]]), True)
    expected = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)  # (T, S)
    assert allowed.shape == (1, 2, 2, 4) and torch.equal(allowed[0, 1], expected)
    assert allowed_mask(weights, None, False).all()


def test_cross_attention_records_its_context_mask() -> None:
    mha = MultiHeadAttention(16, 2).eval()
    x, context = torch.randn(B, 3, 16), torch.randn(B, 5, 16)  # (B, T, C), (B, S, C)
    key_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)  # (B, S)
    with torch.no_grad(), capture_attention(mha) as rec:
        mha(x, context, mask=key_mask[:, None, None, :])
    (record,) = rec
    assert not record.self_attention and record.name == ""
    assert torch.equal(record.allowed, key_mask[:, None, None, :].expand(B, 2, 3, 5))
    assert torch.all(record.weights[0, :, :, 3:] == 0)


def test_the_caller_gets_what_it_asked_for() -> None:
    mha = MultiHeadAttention(16, 2, attention="sdpa").eval()
    x = torch.randn(1, 5, 16)  # (B, T, C)
    with torch.no_grad(), capture_attention(mha) as rec:
        _, given = mha(x, is_causal=True, need_weights=True)
        _, not_asked = mha(x, is_causal=True)
    assert given is not None and given.shape == (1, 2, 5, 5)
    assert not_asked is None  # the wrapper does not change what a caller receives
    assert len(rec.all("")) == 2 and rec.last("") is rec[1]


class _NoWeights(MultiHeadAttention):
    """A layer whose forward ignores need_weights."""

    def forward(self, x: Tensor, context: Tensor | None = None, **kw: Any
                ) -> tuple[Tensor, Tensor | None]:
        kw["need_weights"] = False
        return super().forward(x, context, **kw)


def test_a_layer_that_returns_no_weights_is_named_not_recorded() -> None:
    mha = _NoWeights(16, 2).eval()
    with torch.no_grad(), capture_attention(mha) as rec:
        mha(torch.randn(1, 3, 16))
    assert len(rec) == 0 and rec.unweighted == [""]
    with pytest.raises(KeyError, match="returned no weights"):
        rec.last("")
    with pytest.raises(KeyError, match="was not called"):
        rec.last("blocks.0.self_attn")


# -- no trace left -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["manual", "sdpa"])
def test_capture_leaves_nothing_on_the_model(kind: str) -> None:
    model = _model(attention=kind)
    before = _snapshot(model)
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad(), capture_attention(model) as rec:
        assert all("forward" in vars(m) for m in attention_modules(model).values())
        model(torch.randint(0, V, (1, 9)))
    assert rec.names  # it did capture something
    _assert_untouched(model, before)
    after_state = model.state_dict()
    assert after_state.keys() == before_state.keys()
    assert all(torch.equal(after_state[k], before_state[k]) for k in before_state)


def _float_mask_in_a_block(model: DecoderLM) -> None:  # raises inside a wrapped forward
    model.blocks[0](torch.randn(1, 3, 32), mask=torch.ones(3, 3))


def _cache_overflow(model: DecoderLM) -> None:  # raises before any attention call
    model(torch.tensor([[4, 5, 6]]), cache=model.make_cache(1, max_len=2))


def _ids_out_of_range(model: DecoderLM) -> None:  # raises before any attention call
    model(torch.full((1, 4), 10_000))


@pytest.mark.parametrize(("call", "message"), [
    (_float_mask_in_a_block, "must be boolean"),
    (_cache_overflow, "overflow"),
    (_ids_out_of_range, "token ids must lie"),
])
def test_the_model_is_restored_when_the_forward_raises(call: Any, message: str) -> None:
    model = _model()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=message), capture_attention(model) as rec:
        call(model)
    assert len(rec) == 0
    _assert_untouched(model, before)
    with torch.no_grad(), capture_attention(model) as rec:  # and it captures again
        model(torch.zeros(B, 5, dtype=torch.long))
    assert [r.weights.shape for r in rec] == [torch.Size([B, H, 5, 5])] * 2


def test_a_forward_of_the_instance_own_is_put_back() -> None:
    mha = MultiHeadAttention(16, 2).eval()
    own = mha.forward  # a bound method stored on the instance, as a user's patch would be
    mha.forward = own  # type: ignore[method-assign]
    with torch.no_grad(), capture_attention(mha) as rec:
        mha(torch.randn(1, 3, 16))
    assert len(rec) == 1 and vars(mha)["forward"] is own


def test_nested_captures_both_record_and_unwind_to_the_plain_model() -> None:
    model = _model()
    before = _snapshot(model)
    with torch.no_grad(), capture_attention(model) as outer, capture_attention(model) as inner:
        model(torch.randint(0, V, (1, 4)))
    assert inner.names == outer.names == self_attention_names(model)
    for a, b in zip(inner, outer, strict=True):
        assert torch.equal(a.weights, b.weights)
    _assert_untouched(model, before)


# -- forced kernel -----------------------------------------------------------------------------
def test_forced_kind_switches_every_layer_and_restores_each_one() -> None:
    model = _model(attention="sdpa")
    layers = list(attention_modules(model).values())
    layers[1].attention = "tiled"  # mixed kernels: each layer gets its own back
    with forced_attention_kind(model, "manual") as switched:
        assert switched == 2 and all(m.attention == "manual" for m in layers)
    assert [m.attention for m in layers] == ["sdpa", "tiled"]
    with pytest.raises(RuntimeError, match="boom"), forced_attention_kind(model, "tiled"):
        raise RuntimeError("boom")
    assert [m.attention for m in layers] == ["sdpa", "tiled"]
    with pytest.raises(ValueError, match="unknown attention kind"), \
            forced_attention_kind(model, "flash"):
        pass
    assert [m.attention for m in layers] == ["sdpa", "tiled"]
