"""Encoder and EncoderClassifier: bidirectional blocks over padded batches.

ids (B, T) → token embedding (+ positions) → N × TransformerBlock (no causal mask, padding
mask on the keys) → [LayerNorm] → hidden states (B, T, C). ``EncoderClassifier`` pools the
hidden states of each sequence into one vector (its first real token, or the mean over its
real tokens), applies dropout and a linear head: logits (B, K).

Padding, the rule every piece here follows: a pad position may *receive* information (its
own hidden state is computed, and ignored) but no query ever attends *to* it, and pooling
never reads it. So a sequence's outputs do not depend on how much padding its batch needed.

The encoder is the shared ``Trunk`` (``models/trunk.py``: embedding → blocks → final norm)
without a head, run without a causal mask: the decoder LM, this encoder and the seq2seq
decoder are one body.

Shape legend: ``B`` batch, ``T`` sequence, ``C`` model dim, ``K`` classes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from handformer.config import POOLING_KINDS, ClassifierConfig, ModelConfig
from handformer.masks import combine_masks
from handformer.models.budget import check_model_fits
from handformer.models.embedding import check_ids
from handformer.models.trunk import Trunk

__all__ = [
    "Encoder",
    "EncoderClassifier",
    "pool",
]


class Encoder(Trunk):
    """Bidirectional Transformer encoder: ``forward(ids, padding_mask) -> (B, T, C)``.

    ``final_norm=None`` follows the stack's norm placement: pre-norm leaves the residual
    stream un-normalised and needs a last norm, post-norm blocks already end in one.
    ``EncoderDecoder`` asks for one either way (as ``nn.Transformer`` builds it).
    """

    def __init__(self, config: ModelConfig, *, final_norm: bool | None = None,
                 causal: bool = False) -> None:
        check_model_fits(config, type(self).__name__)  # before torch allocates anything
        super().__init__(config, final_norm=final_norm, head=False)
        self.causal = causal  # a decoder's body: each token reads only those before it

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
        return self.run_blocks(x, mask=mask, is_causal=self.causal, positions=positions)


def pool(hidden: Tensor, padding_mask: Tensor | None, kind: str) -> Tensor:
    """(B, T, C) → (B, C): the first *real* token (``cls``), the last (``last``) or the mean
    over real tokens.

    Padding never enters: ``cls`` picks each row's first True position and ``last`` its last
    (either side may be padded), ``mean`` divides the masked sum by the number of real tokens.
    """
    if kind not in POOLING_KINDS:
        raise ValueError(f"unknown pooling {kind!r}; expected one of {POOLING_KINDS}")
    if padding_mask is None:
        if kind == "last":
            return hidden[:, -1]  # (B, C)
        return hidden[:, 0] if kind == "cls" else hidden.mean(dim=1)  # (B, C)
    if kind == "last":
        t = padding_mask.shape[1]
        last = t - 1 - padding_mask.flip(1).int().argmax(dim=1)  # (B,) index of the last True
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # (B, C)
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
        self.encoder = Encoder(config.encoder, causal=config.causal)
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
