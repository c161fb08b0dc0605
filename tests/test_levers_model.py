"""Every ``ModelConfig`` lever pinned to its exact meaning, against formulas written out here.

The centre is ``reference_logits``: a from-scratch decoder / encoder in float64 that reads the
model's parameters and implements each lever from its textbook formula (LayerNorm and RMSNorm
with their epsilon, pre/post placement, the five activations, sinusoidal positions with the
√C token scale, learned positions, RoPE with its base on interleaved channel pairs, ALiBi with
the published per-head slopes typed in as numbers, grouped-query heads where query head h
reads key/value head h // G, QK-norm before RoPE, the tied or untied head, soft-capping).
Each configuration below sets several levers to non-default values; the model must match
the reference on every attention kernel, *and* the reference with any one lever set wrongly
must differ from the model by far more than the tolerance — so a test passes only if each
lever means exactly what it says.

Weights are re-drawn at sizes where every lever shows (peaked attention, logits beyond the
soft cap, epsilons of 0.5): at the default initialisation most of them would be invisible.

Tolerances: model fp32 vs reference fp64, ``TOL`` = rtol 1e-4, atol 1e-4; a wrong lever must
move some value by more than ``MARGIN`` = 10 times what ``TOL`` allows there (``excess``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch
from torch import Tensor

from handformer.config import ModelConfig
from handformer.models.decoder_lm import DecoderLM
from handformer.models.encoder import Encoder
from handformer.nn.attention import MultiHeadAttention
from handformer.nn.feedforward import FeedForward
from handformer.nn.norm import RMSNorm

TOL = dict(rtol=1e-4, atol=1e-4)
MARGIN = 10.0


def excess(a: Tensor, b: Tensor) -> float:
    """How many times over ``TOL`` the farthest element of ``a`` is from ``b``."""
    allowed = TOL["atol"] + TOL["rtol"] * b.abs()
    return float(((a - b).abs() / allowed).max())
KERNELS = ("manual", "sdpa", "tiled")

# The ALiBi slopes of Press et al. (2022), head by head, as numbers: for 2^k heads the
# geometric sequence 2^(-8/n), 2^(-16/n), …; for 6 heads the four of 4 heads, then every
# other one of 8 heads.
SLOPES: dict[int, list[float]] = {
    4: [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8],
    6: [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3],
    8: [2 ** -1, 2 ** -2, 2 ** -3, 2 ** -4, 2 ** -5, 2 ** -6, 2 ** -7, 2 ** -8],
}


# -- the reference -----------------------------------------------------------------------------
@dataclass
class Wrong:
    """One lever of the reference set against the config (for the sensitivity checks)."""

    config: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields overridden
    slopes: list[float] | None = None  # ALiBi slopes other than the published ones
    kv_head: str = "div"  # "div": query head h reads kv head h // G; "mod": h % Hkv
    qk_norm_after_rope: bool = False
    token_scale: float | None = None  # the sinusoidal √C scale replaced
    softcap: str = "cap*tanh(x/cap)"
    swiglu_gate_second: bool = False
    rope_half_split: bool = False  # rotate (i, i + D/2) instead of (2i, 2i + 1)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)  # biased variance
    y = (x - mean) / torch.sqrt(var + eps) * weight
    return y if bias is None else y + bias


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + eps) * weight


def activate(h: Tensor, kind: str, *, gate_second: bool = False) -> Tensor:
    if kind == "gelu":
        return 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
    if kind == "gelu_tanh":
        return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h ** 3)))
    if kind == "relu":
        return h.clamp(min=0.0)
    if kind == "relu2":
        return h.clamp(min=0.0) ** 2
    assert kind == "swiglu"
    gate, up = h.chunk(2, dim=-1)  # the first half is the gate
    if gate_second:
        gate, up = up, gate
    return gate / (1.0 + torch.exp(-gate)) * up  # silu(gate) · up


def rotate(x: Tensor, positions: Tensor, base: float, *, half_split: bool = False) -> Tensor:
    """RoPE on (B, H, T, D): channel pair (2i, 2i+1) turned by angle p · base^(-2i/D)."""
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (D/2,)
    angle = positions.double()[:, None, :, None] * theta  # (B|1, 1, T, D/2)
    if half_split:
        a, b = x[..., : d // 2], x[..., d // 2:]
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    ra = a * torch.cos(angle) - b * torch.sin(angle)
    rb = a * torch.sin(angle) + b * torch.cos(angle)
    if half_split:
        return torch.cat([ra, rb], dim=-1)
    return torch.stack([ra, rb], dim=-1).flatten(-2)


def sinusoidal(positions: Tensor, c: int) -> Tensor:
    """(B|1, T) → (B|1, T, C): channel 2i = sin(p / 10000^(2i/C)), 2i+1 = cos of the same."""
    i = torch.arange(0, c, 2, dtype=torch.float64)
    angle = positions.double()[..., None] / 10000.0 ** (i / c)  # (…, T, C/2)
    return torch.stack([torch.sin(angle), torch.cos(angle)], dim=-1).flatten(-2)


def reference_logits(model: torch.nn.Module, ids: Tensor, padding_mask: Tensor | None = None,
                     wrong: Wrong | None = None) -> Tensor:
    """DecoderLM logits (B, T, V) or Encoder hidden states (B, T, C), in float64."""
    wrong = wrong or Wrong()
    c = replace(model.config, **wrong.config)
    causal = isinstance(model, DecoderLM)
    p = {k: v.detach().double() for k, v in model.state_dict().items()}

    def get(name: str) -> Tensor | None:
        return p.get(name)

    b, t = ids.shape
    h, hkv, d = c.n_heads, c.n_kv_heads, c.d_model // c.n_heads
    g = h // hkv
    real = torch.ones(b, t, dtype=torch.bool) if padding_mask is None else padding_mask
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)  # real tokens counted only

    def norm(x: Tensor, name: str) -> Tensor:
        if c.norm_type == "rmsnorm":
            return rms_norm(x, p[f"{name}.weight"], c.layer_norm_eps)
        return layer_norm(x, p[f"{name}.weight"], get(f"{name}.bias"), c.layer_norm_eps)

    def linear(x: Tensor, name: str) -> Tensor:
        y = x @ p[f"{name}.weight"].T
        bias = get(f"{name}.bias")
        return y if bias is None else y + bias

    # Embedding: tokens (×√C for sinusoidal positions) + positions + segment 0, [LayerNorm].
    scale = math.sqrt(c.d_model) if c.positional == "sinusoidal" else 1.0
    if wrong.token_scale is not None:
        scale = wrong.token_scale
    x = p["embed.token.weight"][ids] * scale  # (B, T, C)
    if c.positional == "learned":
        x = x + p["embed.positions.table.weight"][positions]
    elif c.positional == "sinusoidal":
        x = x + sinusoidal(positions, c.d_model)
    if c.type_vocab_size:
        x = x + p["embed.token_type.weight"][0]
    if c.embedding_norm:
        x = layer_norm(x, p["embed.norm.weight"], get("embed.norm.bias"), c.layer_norm_eps)

    allowed = real[:, None, None, :]  # (B, 1, 1, S): no query attends to a pad key
    if causal:
        allowed = allowed & torch.ones(t, t, dtype=torch.bool).tril()  # key j ≤ query i
    slopes = torch.tensor(wrong.slopes or SLOPES.get(h, [0.0] * h), dtype=torch.float64)
    distance = (positions[:, :, None] - positions[:, None, :]).abs().double()  # (B, T, S)
    kv_of = [q // g if wrong.kv_head == "div" else q % hkv for q in range(h)]

    def attention(z: Tensor, blk: str) -> Tensor:
        qkv = linear(z, f"{blk}.in_proj")  # (B, T, C + 2·Hkv·D)
        q = qkv[..., : h * d].reshape(b, t, h, d).transpose(1, 2)  # (B, H, T, D)
        k = qkv[..., h * d: (h + hkv) * d].reshape(b, t, hkv, d).transpose(1, 2)
        v = qkv[..., (h + hkv) * d:].reshape(b, t, hkv, d).transpose(1, 2)  # (B, Hkv, T, D)

        def qk_norm(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
            # QK-norm's epsilon is layer_norm_eps, as Qwen3's q_norm / k_norm use rms_norm_eps.
            return (rms_norm(q, p[f"{blk}.q_norm.weight"], c.layer_norm_eps),
                    rms_norm(k, p[f"{blk}.k_norm.weight"], c.layer_norm_eps))

        if c.qk_norm and not wrong.qk_norm_after_rope:
            q, k = qk_norm(q, k)
        if c.positional == "rope":
            q = rotate(q, positions, c.rope_base, half_split=wrong.rope_half_split)
            k = rotate(k, positions, c.rope_base, half_split=wrong.rope_half_split)
        if c.qk_norm and wrong.qk_norm_after_rope:
            q, k = qk_norm(q, k)
        k, v = k[:, kv_of], v[:, kv_of]  # (B, H, T, D): each query head's kv head
        scores = q @ k.transpose(-2, -1) / math.sqrt(d)  # (B, H, T, S)
        if c.positional == "alibi":
            scores = scores - slopes[None, :, None, None] * distance[:, None]
        scores = scores.masked_fill(~allowed, -math.inf)
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an empty row gives zeros
        out = (weights @ v).transpose(1, 2).reshape(b, t, h * d)  # (B, T, C)
        return linear(out, f"{blk}.out_proj")

    def ffn(z: Tensor, blk: str) -> Tensor:
        hidden = activate(linear(z, f"{blk}.ffn.fc_in"), c.activation,
                          gate_second=wrong.swiglu_gate_second)
        return linear(hidden, f"{blk}.ffn.fc_out")

    for i in range(c.n_layers):
        blk = f"blocks.{i}"
        if c.norm == "pre":
            x = x + attention(norm(x, f"{blk}.norm1"), f"{blk}.self_attn")
            x = x + ffn(norm(x, f"{blk}.norm2"), blk)
        else:
            x = norm(x + attention(x, f"{blk}.self_attn"), f"{blk}.norm1")
            x = norm(x + ffn(x, blk), f"{blk}.norm2")
    if c.norm == "pre" and model.config.norm == "pre":  # (a post-norm model has none)
        x = norm(x, "final_norm")
    if not causal:
        return x  # the encoder's hidden states
    head = p["embed.token.weight"] if c.tie_weights else p["lm_head.weight"]
    logits = x @ head.T  # (B, T, V)
    cap = c.logit_softcap
    if cap == 0.0:
        return logits
    if wrong.softcap == "cap*tanh(x)":
        return cap * torch.tanh(logits)
    if wrong.softcap == "tanh(x/cap)":
        return torch.tanh(logits / cap)
    return cap * torch.tanh(logits / cap)


def expected_parameter_count(c: ModelConfig, *, head: bool = True) -> int:
    """Unique parameters, counted from the config by hand (``head``: a decoder's output
    head, its own matrix unless tied)."""
    cc, v, d, f = c.d_model, c.vocab_size, c.d_model // c.n_heads, c.d_ff
    kv = c.n_kv_heads * d
    norm = cc * (2 if c.norm_type == "layernorm" and c.bias else 1)
    ffn_in = 2 * f if c.activation == "swiglu" else f
    block = (cc * (cc + 2 * kv) + (cc + 2 * kv if c.bias else 0)  # in_proj
             + cc * cc + (cc if c.bias else 0)  # out_proj
             + (2 * d if c.qk_norm else 0)  # q_norm, k_norm gains
             + 2 * norm
             + cc * ffn_in + (ffn_in if c.bias else 0) + f * cc + (cc if c.bias else 0))
    total = v * cc + c.n_layers * block
    total += c.max_len * cc if c.positional == "learned" else 0
    total += c.type_vocab_size * cc
    total += (2 * cc if c.bias else cc) if c.embedding_norm else 0
    total += norm if c.norm == "pre" else 0
    total += v * cc if head and not c.tie_weights else 0
    return total


def redraw(model: torch.nn.Module, seed: int, *, head_scale: float = 1.0) -> None:
    """Weights at sizes where every lever shows: peaked attention, O(1) activations,
    gains in [0.5, 1.5] and non-zero biases (so pre/post, eps, bias and QK-norm order
    matter)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                if name.endswith("bias"):
                    new = torch.randn(param.shape, generator=gen) * 0.2
                else:
                    new = torch.rand(param.shape, generator=gen) + 0.5
            elif name.startswith("embed.") or name.startswith("lm_head."):
                new = torch.randn(param.shape, generator=gen) * 0.5 * head_scale
            else:
                std = (2.0 if "in_proj" in name else 1.0) / math.sqrt(param.shape[1])
                new = torch.randn(param.shape, generator=gen) * std
            param.copy_(new)


