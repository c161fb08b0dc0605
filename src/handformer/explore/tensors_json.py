"""Tensors → plain JSON lists, rounded so a heatmap stays small on the wire.

Rounding is done in float64 to 5 decimals: exact zeros (masked keys) stay exactly 0 and a
row of S weights still sums to 1 within S · 5e-6.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["finite_json", "mask_to_json", "weights_to_json"]

DECIMALS = 5


def weights_to_json(weights: Tensor) -> Any:
    """Any-shape float tensor → nested lists of floats rounded to ``DECIMALS``."""
    if not bool(torch.isfinite(weights).all()):
        raise ValueError("the model produced NaN or Inf attention weights (a diverged run?); "
                         "there is nothing meaningful to draw")
    scale = 10.0 ** DECIMALS
    return (torch.round(weights.detach().double().cpu() * scale) / scale).tolist()


def mask_to_json(mask: Tensor) -> Any:
    """Bool tensor → nested lists of 0/1 (half the bytes of true/false)."""
    return mask.detach().to(torch.int8).cpu().tolist()


def finite_json(value: Any) -> Any:
    """NaN / ±Inf (a diverged run's summary) become ``null``: strict JSON for the browser."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value
