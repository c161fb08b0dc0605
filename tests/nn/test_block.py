"""TransformerBlock and FeedForward vs ``nn.TransformerEncoderLayer`` with copied weights.

Eval mode (dropout off); fp32 at ``assert_close`` defaults.
"""

from __future__ import annotations

import pytest
import torch

from handformer.interop.torch_nn import to_torch_encoder_layer
from handformer.masks import causal_mask, combine_masks, to_torch_key_padding_mask
from handformer.nn.block import TransformerBlock


def _randomise(block: TransformerBlock) -> None:
    """Non-trivial LayerNorm gains/biases so a swapped norm would be caught."""
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 and p.shape[0] else 0.0))


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("path", ["manual", "sdpa", "tiled"])
def test_block_matches_transformer_encoder_layer(norm: str, activation: str, path: str) -> None:
    block = TransformerBlock(32, 4, 64, norm=norm, activation=activation, attention=path)
    _randomise(block)
    block.eval()
    ref = to_torch_encoder_layer(block)
    x = torch.randn(3, 6, 32)
    pad = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4]).bool()
    ours = block(x, mask=combine_masks(pad))
    expected = ref(x, src_key_padding_mask=to_torch_key_padding_mask(pad))
    real = pad[..., None].expand_as(ours)
    # torch's fast path may leave padded positions as zeros: compare real tokens.
    torch.testing.assert_close(ours[real], expected[real])


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_causal_block_matches_encoder_layer_with_causal_mask(norm: str) -> None:
    block = TransformerBlock(32, 4, 64, norm=norm, activation="gelu")
    _randomise(block)
    block.eval()
    ref = to_torch_encoder_layer(block)
    x = torch.randn(2, 7, 32)
    ours = block(x, is_causal=True)
    expected = ref(x, src_mask=~causal_mask(7), is_causal=True)
    torch.testing.assert_close(ours, expected)
    torch.testing.assert_close(block(x, mask=causal_mask(7)), ours)


def test_cross_attention_block_needs_context() -> None:
    block = TransformerBlock(32, 4, 64, cross_attention=True)
    with pytest.raises(ValueError, match="pass context"):
        block(torch.randn(1, 3, 32))
    out = block(torch.randn(1, 3, 32), context=torch.randn(1, 5, 32))
    assert out.shape == (1, 3, 32)


def test_unknown_norm_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="norm placement 'middle'"):
        TransformerBlock(32, 4, 64, norm="middle")
