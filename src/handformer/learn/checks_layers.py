"""Checkers for the reader's positions, LayerNorm, feed-forward network and block.

Shape legend: ``B`` batch, ``T`` tokens, ``C`` model dim, ``F`` the FFN's hidden width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from handformer.learn.checks_attention import (
    as_output,
    copy_attention_weights,
    linears,
    shape_problem,
)
from handformer.learn.result import (
    CheckResult,
    ReaderError,
    call_reader,
    fail,
    never_raises,
    passed,
)
from handformer.masks import causal_mask
from handformer.nn.block import TransformerBlock
from handformer.nn.feedforward import FeedForward
from handformer.nn.positional import SinusoidalPositions

__all__ = ["check_block", "check_feed_forward", "check_layer_norm", "check_positional_encoding"]

B, T = 2, 6


def _run_reader_layer(name: str, construct: str, cls: Callable[..., nn.Module],
                      args: tuple[int, ...], call: str, *inputs: Tensor,
                      shape: tuple[int, ...]) -> tuple[nn.Module, Tensor] | CheckResult:
    """The reader's layer built as ``construct`` says (``cls(*args)``, in eval mode) and
    called as ``call`` says on ``inputs`` without gradients: (the layer, its output as
    float32 — a float64 answer is compared too), or the result that fails the check (it
    raised, or its output is not a finite tensor of ``shape``)."""
    try:
        layer = call_reader(name, construct, cls, *args)
        layer.eval()
        with torch.no_grad():
            got = as_output(call_reader(name, call, layer, *inputs))
    except ReaderError as err:
        return err.result
    problem = shape_problem(call, got, shape)
    if problem is not None:
        return fail(name, problem)
    return layer, got.float()  # type: ignore[union-attr]


@never_raises
def check_positional_encoding(cls: Callable[..., nn.Module], d_model: int = 16,
                              max_len: int = 64) -> CheckResult:
    """``cls(d_model, max_len)``: ``forward(x)`` with x (B, T, C) returns x plus the
    sinusoidal encoding of the 2017 paper (sin on even channels, cos on odd ones, as
    ``SinusoidalPositions``)."""
    name = "check_positional_encoding"
    torch.manual_seed(0)
    x = torch.randn(B, T, d_model)  # (B, T, C)
    ran = _run_reader_layer(name, f"cls({d_model}, {max_len})", cls, (d_model, max_len),
                            "forward(x)", x, shape=(B, T, d_model))
    if isinstance(ran, CheckResult):
        return ran
    _, got = ran
    pe = SinusoidalPositions(d_model)(torch.arange(T))  # (T, C)
    want = x + pe
    if torch.allclose(got, want, atol=1e-5):
        return passed(name, f"forward(x) = x + the sinusoidal encoding, for {T} positions of "
                            f"width {d_model}")
    if torch.allclose(got, x, atol=1e-6):
        return fail(name, "forward(x) returned x unchanged", "positions_missing")
    if torch.allclose(got, x + 2 * pe, atol=1e-5):
        return fail(name, "forward(x) returned x + 2 · the encoding", "positions_twice")
    added = got - x  # (B, T, C)
    if torch.allclose(added[0], added[1], atol=1e-6):
        first = [round(v, 3) for v in added[0, 1, :4].tolist()]
        return fail(name, f"the added encoding differs from sin/cos: position 1 starts "
                          f"{first}, expected {[round(v, 3) for v in pe[1, :4].tolist()]} "
                          "(sin(p·ω) on channel 2i, cos(p·ω) on 2i + 1, ω = 10000^(−2i/C))")
    return fail(name, "forward(x) − x depends on x: the encoding must be added, the same for "
                      "every row of the batch")


@never_raises
def check_layer_norm(cls: Callable[..., nn.Module], d_model: int = 16) -> CheckResult:
    """``cls(d_model)``: ``forward(x)`` normalises each token's C features to zero mean and
    unit variance (divided by C, eps 1e-5 inside the square root), then applies a learned
    gain and bias, as ``nn.LayerNorm(d_model)``."""
    name = "check_layer_norm"
    torch.manual_seed(0)
    x = torch.randn(B, T, d_model) * 3 + 1  # (B, T, C)
    ran = _run_reader_layer(name, f"cls({d_model})", cls, (d_model,), "forward(x)", x,
                            shape=(B, T, d_model))
    if isinstance(ran, CheckResult):
        return ran
    layer, got = ran
    want = F.layer_norm(x, (d_model,))  # a fresh gain is 1 and bias 0
    if not torch.allclose(got, want, atol=1e-4):
        def norm_over(dim: int, unbiased: bool = False) -> Tensor:
            mean = x.mean(dim, keepdim=True)
            var = x.var(dim, keepdim=True, unbiased=unbiased)
            return (x - mean) / torch.sqrt(var + 1e-5)

        if any(torch.allclose(got, norm_over(d), atol=1e-4) for d in (0, 1)):
            return fail(name, "the output's per-token mean is not 0", "layer_norm_axis")
        if torch.allclose(got, norm_over(-1, unbiased=True), atol=1e-4):
            return fail(name, f"the outputs are off by a factor √((C − 1) / C) = "
                              f"{((d_model - 1) / d_model) ** 0.5:.4f}", "layer_norm_unbiased")
        std = got.std(-1, unbiased=False).mean().item()
        return fail(name, f"the output differs from nn.LayerNorm's by up to "
                          f"{(got - want).abs().max().item():.3g} (per-token std {std:.3f})")
    params = sum(p.numel() for p in layer.parameters())
    if params != 2 * d_model:
        return fail(name, f"the output is right but the layer has {params} parameters; "
                          f"expected a gain and a bias of {d_model} each "
                          "(nn.Parameter(torch.ones(C)), nn.Parameter(torch.zeros(C)))")
    return passed(name, f"each token's {d_model} features normalised like nn.LayerNorm, with "
                        "a gain and a bias")


@never_raises
def check_feed_forward(cls: Callable[..., nn.Module], d_model: int = 16,
                       d_ff: int = 64) -> CheckResult:
    """``cls(d_model, d_ff)``: ``forward(x)`` = linear(C → F), ReLU or GELU, linear(F → C),
    applied to each token; its two ``nn.Linear`` layers in that order. Compared with
    handformer's ``FeedForward`` with the reader's weights copied in."""
    name = "check_feed_forward"
    torch.manual_seed(0)
    x = torch.randn(B, T, d_model)  # (B, T, C)
    ran = _run_reader_layer(name, f"cls({d_model}, {d_ff})", cls, (d_model, d_ff),
                            "forward(x)", x, shape=(B, T, d_model))
    if isinstance(ran, CheckResult):
        return ran
    layer, got = ran
    found = linears(layer)
    shapes = [tuple(lin.weight.shape) for lin in found]
    if shapes != [(d_ff, d_model), (d_model, d_ff)]:
        return fail(name, f"its nn.Linear layers have weight shapes {shapes}; expected "
                          f"{[(d_ff, d_model), (d_model, d_ff)]} (C → F, then F → C)")
    with torch.no_grad():
        linear_only = found[1](found[0](x))
        for activation in ("relu", "gelu"):
            ref = FeedForward(d_model, d_ff, activation=activation).eval()
            ref.fc_in.load_state_dict(found[0].state_dict())
            ref.fc_out.load_state_dict(found[1].state_dict())
            if torch.allclose(got, ref(x), atol=1e-5):
                return passed(name, f"linear {d_model} → {d_ff}, {activation}, linear "
                                    f"{d_ff} → {d_model}: equals FeedForward with your weights")
    if torch.allclose(got, linear_only, atol=1e-5):
        return fail(name, "forward(x) equals linear2(linear1(x))", "no_activation")
    return fail(name, "the output matches FeedForward with neither ReLU nor GELU between your "
                      "two linear layers")


def _norms(module: nn.Module, d_model: int) -> list[nn.Module]:
    """Modules holding exactly a (C,) gain and a (C,) bias: the reader's LayerNorms."""
    found = []
    for m in module.modules():
        params = list(m.parameters(recurse=False))
        if len(params) == 2 and all(tuple(p.shape) == (d_model,) for p in params):
            found.append(m)
    return found