# -- the configurations: several levers away from their defaults in each -------------------
BASE = dict(vocab_size=29, d_model=32, n_heads=4, n_layers=2, max_len=16)
CASES: dict[str, tuple[dict[str, Any], list[Wrong]]] = {
    "learned-pre-gelu-tied": (
        dict(positional="learned", norm="pre", activation="gelu", layer_norm_eps=0.5),
        [Wrong(config={"layer_norm_eps": 1e-5}), Wrong(config={"norm": "post"}),
         Wrong(config={"activation": "gelu_tanh"})]),
    "sinusoidal-post-relu-untied": (
        dict(positional="sinusoidal", norm="post", activation="relu", tie_weights=False,
             layer_norm_eps=0.5),
        [Wrong(token_scale=1.0), Wrong(config={"layer_norm_eps": 1e-5}),
         Wrong(config={"norm": "pre"}), Wrong(config={"tie_weights": True})]),
    "rope100-rms-swiglu-gqa-qknorm-nobias": (
        dict(positional="rope", rope_base=100.0, norm_type="rmsnorm", layer_norm_eps=0.5,
             activation="swiglu", n_kv_heads=2, qk_norm=True, bias=False),
        [Wrong(config={"rope_base": 10000.0}), Wrong(config={"layer_norm_eps": 1e-5}),
         Wrong(kv_head="mod"), Wrong(qk_norm_after_rope=True), Wrong(swiglu_gate_second=True),
         Wrong(rope_half_split=True)]),
    "alibi6-gelutanh-gqa3": (
        dict(positional="alibi", d_model=48, n_heads=6, n_kv_heads=3, activation="gelu_tanh",
             d_ff=40),
        [Wrong(slopes=SLOPES[6][::-1]), Wrong(slopes=[2 ** -(i + 1) for i in range(6)]),
         Wrong(kv_head="mod")]),
    "rope-relu2-mqa-softcap": (
        dict(positional="rope", activation="relu2", n_kv_heads=1, logit_softcap=2.0,
             n_layers=3),
        [Wrong(softcap="cap*tanh(x)"), Wrong(softcap="tanh(x/cap)"),
         Wrong(config={"logit_softcap": 0.0}), Wrong(config={"activation": "relu"})]),
    "alibi8-post-rms-bias": (
        dict(positional="alibi", n_heads=8, norm="post", norm_type="rmsnorm",
             layer_norm_eps=0.5),
        [Wrong(slopes=SLOPES[8][::-1]), Wrong(config={"layer_norm_eps": 1e-5})]),
}


