"""Classification data: labelled text files → padded batches with padding masks.

* ``read_examples``: a CSV/TSV or JSONL file with a text column and a label column (names
  configurable). Missing columns, unreadable rows and single-class files are errors naming
  what was expected; rows with an empty text or label are skipped with a warning that counts
  them and names their lines.
* ``LabelVocab``: label strings ↔ class ids, sorted so the mapping does not depend on row
  order; saved with the run as ``labels.json``.
* ``encode_texts``: ``<bos>`` + characters, truncated to ``max_len`` tokens with one warning
  that counts the truncated texts. ``<bos>`` is the summary slot ``pooling="cls"`` reads.
* ``collate_classification`` and ``ClassificationBatches``: batches padded to their longest
  sequence (not to ``max_len``), optionally *bucketed* — examples of similar length batched
  together, so little compute is spent on padding.

A classification ``Batch`` has ``ids`` (B, T), ``padding_mask`` (B, T) and ``targets`` (B,)
class ids — one label per sequence.

Shape legend: ``B`` batch, ``T`` longest sequence in the batch, ``N`` examples.
"""

from __future__ import annotations

import csv
import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from handformer.atomic import atomic_write_text
from handformer.data import Batch
from handformer.data.padding import pad_sequences
from handformer.tokenizers import CharTokenizer

__all__ = [
    "ClassificationBatches",
    "DataWarning",
    "DatasetError",
    "LabelVocab",
    "collate_classification",
    "encode_texts",
    "read_examples",
]

SUFFIXES = {".csv": ",", ".tsv": "\t", ".jsonl": None, ".ndjson": None}


class DatasetError(ValueError):
    """A labelled data file that cannot be used: missing, malformed, or a bad label."""


class DataWarning(UserWarning):
    """Something in the data was skipped or changed (empty rows, truncated texts)."""


def _lines(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:10]))
    return shown + (f", … ({len(numbers) - 10} more)" if len(numbers) > 10 else "")


def _read_rows(path: Path) -> tuple[list[tuple[int, dict[str, Any]]], list[str]]:
    """(line number, row) pairs and the columns seen, for CSV/TSV or JSONL."""
    delimiter = SUFFIXES[path.suffix.lower()]
    text = path.read_text(encoding="utf-8-sig")
    if delimiter is not None:
        reader = csv.DictReader(text.splitlines(), delimiter=delimiter)
        columns = list(reader.fieldnames or [])
        # DictReader skips blank lines; line_num is the 1-based line the row ended on.
        return [(reader.line_num, row) for row in reader], columns
    rows: list[tuple[int, dict[str, Any]]] = []
    columns: dict[str, None] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            rows.append((number, {}))  # an empty row: reported with the others below
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{path}, line {number}: not valid JSON ({err.msg}); expected one "
                               "JSON object per line") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{path}, line {number}: expected a JSON object like "
                               f'{{"text": ..., "label": ...}}; got {type(row).__name__}')
        columns.update(dict.fromkeys(row))
        rows.append((number, row))
    return rows, list(columns)


def _cell(value: Any) -> str:
    """A CSV cell or JSON value as text (JSON labels may be numbers); missing → ""."""
    return "" if value is None else str(value)


