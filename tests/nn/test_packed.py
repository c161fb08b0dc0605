"""``PackedLinear``: oneDNN's product over a reordered weight equals ``nn.Linear``'s to
float32 rounding, for every shape a model meets, and refuses what it cannot run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import handformer.nn.packed as packed_module
from handformer.nn.packed import (
    EXACT_ROWS,
    ROW_STEP,
    ROWS_PER_CALL,
    PackedLinear,
    call_rows,
    onednn_packing_available,
)

pytestmark = pytest.mark.skipif(not onednn_packing_available(),
                                reason="this torch build has no oneDNN")


@pytest.mark.parametrize("seed", range(12))
def test_packed_product_equals_linear_for_random_shapes(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    k, n = (int(v) for v in torch.randint(1, 200, (2,), generator=g))
    rows = int(torch.randint(0, 3 * ROWS_PER_CALL, (1,), generator=g))
    lead = [(rows,), (1, rows), (2, 3, rows)][seed % 3]  # (..., K) of any depth, 0 rows too
    linear = nn.Linear(k, n, bias=seed % 2 == 0)
    x = torch.randn(*lead, k, generator=g)
    packed = PackedLinear.from_linear(linear)
    with torch.inference_mode():
        expected, got = linear(x), packed(x)
    assert got.shape == expected.shape == (*x.shape[:-1], n)
    # Float32 products of the same numbers in another order: within K ulps of the sums.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_tall_inputs_are_multiplied_in_few_near_equal_pieces_from_a_fixed_set_of_heights(
        monkeypatch) -> None:
    calls: list[int] = []
    product = packed_module._product

    def counted(rows, packed, bias):
        calls.append(rows.shape[0])
        return product(rows, packed, bias)

    monkeypatch.setattr(packed_module, "_product", counted)
    linear = nn.Linear(8, 6)
    packed = PackedLinear.from_linear(linear)
    x = torch.randn(2 * ROWS_PER_CALL + 5, 8)  # 133 rows: three pieces of 45, 44, 44
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
        for rows in (ROWS_PER_CALL, ROWS_PER_CALL + 1, EXACT_ROWS, EXACT_ROWS + 1, 3):
            torch.testing.assert_close(packed(x[:rows]), linear(x[:rows]), rtol=1e-5,
                                       atol=1e-5)
    # 45 rows are handed over as 48 (the three zero rows dropped from the product); a
    # decoding step's batch (up to EXACT_ROWS) as it is; 65 rows as 33 (padded) + 32.
    assert calls == [48, 44, 44, ROWS_PER_CALL, 36, 32, EXACT_ROWS, 20, 3]


def test_every_row_count_is_split_into_at_most_a_few_dozen_kernel_heights() -> None:
    heights: set[int] = set()
    for rows in range(1, 40 * ROWS_PER_CALL):
        calls = call_rows(rows)
        assert sum(taken for taken, _ in calls) == rows
        assert len(calls) == -(-rows // ROWS_PER_CALL)  # as few calls as the cap allows
        assert max(t for t, _ in calls) - min(t for t, _ in calls) <= 1  # near-equal
        for taken, height in calls:
            assert taken <= height <= ROWS_PER_CALL
            assert height == taken if taken <= EXACT_ROWS else (
                height % ROW_STEP == 0 and height - taken < ROW_STEP)
            heights.add(height)
    assert len(heights) == EXACT_ROWS + (ROWS_PER_CALL - EXACT_ROWS) // ROW_STEP


def test_a_non_contiguous_input_gives_the_same_rows() -> None:
    linear = nn.Linear(16, 8)
    x = torch.randn(16, 6).t()  # (6, 16), a transposed view
    packed = PackedLinear.from_linear(linear)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)


def test_the_packed_layer_holds_no_trainable_weight_and_changes_nothing_of_the_original() -> None:
    linear = nn.Linear(12, 5)
    before = linear.weight.detach().clone()
    packed = PackedLinear.from_linear(linear)
    assert list(packed.parameters()) == []
    assert set(packed.state_dict()) == {"bias"}
    assert torch.equal(linear.weight.detach(), before)
    assert "oneDNN-packed" in repr(packed)


def test_wrong_weights_and_inputs_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"float32 weights on the CPU; got torch\.bfloat16"):
        PackedLinear.from_linear(nn.Linear(4, 4).to(torch.bfloat16))
    packed = PackedLinear.from_linear(nn.Linear(4, 3))
    with pytest.raises(ValueError, match=r"float32 CPU input \(\.\.\., 4\); got torch.float32 "
                       r"\(2, 5\)"):
        packed(torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"got torch\.float64"):
        packed(torch.randn(2, 4, dtype=torch.float64))