def _ids(case_seed: int, vocab: int, b: int = 2, t: int = 12) -> Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(case_seed))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", list(CASES))
def test_decoder_equals_the_written_out_formulas_and_every_lever_shows(case: str,
                                                                       kernel: str) -> None:
    overrides, wrongs = CASES[case]
    cfg = ModelConfig(**{**BASE, **overrides, "attention": kernel})
    model = DecoderLM(cfg).eval()
    redraw(model, seed=len(case))
    assert sum(p.numel() for p in model.parameters()) == expected_parameter_count(cfg)
    ids = _ids(len(case), cfg.vocab_size)
    with torch.no_grad():
        got = model(ids).double()
    expected = reference_logits(model, ids)
    torch.testing.assert_close(got, expected, **TOL)
    for wrong in wrongs:
        moved = excess(reference_logits(model, ids, wrong=wrong), got)
        assert moved > MARGIN, (wrong, moved)


@pytest.mark.parametrize("kernel", KERNELS)
def test_left_padded_decoder_counts_positions_on_real_tokens_only(kernel: str) -> None:
    cfg = ModelConfig(**{**BASE, "positional": "learned", "attention": kernel})
    model = DecoderLM(cfg).eval()
    redraw(model, seed=3)
    ids = _ids(3, cfg.vocab_size)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :3] = False  # three pads on the left of row 0
    with torch.no_grad():
        got = model(ids, padding_mask=mask).double()
    expected = reference_logits(model, ids, mask)
    torch.testing.assert_close(got[mask], expected[mask], **TOL)


