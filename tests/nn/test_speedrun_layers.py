"""The speedrun's layer levers against references: RMSNorm vs ``torch.nn.RMSNorm``, ReLU² and
SwiGLU written out with plain tensor ops, SwiGLU's parameter rule, QK-norm on every kernel
and in cached decoding, zero-initialised output projections and logit soft-capping.

Tolerances: fp32 at ``torch.testing.assert_close`` defaults (rtol 1.3e-6, atol 1e-5) unless a
line says otherwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from handformer.config import ModelConfig
from handformer.models.decoder_lm import DecoderLM
from handformer.nn.attention import MultiHeadAttention
from handformer.nn.feedforward import FeedForward, swiglu_hidden
from handformer.nn.norm import RMSNorm, make_norm


# -- RMSNorm ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(2, 5, 16), (7, 3), (1, 1, 1, 32)])
def test_rmsnorm_matches_torch_rmsnorm(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    ours, ref = RMSNorm(shape[-1], eps=1e-5), nn.RMSNorm(shape[-1], eps=1e-5)
    with torch.no_grad():
        ours.weight.normal_()
        ref.weight.copy_(ours.weight)
    x = torch.randn(shape) * 3.0
    torch.testing.assert_close(ours(x), ref(x))
    # bf16 input: computed in fp32, returned in bf16 (bf16's own rounding: atol 2e-2).
    xb = x.bfloat16()
    out = ours(xb)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref(xb.float()), rtol=1e-2, atol=2e-2)


def _plain_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The formula as autograd records it, op by op: the reference for the written-out backward."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) \
        * weight.to(x.dtype)


@pytest.mark.parametrize("shape", [(2, 5, 16), (7, 3), (2, 3, 4, 8)])
def test_rmsnorm_backward_equals_autograds_of_the_formula(shape: tuple[int, ...]) -> None:
    """The hand-derived backward: gradcheck in float64, then fp32 and a bf16 activation
    against autograd through the plain formula; only the inputs that ask get a gradient."""
    from handformer.nn.norm import _RMSNormFunction

    torch.manual_seed(2)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(shape[-1], dtype=torch.float64, requires_grad=True)
    # (x̂ is kept in fp32 by design: gradcheck's float64 finite differences need looser
    # tolerances than its defaults.)
    assert torch.autograd.gradcheck(lambda a, g: _RMSNormFunction.apply(a, g, 1e-5), (x, w),
                                    eps=1e-3, atol=1e-3, rtol=1e-3)
    for dtype, tol in ((torch.float32, {}), (torch.bfloat16, {"rtol": 1e-2, "atol": 2e-2})):
        xs = (torch.randn(shape) * 3).to(dtype).requires_grad_()
        w = torch.randn(shape[-1], requires_grad=True)
        grad = torch.randn(shape).to(dtype)
        ours = RMSNorm(shape[-1], eps=1e-5)
        with torch.no_grad():
            ours.weight.copy_(w)
        gx, gw = torch.autograd.grad(ours(xs), (xs, ours.weight), grad)
        rx, rw = torch.autograd.grad(_plain_rmsnorm(xs, w, 1e-5), (xs, w), grad)
        assert gx.dtype == dtype and gw.dtype == torch.float32
        torch.testing.assert_close(gx.float(), rx.float(), **tol)
        torch.testing.assert_close(gw, rw, **tol)
    frozen = RMSNorm(shape[-1]).requires_grad_(False)
    x32 = torch.randn(shape, requires_grad=True)
    (gx,) = torch.autograd.grad(frozen(x32).sum(), (x32,))
    torch.testing.assert_close(gx, torch.autograd.grad(
        _plain_rmsnorm(x32, frozen.weight, 1e-5).sum(), (x32,))[0])


def test_make_norm_builds_either_kind_and_names_the_choices_for_a_typo() -> None:
    assert isinstance(make_norm("layernorm", 8), nn.LayerNorm)
    assert isinstance(make_norm("rmsnorm", 8), RMSNorm)
    with pytest.raises(ValueError, match=r"layernorm.*rmsnorm"):
        make_norm("batchnorm", 8)
    with pytest.raises(ValueError, match="norm_type"):
        ModelConfig(vocab_size=10, norm_type="rms")


# -- feed-forward variants ----------------------------------------------------------------
def test_relu2_and_swiglu_match_their_formulas() -> None:
    torch.manual_seed(1)
    x = torch.randn(2, 5, 16)
    relu2 = FeedForward(16, 32, activation="relu2")
    expected = relu2.fc_out(F.relu(relu2.fc_in(x)) ** 2)
    torch.testing.assert_close(relu2(x), expected)
    swiglu = FeedForward(16, 24, activation="swiglu")
    w_gate, w_up = swiglu.fc_in.weight[:24], swiglu.fc_in.weight[24:]
    b_gate, b_up = swiglu.fc_in.bias[:24], swiglu.fc_in.bias[24:]
    hidden = F.silu(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)  # (B, T, F)
    torch.testing.assert_close(swiglu(x), swiglu.fc_out(hidden))


@pytest.mark.parametrize("d_model", [32, 64, 96, 128, 160, 192, 256, 384, 512, 768])
def test_swiglu_default_width_keeps_the_parameter_count_comparable(d_model: int) -> None:
    """Rounding 8C/3 to a multiple of 8 moves it by at most 4: a relative error of at most
    1.5 / C in the FFN's parameters (under 2 % from C = 75 on)."""
    def ffn_params(activation: str) -> int:
        cfg = ModelConfig(vocab_size=10, d_model=d_model, n_heads=4, activation=activation)
        return sum(p.numel() for p in FeedForward(d_model, cfg.d_ff, activation=activation,
                                                  bias=False).parameters())

    assert ModelConfig(vocab_size=10, d_model=d_model, n_heads=4,
                       activation="swiglu").d_ff == swiglu_hidden(d_model)
    assert swiglu_hidden(d_model) % 8 == 0
    gelu, swiglu = ffn_params("gelu"), ffn_params("swiglu")
    assert gelu == ffn_params("relu2") == 8 * d_model * d_model
    assert abs(swiglu - gelu) / gelu <= 1.5 / d_model, (swiglu, gelu)
    if d_model >= 75:
        assert abs(swiglu - gelu) / gelu < 0.02
    # An explicit d_ff is the hidden width as given.
    assert ModelConfig(vocab_size=10, d_model=d_model, n_heads=4, d_ff=100,
                       activation="swiglu").d_ff == 100


