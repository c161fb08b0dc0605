"""DecoderLM: a GPT-style causal language model built from handformer's pieces.

ids (B, T) → token embedding (+ positions) → N × TransformerBlock (causal) → [LayerNorm] →
linear head → logits (B, T, V). The model returns logits; losses live in ``handformer.loss``.

Shape legend: ``B`` batch, ``T`` sequence, ``C`` model dim, ``V`` vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from handformer.config import ModelConfig
from handformer.masks import combine_masks
from handformer.nn.block import TransformerBlock
from handformer.nn.positional import build_positional

__all__ = ["DecoderLM", "positions_from_padding"]


def positions_from_padding(padding_mask: Tensor) -> Tensor:
    """Position ids that count only real tokens: (B, T) bool → (B, T) long.

    A left-padded row ``[pad, pad, a, b]`` gets positions ``[0, 0, 0, 1]``, so a prompt has
    the same positions however much padding precedes it; right padding leaves 0..n-1.
    """
    return (padding_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


class DecoderLM(nn.Module):
    """Causal language model. ``forward(ids, padding_mask=None) -> logits (B, T, V)``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.token_embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.positions = build_positional(c.positional, c.d_model, c.max_len)
        # Sinusoidal values are O(1) while embeddings start at std 0.02: scale the embeddings
        # by √C as in the original paper so the tokens are not drowned out.
        self.embed_scale = math.sqrt(c.d_model) if c.positional == "sinusoidal" else 1.0
        self.dropout = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(
                c.d_model,
                c.n_heads,
                c.d_ff,
                dropout=c.dropout,
                norm=c.norm,
                activation=c.activation,
                attention=c.attention,  # type: ignore[arg-type]
                bias=c.bias,
            )
            for _ in range(c.n_layers)
        )
        # Pre-norm leaves the residual stream un-normalised, so it needs a final LayerNorm;
        # post-norm blocks already end in one.
        self.final_norm: nn.Module = (
            nn.LayerNorm(c.d_model, bias=c.bias) if c.norm == "pre" else nn.Identity()
        )
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_weights:
            self.lm_head.weight = self.token_embedding.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual output projections scaled by 1/√(2L)."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if param.dim() < 2:
                if name.endswith("bias"):
                    nn.init.zeros_(param)
                continue
            std = residual_std if name.endswith(("out_proj.weight", "fc_out.weight")) else 0.02
            nn.init.normal_(param, mean=0.0, std=std)
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def num_parameters(self, *, exclude_positions: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        if exclude_positions and isinstance(self.positions, nn.Module):
            total -= sum(p.numel() for p in self.positions.parameters())
        return total

    def forward(self, ids: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """ids (B, T) long; ``padding_mask`` (B, T) bool, True on real tokens (left or right
        padding). Returns logits (B, T, V)."""
        if ids.dim() != 2:
            raise ValueError(f"DecoderLM expects ids of shape (B, T); got {tuple(ids.shape)}")
        if ids.dtype not in (torch.long, torch.int, torch.int32, torch.int64):
            raise ValueError(f"ids must be an integer tensor; got {ids.dtype}")
        _b, t = ids.shape
        if padding_mask is not None and padding_mask.shape != ids.shape:
            raise ValueError(
                f"padding_mask shape {tuple(padding_mask.shape)} != ids shape {tuple(ids.shape)};"
                " expected (B, T) bool with True on real tokens"
            )
        if t > self.config.max_len and self.config.positional == "learned":
            # Let the positional module raise its explanatory error.
            self.positions(torch.arange(t, device=ids.device))
        vocab = self.config.vocab_size
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(
                f"token ids must lie in [0, {vocab}); got min {int(ids.min())}, "
                f"max {int(ids.max())} — was the tokenizer built for this model?"
            )

        if padding_mask is None:
            positions = torch.arange(t, device=ids.device)  # (T,)
            mask = None  # plain causal attention: lets the fused kernel take its fastest path
        else:
            positions = positions_from_padding(padding_mask)  # (B, T)
            mask = combine_masks(padding_mask.bool())  # (B, 1, 1, T)

        x = self.token_embedding(ids) * self.embed_scale  # (B, T, C)
        x = self.dropout(x + self.positions(positions))  # (B, T, C)
        for block in self.blocks:
            x = block(x, mask=mask, is_causal=True)  # (B, T, C)
        return self.lm_head(self.final_norm(x))  # (B, T, V)