ENCODER_CASES: dict[str, tuple[dict[str, Any], list[Wrong]]] = {
    "bert-like": (
        dict(positional="learned", norm="post", embedding_norm=True, type_vocab_size=2,
             layer_norm_eps=0.5, activation="gelu"),
        [Wrong(config={"layer_norm_eps": 1e-5}), Wrong(config={"type_vocab_size": 0}),
         Wrong(config={"embedding_norm": False})]),
    "alibi-pre-rms": (
        dict(positional="alibi", norm="pre", norm_type="rmsnorm", layer_norm_eps=0.5,
             n_kv_heads=2),
        [Wrong(slopes=SLOPES[4][::-1]), Wrong(kv_head="mod")]),
}


@pytest.mark.parametrize("kernel", ["manual", "sdpa"])
@pytest.mark.parametrize("case", list(ENCODER_CASES))
def test_encoder_equals_the_written_out_formulas(case: str, kernel: str) -> None:
    overrides, wrongs = ENCODER_CASES[case]
    cfg = ModelConfig(**{**BASE, **overrides, "attention": kernel})
    model = Encoder(cfg).eval()
    redraw(model, seed=11)
    assert sum(p.numel() for p in model.parameters()) == expected_parameter_count(cfg,
                                                                                head=False)
    ids = _ids(5, cfg.vocab_size)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :4] = False  # left padding: positions restart at the first real token
    with torch.no_grad():
        got = model(ids, mask).double()
    expected = reference_logits(model, ids, mask)
    torch.testing.assert_close(got[mask], expected[mask], **TOL)
    for wrong in wrongs:
        moved = excess(reference_logits(model, ids, mask, wrong=wrong)[mask], got[mask])
        assert moved > MARGIN, (wrong, moved)