# -- QK-norm ------------------------------------------------------------------------------
def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight


@pytest.mark.parametrize("positional", ["none", "rope"])
def test_qk_norm_equals_attention_over_normalised_queries_and_keys(positional: str) -> None:
    torch.manual_seed(2)
    b, t, c, h = 2, 6, 32, 4
    d = c // h
    mha = MultiHeadAttention(c, h, attention="manual", positional=positional, qk_norm=True)
    with torch.no_grad():
        mha.q_norm.weight.uniform_(0.5, 1.5)  # type: ignore[union-attr]
        mha.k_norm.weight.uniform_(0.5, 1.5)  # type: ignore[union-attr]
    x = torch.randn(b, t, c) * 4.0
    q, k, v = mha.in_proj(x).split(c, dim=-1)
    q, k, v = (z.view(b, t, h, d).transpose(1, 2) for z in (q, k, v))  # (B, H, T, D)
    q, k = _rms(q, mha.q_norm.weight), _rms(k, mha.k_norm.weight)  # type: ignore[union-attr]
    if mha.rotary is not None:  # normalised first, then rotated
        q, k = mha.rotary(q, torch.arange(t)), mha.rotary(k, torch.arange(t))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
    expected = mha.out_proj(out.transpose(1, 2).reshape(b, t, c))
    torch.testing.assert_close(mha(x, is_causal=True)[0], expected)