@never_raises
def check_block(cls: Callable[..., nn.Module], d_model: int = 16, num_heads: int = 4,
                d_ff: int = 64) -> CheckResult:
    """``cls(d_model, num_heads, d_ff)``: a pre-norm block, ``forward(x, mask=None)`` with
    x (B, T, C) returning (B, T, C): x + attention(LN1(x)), then + FFN(LN2(x)). Registered in
    the order attention, FFN, LN1, LN2 (its ``nn.Linear`` layers: query, key, value, output,
    FFN in, FFN out). Compared with handformer's ``TransformerBlock(norm="pre")`` with the
    reader's weights copied in; a missing residual is named."""
    name = "check_block"
    torch.manual_seed(0)
    x = torch.randn(B, T, d_model)  # (B, T, C)
    mask = causal_mask(T)
    ran = _run_reader_layer(name, f"cls({d_model}, {num_heads}, {d_ff})", cls,
                            (d_model, num_heads, d_ff), "forward(x, mask)", x, mask,
                            shape=(B, T, d_model))
    if isinstance(ran, CheckResult):
        return ran
    block, got = ran
    with torch.no_grad():
        found, norms = linears(block), _norms(block, d_model)
        if len(found) != 6 or len(norms) != 2:
            return fail(name, f"cannot compare: found {len(found)} nn.Linear layers and "
                              f"{len(norms)} LayerNorms; expected 6 (q, k, v, out, FFN in, "
                              "FFN out) and 2")
        for activation in ("relu", "gelu"):
            ref = TransformerBlock(d_model, num_heads, d_ff, norm="pre",
                                   activation=activation).eval()
            why = copy_attention_weights(found[:4], ref.self_attn)
            if why is not None:
                return fail(name, f"cannot compare the attention: {why}")
            ref.ffn.fc_in.load_state_dict(found[4].state_dict())
            ref.ffn.fc_out.load_state_dict(found[5].state_dict())
            for mine, theirs in ((norms[0], ref.norm1), (norms[1], ref.norm2)):
                gain, bias = mine.parameters(recurse=False)
                theirs.weight.copy_(gain)
                theirs.bias.copy_(bias)
            want = ref(x, mask=mask)
            if torch.allclose(got, want, atol=1e-5):
                return passed(name, f"pre-norm block ({activation} FFN) equals "
                                    "TransformerBlock with your weights, under a causal "
                                    "mask")
            h = ref.self_attn(ref.norm1(x), mask=mask)[0]  # (B, T, C)
            no_attn_residual = h + ref.ffn(ref.norm2(h))
            no_ffn_residual = ref.ffn(ref.norm2(x + h))
            if any(torch.allclose(got, z, atol=1e-5)
                   for z in (no_attn_residual, no_ffn_residual)):
                return fail(name, "the output equals the block without one of its "
                                  "residual connections", "no_residual")
    return fail(name, f"the output differs from the pre-norm TransformerBlock's by up to "
                      f"{(got - want).abs().max().item():.3g}; check each sub-layer on its "
                      "own (check_multi_head, check_feed_forward, check_layer_norm) and the "
                      "order x + f(LN(x))")
