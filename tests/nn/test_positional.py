"""Positions and attention variants: RoPE, ALiBi, sinusoidal, grouped-query attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from handformer.masks import causal_mask
from handformer.nn.attention import MultiHeadAttention, attention
from handformer.nn.kv_cache import KVCache
from handformer.nn.positional import (
    RotaryEmbedding,
    SinusoidalPositions,
    alibi_bias,
    alibi_slopes,
)


def _rope_complex(x: torch.Tensor, positions: torch.Tensor,
                  theta: torch.Tensor) -> torch.Tensor:
    """RoPE the textbook way: channel pairs as complex numbers times e^{i·p·θ}."""
    d = x.shape[-1]
    angle = positions.double()[:, None] * theta  # (T, D/2)
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).flatten(-2)


@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_rope_matches_complex_number_implementation(base: float) -> None:
    rope = RotaryEmbedding(16, base)
    x = torch.randn(2, 3, 7, 16)
    positions = torch.tensor([0, 1, 2, 5, 9, 100, 4096])
    # θ_i = base^(-2i/D), held in fp32 (the rounding Hugging Face checkpoints use): the
    # frequencies are pinned to the formula here, the rotation below to complex numbers.
    exact = base ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)  # (D/2,)
    torch.testing.assert_close(rope.inv_freq.double(), exact, rtol=2e-7, atol=0)
    torch.testing.assert_close(rope(x, positions).double(),
                               _rope_complex(x, positions, rope.inv_freq.double()),
                               rtol=1e-5, atol=1e-4)


def _reference_rope_attention(mha: MultiHeadAttention, x: torch.Tensor,
                              positions: torch.Tensor, base: float) -> torch.Tensor:
    """Causal self-attention with RoPE, built independently of handformer's attention: the
    module's projection weights (copied), q AND k rotated by ``_rope_complex`` (complex
    numbers, float64), torch's ``F.scaled_dot_product_attention``, the output projection."""
    b, t, c = x.shape
    h, hkv, d = mha.n_heads, mha.n_kv_heads, mha.head_dim
    w_in, b_in = mha.in_proj.weight.detach().clone(), mha.in_proj.bias.detach().clone()
    w_out, b_out = mha.out_proj.weight.detach().clone(), mha.out_proj.bias.detach().clone()
    q, k, v = (x @ w_in.T + b_in).split([c, hkv * d, hkv * d], dim=-1)
    q = q.reshape(b, t, h, d).transpose(1, 2)  # (B, H, T, D)
    k = k.reshape(b, t, hkv, d).transpose(1, 2)  # (B, Hkv, T, D)
    v = v.reshape(b, t, hkv, d).transpose(1, 2)  # (B, Hkv, T, D)
    theta = base ** (-torch.arange(0, q.shape[-1], 2, dtype=torch.float64) / q.shape[-1])
    q, k = (_rope_complex(z, positions, theta).float() for z in (q, k))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv != h)
    return out.transpose(1, 2).reshape(b, t, c) @ w_out.T + b_out  # (B, T, C)


@pytest.mark.parametrize("path", ["manual", "sdpa", "tiled"])
@pytest.mark.parametrize("n_kv_heads", [4, 2])
@pytest.mark.parametrize("cached", [False, True])
def test_rope_attention_matches_an_independent_reference(path: str, n_kv_heads: int,
                                                         cached: bool) -> None:
    """MultiHeadAttention(positional="rope") against ``_reference_rope_attention``, in one
    pass and as a KV-cached prefill followed by one-token steps (the decoding path)."""
    base = 500.0
    mha = MultiHeadAttention(32, 4, n_kv_heads=n_kv_heads, attention=path, positional="rope",
                             rope_base=base).eval()
    x = torch.randn(2, 9, 32)
    positions = torch.arange(9) + 3  # not starting at 0: the rotation must use them
    expected = _reference_rope_attention(mha, x, positions, base)
    with torch.no_grad():
        if not cached:
            out, _ = mha(x, is_causal=True, positions=positions)
        else:
            cache = KVCache(2, n_kv_heads, 12, 8)
            pieces = [mha(x[:, :4], is_causal=True, positions=positions[:4], cache=cache)[0]]
            for t in range(4, 9):
                step, _ = mha(x[:, t : t + 1], is_causal=True, positions=positions[t : t + 1],
                              cache=cache, cache_start=t)  # (B, 1, C)
                pieces.append(step)
            out = torch.cat(pieces, dim=1)  # (B, T, C)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_rope_preserves_norms() -> None:
    x = torch.randn(2, 4, 9, 32)
    rotated = RotaryEmbedding(32)(x, torch.arange(9) * 37)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))


@settings(max_examples=60, deadline=None)
@given(m=st.integers(0, 2000), n=st.integers(0, 2000), shift=st.integers(-500, 3000))
def test_rope_score_depends_only_on_the_offset(m: int, n: int, shift: int) -> None:
    rope = RotaryEmbedding(16)
    gen = torch.Generator().manual_seed(m * 7919 + n)
    q, k = torch.randn(1, 1, 1, 16, generator=gen), torch.randn(1, 1, 1, 16, generator=gen)
    shift = max(shift, -min(m, n))  # keep positions non-negative

    def score(pq: int, pk: int) -> float:
        qr = rope(q, torch.tensor([pq]))
        kr = rope(k, torch.tensor([pk]))
        return float((qr * kr).sum())

    assert score(m, n) == pytest.approx(score(m + shift, n + shift), rel=1e-3, abs=1e-3)


