"""Losses. ``IGNORE_INDEX`` marks targets that must not count (padding); it is defined here
and nowhere else.

Shape legend: ``B`` batch, ``T`` sequence, ``V`` vocabulary, ``K`` classes.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

__all__ = ["IGNORE_INDEX", "classification_loss", "lm_loss"]

IGNORE_INDEX = -100


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy over positions whose target is not ``IGNORE_INDEX``
    (0 when there are none).

    logits (B, T, V), targets (B, T) — already shifted: ``targets[:, t]`` is the token that
    follows ``ids[:, t]``. Returns a 0-d float32 tensor (computed in float32 also under
    autocast). Raises ``ValueError`` when the shapes do not fit.
    """
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"lm_loss expects logits (B, T, V) and targets (B, T); got logits "
            f"{tuple(logits.shape)} and targets {tuple(targets.shape)}"
        )
    flat_targets = targets.flatten()  # (B·T,)
    total = F.cross_entropy(
        logits.flatten(0, 1).float(),  # (B·T, V)
        flat_targets,
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    # Sum / count rather than "mean": a batch with no real target gives 0 (not 0/0 = NaN,
    # which would poison a whole accumulated step), and no host sync is needed.
    count = (flat_targets != IGNORE_INDEX).sum().clamp(min=1)
    return total / count


def classification_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over examples whose label is not ``IGNORE_INDEX``.

    logits (B, K), targets (B,) class ids. One label per sequence: padding never reaches
    the loss because pooling has already read only the real tokens. Raises ``ValueError``
    when the shapes do not fit.
    """
    if logits.dim() != 2 or targets.dim() != 1 or targets.shape[0] != logits.shape[0]:
        raise ValueError(
            f"classification_loss expects logits (B, K) and targets (B,); got logits "
            f"{tuple(logits.shape)} and targets {tuple(targets.shape)}"
        )
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX)
