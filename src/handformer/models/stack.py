"""The block stack every handformer model is built from: ``config.n_layers`` copies of the
one ``TransformerBlock``, configured from a ``ModelConfig`` — and the KV cache that a stack of
causal self-attention blocks decodes with (the decoder LM's and the seq2seq decoder's)."""

from __future__ import annotations

from torch import nn

from handformer.config import ModelConfig
from handformer.nn.block import TransformerBlock
from handformer.nn.kv_cache import DecoderCache
from handformer.nn.positional import ADDITIVE_KINDS

__all__ = ["build_blocks", "make_cache"]


def build_blocks(config: ModelConfig, *, cross_attention: bool = False) -> nn.ModuleList:
    """``config.n_layers`` TransformerBlocks; the only block class every model uses."""
    c = config
    return nn.ModuleList(
        TransformerBlock(
            c.d_model,
            c.n_heads,
            c.d_ff,
            dropout=c.dropout,
            norm=c.norm,
            activation=c.activation,
            attention=c.attention,  # type: ignore[arg-type]
            bias=c.bias,
            cross_attention=cross_attention,
            n_kv_heads=c.n_kv_heads,
            positional="none" if c.positional in ADDITIVE_KINDS else c.positional,
            rope_base=c.rope_base,
            rope_scaling=c.rope_scaling_spec,
            layer_norm_eps=c.layer_norm_eps,
            norm_type=c.norm_type,
            qk_norm=c.qk_norm,
            head_dim=c.head_dim,
        )
        for _ in range(c.n_layers)
    )


def make_cache(model: nn.Module, config: ModelConfig, batch_size: int,
               max_len: int | None = None) -> DecoderCache:
    """Preallocated KV buffers for the self-attention of ``model``'s ``config.n_layers``
    blocks: ``batch_size`` rows, up to ``max_len`` tokens (default: ``config.max_len``), in
    the dtype and on the device of the model's parameters. Keys/values are stored once per
    KV head, so grouped-query attention shrinks the cache by ``n_heads / n_kv_heads``."""
    c = config
    param = next(model.parameters())
    return DecoderCache(c.n_layers, batch_size, c.n_kv_heads, max_len or c.max_len, c.head_dim,
                        dtype=param.dtype, device=param.device)
