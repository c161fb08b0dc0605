"""Normalisation layers: LayerNorm (torch's) and a hand-written RMSNorm.

RMSNorm drops LayerNorm's mean subtraction and bias: ``y = x / rms(x) · g`` with
``rms(x) = √(mean(x²) + ε)``. It is cheaper, and the speedrun recipes that use it (and QK-norm,
which normalises each head's queries and keys with it) train as well as with LayerNorm.

Shape legend: ``…`` any leading dims, ``C`` the normalised (last) dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["NORM_TYPES", "RMSNorm", "make_norm"]

NORM_TYPES: tuple[str, ...] = ("layernorm", "rmsnorm")


def _normalize(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x (…, C) → (x̂ = x / rms(x) in fp32 (…, C), 1 / rms(x) (…, 1))."""
    xf = x.float()
    inv_rms = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True).add_(eps))  # (…, 1)
    return xf * inv_rms, inv_rms


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm with its backward written out. Autograd would record every elementwise step
    of the forward and replay each one backwards; LayerNorm is one fused kernel each way, so
    a model with RMSNorm paid for every norm several times over. With x̂ = x · r,
    r = 1 / rms(x) and the gain g::

        ∂L/∂g = Σ_rows ∂L/∂y · x̂
        ∂L/∂x = r · (u − x̂ · mean(u · x̂)),   u = ∂L/∂y · g
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        xhat, inv_rms = _normalize(x, eps)  # (…, C), (…, 1)
        ctx.save_for_backward(xhat, inv_rms, weight)
        return xhat.to(x.dtype) * weight.to(x.dtype)  # (…, C)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        xhat, inv_rms, weight = ctx.saved_tensors
        gy = grad_y.float()  # (…, C)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (gy * xhat).flatten(0, -2).sum(0).to(weight.dtype)  # (C,)
        grad_x = None
        if ctx.needs_input_grad[0]:
            u = gy * weight  # (…, C)
            dot = (u * xhat).mean(dim=-1, keepdim=True)  # (…, 1)
            grad_x = (u - xhat * dot).mul_(inv_rms).to(grad_y.dtype)  # (…, C)
        return grad_x, grad_w, None


class RMSNorm(nn.Module):
    """``x / √(mean(x², last dim) + eps) · weight``, returned in x's dtype.

    The convention Llama and Qwen3 checkpoints were trained with, so imported weights give
    the same numbers: x is normalised in fp32 and rounded to its own dtype, and only then
    multiplied by the gain (``weight``, cast to x's dtype so a bf16 activation under fp32
    parameters stays bf16). ``weight`` starts at one. When gradients flow, the backward is
    the hand-derived one of ``_RMSNormFunction``; it computes the same forward.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormFunction.apply(x, self.weight, self.eps)  # (…, C)
        xhat, _ = _normalize(x, self.eps)
        return xhat.to(x.dtype) * self.weight.to(x.dtype)  # (…, C)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(kind: str, dim: int, *, eps: float = 1e-5, bias: bool = True) -> nn.Module:
    """The ``kind`` of norm over the last ``dim`` features (``bias`` applies to LayerNorm)."""
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=bias)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    raise ValueError(f"unknown norm type {kind!r}; expected one of {NORM_TYPES}")
