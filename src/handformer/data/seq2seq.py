"""(source, target) string pairs → encoder-decoder batches.

Each example becomes

    src  = s1 … sm <eos>                 the encoder's input (the <eos> marks the end)
    ids  = <bos> t1 … tn                 the decoder's input (teacher forcing)
    tgt  =       t1 … tn <eos>           what each decoder position must predict

right-padded to the longest in the batch, with ``IGNORE_INDEX`` where the target is padding.

Shape legend: ``B`` batch, ``S`` source length, ``T`` target length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from handformer.data.lm import Batch
from handformer.data.padding import pad_sequences
from handformer.loss import IGNORE_INDEX
from handformer.tokenizers import CharTokenizer

__all__ = ["Seq2SeqBatch", "collate_pairs", "encode_sources"]


@dataclass
class Seq2SeqBatch(Batch):
    """A ``Batch`` whose ``ids``/``targets``/``padding_mask`` are the decoder's, plus the
    source: ``src`` (B, S) and ``src_mask`` (B, S), True on real tokens."""

    src: Tensor | None = None
    src_mask: Tensor | None = None

    def to(self, device: torch.device | str) -> Seq2SeqBatch:
        moved = {k: None if v is None else v.to(device)
                 for k, v in (("ids", self.ids), ("targets", self.targets),
                              ("padding_mask", self.padding_mask), ("src", self.src),
                              ("src_mask", self.src_mask))}
        out = Seq2SeqBatch(**moved)  # type: ignore[arg-type]
        out.carry_token_count(self)
        return out


def encode_sources(sources: Sequence[str], tokenizer: CharTokenizer) -> list[list[int]]:
    """Characters + ``<eos>``; a character outside the vocabulary is an error naming it."""
    empty = [i for i, s in enumerate(sources) if not s]
    if empty:
        raise ValueError(f"source(s) {empty[:5]} are empty; give at least one character")
    return [tokenizer.encode(s, add_eos=True, unknown="error") for s in sources]


def collate_pairs(pairs: Sequence[tuple[str, str]], tokenizer: CharTokenizer) -> Seq2SeqBatch:
    """(source, target) strings → a right-padded ``Seq2SeqBatch``."""
    if not pairs:
        raise ValueError("collate_pairs got no pairs")
    pad = tokenizer.pad_id
    src = encode_sources([s for s, _ in pairs], tokenizer)
    tgt = [tokenizer.encode(t, add_bos=True, add_eos=True, unknown="error") for _, t in pairs]
    src_ids, src_mask = pad_sequences(src, pad)  # (B, S)
    dec_in, dec_mask = pad_sequences([t[:-1] for t in tgt], pad)  # (B, T): <bos> t1 … tn
    targets, _ = pad_sequences([t[1:] for t in tgt], IGNORE_INDEX)  # (B, T): t1 … tn <eos>
    return Seq2SeqBatch(ids=dec_in, targets=targets, padding_mask=dec_mask,
                        src=src_ids, src_mask=src_mask)
