"""handformer.data.lm: Batch, train/val split and LM windows with shifted targets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from handformer.data import Batch, LMWindows, collate_sequences, train_val_split
from handformer.data.corpora import CorpusError
from handformer.loss import IGNORE_INDEX


# =========================================================================================
# data.py
# =========================================================================================
@pytest.mark.parametrize(("n", "frac", "n_val"), [(100, 0.1, 10), (101, 0.1, 10), (10, 0.5, 5)])
def test_train_val_split_takes_the_last_fraction(n: int, frac: float, n_val: int) -> None:
    ids = np.arange(n)
    train, val = train_val_split(ids, frac)
    assert train.dtype == val.dtype == torch.long
    assert len(val) == n_val
    assert torch.equal(torch.cat([train, val]), torch.arange(n))
    assert torch.equal(val, torch.arange(n - n_val, n))


@pytest.mark.parametrize("frac", [float("nan"), float("inf"), 1.0, -0.1, True])
def test_train_val_split_refuses_a_fraction_outside_zero_to_one(frac: float) -> None:
    with pytest.raises(ValueError, match=r"val_fraction must be a number in \[0, 1\)"):
        train_val_split(np.arange(10), frac)


def test_lm_windows_targets_are_ids_shifted_by_one() -> None:
    tokens = torch.randint(0, 50, (500,))
    windows = LMWindows(tokens, block_size=8)
    assert windows.num_windows == 500 - 8
    batch = windows.random_batch(16, torch.Generator().manual_seed(0))
    assert batch.ids.shape == batch.targets.shape == (16, 8)
    assert batch.padding_mask is None
    assert batch.num_tokens == 16 * 8
    assert torch.equal(batch.ids[:, 1:], batch.targets[:, :-1])
    # Every row is a real slice of the stream: find its start and compare directly.
    unique_stream = torch.arange(1000)
    w = LMWindows(unique_stream, block_size=5)
    b = w.random_batch(32, torch.Generator().manual_seed(1))
    for ids_row, tgt_row in zip(b.ids, b.targets, strict=True):
        start = int(ids_row[0])
        assert torch.equal(ids_row, unique_stream[start : start + 5])
        assert torch.equal(tgt_row, unique_stream[start + 1 : start + 6])


def test_random_batch_reproducible_with_seeded_generator() -> None:
    windows = LMWindows(torch.arange(300), block_size=10)
    a = windows.random_batch(8, torch.Generator().manual_seed(42))
    b = windows.random_batch(8, torch.Generator().manual_seed(42))
    c = windows.random_batch(8, torch.Generator().manual_seed(43))
    assert torch.equal(a.ids, b.ids) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.ids, c.ids)


def test_random_batch_covers_first_and_last_window() -> None:
    windows = LMWindows(torch.arange(12), block_size=10)  # exactly 2 windows
    batch = windows.random_batch(64, torch.Generator().manual_seed(0))
    assert set(batch.ids[:, 0].tolist()) == {0, 1}


def test_fixed_batches_identical_across_calls_and_in_range() -> None:
    tokens = torch.arange(1000)
    windows = LMWindows(tokens, block_size=16)
    first = windows.fixed_batches(num_batches=3, batch_size=4)
    second = windows.fixed_batches(num_batches=3, batch_size=4)
    assert len(first) == 3
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a.ids, b.ids) and torch.equal(a.targets, b.targets)
        assert torch.equal(a.ids[:, 1:], a.targets[:, :-1])
    starts = torch.cat([b.ids[:, 0] for b in first])
    assert int(starts[0]) == 0
    assert int(starts[-1]) == windows.num_windows - 1  # last window reaches the last token
    assert int(first[-1].targets[-1, -1]) == 999


def test_fixed_batches_capped_by_num_windows() -> None:
    windows = LMWindows(torch.arange(13), block_size=10)  # 3 windows
    batches = windows.fixed_batches(num_batches=5, batch_size=4)
    assert sum(len(b.ids) for b in batches) == 3


def test_fixed_batches_on_long_stream_stay_in_range() -> None:
    n_windows = 2**24 + 4  # n_windows - 1 = 16_777_219 rounds up to 16_777_220 in float32
    windows = LMWindows(torch.zeros(n_windows + 2, dtype=torch.long), block_size=2)
    batch = windows.fixed_batches(num_batches=1, batch_size=2)[0]
    assert batch.ids.shape == (2, 2)


@pytest.mark.parametrize("n_tokens", [0, 5, 8])
def test_lm_windows_too_short_raises(n_tokens: int) -> None:
    with pytest.raises(CorpusError, match="window") as info:
        LMWindows(torch.arange(n_tokens), block_size=8, name="validation split")
    assert "validation split" in str(info.value)
    assert f"{n_tokens} tokens" in str(info.value)


def test_lm_windows_exactly_one_window() -> None:
    windows = LMWindows(torch.arange(9), block_size=8)
    assert windows.num_windows == 1
    assert torch.equal(windows.fixed_batches(2, 2)[0].targets, torch.arange(1, 9)[None])


def test_lm_windows_rejects_2d_stream() -> None:
    with pytest.raises(ValueError, match="1-D"):
        LMWindows(torch.zeros(2, 20, dtype=torch.long), block_size=4)


SEQS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


@pytest.mark.parametrize("side", ["right", "left"])
def test_collate_sequences(side: str) -> None:
    batch = collate_sequences(SEQS, pad_id=0, side=side)
    t = max(len(s) for s in SEQS) - 1
    assert batch.ids.shape == batch.targets.shape == batch.padding_mask.shape == (3, t)
    assert batch.padding_mask.dtype == torch.bool
    assert batch.num_tokens == sum(len(s) - 1 for s in SEQS)
    for row, seq in enumerate(SEQS):
        n = len(seq) - 1
        real = slice(0, n) if side == "right" else slice(t - n, t)
        pad = slice(n, t) if side == "right" else slice(0, t - n)
        mask_row = batch.padding_mask[row]
        assert mask_row[real].all() and not mask_row[pad].any()
        assert int(mask_row.sum()) == n
        assert batch.ids[row, real].tolist() == seq[:-1]
        assert batch.targets[row, real].tolist() == seq[1:]
        assert (batch.targets[row, pad] == IGNORE_INDEX).all()
        assert (batch.ids[row, pad] == 0).all()
    # The mask and IGNORE_INDEX targets agree everywhere.
    assert torch.equal(batch.padding_mask, batch.targets != IGNORE_INDEX)


def test_collate_sequences_custom_pad_id() -> None:
    batch = collate_sequences([[1, 2, 3], [4, 5]], pad_id=99)
    assert batch.ids.tolist() == [[1, 2], [4, 99]]
    assert batch.targets.tolist() == [[2, 3], [5, IGNORE_INDEX]]


@pytest.mark.parametrize(
    ("sequences", "kwargs", "needle"),
    [([], {}, "no sequences"),
     ([[1, 2], [3]], {}, "fewer than 2"),
     ([[1, 2], []], {}, "fewer than 2"),
     ([[1, 2, 3]], {"side": "middle"}, "side")],
    ids=["empty-list", "length-1", "length-0", "bad-side"],
)
def test_collate_sequences_errors(sequences: list, kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        collate_sequences(sequences, **kwargs)


def test_batch_to_keeps_fields() -> None:
    batch = collate_sequences(SEQS).to("cpu")
    assert isinstance(batch, Batch) and batch.padding_mask is not None
    no_pad = Batch(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))
    assert no_pad.to("cpu").padding_mask is None