def test_qk_norm_gives_the_same_output_on_every_kernel() -> None:
    torch.manual_seed(3)
    x = torch.randn(2, 9, 32) * 5.0
    outs = {}
    for kind in ("manual", "sdpa", "tiled"):
        torch.manual_seed(4)
        mha = MultiHeadAttention(32, 4, attention=kind, positional="rope", qk_norm=True,
                                 n_kv_heads=2)
        outs[kind] = mha(x, is_causal=True)[0]
    torch.testing.assert_close(outs["sdpa"], outs["manual"])
    torch.testing.assert_close(outs["tiled"], outs["manual"])


@pytest.mark.parametrize("attention", ["manual", "sdpa", "tiled"])
def test_cached_decoding_with_qk_norm_equals_the_full_forward(attention: str) -> None:
    torch.manual_seed(5)
    cfg = ModelConfig(vocab_size=20, d_model=32, n_heads=4, n_layers=2, max_len=16,
                      positional="rope", qk_norm=True, attention=attention)
    model = DecoderLM(cfg).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.self_attn.k_norm.weight.uniform_(0.5, 2.0)
        ids = torch.randint(0, 20, (2, 12))
        full = model(ids)
        cache = model.make_cache(2)
        pieces = [model(ids[:, :5], cache=cache)]
        pieces += [model(ids[:, i:i + 1], cache=cache, validate=False) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


# -- zero-initialised output projections ----------------------------------------------------
def test_zero_init_out_makes_every_block_the_identity_at_first() -> None:
    torch.manual_seed(6)
    cfg = ModelConfig(vocab_size=20, d_model=32, n_heads=4, n_layers=3, zero_init_out=True,
                      activation="swiglu")
    model = DecoderLM(cfg)
    for block in model.blocks:
        assert torch.count_nonzero(block.self_attn.out_proj.weight) == 0
        assert torch.count_nonzero(block.ffn.fc_out.weight) == 0
        assert torch.count_nonzero(block.ffn.fc_in.weight) > 0
    ids = torch.randint(0, 20, (2, 7))
    x, _ = model.embed(ids)
    torch.testing.assert_close(model(ids), model.lm_head(model.final_norm(x)))
    plain = DecoderLM(ModelConfig(**{**cfg.to_dict(), "zero_init_out": False}))
    assert torch.count_nonzero(plain.blocks[0].self_attn.out_proj.weight) > 0


# -- logit soft-capping ----------------------------------------------------------------------
def test_softcap_bounds_the_logits_and_is_tanh_of_the_uncapped_ones() -> None:
    torch.manual_seed(7)
    cfg = ModelConfig(vocab_size=20, d_model=32, n_heads=4, n_layers=1, logit_softcap=5.0)
    capped = DecoderLM(cfg)
    with torch.no_grad():
        capped.lm_head.weight.mul_(400.0)  # (tied) logits far beyond the cap
    uncapped = DecoderLM(ModelConfig(**{**cfg.to_dict(), "logit_softcap": 0.0}))
    uncapped.load_state_dict(capped.state_dict())
    ids = torch.randint(0, 20, (3, 9))
    raw, out = uncapped(ids), capped(ids)
    assert raw.abs().max() > 50.0
    assert out.abs().max() <= 5.0  # tanh saturates to exactly ±1 in fp32
    torch.testing.assert_close(out, 5.0 * torch.tanh(raw / 5.0))
    with pytest.raises(ValueError, match="logit_softcap"):
        ModelConfig(vocab_size=10, logit_softcap=-1.0)


def test_generation_samples_from_the_capped_logits_of_the_one_forward() -> None:
    from handformer.generate import generate

    torch.manual_seed(8)
    cfg = ModelConfig(vocab_size=20, d_model=32, n_heads=4, n_layers=2, max_len=16,
                      positional="rope", logit_softcap=2.0, qk_norm=True)
    model = DecoderLM(cfg).eval()
    seen: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o))
    prompt = torch.tensor([[1, 2, 3]])
    out = generate(model, prompt, 6, temperature=1e-4, top_k=None, seed=0)  # ≈ greedy
    # Greedy decoding over the full forward's (capped) logits picks the same tokens.
    with torch.no_grad():
        ids = prompt
        for _ in range(6):
            logits = model(ids)[:, -1]  # (1, V)
            assert logits.abs().max() <= 2.0
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ids)
    assert seen  # generate ran the model's forward (and its head)
