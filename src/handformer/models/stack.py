"""The block stack every handformer model is built from: ``config.n_layers`` copies of the
one ``TransformerBlock``, configured from a ``ModelConfig``."""

from __future__ import annotations

from torch import nn

from handformer.config import ModelConfig
from handformer.nn.block import TransformerBlock
from handformer.nn.positional import ADDITIVE_KINDS

__all__ = ["build_blocks"]


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
            layer_norm_eps=c.layer_norm_eps,
        )
        for _ in range(c.n_layers)
    )
