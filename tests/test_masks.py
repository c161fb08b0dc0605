"""handformer.masks: causal and padding masks, their combination and torch polarity."""

from __future__ import annotations

import re

import pytest
import torch

from handformer.masks import (
    causal_mask,
    check_padding_mask,
    combine_masks,
    from_additive_mask,
    from_torch_key_padding_mask,
    padding_mask,
    to_torch_attn_mask,
    to_torch_key_padding_mask,
)


# =========================================================================================
# masks.py
# =========================================================================================
@pytest.mark.parametrize("t", [0, 1, 2, 5, 17])
def test_causal_mask_square(t: int) -> None:
    mask = causal_mask(t)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, torch.tril(torch.ones(t, t)).bool())
    assert torch.equal(causal_mask(t, t), mask)


@pytest.mark.parametrize(("t_q", "t_k"), [(1, 4), (2, 4), (3, 7), (0, 3), (6, 6)])
def test_causal_mask_end_aligned(t_q: int, t_k: int) -> None:
    mask = causal_mask(t_q, t_k)
    assert mask.shape == (t_q, t_k)
    assert torch.equal(mask, causal_mask(t_k)[t_k - t_q :])
    if t_q:
        assert mask[-1].all()  # the newest query sees every key


@pytest.mark.parametrize(("t_q", "t_k"), [(5, 4), (2, 1), (-1, None)])
def test_causal_mask_rejects_more_queries_than_keys(t_q: int, t_k: int | None) -> None:
    with pytest.raises(ValueError, match="t_q"):
        causal_mask(t_q, t_k)


def test_combine_masks_is_pad_and_causal() -> None:
    ids = torch.tensor([[5, 6, 7, 0], [5, 0, 0, 0], [1, 2, 3, 4]])
    pad = padding_mask(ids)
    causal = causal_mask(4)
    combined = combine_masks(pad, causal)
    assert combined.shape == (3, 1, 4, 4)
    for b in range(3):
        for i in range(4):
            for j in range(4):
                assert bool(combined[b, 0, i, j]) == (bool(pad[b, j]) and bool(causal[i, j]))


def test_combine_masks_single_inputs() -> None:
    pad = torch.tensor([[True, False, True]])
    assert combine_masks() is None
    assert combine_masks(None, None) is None
    only_causal = combine_masks(causal=causal_mask(3))
    assert only_causal.shape == (1, 1, 3, 3)
    only_pad = combine_masks(pad, t_q=2)
    assert only_pad.shape == (1, 1, 2, 3)
    assert torch.equal(only_pad[0, 0, 0], pad[0]) and torch.equal(only_pad[0, 0, 1], pad[0])
    assert combine_masks(pad).shape == (1, 1, 1, 3)


def test_combine_masks_end_aligned_with_cache() -> None:
    pad = torch.tensor([[False, True, True, True]])
    combined = combine_masks(pad, causal_mask(2, 4))
    assert combined.shape == (1, 1, 2, 4)
    assert combined[0, 0].tolist() == [[False, True, True, False], [False, True, True, True]]


@pytest.mark.parametrize(
    ("pad", "causal", "needle"),
    [(torch.ones(2, 3, dtype=torch.long), None, "bool"),
     (torch.ones(2, 3, 1, dtype=torch.bool), None, "bool"),
     (None, torch.ones(3, 3), "bool"),
     (torch.ones(2, 4, dtype=torch.bool), causal_mask(3), "key length")],
    ids=["pad-not-bool", "pad-3d", "causal-not-bool", "length-mismatch"],
)
def test_combine_masks_errors(pad: torch.Tensor | None, causal: torch.Tensor | None,
                              needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        combine_masks(pad, causal)


def test_padding_mask_polarity() -> None:
    ids = torch.tensor([[3, 4, 0, 0]])
    assert padding_mask(ids).tolist() == [[True, True, False, False]]
    assert padding_mask(ids, pad_id=4).tolist() == [[True, False, True, True]]
    with pytest.raises(ValueError, match=re.escape("(B, T)")):
        padding_mask(torch.tensor([1, 2, 0]))


def test_polarity_converters_round_trip() -> None:
    mask = torch.tensor([[True, True, False], [True, False, False]])
    torch_mask = to_torch_key_padding_mask(mask)
    assert torch.equal(torch_mask, ~mask)  # torch: True = ignore
    assert torch.equal(from_torch_key_padding_mask(torch_mask), mask)
    assert torch.equal(to_torch_attn_mask(causal_mask(3)), ~causal_mask(3))
    with pytest.raises(ValueError, match="boolean"):
        from_torch_key_padding_mask(torch.zeros(1, 3))


def test_polarity_matches_torch_multihead_attention() -> None:
    """Our (True = attend) masks, converted, reproduce a hand-masked torch MHA result."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 4, 8)
    keep = torch.tensor([[True, True, True, False], [True, True, False, False]])
    out_ours, _ = mha(x, x, x, key_padding_mask=to_torch_key_padding_mask(keep),
                      attn_mask=to_torch_attn_mask(causal_mask(4)))
    float_mask = torch.zeros(2, 4, 4).masked_fill(
        ~combine_masks(keep, causal_mask(4))[:, 0], float("-inf"))
    out_ref, _ = mha(x, x, x, attn_mask=float_mask.repeat_interleave(2, dim=0))
    assert torch.allclose(out_ours, out_ref, atol=1e-6)




# -- refusing masks of another convention -------------------------------------------------
def test_from_additive_mask_flips_a_torch_additive_mask() -> None:
    additive = torch.tensor([[0.0, 0.0, float("-inf")],
                             [0.0, torch.finfo(torch.float32).min, -1e4]])
    assert torch.equal(from_additive_mask(additive),
                       torch.tensor([[True, True, False], [True, False, False]]))


@pytest.mark.parametrize("bad", [torch.tensor([[0.0, 1.5]]), torch.tensor([[0.0, float("nan")]]),
                                 torch.tensor([[1, 0]])])
def test_from_additive_mask_refuses_what_is_not_an_additive_mask(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="from_additive_mask"):
        from_additive_mask(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.long, torch.int32,
                                   torch.uint8])
def test_check_padding_mask_refuses_non_boolean_masks_and_says_how_to_convert(
        dtype: torch.dtype) -> None:
    with pytest.raises(ValueError) as info:
        check_padding_mask(torch.zeros(2, 3, dtype=dtype), (2, 3), "Encoder")
    message = str(info.value)
    for needle in ("Encoder", "padding_mask", "True on real tokens", str(dtype),
                   "from_additive_mask", "mask.bool()", "from_torch_key_padding_mask"):
        assert needle in message, f"{needle!r} missing from: {message}"


def test_check_padding_mask_names_the_shape_and_accepts_a_good_mask() -> None:
    check_padding_mask(torch.ones(2, 3, dtype=torch.bool), (2, 3), "X")
    with pytest.raises(ValueError, match=r"memory_mask must be bool \(B, T\) = \(2, 3\)"):
        check_padding_mask(torch.ones(2, 4, dtype=torch.bool), (2, 3), "X", "memory_mask")
    with pytest.raises(ValueError, match="torch bool tensor"):
        check_padding_mask([[True, False]], (1, 2), "X")  # type: ignore[arg-type]
