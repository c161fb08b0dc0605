"""The one padding helper: token sequences of different lengths → one rectangular batch.

Every padded batch in handformer is built here — classification batches, seq2seq sources and
targets, prompts for generation — so "where is the padding, and what does the mask say"
has one answer: ``mask`` is True on real tokens, and the pad value fills the rest.

Shape legend: ``B`` sequences, ``L`` the longest sequence's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

__all__ = ["pad_sequences"]


def pad_sequences(
    sequences: Sequence[Sequence[int]], pad_value: int, *,
    side: Literal["right", "left"] = "right",
) -> tuple[Tensor, Tensor]:
    """ids (B, L) long and mask (B, L) bool (True on real tokens), padded with ``pad_value``.

    ``side="right"`` keeps every row's first token in column 0 (training batches);
    ``"left"`` keeps every row's last token in the last column, where generation continues.
    Raises ``ValueError`` for no sequences, an empty sequence or an unknown side.
    """
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left'; got {side!r}")
    if not sequences:
        raise ValueError("nothing to pad: no sequences given")
    empty = [i for i, s in enumerate(sequences) if len(s) == 0]
    if empty:
        raise ValueError(f"sequences {empty[:5]} are empty; every sequence needs a token")
    b, longest = len(sequences), max(len(s) for s in sequences)
    ids = torch.full((b, longest), pad_value, dtype=torch.long)  # (B, L)
    mask = torch.zeros((b, longest), dtype=torch.bool)  # (B, L)
    for row, seq in enumerate(sequences):
        cols = slice(0, len(seq)) if side == "right" else slice(longest - len(seq), longest)
        ids[row, cols] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[row, cols] = True
    return ids, mask
