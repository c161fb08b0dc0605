"""Reading a mask matrix: which keys each query may see, and what kind of mask that is.

Shared by the mask checks (builders, the masks a model actually used) and the pictures.

Shape legend: ``T`` queries, ``S`` keys.
"""

from __future__ import annotations

import torch
from torch import Tensor

from handformer.masks import causal_mask

__all__ = ["allowed", "classify", "describe", "show"]


def allowed(mask: Tensor) -> Tensor:
    """Any common mask encoding → bool (T, S) with ``True`` = may attend.

    bool is taken as handformer's convention; a float mask with negative entries is read as
    additive (0 = keep, -inf / -1e9 = drop); any other number as 0/1 (1 = keep).
    """
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point() and bool((mask < 0).any()):
        return mask == 0
    return mask != 0


def classify(mask: Tensor) -> str:
    """Name a (T, S) allowed-mask relative to the end-aligned causal mask.

    ``causal`` (correct), ``transposed`` (query i sees keys j ≥ i), ``inverted`` (the
    complement: torch's True = ignore read as True = attend), ``full`` (no causal mask),
    ``empty`` (nothing visible) or ``other``.
    """
    t, s = mask.shape
    if t > s:
        return "other"
    causal = causal_mask(t, s, device=mask.device)  # (T, S)
    if torch.equal(mask, causal):
        return "causal"
    if bool(mask.all()):
        return "full"
    if not bool(mask.any()):
        return "empty"
    if torch.equal(mask, ~causal):
        return "inverted"
    if t == s and torch.equal(mask, causal.T):
        return "transposed"
    return "other"


_MEANING = {
    "causal": "lower-triangular (causal)",
    "transposed": "upper-triangular: transposed (query i sees keys j ≥ i)",
    "inverted": "strictly upper-triangular: inverted polarity (True read as 'ignore')",
    "full": "all ones: no causal mask",
    "empty": "all zeros: nothing may be attended",
    "other": "neither causal, transposed, inverted nor full",
}


def describe(kind: str) -> str:
    return _MEANING[kind]


def show(mask: Tensor) -> str:
    """A small bool matrix as rows of 1/0, e.g. ``1000/1100/1110/1111``."""
    return "/".join("".join("1" if v else "0" for v in row) for row in mask.tolist())