# -- ALiBi: which slope each head of MultiHeadAttention gets ----------------------------------
def _zero_qk(mha: MultiHeadAttention) -> None:
    """Queries and keys of zero: the scores are exactly the position bias."""
    with torch.no_grad():
        qk = mha.d_model + mha.kv_dim
        mha.in_proj.weight[:qk].zero_()
        mha.in_proj.bias[:qk].zero_()


@pytest.mark.parametrize("n_heads", [4, 6, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_each_alibi_head_gets_its_published_slope(n_heads: int, causal: bool) -> None:
    """With q = k = 0 the weights of head h are softmax(−m_h·|i − j|) over the visible keys,
    with m_h from the ``SLOPES`` table: head order is part of the meaning (checkpoints
    trained with ALiBi assume it)."""
    t = 7
    mha = MultiHeadAttention(8 * n_heads, n_heads, positional="alibi").eval()
    _zero_qk(mha)
    x = torch.randn(2, t, 8 * n_heads)
    with torch.no_grad():
        _, weights = mha(x, is_causal=causal, need_weights=True)  # (B, H, T, S)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    for head, slope in enumerate(SLOPES[n_heads]):
        scores = -slope * (i - j).abs().double()  # (T, S)
        if causal:
            scores = scores.masked_fill(j > i, -math.inf)
        expected = torch.softmax(scores, dim=-1)
        torch.testing.assert_close(weights[:, head].double(), expected.expand(2, t, t),
                                   rtol=1e-5, atol=1e-6)
    # Neighbouring heads' slopes differ by 2× at least: a head order mistake moves weights.
    assert float((weights[0, 0] - weights[0, 1]).abs().max()) > 0.05


@pytest.mark.parametrize("kernel", KERNELS)
def test_alibi_slopes_reach_every_kernel_head_by_head(kernel: str) -> None:
    """q = k = 0 and v = the input, a one-hot of the key's position in each head's channels:
    head h's output at query i is then its weight row, softmax(−m_h·(i − j)) over j ≤ i."""
    t, h, d = 6, 4, 8
    c = h * d
    mha = MultiHeadAttention(c, h, positional="alibi", attention=kernel).eval()
    _zero_qk(mha)
    with torch.no_grad():
        mha.in_proj.weight[2 * c:].copy_(torch.eye(c))  # v = x
        mha.in_proj.bias[2 * c:].zero_()
        mha.out_proj.weight.copy_(torch.eye(c))
        mha.out_proj.bias.zero_()
    onehot = torch.zeros(1, t, c)  # (1, T, C): token j carries a 1 in channel h·D + j
    for head in range(h):
        onehot[0, torch.arange(t), head * d + torch.arange(t)] = 1.0
    out, _ = mha(onehot, is_causal=True)  # (1, T, C)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    for head, slope in enumerate(SLOPES[h]):
        scores = (-slope * (i - j).abs().double()).masked_fill(j > i, -math.inf)
        expected = torch.softmax(scores, dim=-1)  # (T, S)
        got = out[0, :, head * d: head * d + t].double()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


# -- grouped-query attention: which key/value head each query head reads -----------------------
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(4, 2), (6, 3), (6, 2), (4, 1), (4, 4)])
def test_query_head_h_reads_kv_head_h_div_g(kernel: str, n_heads: int, n_kv_heads: int) -> None:
    """Values constant per kv head (its bias, weight zero): softmax weights sum to one, so
    query head h outputs exactly kv head h // G's constant, whatever it attends to."""
    d = 4
    c = n_heads * d
    mha = MultiHeadAttention(c, n_heads, n_kv_heads=n_kv_heads, attention=kernel).eval()
    groups = n_heads // n_kv_heads
    with torch.no_grad():
        v_rows = slice(c + n_kv_heads * d, c + 2 * n_kv_heads * d)
        mha.in_proj.weight[v_rows].zero_()
        mha.in_proj.bias[v_rows].copy_(torch.arange(n_kv_heads).repeat_interleave(d) + 1.0)
        mha.out_proj.weight.copy_(torch.eye(c))
        mha.out_proj.bias.zero_()
    out, _ = mha(torch.randn(2, 5, c), is_causal=True)  # (B, T, C)
    for head in range(n_heads):
        expected = float(head // groups + 1)
        got = out[..., head * d:(head + 1) * d]
        torch.testing.assert_close(got, torch.full_like(got, expected))
    assert mha.in_proj.out_features == c + 2 * n_kv_heads * d  # Hkv key and value heads


def test_n_kv_heads_defaults_to_n_heads() -> None:
    assert ModelConfig(vocab_size=5, n_heads=4).n_kv_heads == 4
    assert ModelConfig(vocab_size=5, n_heads=4, n_kv_heads=2).n_kv_heads == 2


# -- RoPE: the base and the channel pairs ------------------------------------------------------
@pytest.mark.parametrize("base", [100.0, 10000.0])
def test_rope_rotates_pair_2i_by_position_times_base_to_the_minus_2i_over_d(base: float) -> None:
    """One head, D = 4, q and k constant (bias only): the score between query p and key s is
    Σ_i (q_a·k_a + q_b·k_b)·cos((p − s)·θ_i) + (q_a·k_b − q_b·k_a)·sin((p − s)·θ_i)
    over the pairs (a, b) = (2i, 2i + 1), θ_i = base^(−2i/D),
    written out per channel pair."""
    d, t = 4, 6
    mha = MultiHeadAttention(d, 1, positional="rope", rope_base=base).eval()
    qv = torch.tensor([1.0, 0.5, -0.7, 2.0])
    kv = torch.tensor([0.3, -1.2, 1.5, 0.4])
    with torch.no_grad():
        mha.in_proj.weight.zero_()
        mha.in_proj.bias.copy_(torch.cat([qv, kv, torch.zeros(d)]))
    _, weights = mha(torch.zeros(1, t, d), is_causal=True, need_weights=True)  # (1, 1, T, S)
    scores = torch.full((t, t), -math.inf, dtype=torch.float64)
    for p in range(t):
        for s in range(p + 1):
            total = 0.0
            for i in range(d // 2):
                theta = base ** (-2 * i / d)
                qa, qb, ka, kb = (float(qv[2 * i]), float(qv[2 * i + 1]), float(kv[2 * i]),
                                  float(kv[2 * i + 1]))
                delta = (p - s) * theta
                # ⟨R(p)q, R(s)k⟩ for the pair (a, b): a rotation by p − s between them.
                total += (qa * ka + qb * kb) * math.cos(delta) + \
                         (qa * kb - qb * ka) * math.sin(delta)
            scores[p, s] = total / math.sqrt(d)
    torch.testing.assert_close(weights[0, 0].double(), torch.softmax(scores, dim=-1),
                               rtol=1e-5, atol=1e-6)


def test_rope_base_reaches_the_model() -> None:
    ids = _ids(1, BASE["vocab_size"])
    outs = {}
    for base in (100.0, 10000.0):
        model = DecoderLM(ModelConfig(**{**BASE, "positional": "rope",
                                         "rope_base": base})).eval()
        redraw(model, seed=1)
        with torch.no_grad():
            outs[base] = model(ids)
        torch.testing.assert_close(outs[base].double(), reference_logits(model, ids), **TOL)
    assert excess(outs[100.0].double(), outs[10000.0].double()) > MARGIN


# -- norms: epsilon and placement --------------------------------------------------------------
@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_layer_norm_eps_is_the_epsilon_of_every_norm(norm_type: str, norm: str) -> None:
    """A block's output with eps = 0.5 against the formula; 1e-5 in its place moves it far."""
    from handformer.nn.block import TransformerBlock

    torch.manual_seed(2)
    block = TransformerBlock(16, 2, 32, norm=norm, norm_type=norm_type,
                             layer_norm_eps=0.5).eval()
    redraw(block, seed=2)
    x = torch.randn(2, 5, 16)
    p = {k: v.double() for k, v in block.state_dict().items()}

    def run(eps: float) -> Tensor:
        def n(z: Tensor, name: str) -> Tensor:
            if norm_type == "rmsnorm":
                return rms_norm(z, p[f"{name}.weight"], eps)
            return layer_norm(z, p[f"{name}.weight"], p[f"{name}.bias"], eps)

        def attn(z: Tensor) -> Tensor:
            qkv = z @ p["self_attn.in_proj.weight"].T + p["self_attn.in_proj.bias"]
            q, k, v = (u.reshape(2, 5, 2, 8).transpose(1, 2) for u in qkv.split(16, -1))
            w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), dim=-1)
            out = (w @ v).transpose(1, 2).reshape(2, 5, 16)
            return out @ p["self_attn.out_proj.weight"].T + p["self_attn.out_proj.bias"]

        def ffn(z: Tensor) -> Tensor:
            hidden = activate(z @ p["ffn.fc_in.weight"].T + p["ffn.fc_in.bias"], "gelu")
            return hidden @ p["ffn.fc_out.weight"].T + p["ffn.fc_out.bias"]

        z = x.double()
        if norm == "pre":
            z = z + attn(n(z, "norm1"))
            return z + ffn(n(z, "norm2"))
        z = n(z + attn(z), "norm1")
        return n(z + ffn(z), "norm2")

    with torch.no_grad():
        got = block(x).double()
    torch.testing.assert_close(got, run(0.5), **TOL)
    assert excess(run(1e-5), got) > MARGIN