@pytest.mark.parametrize("n_heads", [8, 6, 12, 1])
def test_alibi_slopes_follow_the_published_formula(n_heads: int) -> None:
    def geometric(n: int) -> list[float]:
        return [2 ** (-8 * (i + 1) / n) for i in range(n)]

    lower = 2 ** math.floor(math.log2(n_heads))
    expected = geometric(lower) + geometric(2 * lower)[0::2][: n_heads - lower]
    torch.testing.assert_close(alibi_slopes(n_heads), torch.tensor(expected))


def test_alibi_slopes_known_values() -> None:
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -i for i in range(1, 9)]))
    # 6 heads: the 4-head slopes 1/4, 1/16, 1/64, 1/256, then every other 8-head slope.
    torch.testing.assert_close(alibi_slopes(6),
                               torch.tensor([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]))


def test_alibi_bias_shape_and_values() -> None:
    slopes = alibi_slopes(4)
    bias = alibi_bias(slopes, torch.arange(3)[None] + 2, torch.arange(5)[None])  # (1, 4, 3, 5)
    assert bias.shape == (1, 4, 3, 5)
    for h in range(4):
        for i in range(3):
            for j in range(5):
                assert float(bias[0, h, i, j]) == pytest.approx(-float(slopes[h]) * abs(i + 2 - j))


@pytest.mark.parametrize("path", ["manual", "sdpa", "tiled"])
def test_alibi_attention_equals_sdpa_with_float_mask(path: str) -> None:
    mha = MultiHeadAttention(32, 4, attention=path, positional="alibi").eval()
    x = torch.randn(2, 6, 32)
    out, _ = mha(x, is_causal=True)
    q, k, v = mha.in_proj(x).split(32, dim=-1)
    q, k, v = (t.view(2, 6, 4, 8).transpose(1, 2) for t in (q, k, v))
    pos = torch.arange(6)[None]
    float_mask = alibi_bias(mha.alibi_slopes, pos, pos).masked_fill(~causal_mask(6), -math.inf)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask)
    torch.testing.assert_close(out, mha.out_proj(ref.transpose(1, 2).reshape(2, 6, 32)))


def test_sinusoidal_matches_the_paper_formula() -> None:
    enc = SinusoidalPositions(16)(torch.arange(50))  # (T, C)
    pos = torch.arange(50, dtype=torch.float64)[:, None]
    i = torch.arange(0, 16, 2, dtype=torch.float64)
    torch.testing.assert_close(enc[:, 0::2].double(), torch.sin(pos / 10000 ** (i / 16)),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(enc[:, 1::2].double(), torch.cos(pos / 10000 ** (i / 16)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_kv_heads", [1, 2])
@pytest.mark.parametrize("path", ["manual", "sdpa", "tiled"])
def test_gqa_equals_mha_with_repeated_kv_heads(n_kv_heads: int, path: str) -> None:
    d, h = 32, 4
    gqa = MultiHeadAttention(d, h, n_kv_heads=n_kv_heads, attention=path).eval()
    mha = MultiHeadAttention(d, h, attention=path).eval()
    hd, groups = d // h, h // n_kv_heads
    w, b = gqa.in_proj.weight, gqa.in_proj.bias
    q_w, k_w, v_w = w.split([d, n_kv_heads * hd, n_kv_heads * hd])
    q_b, k_b, v_b = b.split([d, n_kv_heads * hd, n_kv_heads * hd])

    def repeat(t: torch.Tensor) -> torch.Tensor:  # (Hkv·D, …) → (H·D, …)
        return t.view(n_kv_heads, hd, *t.shape[1:]).repeat_interleave(groups, 0).flatten(0, 1)

    with torch.no_grad():
        mha.in_proj.weight.copy_(torch.cat([q_w, repeat(k_w), repeat(v_w)]))
        mha.in_proj.bias.copy_(torch.cat([q_b, repeat(k_b), repeat(v_b)]))
        mha.out_proj.load_state_dict(gqa.out_proj.state_dict())
    x = torch.randn(2, 7, d)
    pad = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    pad[1, ..., 5:] = False
    torch.testing.assert_close(gqa(x, mask=pad, is_causal=True)[0],
                               mha(x, mask=pad, is_causal=True)[0])


def test_grouped_kernels_equal_torch_enable_gqa() -> None:
    q, k, v = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for kind in ("manual", "sdpa", "tiled"):
        out, _ = attention(q, k, v, kind=kind, is_causal=True)
        torch.testing.assert_close(out, expected)


def test_bad_head_counts_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="n_kv_heads=3 must divide n_heads=4"):
        MultiHeadAttention(32, 4, n_kv_heads=3)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention(torch.randn(1, 4, 2, 8), torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8))
    with pytest.raises(ValueError, match="even head dim"):
        RotaryEmbedding(7)
