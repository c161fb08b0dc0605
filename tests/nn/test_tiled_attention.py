"""The hand-written memory-efficient attention equals the reference, forward and backward.

Tolerances: fp32, rtol 1e-5 / atol 1e-5 (the online softmax sums in a different order).
"""

from __future__ import annotations

import pytest
import torch

from handformer.masks import combine_masks
from handformer.nn.attention import scaled_dot_product_attention
from handformer.nn.positional import alibi_bias, alibi_slopes
from handformer.nn.tiled_attention import tiled_attention

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _inputs(t: int, s: int, h: int = 4, hkv: int = 4) -> list[torch.Tensor]:
    return [torch.randn(2, h, t, 8, requires_grad=True),
            torch.randn(2, hkv, s, 8, requires_grad=True),
            torch.randn(2, hkv, s, 8, requires_grad=True)]


def _grads(out: torch.Tensor, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    weight = torch.linspace(-1, 1, out.numel()).view_as(out)  # a non-trivial upstream grad
    return torch.autograd.grad((out * weight).sum(), inputs)


@pytest.mark.parametrize("block", [1, 5, 16, 256])
@pytest.mark.parametrize("masking", ["none", "causal", "padding", "both", "alibi"])
@pytest.mark.parametrize("hkv", [4, 1])
def test_tiled_equals_reference(block: int, masking: str, hkv: int) -> None:
    t = s = 23
    inputs = _inputs(t, s, hkv=hkv)
    pad = torch.arange(s)[None] < torch.tensor([[23], [11]])  # (B, S)
    mask = combine_masks(pad) if masking in ("padding", "both") else None
    causal = masking in ("causal", "both", "alibi")
    pos = torch.arange(s)[None]
    bias = alibi_bias(alibi_slopes(4), pos, pos) if masking == "alibi" else None
    ours = tiled_attention(*inputs, mask, is_causal=causal, bias=bias, block=block)
    ref, _ = scaled_dot_product_attention(*inputs, mask, is_causal=causal, bias=bias)
    torch.testing.assert_close(ours, ref, **TOL)
    for g_ours, g_ref in zip(_grads(ours, inputs), _grads(ref, inputs), strict=True):
        torch.testing.assert_close(g_ours, g_ref, **TOL)


def test_end_aligned_causal_with_fewer_queries() -> None:
    inputs = _inputs(3, 40)
    ours = tiled_attention(*inputs, is_causal=True, block=7)
    ref, _ = scaled_dot_product_attention(*inputs, is_causal=True)
    torch.testing.assert_close(ours, ref, **TOL)


def test_rows_with_nothing_to_attend_give_zeros_and_zero_grads() -> None:
    inputs = _inputs(6, 6)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    mask[0, :, 2] = False
    mask[1] = False
    out = tiled_attention(*inputs, mask, block=4)
    assert not torch.isnan(out).any() and torch.all(out[1] == 0) and torch.all(out[0, :, 2] == 0)
    ref, _ = scaled_dot_product_attention(*inputs, mask)
    for g_ours, g_ref in zip(_grads(out, inputs), _grads(ref, inputs), strict=True):
        assert not torch.isnan(g_ours).any()
        torch.testing.assert_close(g_ours, g_ref, **TOL)


def test_gradcheck_in_double_precision() -> None:
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    mask = torch.tensor([True, True, True, False, True])[None, None, None, :]
    assert torch.autograd.gradcheck(
        lambda q, k, v: tiled_attention(q, k, v, mask, is_causal=True, block=2), (q, k, v))


def test_dropout_is_refused_on_the_tiled_path() -> None:
    from handformer.nn.attention import attention

    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    with pytest.raises(ValueError, match="no attention dropout"):
        attention(q, k, v, kind="tiled", dropout_p=0.1)
