"""Position information: sinusoidal (fixed) and learned (a table).

Self-attention is blind to order: permute the tokens and the outputs permute with them.
Both modules here map integer positions (…, T) to vectors (…, T, C) that the model adds to
the token embeddings.

Shape legend: ``B`` batch, ``T`` positions, ``C`` model dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["POSITIONAL_KINDS", "LearnedPositions", "SinusoidalPositions", "build_positional"]

POSITIONAL_KINDS: tuple[str, ...] = ("sinusoidal", "learned")


class SinusoidalPositions(nn.Module):
    """sin/cos of geometrically spaced frequencies (Vaswani et al., 2017). No parameters.

    Channel pairs (2i, 2i+1) hold sin(p·ω_i) and cos(p·ω_i) with ω_i = base^(-2i/C), so a
    shift by k is a fixed rotation of each pair — relative offsets are linear functions of
    the encoding. Computed from the positions on the fly, so any position is valid.
    """

    def __init__(self, d_model: int, base: float = 10000.0) -> None:
        super().__init__()
        if d_model % 2 != 0:
            raise ValueError(f"sinusoidal positions need an even d_model; got {d_model}")
        self.d_model = d_model
        inv_freq = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(base) / d_model))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (C/2,)

    def forward(self, positions: Tensor) -> Tensor:
        angles = positions.unsqueeze(-1).float() * self.inv_freq  # (…, T, C/2)
        enc = torch.stack((angles.sin(), angles.cos()), dim=-1)  # (…, T, C/2, 2)
        return enc.flatten(-2)  # (…, T, C), channels interleaved sin, cos, sin, cos …


class LearnedPositions(nn.Module):
    """One trained vector per position, up to ``max_len`` — and not one position further."""

    def __init__(self, max_len: int, d_model: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.table = nn.Embedding(max_len, d_model)

    def forward(self, positions: Tensor) -> Tensor:
        if positions.numel() and int(positions.max()) >= self.max_len:
            length = int(positions.max()) + 1
            raise ValueError(
                f"learned positions cover 0..{self.max_len - 1} (max_len={self.max_len}) but "
                f"position {length - 1} was asked for (sequence length {length}). Crop the "
                f"input to max_len, train with a larger max_len, or use positional="
                f"'sinusoidal' (computed for any position)."
            )
        return self.table(positions)  # (…, T, C)


def build_positional(kind: str, d_model: int, max_len: int) -> nn.Module:
    if kind == "sinusoidal":
        return SinusoidalPositions(d_model)
    if kind == "learned":
        return LearnedPositions(max_len, d_model)
    raise ValueError(f"unknown positional kind {kind!r}; expected one of {POSITIONAL_KINDS}")
