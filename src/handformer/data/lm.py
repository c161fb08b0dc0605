"""From token ids to batches the model can eat.

* ``Batch``: ``ids`` (B, T), ``targets`` (B, T) and ``padding_mask`` (B, T) bool.
* ``LMWindows``: contiguous windows over one long token stream; ``targets`` are ``ids``
  shifted by one. Random windows for training, evenly spaced fixed ones for validation.
* ``collate_sequences``: variable-length sequences padded to the longest, with a padding mask
  and ``IGNORE_INDEX`` targets on padding so the loss skips it.

Shape legend: ``B`` batch, ``T`` window length, ``N`` tokens in the stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from handformer.data.corpora import CorpusError
from handformer.data.padding import pad_sequences
from handformer.loss import IGNORE_INDEX

__all__ = ["Batch", "LMWindows", "collate_sequences", "train_val_split"]


@dataclass
class Batch:
    """One batch for a language model (or any model the Trainer drives).

    ``ids`` (B, T) long; ``targets`` (B, T) long, already shifted (``targets[:, t]`` follows
    ``ids[:, t]``), ``IGNORE_INDEX`` where nothing is to be predicted (padding), so the loss
    skips it; ``padding_mask`` (B, T) bool, True on real tokens, or ``None`` (default) when
    there is no padding. ``LMWindows`` and ``collate_sequences`` build them.
    """

    ids: Tensor  # (B, T) long
    targets: Tensor  # (B, T) long, IGNORE_INDEX where nothing is to be predicted
    padding_mask: Tensor | None = None  # (B, T) bool, True on real tokens; None = no padding

    def to(self, device: torch.device | str) -> Batch:
        """A copy with every tensor on ``device`` (and the token count, see ``num_tokens``)."""
        moved = Batch(
            self.ids.to(device, non_blocking=True),
            self.targets.to(device, non_blocking=True),
            None if self.padding_mask is None else self.padding_mask.to(device),
        )
        moved.carry_token_count(self)
        return moved

    def first_tokens(self, length: int) -> Batch:
        """The first ``length`` positions of every row (a sequence-length warm-up trains on
        these). Needs per-token targets (B, T); ``ValueError`` otherwise."""
        if self.targets.shape != self.ids.shape:
            raise ValueError(f"first_tokens needs per-token targets (B, T) = "
                             f"{tuple(self.ids.shape)}; got targets {tuple(self.targets.shape)} "
                             "(a sequence-length warm-up is for language models)")
        mask = None if self.padding_mask is None else self.padding_mask[:, :length]
        return Batch(self.ids[:, :length], self.targets[:, :length], mask)  # (B, length)

    def first_rows(self, rows: int) -> Batch:
        """The first ``rows`` examples (a batch-size warm-up trains on these); targets may be
        per token (B, T) or per example (B,)."""
        if not 0 < rows <= self.ids.shape[0]:
            raise ValueError(f"first_rows needs 1 <= rows <= {self.ids.shape[0]} (the batch); "
                             f"got {rows}")
        mask = None if self.padding_mask is None else self.padding_mask[:rows]
        return Batch(self.ids[:rows], self.targets[:rows], mask)  # (rows, T)

    def carry_token_count(self, source: Batch) -> None:
        """Take ``source``'s token count when it is free: counted on the CPU (or already
        counted). Reading ``num_tokens`` of a GPU batch would otherwise wait for the GPU."""
        if source.targets.device.type == "cpu" or "_num_tokens" in source.__dict__:
            self.__dict__["_num_tokens"] = source.num_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens that carry a target (what the loss averages over). Counted once per batch
        (batches are not modified in place); a batch moved off the CPU by ``to`` keeps the
        count taken there, so the training loop never waits on the device for it."""
        count = self.__dict__.get("_num_tokens")
        if count is None:
            count = self.__dict__["_num_tokens"] = int((self.targets != IGNORE_INDEX).sum())
        return count


def train_val_split(ids: np.ndarray | Tensor, val_fraction: float) -> tuple[Tensor, Tensor]:
    """Split a token stream: the *last* ``val_fraction`` (a number in [0, 1); NaN refused)
    is held out for validation."""
    if isinstance(val_fraction, bool) or not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be a number in [0, 1); got {val_fraction!r}")
    ids = torch.as_tensor(ids, dtype=torch.long)
    n_val = int(len(ids) * val_fraction)
    return ids[: len(ids) - n_val], ids[len(ids) - n_val :]


class LMWindows:
    """Windows of ``block_size + 1`` tokens over one stream: inputs and shifted targets."""

    def __init__(self, tokens: Tensor, block_size: int, *, name: str = "text") -> None:
        if tokens.dim() != 1:
            raise ValueError(f"LMWindows expects a 1-D token stream; got {tuple(tokens.shape)}")
        if len(tokens) < block_size + 1:
            raise CorpusError(
                f"{name} has {len(tokens)} tokens, too short for one training window of "
                f"{block_size} + 1 tokens; use more text or a smaller block_size"
            )
        self.tokens = tokens.long()
        self.block_size = block_size
        self._offsets = torch.arange(block_size + 1)  # (T+1,)

    @property
    def num_windows(self) -> int:
        return len(self.tokens) - self.block_size

    def _gather(self, starts: Tensor) -> Batch:
        chunk = self.tokens[starts[:, None] + self._offsets]  # (B, T+1)
        return Batch(ids=chunk[:, :-1], targets=chunk[:, 1:])

    def random_batch(self, batch_size: int, generator: torch.Generator | None = None) -> Batch:
        """``batch_size`` windows at uniformly random starts."""
        starts = torch.randint(0, self.num_windows, (batch_size,), generator=generator)
        return self._gather(starts)

    def fixed_batches(self, num_batches: int, batch_size: int) -> list[Batch]:
        """Evenly spaced windows covering the stream: the same every call, for validation."""
        n = min(num_batches * batch_size, self.num_windows)
        # Exact integer spacing (a float32 linspace overshoots past 2**24 windows).
        starts = torch.arange(n) * (self.num_windows - 1) // max(n - 1, 1)  # (n,)
        return [self._gather(s) for s in starts.split(batch_size)]


def collate_sequences(
    sequences: Sequence[Sequence[int]], *, pad_id: int = 0, side: str = "right"
) -> Batch:
    """Pad variable-length token sequences to the longest into an LM ``Batch``.

    ``ids`` are each sequence minus its last token, ``targets`` minus its first; padded
    positions get ``pad_id`` in ids, ``IGNORE_INDEX`` in targets and ``False`` in the mask.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right'; got {side!r}")
    if not sequences:
        raise ValueError("collate_sequences got no sequences")
    short = [i for i, s in enumerate(sequences) if len(s) < 2]
    if short:
        raise ValueError(f"sequences {short[:5]} have fewer than 2 tokens; an LM example needs "
                         "an input and a next token")
    ids, mask = pad_sequences([s[:-1] for s in sequences], pad_id, side=side)  # (B, T)
    targets, _ = pad_sequences([s[1:] for s in sequences], IGNORE_INDEX, side=side)  # (B, T)
    return Batch(ids=ids, targets=targets, padding_mask=mask)
