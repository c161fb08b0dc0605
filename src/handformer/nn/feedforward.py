"""The position-wise feed-forward network: each token is transformed on its own.

Attention moves information *between* positions; the FFN processes it *at* each position:
C → d_ff → C with a non-linearity in between.

``relu2`` is ReLU squared (the modded-nanogpt speedrun's choice). ``swiglu`` is a gated unit,
``silu(x·W_gate) ⊙ (x·W_up)``, whose ``fc_in`` holds the gate and up projections side by side
(C → 2·d_ff): it has three d_ff-wide matrices where the others have two, so a config that
leaves ``d_ff`` at 0 gets ``swiglu_hidden(C)`` ≈ 8C/3, the width with the parameter count of
a 4C ungated FFN (see ``handformer.config.ModelConfig``).

Shape legend: ``B`` batch, ``T`` sequence, ``C`` model dim, ``F`` hidden (d_ff).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from handformer.nn.dropout import apply_dropout

__all__ = ["ACTIVATIONS", "FeedForward", "swiglu_hidden"]

# "gelu_tanh" is GELU's tanh approximation, the one GPT-2 was trained with.
ACTIVATIONS: tuple[str, ...] = ("gelu", "gelu_tanh", "relu", "relu2", "swiglu")


def swiglu_hidden(d_model: int) -> int:
    """SwiGLU's hidden width for the parameter count of a 4·C ungated FFN: 3·C·F ≈ 8·C², so
    F = 8C/3, rounded to the nearest multiple of 8 (at least 8)."""
    return max(8, 8 * round(d_model / 3))


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
        gated = activation == "swiglu"
        self.fc_in = nn.Linear(d_model, 2 * d_ff if gated else d_ff, bias=bias)
        self.fc_out = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def _activate(self, h: Tensor) -> Tensor:
        if self.activation == "relu":
            return F.relu(h)
        if self.activation == "relu2":
            return F.relu(h).square()
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)  # (B, T, F) each
            return F.silu(gate) * up
        return F.gelu(h, approximate="tanh" if self.activation == "gelu_tanh" else "none")

    def forward(self, x: Tensor) -> Tensor:
        h = self._activate(self.fc_in(x))  # (B, T, F) (fc_in gives 2·F for swiglu)
        return self.fc_out(apply_dropout(self.dropout, h))  # (B, T, C)
