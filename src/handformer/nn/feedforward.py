"""The position-wise feed-forward network: each token is transformed on its own.

Attention moves information *between* positions; the FFN processes it *at* each position:
C → d_ff → C with a non-linearity in between.

Shape legend: ``B`` batch, ``T`` sequence, ``C`` model dim, ``F`` hidden (d_ff).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from handformer.nn.dropout import apply_dropout

__all__ = ["ACTIVATIONS", "FeedForward"]

# "gelu_tanh" is GELU's tanh approximation, the one GPT-2 was trained with.
ACTIVATIONS: tuple[str, ...] = ("gelu", "gelu_tanh", "relu")


class FeedForward(nn.Module):
    """Linear → activation → dropout → linear (the layout of ``nn.TransformerEncoderLayer``)."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        activation: str = "gelu",
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
        self.activation = activation
        self.fc_in = nn.Linear(d_model, d_ff, bias=bias)
        self.fc_out = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def _activate(self, h: Tensor) -> Tensor:
        if self.activation == "relu":
            return F.relu(h)
        return F.gelu(h, approximate="tanh" if self.activation == "gelu_tanh" else "none")

    def forward(self, x: Tensor) -> Tensor:
        h = self._activate(self.fc_in(x))  # (B, T, F)
        return self.fc_out(apply_dropout(self.dropout, h))  # (B, T, C)
