"""The embedding stage every handformer model starts with: ids → vectors, and the id checks.

    ids (B, T) ─▶ token vectors × scale ─▶ + positions (additive kinds) ─▶ + segment vectors
               ─▶ [LayerNorm] ─▶ dropout ─▶ x (B, T, C)

One ``TokenEmbedding`` serves the decoder LM, the encoder and both sides of the seq2seq
model, so the √C scale, the position ids and the id validation are written once:

* ``check_ids`` — validate ids (and a padding mask) at a model's public entry, with a
  ``ValueError`` naming expected vs received. Models run it once per call from outside;
  ``generate`` skips it for the ids the model itself produced (see ``DecoderLM.forward``).
* ``positions_from_padding`` — position ids that count real tokens only.
* ``TokenEmbedding`` — the module above. RoPE and ALiBi live inside attention: for them it
  adds no position vector and only hands the position ids on.

Shape legend: ``B`` batch, ``T`` sequence, ``C`` model dim, ``V`` vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from handformer.config import ModelConfig
from handformer.masks import check_padding_mask
from handformer.nn.dropout import apply_dropout
from handformer.nn.positional import LearnedPositions, build_positional

__all__ = ["TokenEmbedding", "check_ids", "positions_from_padding"]


def check_ids(ids: Tensor, padding_mask: Tensor | None, vocab_size: int, who: str, *,
              allow_empty_rows: bool = False) -> None:
    """Raise ``ValueError`` naming expected vs received for bad ids or padding masks.

    ids must be (B, T) integers with T ≥ 1 and every id in [0, vocab_size); a padding mask
    must be bool (B, T), True on real tokens — a float or int one is refused with the way to
    convert it (``handformer.masks.check_padding_mask``). Unless ``allow_empty_rows``, every
    row needs at least one real token (a pooled encoder has nothing to pool). The range check
    reads the ids once (one host sync): run it at entry points, not per generated token.

    While the model is being traced (``torch.export``, the ONNX exporter, ``torch.compile``)
    only the shape and dtype checks run: the value checks read tensor data back to the host,
    which a traced graph cannot express (the traced program has no Python to raise from).
    Eager calls — every command, ``generate``'s prompt, a user's ``model(ids)`` — keep them.
    """
    if ids.dim() != 2:
        raise ValueError(f"{who} expects ids of shape (B, T); got {tuple(ids.shape)}")
    if ids.dtype not in (torch.long, torch.int32):
        raise ValueError(f"{who}: ids must be an integer tensor (long); got {ids.dtype}")
    if ids.shape[1] == 0:
        raise ValueError(f"{who}: ids have no tokens (T = 0); got {tuple(ids.shape)}")
    if padding_mask is not None:
        check_padding_mask(padding_mask, tuple(ids.shape), who)
    if torch.compiler.is_compiling():  # tracing: no data-dependent checks (see above)
        return
    if padding_mask is not None and not allow_empty_rows:
        empty = (~padding_mask.any(dim=1)).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"{who}: rows {empty[:5]} of the batch have no real token "
                             "(padding_mask all False); drop empty sequences before "
                             "batching")
    if ids.numel():
        lo, hi = (int(v) for v in torch.aminmax(ids))  # one pass, one sync
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"{who}: token ids must lie in [0, {vocab_size}); got min {lo}, max {hi} — "
                "was the tokenizer built for this model?"
            )


def positions_from_padding(padding_mask: Tensor) -> Tensor:
    """Position ids that count only real tokens: (B, T) bool → (B, T) long.

    A left-padded row ``[pad, pad, a, b]`` gets positions ``[0, 0, 0, 1]``, so a prompt has
    the same positions however much padding precedes it; right padding leaves 0..n-1.
    """
    return (padding_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


class TokenEmbedding(nn.Module):
    """ids (B, T) → token vectors (+ additive positions) (B, T, C), and the position ids.

    Built from a ``ModelConfig``: ``token`` (V × C), ``positions`` (the additive kind, or
    ``None`` for RoPE / ALiBi, which attention applies), optional BERT-style ``token_type``
    (segment) vectors and ``norm`` (a LayerNorm on the sum), then dropout. Positions count
    real tokens only (``positions_from_padding``), so a sequence gets the same positions
    whether it is alone or padded on either side. Validation is ``check_ids``' job (the
    model's entry point), not this module's: it runs on every cached decoding step.
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

    def table_rows(self) -> tuple[Tensor, Tensor | None] | None:
        """(the token table (V, C), the position table (P, C) or None) where this embedding
        is only a token's row plus its position's row — learned positions or none, no scale,
        no token types, no norm, not training — else None: what a kernel that looks the rows
        up itself (``nn.decode_block.token_step``) must know to compute ``forward``."""
        table = None
        if self.positions is not None:
            if not isinstance(self.positions, LearnedPositions):
                return None
            table = self.positions.table.weight
        if (self.scale != 1.0 or self.token_type is not None or self.norm is not None
                or self.training):
            return None
        return self.token.weight, table

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
        x = self.token(ids)  # (B, T, C)
        if self.scale != 1.0:  # a ×1 would cost a (B, T, C) pass forward and backward
            x = x * self.scale
        if self.positions is not None:
            x = x + self.positions(positions).to(x.dtype)  # (B, T, C)
        if self.token_type is not None:
            types = torch.zeros_like(ids) if token_types is None else token_types
            x = x + self.token_type(types)  # (B, T, C)
        elif token_types is not None:
            raise ValueError("token_types given but this model has no token-type embeddings "
                             "(type_vocab_size=0)")
        if self.norm is not None:
            x = self.norm(x)
        return apply_dropout(self.dropout, x), positions
