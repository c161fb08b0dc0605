"""Copy handformer weights into torch's own modules, to prove the two compute the same thing
(a parity helper of the test suite and the tour; nothing in ``src/`` uses it).

Blocks go to ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``; whole stacks to
``nn.TransformerEncoder`` (an ``Encoder``) and ``nn.Transformer`` (an ``EncoderDecoder``).

handformer's layouts were chosen to match torch's (fused ``in_proj`` for Q/K/V, the FFN as
two linears), so each copy is a plain parameter-for-parameter assignment.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from handformer.config import ModelConfig
from handformer.models.encoder import Encoder
from handformer.models.seq2seq import EncoderDecoder
from handformer.nn.attention import MultiHeadAttention
from handformer.nn.block import TransformerBlock

__all__ = [
    "to_torch_decoder_layer",
    "to_torch_encoder_layer",
    "to_torch_multihead_attention",
    "to_torch_transformer",
    "to_torch_transformer_encoder",
]


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


def _copy_norm(dst: nn.LayerNorm, src: nn.Module, what: str) -> None:
    if not isinstance(src, nn.LayerNorm):
        raise ValueError(f"{what}: expected an nn.LayerNorm to copy; got {type(src).__name__}")
    _copy(dst.weight, src.weight, f"{what}.weight")
    _copy(dst.bias, src.bias, f"{what}.bias")


def to_torch_decoder_layer(block: TransformerBlock) -> nn.TransformerDecoderLayer:
    """An ``nn.TransformerDecoderLayer`` (batch_first) with ``block``'s weights, in eval mode.

    torch's order is self-attention, cross-attention (``multihead_attn``), FFN with
    ``norm1``/``norm2``/``norm3``; the block's are ``norm1``, ``norm_cross``, ``norm2``."""
    if block.cross_attn is None:
        raise ValueError("a block without cross-attention maps to nn.TransformerEncoderLayer, "
                         "not nn.TransformerDecoderLayer")
    attn, ffn = block.self_attn, block.ffn
    ref = nn.TransformerDecoderLayer(
        attn.d_model, attn.n_heads, dim_feedforward=ffn.fc_in.out_features,
        dropout=attn.dropout, activation=ffn.activation, layer_norm_eps=block.norm1.eps,
        batch_first=True, norm_first=block.norm == "pre", bias=attn.in_proj.bias is not None,
    )
    ref.self_attn = to_torch_multihead_attention(attn)
    ref.multihead_attn = to_torch_multihead_attention(block.cross_attn)
    for dst, src in [(ref.linear1, ffn.fc_in), (ref.linear2, ffn.fc_out)]:
        _copy(dst.weight, src.weight, "FeedForward linear.weight")
        _copy(dst.bias, src.bias, "FeedForward linear.bias")
    _copy_norm(ref.norm1, block.norm1, "norm1")
    _copy_norm(ref.norm2, block.norm_cross, "norm_cross")
    _copy_norm(ref.norm3, block.norm2, "norm2")
    return ref.eval()


def _check_torch_compatible(config: ModelConfig, what: str) -> None:
    if config.positional not in ("sinusoidal", "learned"):
        raise ValueError(f"{what}: positional={config.positional!r} works inside attention and "
                         "torch's layers have no twin; use 'learned' or 'sinusoidal'")
    if config.n_kv_heads != config.n_heads:
        raise ValueError(f"{what}: grouped-query attention (n_kv_heads={config.n_kv_heads} != "
                         f"n_heads={config.n_heads}) has no nn.MultiheadAttention twin")


def to_torch_transformer_encoder(encoder: Encoder) -> nn.TransformerEncoder:
    """An ``nn.TransformerEncoder`` computing ``encoder.encode_embedded``, in eval mode.

    Its final ``norm`` is the encoder's final LayerNorm, or ``None`` when it has none."""
    _check_torch_compatible(encoder.config, "Encoder")
    layers = [to_torch_encoder_layer(block) for block in encoder.blocks]  # type: ignore[arg-type]
    ref = nn.TransformerEncoder(layers[0], num_layers=len(layers), enable_nested_tensor=False)
    ref.layers = nn.ModuleList(layers)
    if isinstance(encoder.final_norm, nn.LayerNorm):
        norm = nn.LayerNorm(encoder.config.d_model, eps=encoder.final_norm.eps,
                            bias=encoder.final_norm.bias is not None)
        _copy_norm(norm, encoder.final_norm, "final_norm")
        ref.norm = norm
    return ref.eval()


def to_torch_transformer(model: EncoderDecoder) -> nn.Transformer:
    """An ``nn.Transformer`` (batch_first) with ``model``'s encoder and decoder stacks, in eval
    mode. It maps embeddings to hidden states: feed it ``model.encoder.embed(src)`` and
    ``model.decoder.embed(tgt)`` and apply ``model.decoder.lm_head`` to its output."""
    enc, dec = model.config.encoder, model.config.decoder
    _check_torch_compatible(enc, "encoder")
    _check_torch_compatible(dec, "decoder")
    shared = ("n_heads", "d_ff", "norm", "activation", "bias")
    differ = [n for n in shared if getattr(enc, n) != getattr(dec, n)]
    if differ:
        raise ValueError(f"nn.Transformer uses one setting for both stacks; encoder and decoder "
                         f"differ in {differ}")
    with warnings.catch_warnings():  # its default encoder warns about nested tensors
        warnings.simplefilter("ignore", UserWarning)
        ref = nn.Transformer(
            enc.d_model, enc.n_heads, num_encoder_layers=enc.n_layers,
            num_decoder_layers=dec.n_layers, dim_feedforward=enc.d_ff, dropout=enc.dropout,
            activation=enc.activation, batch_first=True, norm_first=enc.norm == "pre",
            bias=enc.bias,
        )
    # Replace the stacks after construction: nn.Transformer re-initialises every parameter
    # at the end of __init__, custom_encoder/custom_decoder included.
    ref.encoder = to_torch_transformer_encoder(model.encoder)
    ref.decoder.layers = nn.ModuleList(
        to_torch_decoder_layer(block) for block in model.decoder.blocks  # type: ignore[arg-type]
    )
    _copy_norm(ref.decoder.norm, model.decoder.final_norm, "decoder.final_norm")
    return ref.eval()