def read_examples(
    path: str | Path, *, text_col: str = "text", label_col: str | None = "label"
) -> tuple[list[str], list[str] | None]:
    """Texts and labels from ``path`` (.csv, .tsv, .jsonl). ``label_col=None`` reads texts
    only (prediction). Rows with an empty text (or label) are skipped with a ``DataWarning``.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"data file not found: {path}")
    if path.suffix.lower() not in SUFFIXES:
        raise DatasetError(f"{path}: unsupported file type {path.suffix!r}; expected one of "
                           f"{sorted(SUFFIXES)}")
    try:
        rows, columns = _read_rows(path)
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path} is not valid UTF-8 (byte {err.start}); re-save it as "
                           "UTF-8") from None
    wanted = [c for c in (text_col, label_col) if c is not None]
    missing = [c for c in wanted if c not in columns]
    if missing:
        raise DatasetError(f"{path}: column(s) {missing} not found; the file has columns "
                           f"{columns}. Choose them with --text-col / --label-col.")
    texts: list[str] = []
    labels: list[str] = []
    empty: list[int] = []
    for number, row in rows:
        text = _cell(row.get(text_col))
        label = _cell(row.get(label_col)) if label_col is not None else "-"
        if not text.strip() or not label.strip():
            empty.append(number)
            continue
        texts.append(text)
        labels.append(label.strip())
    if empty:
        what = "text" if label_col is None else "text or label"
        warnings.warn(f"{path}: skipped {len(empty)} row(s) with an empty {what} "
                      f"(line {_lines(empty)})", DataWarning, stacklevel=2)
    if not texts:
        raise DatasetError(f"{path}: no usable rows (every row's {text_col!r} is empty)"
                           if rows else f"{path} holds no data rows")
    return texts, (labels if label_col is not None else None)


@dataclass
class LabelVocab:
    """Label strings ↔ class ids 0..K-1, in sorted order."""

    labels: list[str]

    def __post_init__(self) -> None:
        if len(set(self.labels)) != len(self.labels):
            raise DatasetError(f"label vocabulary has repeated labels: {self.labels}")
        if len(self.labels) < 2:
            raise DatasetError(
                f"classification needs at least 2 classes; the data has only "
                f"{self.labels!r}. Check the label column, or add examples of other classes."
            )
        self._ids = {label: i for i, label in enumerate(self.labels)}

    @classmethod
    def from_labels(cls, labels: Sequence[str], *, source: str = "the data") -> LabelVocab:
        distinct = sorted(set(labels))
        if len(distinct) < 2:
            raise DatasetError(
                f"{source} has one class only ({distinct!r} in all {len(labels)} rows); a "
                "classifier needs at least 2. Check the label column."
            )
        return cls(distinct)

    def __len__(self) -> int:
        return len(self.labels)

    def encode(self, labels: Sequence[str], *, source: str = "the data") -> list[int]:
        unknown = sorted({y for y in labels if y not in self._ids})
        if unknown:
            raise DatasetError(f"{source} has label(s) {unknown[:10]} that this model was not "
                               f"trained on; it knows {self.labels}")
        return [self._ids[y] for y in labels]

    def decode(self, ids: Sequence[int]) -> list[str]:
        return [self.labels[i] for i in ids]

    def to_dict(self) -> dict[str, Any]:
        return {"labels": self.labels}

    def save(self, path: str | Path) -> None:
        atomic_write_text(Path(path), json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> LabelVocab:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("labels"), list):
            raise DatasetError(f"{path}: expected {{\"labels\": [...]}}")
        return cls([str(y) for y in data["labels"]])


def encode_texts(
    texts: Sequence[str], tokenizer: CharTokenizer, max_len: int, *, source: str = "data"
) -> list[list[int]]:
    """``<bos>`` + character ids per text, cut to ``max_len`` tokens. One ``DataWarning``
    counts the texts that were cut, so a too-small ``max_len`` cannot pass unnoticed."""
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 (<bos> and one character); got {max_len}")
    encoded = [tokenizer.encode(t, add_bos=True) for t in texts]
    long = [len(ids) for ids in encoded if len(ids) > max_len]
    if long:
        warnings.warn(
            f"{source}: {len(long)} of {len(encoded)} texts are longer than max_len={max_len} "
            f"tokens (<bos> included) and were truncated; the longest has {max(long)} tokens",
            DataWarning, stacklevel=2,
        )
    return [ids[:max_len] for ids in encoded]


def collate_classification(
    sequences: Sequence[Sequence[int]], labels: Sequence[int] | None = None, *,
    pad_id: int = 0,
) -> Batch:
    """Right-pad to the longest sequence: ids (B, T), padding_mask (B, T), targets (B,).
    Without labels the targets are all ``-1`` (prediction)."""
    if labels is not None and len(labels) != len(sequences):
        raise ValueError(f"{len(sequences)} sequences but {len(labels)} labels")
    ids, mask = pad_sequences(sequences, pad_id)  # (B, T), (B, T)
    b = len(sequences)
    targets = (torch.full((b,), -1, dtype=torch.long) if labels is None
               else torch.as_tensor(list(labels), dtype=torch.long))  # (B,)
    return Batch(ids=ids, targets=targets, padding_mask=mask)


class ClassificationBatches:
    """Padded batches over encoded examples.

    Called with a ``torch.Generator`` it returns the next training batch (the Trainer's
    ``train_batch``): each epoch is a fresh shuffle, and with ``bucket=True`` the shuffled
    examples are sorted by length (ties in shuffled order) before being cut into batches,
    whose order is then shuffled. ``fixed_batches()`` gives the same batches every call,
    for evaluation.
    """

    def __init__(
        self, sequences: Sequence[Sequence[int]], labels: Sequence[int] | None, batch_size: int,
        *, bucket: bool = True, pad_id: int = 0,
    ) -> None:
        if not sequences:
            raise ValueError("ClassificationBatches got no examples")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive; got {batch_size}")
        if labels is not None and len(labels) != len(sequences):
            raise ValueError(f"{len(sequences)} sequences but {len(labels)} labels")
        self.sequences = [list(s) for s in sequences]
        self.labels = None if labels is None else list(labels)
        self.batch_size = batch_size
        self.bucket = bucket
        self.pad_id = pad_id
        self.lengths = torch.tensor([len(s) for s in self.sequences])  # (N,)
        self._queue: list[list[int]] = []

    def __len__(self) -> int:
        return len(self.sequences)

    def _batch(self, index: Sequence[int]) -> Batch:
        labels = None if self.labels is None else [self.labels[i] for i in index]
        return collate_classification([self.sequences[i] for i in index], labels,
                                      pad_id=self.pad_id)

    def _epoch(self, generator: torch.Generator) -> list[list[int]]:
        order = torch.randperm(len(self.sequences), generator=generator)  # (N,)
        if self.bucket:
            # Stable sort: equal lengths keep their shuffled order.
            order = order[torch.sort(self.lengths[order], stable=True).indices]  # (N,)
        chunks = [c.tolist() for c in order.split(self.batch_size)]
        if len(chunks) > 1 and len(chunks[-1]) < self.batch_size:
            chunks.pop()  # a short last batch would be a noisier step
        if self.bucket:
            perm = torch.randperm(len(chunks), generator=generator).tolist()
            chunks = [chunks[i] for i in perm]
        return chunks

    def __call__(self, generator: torch.Generator) -> Batch:
        if not self._queue:
            self._queue = self._epoch(generator)
        return self._batch(self._queue.pop())

    def fixed_batches(self) -> list[Batch]:
        """Every example once, in batches; sorted by length when bucketing."""
        order = (torch.sort(self.lengths, stable=True).indices if self.bucket
                 else torch.arange(len(self.sequences)))  # (N,)
        return [self._batch(c.tolist()) for c in order.split(self.batch_size)]

    def padding_fraction(self, batches: Sequence[Batch]) -> float:
        """Share of batch positions that are padding (what bucketing saves)."""
        total = sum(b.ids.numel() for b in batches)
        real = sum(int(b.padding_mask.sum()) for b in batches if b.padding_mask is not None)
        return 1.0 - real / max(total, 1)
