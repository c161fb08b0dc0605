"""Encoder and EncoderClassifier: bidirectional blocks over padded batches.

ids (B, T) → token embedding (+ positions) → N × TransformerBlock (no causal mask, padding
mask on the keys) → [LayerNorm] → hidden states (B, T, C). ``EncoderClassifier`` pools the
hidden states of each sequence into one vector (its first real token, or the mean over its
real tokens), applies dropout and a linear head: logits (B, K).

Padding, the rule every piece here follows: a pad position may *receive* information (its
own hidden state is computed, and ignored) but no query ever attends *to* it, and pooling
never reads it. So a sequence's outputs do not depend on how much padding its batch needed.

The pieces shared with the decoder side of ``models/seq2seq.py`` live here too:
``TokenEmbedding`` (ids → vectors) and ``build_blocks`` (a stack of the one
``TransformerBlock``), so every model is built from the same block.

Shape legend: ``B`` batch, ``T`` sequence, ``C`` model dim, ``K`` classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from handformer.config import ModelConfig
from handformer.masks import combine_masks
from handformer.models.decoder_lm import positions_from_padding
from handformer.models.stack import build_blocks  # re-exported: seq2seq imports it from here
from handformer.nn.init import init_weights  # re-exported: seq2seq imports it from here
from handformer.nn.positional import ADDITIVE_KINDS, build_positional

__all__ = [
    "POOLING_KINDS",
    "ClassifierConfig",
    "Encoder",
    "EncoderClassifier",
    "TokenEmbedding",
    "build_blocks",
    "check_ids",
    "init_weights",
    "pool",
]

POOLING_KINDS: tuple[str, ...] = ("cls", "mean")


def check_ids(ids: Tensor, padding_mask: Tensor | None, vocab_size: int, who: str) -> None:
    """Raise ``ValueError`` naming expected vs received for bad ids / padding masks."""
    if ids.dim() != 2:
        raise ValueError(f"{who} expects ids of shape (B, T); got {tuple(ids.shape)}")
    if ids.dtype not in (torch.long, torch.int32):
        raise ValueError(f"{who}: ids must be an integer tensor (long); got {ids.dtype}")
    if ids.shape[1] == 0:
        raise ValueError(f"{who}: ids have no tokens (T = 0); got {tuple(ids.shape)}")
    if padding_mask is not None:
        if padding_mask.shape != ids.shape or padding_mask.dtype != torch.bool:
            raise ValueError(
                f"{who}: padding_mask must be bool (B, T) = {tuple(ids.shape)} with True on "
                f"real tokens; got {padding_mask.dtype} {tuple(padding_mask.shape)}"
            )
        empty = (~padding_mask.any(dim=1)).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"{who}: rows {empty[:5]} of the batch have no real token "
                             "(padding_mask all False); drop empty sequences before batching")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"{who}: token ids must lie in [0, {vocab_size}); got min {int(ids.min())}, "
            f"max {int(ids.max())} — was the tokenizer built for this model?"
        )


class TokenEmbedding(nn.Module):
    """ids (B, T) → token vectors (+ additive positions) (B, T, C), and the position ids.

    Positions count real tokens only (``positions_from_padding``), so a sequence gets the
    same positions whether it is alone or padded on either side.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.vocab_size = c.vocab_size
        self.token = nn.Embedding(c.vocab_size, c.d_model)
        self.positions = build_positional(c.positional, c.d_model, c.max_len)  # None: in attn
        # Sinusoidal values are O(1) while embeddings start at std 0.02: scale the tokens by
        # √C as in the original paper so they are not drowned out.
        self.scale = math.sqrt(c.d_model) if c.positional == "sinusoidal" else 1.0
        # BERT-style extras: segment (token-type) vectors and a LayerNorm on the sum.
        self.token_type = (nn.Embedding(c.type_vocab_size, c.d_model)
                           if c.type_vocab_size > 0 else None)
        self.norm = (nn.LayerNorm(c.d_model, eps=c.layer_norm_eps, bias=c.bias)
                     if c.embedding_norm else None)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, ids: Tensor, padding_mask: Tensor | None = None,
                token_types: Tensor | None = None,
                positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Returns ``(x, positions)``: x (B, T, C); positions (T,) or, with a mask, (B, T).
        ``token_types`` (B, T) selects segment vectors (default: segment 0 everywhere);
        ``positions`` overrides the computed ones (cached decoding continues at an offset)."""
        if positions is None and padding_mask is None:
            positions = torch.arange(ids.shape[1], device=ids.device)  # (T,)
        elif positions is None:
            positions = positions_from_padding(padding_mask)  # (B, T)
        x = self.token(ids) * self.scale  # (B, T, C)
        if self.positions is not None:
            x = x + self.positions(positions)  # (B, T, C)
        if self.token_type is not None:
            types = torch.zeros_like(ids) if token_types is None else token_types
            x = x + self.token_type(types)  # (B, T, C)
        elif token_types is not None:
            raise ValueError("token_types given but this model has no token-type embeddings "
                             "(type_vocab_size=0)")
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x), positions


class Encoder(nn.Module):
    """Bidirectional Transformer encoder: ``forward(ids, padding_mask) -> (B, T, C)``.

    ``final_norm=None`` follows the stack's norm placement: pre-norm leaves the residual
    stream un-normalised and needs a last LayerNorm, post-norm blocks already end in one.
    ``EncoderDecoder`` asks for one either way (as ``nn.Transformer`` builds it).
    """

    def __init__(self, config: ModelConfig, *, final_norm: bool | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed = TokenEmbedding(config)
        self.blocks = build_blocks(config)
        self._in_attention_positions = config.positional not in ADDITIVE_KINDS
        use_norm = config.norm == "pre" if final_norm is None else final_norm
        self.final_norm: nn.Module = (
            nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.bias)
            if use_norm else nn.Identity()
        )
        init_weights(self, config.n_layers)

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


@dataclass
class ClassifierConfig:
    """An ``EncoderClassifier``: the encoder's ``ModelConfig`` plus the head.

    ``encoder.tie_weights`` is unused (an encoder has no output vocabulary). With
    ``pooling="cls"`` the data pipeline prepends ``<bos>`` so the first token is a
    dedicated summary slot, as BERT's [CLS].
    """

    encoder: ModelConfig
    num_classes: int
    pooling: str = "cls"
    head_dropout: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.encoder, dict):  # from JSON
            self.encoder = ModelConfig.from_dict(self.encoder)
        if (not isinstance(self.num_classes, int) or isinstance(self.num_classes, bool)
                or self.num_classes < 2):
            raise ValueError(f"num_classes must be an int >= 2; got {self.num_classes!r}")
        if self.pooling not in POOLING_KINDS:
            raise ValueError(f"pooling={self.pooling!r} is not one of {POOLING_KINDS}")
        if not 0.0 <= self.head_dropout < 1.0:
            raise ValueError(f"head_dropout must be in [0, 1); got {self.head_dropout}")

    def to_dict(self) -> dict[str, Any]:
        return {"encoder": self.encoder.to_dict(), "num_classes": self.num_classes,
                "pooling": self.pooling, "head_dropout": self.head_dropout}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClassifierConfig:
        known = {"encoder", "num_classes", "pooling", "head_dropout"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"ClassifierConfig got unknown fields {unknown}; known fields: "
                             f"{sorted(known)}")
        return cls(**data)


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
        return sum(p.numel() for p in self.parameters())

    def forward(self, ids: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """ids (B, T) long; ``padding_mask`` (B, T) bool, True on real tokens.
        Returns logits (B, K)."""
        hidden = self.encoder(ids, padding_mask)  # (B, T, C)
        pooled = pool(hidden, padding_mask, self.config.pooling)  # (B, C)
        return self.head(self.dropout(pooled))  # (B, K)
