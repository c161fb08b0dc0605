"""Encoder and EncoderClassifier: bidirectional blocks over padded batches.

ids (B, T) → token embedding (+ positions) → N × TransformerBlock (no causal mask, padding
mask on the keys) → [LayerNorm] → hidden states (B, T, C). ``EncoderClassifier`` pools the
hidden states of each sequence into one vector (its first real token, or the mean over its
real tokens), applies dropout and a linear head: logits (B, K).

Padding, the rule every piece here follows: a pad position may *receive* information (its
own hidden state is computed, and ignored) but no query ever attends *to* it, and pooling
never reads it. So a sequence's outputs do not depend on how much padding its batch needed.

The embedding stage (``TokenEmbedding``, ``check_ids``) lives in ``models/embedding.py``
and the block stack (``build_blocks``) in ``models/stack.py``: the decoder LM, this encoder
and the seq2seq model are all built from the same pieces and the one ``TransformerBlock``.

Shape legend: ``B`` batch, ``T`` sequence, ``C`` model dim, ``K`` classes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from handformer.config import POOLING_KINDS, ClassifierConfig, ModelConfig
from handformer.masks import combine_masks
from handformer.models.budget import check_model_fits
from handformer.models.embedding import TokenEmbedding, check_ids
from handformer.models.stack import build_blocks
from handformer.nn.init import init_weights
from handformer.nn.norm import make_norm
from handformer.nn.positional import ADDITIVE_KINDS

__all__ = [
    "Encoder",
    "EncoderClassifier",
    "pool",
]


class Encoder(nn.Module):
    """Bidirectional Transformer encoder: ``forward(ids, padding_mask) -> (B, T, C)``.

    ``final_norm=None`` follows the stack's norm placement: pre-norm leaves the residual
    stream un-normalised and needs a last LayerNorm, post-norm blocks already end in one.
    ``EncoderDecoder`` asks for one either way (as ``nn.Transformer`` builds it).
    """

    def __init__(self, config: ModelConfig, *, final_norm: bool | None = None) -> None:
        check_model_fits(config, type(self).__name__)  # before torch allocates anything
        super().__init__()
        self.config = config
        self.embed = TokenEmbedding(config)
        self.blocks = build_blocks(config)
        self._in_attention_positions = config.positional not in ADDITIVE_KINDS
        use_norm = config.norm == "pre" if final_norm is None else final_norm
        self.final_norm: nn.Module = (
            make_norm(config.norm_type, config.d_model, eps=config.layer_norm_eps,
                      bias=config.bias)
            if use_norm else nn.Identity()
        )
        init_weights(self, config.n_layers, zero_out=config.zero_init_out)

    def forward(self, ids: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """ids (B, T) long; ``padding_mask`` (B, T) bool, True on real tokens (either side).
        Returns hidden states (B, T, C); rows at pad positions are computed but meaningless."""
        check_ids(ids, padding_mask, self.config.vocab_size, type(self).__name__)
        x, positions = self.embed(ids, padding_mask)  # (B, T, C)
        return self.encode_embedded(x, padding_mask, positions)

    def encode_embedded(
        self, x: Tensor, padding_mask: Tensor | None = None, positions: Tensor | None = None
    ) -> Tensor:
        """The block stack alone: x (B, T, C) → (B, T, C). Parity tests feed it directly."""
        mask = None if padding_mask is None else combine_masks(padding_mask)  # (B, 1, 1, T)
        extra: dict[str, Any] = {}
        if self._in_attention_positions:  # RoPE / ALiBi read the positions inside attention
            if positions is None:
                positions = torch.arange(x.shape[1], device=x.device)  # (T,)
            extra = {"positions": positions, "key_positions": positions}
        for block in self.blocks:
            x = block(x, mask=mask, **extra)  # (B, T, C)
        return self.final_norm(x)


def pool(hidden: Tensor, padding_mask: Tensor | None, kind: str) -> Tensor:
    """(B, T, C) → (B, C): the first *real* token (``cls``) or the mean over real tokens.

    Padding never enters: ``cls`` picks each row's first True position (left padding
    works), ``mean`` divides the masked sum by the number of real tokens.
    """
    if kind not in POOLING_KINDS:
        raise ValueError(f"unknown pooling {kind!r}; expected one of {POOLING_KINDS}")
    if padding_mask is None:
        return hidden[:, 0] if kind == "cls" else hidden.mean(dim=1)  # (B, C)
    if kind == "cls":
        first = padding_mask.int().argmax(dim=1)  # (B,) index of the first True
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), first]  # (B, C)
    weights = padding_mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)  # (B, C)


class EncoderClassifier(nn.Module):
    """Sequence classifier: ``forward(ids, padding_mask) -> logits (B, K)``."""

    def __init__(self, config: ClassifierConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config.encoder)
        self.dropout = nn.Dropout(config.head_dropout)
        self.head = nn.Linear(config.encoder.d_model, config.num_classes)
        nn.init.normal_(self.head.weight, std=0.02)
        nn.init.zeros_(self.head.bias)

    def num_parameters(self) -> int:
        """Parameter count (a tied weight counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, ids: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """ids (B, T) long; ``padding_mask`` (B, T) bool, True on real tokens.
        Returns logits (B, K)."""
        hidden = self.encoder(ids, padding_mask)  # (B, T, C)
        pooled = pool(hidden, padding_mask, self.config.pooling)  # (B, C)
        return self.head(self.dropout(pooled))  # (B, K)
