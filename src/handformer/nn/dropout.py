"""Dropout that costs nothing when it does nothing.

An ``nn.Dropout`` call in eval mode (or with p = 0) returns its input but still pays a
module call; at batch-1 decoding a model makes a dozen of them per token, a measurable share
of the step. The modules stay (so configs and module tables show them); this skips the call.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["apply_dropout"]


def apply_dropout(dropout: nn.Dropout, x: Tensor) -> Tensor:
    return dropout(x) if dropout.training and dropout.p > 0.0 else x