def test_rmsnorm_formula_with_a_visible_epsilon() -> None:
    x = torch.randn(3, 8, dtype=torch.float64) * 0.5  # mean square ≈ 0.25: eps 0.5 dominates
    gain = torch.linspace(0.5, 1.5, 8, dtype=torch.float64)
    rms = RMSNorm(8, eps=0.5).double()
    with torch.no_grad():
        rms.weight.copy_(gain)
    with torch.no_grad():
        out = rms(x)
    torch.testing.assert_close(out, x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 0.5)
                               * gain, rtol=1e-6, atol=1e-7)
    assert float((out - rms_norm(x, gain, 1e-5)).abs().max()) > 0.1


# -- activations and the FFN's width -----------------------------------------------------------
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "relu2", "swiglu"])
def test_each_activation_is_its_formula(activation: str) -> None:
    """float64, tolerance 1e-10: exact GELU and its tanh form differ by up to 5e-4."""
    ffn = FeedForward(6, 10, activation=activation).double()
    x = torch.randn(3, 4, 6, dtype=torch.float64) * 3.0
    hidden = x @ ffn.fc_in.weight.T + ffn.fc_in.bias
    expected = activate(hidden, activation) @ ffn.fc_out.weight.T + ffn.fc_out.bias
    torch.testing.assert_close(ffn(x), expected, rtol=1e-10, atol=1e-10)
    others = {"gelu": "gelu_tanh", "gelu_tanh": "gelu", "relu": "relu2", "relu2": "relu"}
    if activation in others:
        wrong = activate(hidden, others[activation]) @ ffn.fc_out.weight.T + ffn.fc_out.bias
        assert float((wrong - expected).abs().max()) > 1e-6
    else:  # swiglu: the gate is the first half of fc_in
        wrong = activate(hidden, "swiglu", gate_second=True) @ ffn.fc_out.weight.T
        assert float((wrong + ffn.fc_out.bias - expected).abs().max()) > 1e-3


