"""Normalisation layers: LayerNorm (torch's) and a hand-written RMSNorm.

RMSNorm drops LayerNorm's mean subtraction and bias: ``y = x / rms(x) · g`` with
``rms(x) = √(mean(x²) + ε)``. It is cheaper, and the speedrun recipes that use it (and QK-norm,
which normalises each head's queries and keys with it) train as well as with LayerNorm.

Shape legend: ``…`` any leading dims, ``C`` the normalised (last) dim.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["NORM_TYPES", "RMSNorm", "make_norm"]

NORM_TYPES: tuple[str, ...] = ("layernorm", "rmsnorm")


class RMSNorm(nn.Module):
    """``x / √(mean(x², last dim) + eps) · weight``, returned in x's dtype.

    The convention Llama and Qwen3 checkpoints were trained with, so imported weights give
    the same numbers: x is normalised in fp32 and rounded to its own dtype, and only then
    multiplied by the gain (``weight``, cast to x's dtype so a bf16 activation under fp32
    parameters stays bf16). ``weight`` starts at one.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (…, 1)
        return (xf * inv_rms).to(x.dtype) * self.weight.to(x.dtype)  # (…, C)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(kind: str, dim: int, *, eps: float = 1e-5, bias: bool = True) -> nn.Module:
    """The ``kind`` of norm over the last ``dim`` features (``bias`` applies to LayerNorm)."""
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=bias)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    raise ValueError(f"unknown norm type {kind!r}; expected one of {NORM_TYPES}")
