"""capture_attention: every layer's weights for one forward pass, and no trace left behind."""

from __future__ import annotations

import pytest
import torch

from handformer.explore.attention_capture import capture_attention, self_attention_names
from handformer.masks import causal_mask
from handformer.models.decoder_lm import DecoderLM
from handformer.nn.attention import MultiHeadAttention
from tests.conftest import tiny_config


def _model(**overrides) -> DecoderLM:
    return DecoderLM(tiny_config(**overrides)).eval()


def _module_attrs(model: torch.nn.Module) -> dict[str, set[str]]:
    return {name: set(vars(m)) for name, m in model.named_modules()}


@pytest.mark.parametrize("kind", ["manual", "sdpa", "tiled"])
def test_weights_per_layer_are_causal_softmaxes(kind: str) -> None:
    model = _model(attention=kind)
    ids = torch.randint(0, 37, (2, 7))  # (B, T)
    with torch.no_grad(), capture_attention(model) as rec:
        model(ids)
    names = self_attention_names(model)
    assert names == ["blocks.0.self_attn", "blocks.1.self_attn"]
    causal = causal_mask(7)  # (T, S)
    for name in names:
        record = rec.last(name)
        assert record.weights.shape == (2, 4, 7, 7)  # (B, H, T, S)
        assert torch.equal(record.allowed, causal.expand(2, 4, 7, 7))
        assert torch.all(record.weights[~record.allowed] == 0)  # masked: exactly zero
        torch.testing.assert_close(record.weights.sum(-1), torch.ones(2, 4, 7))


@pytest.mark.parametrize("kind", ["manual", "sdpa"])
def test_capture_leaves_no_trace_and_does_not_change_outputs(kind: str) -> None:
    model = _model(attention=kind)
    ids = torch.randint(0, 37, (1, 9))
    before_attrs = _module_attrs(model)
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        plain = model(ids)
        with capture_attention(model) as rec:
            captured = model(ids)
            assert all("forward" in vars(m) for m in model.modules()
                       if isinstance(m, MultiHeadAttention))
    torch.testing.assert_close(captured, plain)
    assert rec.names  # it did capture something
    assert _module_attrs(model) == before_attrs  # no wrapper, no stored weights
    after_state = model.state_dict()
    assert after_state.keys() == before_state.keys()
    assert all(torch.equal(after_state[k], before_state[k]) for k in before_state)


def test_wrappers_are_removed_when_the_forward_raises() -> None:
    model = _model()
    cache = model.make_cache(1, max_len=2)  # too small for three tokens: overflows inside attention
    with pytest.raises(ValueError, match="overflow"), capture_attention(model):
        model(torch.tensor([[4, 5, 6]]), cache=cache)
    assert not any("forward" in vars(m) for m in model.modules())


def test_nested_captures_unwind_to_the_plain_model() -> None:
    model = _model()
    ids = torch.randint(0, 37, (1, 4))
    with torch.no_grad(), capture_attention(model) as outer, capture_attention(model) as inner:
        model(ids)
    assert inner.names == outer.names == self_attention_names(model)
    assert not any("forward" in vars(m) for m in model.modules())


def test_caller_asking_for_weights_still_gets_them() -> None:
    mha = MultiHeadAttention(16, 2, attention="sdpa").eval()
    x = torch.randn(1, 5, 16)  # (B, T, C)
    with torch.no_grad(), capture_attention(mha) as rec:
        _, given = mha(x, is_causal=True, need_weights=True)
        _, not_asked = mha(x, is_causal=True)
    assert given is not None and given.shape == (1, 2, 5, 5)
    assert not_asked is None  # the wrapper does not change what a caller receives
    assert len(rec.all("")) == 2


def test_cached_step_attends_over_all_cached_keys_like_the_full_pass() -> None:
    """A cached decoding step's (1, H, 1, S) weights equal the last row of the full
    (T, T) weights: the cache holds exactly the keys the full pass computes."""
    model = _model(attention="sdpa", positional="rope")
    ids = torch.randint(0, 37, (1, 6))  # (B, T)
    with torch.no_grad():
        with capture_attention(model) as full:
            model(ids)
        cache = model.make_cache(1)
        model(ids[:, :5], cache=cache)
        with capture_attention(model) as step:
            model(ids[:, 5:], cache=cache)
    for name in self_attention_names(model):
        row = step.last(name).weights  # (1, H, 1, S)
        assert row.shape == (1, 4, 1, 6)
        torch.testing.assert_close(row[:, :, 0], full.last(name).weights[:, :, -1])


def test_left_padding_gets_zero_weight() -> None:
    model = _model(attention="sdpa")
    ids = torch.tensor([[0, 0, 5, 6, 7], [4, 5, 6, 7, 8]])  # (B, T); 0 = <pad>
    real = ids != 0  # (B, T)
    with torch.no_grad(), capture_attention(model) as rec:
        model(ids, padding_mask=real)
    for name in rec.names:
        record = rec.last(name)
        assert torch.all(record.weights[0, :, :, :2] == 0)  # padded keys of row 0
        assert not record.allowed[0, :, :, :2].any()
        has_key = record.allowed.any(-1)  # (B, H, T): pad queries may see nothing
        sums = record.weights.sum(-1)
        torch.testing.assert_close(sums[has_key], torch.ones_like(sums[has_key]))
        assert torch.all(sums[~has_key] == 0)