@pytest.mark.parametrize(("d_model", "activation", "d_ff"), [
    (48, "gelu", 192), (32, "relu", 128), (48, "swiglu", 128), (64, "swiglu", 168),
    (100, "swiglu", 264), (8, "swiglu", 24), (4, "swiglu", 8),
])
def test_default_d_ff(d_model: int, activation: str, d_ff: int) -> None:
    """4·C for ungated activations; for swiglu 8·round(C/3), at least 8 (typed in)."""
    cfg = ModelConfig(vocab_size=5, d_model=d_model, n_heads=4, activation=activation)
    assert cfg.d_ff == d_ff
    ffn = DecoderLM(replace(cfg, n_layers=1)).blocks[0].ffn
    assert ffn.fc_out.in_features == d_ff
    assert ffn.fc_in.out_features == (2 * d_ff if activation == "swiglu" else d_ff)


def test_an_explicit_d_ff_is_the_hidden_width() -> None:
    for activation in ("gelu", "swiglu"):
        cfg = ModelConfig(vocab_size=5, d_model=16, n_heads=2, d_ff=36, activation=activation,
                          n_layers=1)
        assert cfg.d_ff == 36
        assert DecoderLM(cfg).blocks[0].ffn.fc_out.in_features == 36


# -- initialisation: std, zero_init_out --------------------------------------------------------
@pytest.mark.parametrize("zero_init_out", [False, True])
def test_initialisation_follows_the_gpt2_recipe(zero_init_out: bool) -> None:
    """Matrices N(0, 0.02); out_proj and fc_out N(0, 0.02/√(2L)) — or exactly zero with
    zero_init_out; biases zero; norm gains one. L = 8 makes the residual std 0.005."""
    torch.manual_seed(4)
    cfg = ModelConfig(vocab_size=64, d_model=64, n_heads=4, n_layers=8,
                      zero_init_out=zero_init_out)
    model = DecoderLM(cfg)
    residual_std = 0.02 / math.sqrt(2 * 8)
    for name, param in model.named_parameters():
        if param.dim() == 1:
            expected = 0.0 if name.endswith("bias") else 1.0
            assert torch.all(param == expected), name
            continue
        std = float(param.std())
        if name.endswith(("out_proj.weight", "fc_out.weight")):
            if zero_init_out:
                assert torch.count_nonzero(param) == 0, name
            else:
                assert abs(std / residual_std - 1) < 0.1, (name, std)
        else:
            assert abs(std / 0.02 - 1) < 0.1, (name, std)


