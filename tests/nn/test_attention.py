"""Hand-written attention vs torch's references.

Tolerances: fp32 at ``torch.testing.assert_close`` defaults (rtol 1.3e-6, atol 1e-5).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from handformer.interop.torch_nn import to_torch_multihead_attention
from handformer.masks import causal_mask, combine_masks, to_torch_key_padding_mask
from handformer.nn.attention import MultiHeadAttention, attention, scaled_dot_product_attention

B, H, T, S, D = 3, 4, 7, 9, 8


def _qkv(t: int = T, s: int = S) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(B, H, t, D), torch.randn(B, H, s, D), torch.randn(B, H, s, D)


def _padding(lengths: list[int], s: int) -> torch.Tensor:
    return torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]  # (B, S)


@pytest.mark.parametrize("kind", ["none", "padding", "causal", "both"])
def test_manual_attention_matches_torch_sdpa(kind: str) -> None:
    q, k, v = _qkv()
    pad = _padding([9, 5, 2], S) if kind in ("padding", "both") else None
    causal = causal_mask(T, S) if kind in ("causal", "both") else None
    mask = combine_masks(pad, causal)
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, H, T))
    if mask is not None:
        assert torch.all(weights.masked_select(~mask.expand_as(weights)) == 0)


def test_is_causal_flag_equals_explicit_end_aligned_mask() -> None:
    q, k, v = _qkv(t=3, s=6)
    out_flag, _ = scaled_dot_product_attention(q, k, v, is_causal=True)
    out_mask, _ = scaled_dot_product_attention(q, k, v, causal_mask(3, 6))
    torch.testing.assert_close(out_flag, out_mask)
    fused, _ = attention(q, k, v, kind="sdpa", is_causal=True)
    torch.testing.assert_close(fused, out_flag)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("with_padding", [False, True])
def test_fused_and_manual_paths_agree_with_gradients(is_causal: bool, with_padding: bool) -> None:
    """All three kernels: the same output and the same gradients for q, k and v (the
    tiled kernel's backward is hand-written, so each of dq, dk, dv is checked)."""
    q, k, v = (t.requires_grad_() for t in _qkv(t=S, s=S))
    mask = combine_masks(_padding([9, 4, 6], S)) if with_padding else None
    grad_out = torch.randn(B, H, S, D)
    results = {}
    for kind in ("manual", "sdpa", "tiled"):
        out, _ = attention(q, k, v, mask, kind=kind, is_causal=is_causal)
        results[kind] = (out, *torch.autograd.grad(out, [q, k, v], grad_out))
    for kind in ("sdpa", "tiled"):
        for name, got, want in zip(("out", "dq", "dk", "dv"), results[kind], results["manual"],
                                   strict=True):
            torch.testing.assert_close(got, want, msg=lambda m, k=kind, n=name: f"{k} {n}: {m}")


@pytest.mark.parametrize("kind", ["manual", "sdpa", "tiled"])
def test_fully_masked_rows_give_zeros_not_nan(kind: str) -> None:
    q, k, v = _qkv()
    mask = torch.ones(B, 1, T, S, dtype=torch.bool)
    mask[1, :, 2] = False  # query 2 of batch row 1 may attend to nothing
    mask[2] = False  # a whole sequence of nothing
    out, _ = attention(q, k, v, mask, kind=kind)
    assert not torch.isnan(out).any()
    assert torch.all(out[1, :, 2] == 0) and torch.all(out[2] == 0)
    torch.testing.assert_close(out[0], F.scaled_dot_product_attention(q, k, v)[0])


def test_auto_runs_the_manual_kernel_for_bf16_on_cpu_and_sdpa_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` is no kernel of its own: it hands fp32 to SDPA and CPU bf16 to the manual
    kernel (and gives what they give)."""
    import handformer.nn.attention as attn

    ran: list[str] = []
    manual, fused = attn._manual_attention, attn._fused_attention
    monkeypatch.setattr(attn, "_manual_attention",
                        lambda *a, **k: (ran.append("manual"), manual(*a, **k))[1])
    monkeypatch.setattr(attn, "_fused_attention",
                        lambda *a, **k: (ran.append("sdpa"), fused(*a, **k))[1])
    q, k, v = _qkv()
    out, _ = attention(q, k, v, kind="auto", is_causal=True)
    torch.testing.assert_close(out, attention(q, k, v, kind="sdpa", is_causal=True)[0])
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    outb, _ = attention(qb, kb, vb, kind="auto", is_causal=True)
    assert torch.equal(outb, attention(qb, kb, vb, kind="manual", is_causal=True)[0])
    assert ran == ["sdpa", "sdpa", "manual", "manual"]


def test_bad_masks_and_shapes_raise_clear_errors() -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"mask shape \(2, 7\) does not broadcast"):
        scaled_dot_product_attention(q, k, v, torch.ones(2, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="must be boolean"):
        scaled_dot_product_attention(q, k, v, torch.ones(B, 1, T, S))
    with pytest.raises(ValueError, match="head dim"):
        scaled_dot_product_attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match=r"expects q \(B, H, T, D\)"):
        scaled_dot_product_attention(q[0], k, v)
    mha = MultiHeadAttention(32, 4)
    with pytest.raises(ValueError, match=r"expects x of shape \(B, T, 32\)"):
        mha(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(30, 4)


@pytest.mark.parametrize("path", ["manual", "sdpa", "tiled"])
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_matches_nn_multiheadattention(path: str, causal: bool) -> None:
    """The output of every kernel, and the manual kernel's weights. ``need_weights=True``
    always runs the manual kernel, so the sdpa and tiled outputs are taken without it."""
    ours = MultiHeadAttention(32, 4, attention=path).eval()
    ref = to_torch_multihead_attention(ours)
    x = torch.randn(3, 6, 32)
    pad = _padding([6, 3, 1], 6)  # handformer polarity: True = real token
    attn_mask = causal_mask(6) if causal else None
    expected, ref_weights = ref(
        x, x, x,
        key_padding_mask=to_torch_key_padding_mask(pad),
        attn_mask=None if attn_mask is None else ~attn_mask,
        need_weights=True,
        average_attn_weights=False,
    )
    # The causal part as an explicit mask, and as the is_causal flag.
    for kwargs in ({"mask": combine_masks(pad, attn_mask)},
                   {"mask": combine_masks(pad), "is_causal": causal}):
        out, weights = ours(x, **kwargs)  # the chosen kernel
        assert weights is None
        torch.testing.assert_close(out, expected)
        out, weights = ours(x, need_weights=True, **kwargs)  # the manual kernel, whatever path
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(weights, ref_weights)


@pytest.mark.parametrize("path", ["manual", "sdpa", "tiled"])
def test_cross_attention_matches_nn_multiheadattention(path: str) -> None:
    ours = MultiHeadAttention(32, 4, attention=path).eval()
    ref = to_torch_multihead_attention(ours)
    x, memory = torch.randn(2, 5, 32), torch.randn(2, 8, 32)
    pad = _padding([8, 3], 8)
    out, _ = ours(x, memory, mask=combine_masks(pad))
    expected, _ = ref(x, memory, memory, key_padding_mask=to_torch_key_padding_mask(pad))
    torch.testing.assert_close(out, expected)
