"""Copy handformer weights into torch's own modules, to prove the two compute the same thing.

handformer's layouts were chosen to match torch's (fused ``in_proj`` for Q/K/V, the FFN as
two linears), so each copy is a plain parameter-for-parameter assignment.
"""

from __future__ import annotations

import torch
from torch import nn

from handformer.nn.attention import MultiHeadAttention
from handformer.nn.block import TransformerBlock

__all__ = ["to_torch_encoder_layer", "to_torch_multihead_attention"]


def _copy(dst: nn.Parameter | None, src: torch.Tensor | None, what: str) -> None:
    if dst is None or src is None:
        if dst is not None or src is not None:
            raise ValueError(f"{what}: one side has a bias and the other does not")
        return
    if dst.shape != src.shape:
        raise ValueError(f"{what}: shape {tuple(src.shape)} cannot go into {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def to_torch_multihead_attention(mha: MultiHeadAttention) -> nn.MultiheadAttention:
    """An ``nn.MultiheadAttention`` (batch_first) with ``mha``'s weights, in eval mode."""
    ref = nn.MultiheadAttention(mha.d_model, mha.n_heads, dropout=mha.dropout,
                                bias=mha.in_proj.bias is not None, batch_first=True)
    _copy(ref.in_proj_weight, mha.in_proj.weight, "in_proj.weight")
    _copy(ref.in_proj_bias, mha.in_proj.bias, "in_proj.bias")
    _copy(ref.out_proj.weight, mha.out_proj.weight, "out_proj.weight")
    _copy(ref.out_proj.bias, mha.out_proj.bias, "out_proj.bias")
    return ref.eval()


def to_torch_encoder_layer(block: TransformerBlock) -> nn.TransformerEncoderLayer:
    """An ``nn.TransformerEncoderLayer`` (batch_first, ``norm_first`` = pre-norm) with
    ``block``'s weights, in eval mode. Blocks with cross-attention have no such twin."""
    if block.cross_attn is not None:
        raise ValueError("a block with cross-attention maps to nn.TransformerDecoderLayer, "
                         "not nn.TransformerEncoderLayer")
    attn, ffn = block.self_attn, block.ffn
    has_bias = attn.in_proj.bias is not None
    ref = nn.TransformerEncoderLayer(
        attn.d_model, attn.n_heads, dim_feedforward=ffn.fc_in.out_features,
        dropout=attn.dropout, activation=ffn.activation, layer_norm_eps=block.norm1.eps,
        batch_first=True, norm_first=block.norm == "pre", bias=has_bias,
    )
    ref.self_attn = to_torch_multihead_attention(attn)
    pairs = [
        (ref.linear1, ffn.fc_in), (ref.linear2, ffn.fc_out),
        (ref.norm1, block.norm1), (ref.norm2, block.norm2),
    ]
    for dst, src in pairs:
        _copy(dst.weight, src.weight, f"{type(src).__name__}.weight")
        _copy(dst.bias, src.bias, f"{type(src).__name__}.bias")
    return ref.eval()