# -- dropout: where and how much ---------------------------------------------------------------
def test_dropout_drops_the_embedding_output_with_probability_p_and_rescales() -> None:
    """In training, the blocks receive each embedding value either zeroed or × 1/(1 − p);
    p = 0.25 zeroes about a quarter (n = 4096: ±0.04 is over 6 standard deviations)."""
    p = 0.25
    cfg = ModelConfig(vocab_size=29, d_model=64, n_heads=4, n_layers=1, max_len=32, dropout=p)
    model = DecoderLM(cfg)
    seen: list[Tensor] = []
    model.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    ids = _ids(2, 29, b=2, t=32)
    model.eval()
    with torch.no_grad():
        model(ids)
        model.train()
        model(ids)
    clean, dropped = seen
    zero = dropped == 0
    assert abs(float(zero.float().mean()) - p) < 0.04
    torch.testing.assert_close(dropped[~zero], clean[~zero] / (1 - p))


@pytest.mark.parametrize("p", [0.2, 0.6])
def test_attention_dropout_drops_weights_with_probability_p_and_rescales(p: float) -> None:
    mha = MultiHeadAttention(32, 4, dropout=p)
    x = torch.randn(4, 16, 32)
    torch.manual_seed(9)
    _, clean = mha.eval()(x, is_causal=True, need_weights=True)
    _, dropped = mha.train()(x, is_causal=True, need_weights=True)
    visible = clean > 0
    zero = (dropped == 0) & visible
    assert abs(float(zero.sum()) / float(visible.sum()) - p) < 0.05
    kept = visible & ~zero
    torch.testing.assert_close(dropped[kept], clean[kept] / (1 - p))


def test_dropout_is_off_in_eval_mode() -> None:
    cfg = ModelConfig(**{**BASE, "dropout": 0.5})
    model = DecoderLM(cfg)
    plain = DecoderLM(replace(cfg, dropout=0.0))
    plain.load_state_dict(model.state_dict())
    ids = _ids(4, cfg.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), plain.eval()(ids))
        assert not torch.allclose(model.train()(ids), plain(ids))


# -- tie_weights, bias, max_len, vocab ---------------------------------------------------------
def test_tied_head_reads_the_token_embedding() -> None:
    cfg = ModelConfig(**BASE)
    tied, untied = DecoderLM(cfg), DecoderLM(replace(cfg, tie_weights=False))
    assert sum(p.numel() for p in untied.parameters()) == \
        sum(p.numel() for p in tied.parameters()) + cfg.vocab_size * cfg.d_model
    # Changing the token embedding changes the tied head's logits for a fixed hidden state.
    ids = _ids(6, cfg.vocab_size) % 3  # tokens 0..2: row 3 is read by the head alone
    with torch.no_grad():
        before = tied(ids)
        tied.embed.token.weight[3].add_(1.0)
        after = tied(ids)
    moved = (after - before).abs().amax(dim=(0, 1))  # (V,)
    assert float(moved[3]) > 10 * float(torch.cat([moved[:3], moved[4:]]).max())


def test_bias_false_leaves_no_bias_anywhere() -> None:
    for norm_type in ("layernorm", "rmsnorm"):
        cfg = ModelConfig(**{**BASE, "bias": False, "norm_type": norm_type,
                             "embedding_norm": True})
        for model in (DecoderLM(cfg), Encoder(cfg)):
            names = [n for n, _ in model.named_parameters()]
            assert not [n for n in names if n.endswith("bias")], names
            assert sum(p.numel() for p in model.parameters()) == expected_parameter_count(
                cfg, head=isinstance(model, DecoderLM))
    with_bias = DecoderLM(ModelConfig(**BASE))
    assert any(n.endswith("bias") for n, _ in with_bias.named_parameters())


def test_max_len_is_the_learned_table_and_the_cache_size() -> None:
    cfg = ModelConfig(**{**BASE, "max_len": 10})
    model = DecoderLM(cfg).eval()
    with torch.no_grad():
        assert model(_ids(1, cfg.vocab_size, t=10)).shape == (2, 10, cfg.vocab_size)
        with pytest.raises(ValueError, match="max_len=10"):
            model(_ids(1, cfg.vocab_size, t=11))
        cache = model.make_cache(1)
        model(_ids(2, cfg.vocab_size, b=1, t=10), cache=cache)  # exactly fills it
        with pytest.raises(ValueError):
            model(_ids(3, cfg.vocab_size, b=1, t=1), cache=cache)


def test_sinusoidal_positions_work_past_max_len_and_rope_too() -> None:
    """Positions computed on the fly are defined at any position (max_len binds only the
    learned table)."""
    for positional in ("sinusoidal", "rope", "alibi"):
        cfg = ModelConfig(**{**BASE, "max_len": 8, "positional": positional})
        model = DecoderLM(cfg).eval()
        redraw(model, seed=5)
        ids = _ids(5, cfg.vocab_size, t=12)
        with torch.no_grad():
            torch.testing.assert_close(model(ids).double(), reference_logits(model, ids), **TOL)
