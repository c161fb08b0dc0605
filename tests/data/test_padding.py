"""handformer.data.padding: the one padding helper, right and left."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from handformer.data.padding import pad_sequences

rows = st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=8), min_size=1, max_size=6)


@given(rows, st.sampled_from(["right", "left"]), st.integers(-100, 99))
def test_every_row_comes_back_from_its_mask(seqs: list[list[int]], side: str, pad: int) -> None:
    ids, mask = pad_sequences(seqs, pad, side=side)  # type: ignore[arg-type]
    assert ids.shape == mask.shape == (len(seqs), max(len(s) for s in seqs))
    assert mask.dtype == torch.bool and ids.dtype == torch.long
    for row, seq in enumerate(seqs):
        assert ids[row][mask[row]].tolist() == seq
        assert (ids[row][~mask[row]] == pad).all()
        real = mask[row].nonzero().flatten().tolist()
        # Real tokens form one contiguous run at the chosen end.
        expected = (list(range(len(seq))) if side == "right"
                    else list(range(ids.shape[1] - len(seq), ids.shape[1])))
        assert real == expected


def test_left_padding_puts_every_last_token_in_the_last_column() -> None:
    ids, mask = pad_sequences([[1, 2, 3], [7]], 0, side="left")
    assert ids.tolist() == [[1, 2, 3], [0, 0, 7]]
    assert mask.tolist() == [[True, True, True], [False, False, True]]


@pytest.mark.parametrize(("seqs", "side", "needle"), [
    ([], "right", "no sequences"),
    ([[1], []], "right", r"sequences \[1\] are empty"),
    ([[1]], "middle", "side must be"),
])
def test_bad_input_is_named(seqs: list, side: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        pad_sequences(seqs, 0, side=side)  # type: ignore[arg-type]
