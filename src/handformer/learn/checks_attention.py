"""Checkers for the reader's attention: the function, the two masks, the multi-head layer.

Shape legend: ``B`` batch, ``H`` heads, ``T`` queries, ``S`` keys, ``D`` head dim, ``C`` model
dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from handformer.doctor.maskmath import classify, show
from handformer.learn.reference import attention_mistakes, closest, multi_head_mistakes
from handformer.learn.result import (
    CheckResult,
    ReaderError,
    call_reader,
    fail,
    never_raises,
    passed,
)
from handformer.masks import causal_mask
from handformer.nn.attention import MultiHeadAttention, scaled_dot_product_attention

__all__ = ["as_output", "check_attention", "check_causal_mask", "check_multi_head",
           "check_padding_mask", "copy_attention_weights", "linears", "shape_problem"]

B, H, T, D = 2, 3, 5, 8
PAD_ID = 0


def as_output(result: object) -> object:
    """A layer's output whether it returns ``out`` or ``(out, weights)``."""
    if isinstance(result, tuple) and result and isinstance(result[0], Tensor):
        return result[0]
    return result


def shape_problem(name: str, got: object, want: tuple[int, ...]) -> str | None:
    if not isinstance(got, Tensor):
        return f"{name} returned {type(got).__name__}, expected a tensor of shape {want}"
    if tuple(got.shape) != want:
        return f"{name} returned shape {tuple(got.shape)}, expected {want}"
    if not bool(torch.isfinite(got).all()):
        return f"{name} returned NaN or Inf values"
    return None


def _padding(rows: int, keys: int) -> Tensor:  # (B, S): True on real tokens, the last row padded
    pad = torch.ones(rows, keys, dtype=torch.bool)
    pad[-1, keys - 2:] = False
    return pad


@never_raises
def check_attention(fn: Callable[..., object]) -> CheckResult:
    """``fn(q, k, v, mask=None)`` with q, k, v (B, H, T, D) and a boolean mask broadcastable to
    the scores (B, H, T, S), True = may attend; returns the output (B, H, T, D) or
    ``(output, weights)``. Compared with ``handformer.scaled_dot_product_attention`` with no
    mask, a causal (T, S) mask and a padded (B, 1, T, S) one."""
    name = "check_attention"
    torch.manual_seed(0)
    q, k, v = torch.randn(3, B, H, T, D).unbind(0)
    cases = [("no mask", None), ("a causal (T, S) mask", causal_mask(T)),
             ("a causal + padding (B, 1, T, S) mask",
              _padding(B, T)[:, None, None, :] & causal_mask(T))]
    try:
        for label, mask in cases:
            got = as_output(call_reader(name, f"fn(q, k, v, mask) with {label}", fn,
                                        q, k, v, mask=mask))
            problem = shape_problem(f"with {label}, fn", got, (B, H, T, D))
            if problem is not None:
                return fail(name, problem)
            got = got.float()  # a float64 answer is compared too
            want = scaled_dot_product_attention(q, k, v, mask)[0]  # (B, H, T, D)
            if not torch.allclose(got, want, atol=1e-5):
                diff = (got - want).abs().max().item()
                mistake = closest(got, attention_mistakes(q, k, v, mask))
                return fail(name, f"with {label}, the output differs from the reference by up "
                                  f"to {diff:.3g}", mistake)
    except ReaderError as err:
        return err.result
    return passed(name, f"output {(B, H, T, D)} equals the reference with no mask, a causal "
                        "mask and a padded causal mask")


@never_raises
def check_causal_mask(fn: Callable[[int], object]) -> CheckResult:
    """``fn(T)`` returns the causal mask (T, T): boolean, True = may attend, so query i sees
    the keys j ≤ i (rows are queries, columns keys)."""
    name = "check_causal_mask"
    try:
        for t in (4, 7, 1):
            got = call_reader(name, f"fn({t})", fn, t)
            if not isinstance(got, Tensor) or tuple(got.shape) != (t, t):
                shape = tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__
                return fail(name, f"fn({t}) returned {shape}, expected a ({t}, {t}) tensor")
            if got.dtype != torch.bool:
                return fail(name, f"fn({t}) returned dtype {got.dtype}, expected torch.bool "
                                  "(True = may attend): add .bool()")
            kind = classify(got)
            if kind != "causal":
                mistake = {"transposed": "mask_transposed",
                           "inverted": "mask_polarity"}.get(kind)
                return fail(name, f"fn({t}) = {show(got)}, expected {show(causal_mask(t))} "
                                  f"(it reads as {kind})", mistake)
    except ReaderError as err:
        return err.result
    return passed(name, "fn(4), fn(7), fn(1) are lower-triangular booleans, e.g. fn(4) = "
                        + show(causal_mask(4)))


@never_raises
def check_padding_mask(fn: Callable[..., object]) -> CheckResult:
    """``fn(ids, pad_id)`` with ids (B, S) returns the padding mask ready for the scores
    (B, H, T, S): boolean, True on real tokens, shaped (B, 1, 1, S)."""
    name = "check_padding_mask"
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, PAD_ID, PAD_ID]])  # (B, S)
    want = (ids != PAD_ID)[:, None, None, :]  # (B, 1, 1, S)
    scores = (ids.shape[0], H, 4, ids.shape[1])  # T = 4 queries: B ≠ T, so a (B, S) mask fails
    try:
        got = call_reader(name, "fn(ids, pad_id)", fn, ids, PAD_ID)
    except ReaderError as err:
        return err.result
    if not isinstance(got, Tensor):
        return fail(name, f"fn returned {type(got).__name__}, expected a boolean tensor")
    if got.dtype != torch.bool:
        return fail(name, f"fn returned dtype {got.dtype}, expected torch.bool "
                          "(True = real token)")
    try:
        torch.broadcast_shapes(tuple(got.shape), scores)
        lined_up = got.dim() == 4 and got.shape[0] == ids.shape[0]
    except RuntimeError:
        lined_up = False
    if not lined_up:
        return fail(name, f"fn returned shape {tuple(got.shape)} for ids {tuple(ids.shape)}; "
                          f"it must line up with scores (B, H, T, S) = {scores}, i.e. "
                          f"{tuple(want.shape)}", "mask_broadcast")
    got = got.expand(-1, -1, 1, -1) if got.shape[2] == 1 else got[:, :, :1]
    if torch.equal(got, want):
        return passed(name, f"shape {tuple(want.shape)}, True on the real tokens: row 1 = "
                            + show(want[1, 0]))
    if torch.equal(got, ~want):
        return fail(name, f"row 1 = {show(got[1, 0])}, expected {show(want[1, 0])}",
                    "mask_polarity")
    return fail(name, f"row 0 = {show(got[0, 0])}, row 1 = {show(got[1, 0])}; expected "
                      f"{show(want[0, 0])} and {show(want[1, 0])} (pad id {PAD_ID})")


def linears(module: nn.Module) -> list[nn.Linear]:
    """The ``nn.Linear`` layers of ``module`` in registration order."""
    return [m for m in module.modules() if isinstance(m, nn.Linear)]


def copy_attention_weights(layers: list[nn.Linear], mha: MultiHeadAttention) -> str | None:
    """Copy a reader's projections into ``mha``: four C→C layers (query, key, value, output)
    or a fused C→3C (q, k, v) and a C→C. Returns why it could not, or None."""
    c = mha.out_proj.in_features
    shapes = [tuple(lin.weight.shape) for lin in layers]
    if shapes == [(c, c)] * 4:
        weights = [lin.weight for lin in layers[:3]]
        biases = [lin.bias for lin in layers[:3]]
    elif shapes == [(3 * c, c), (c, c)]:
        weights, biases = [layers[0].weight], [layers[0].bias]
    else:
        return (f"its nn.Linear layers have weight shapes {shapes}; expected four ({c}, {c}) "
                f"layers (query, key, value, output, in that order) or ({3 * c}, {c}) and "
                f"({c}, {c})")
    out = layers[-1]
    with torch.no_grad():
        mha.in_proj.weight.copy_(torch.cat(weights))
        if all(b is not None for b in biases) and mha.in_proj.bias is not None:
            mha.in_proj.bias.copy_(torch.cat(biases))
        elif mha.in_proj.bias is not None:
            mha.in_proj.bias.zero_()
        mha.out_proj.weight.copy_(out.weight)
        if mha.out_proj.bias is not None:
            mha.out_proj.bias.copy_(out.bias if out.bias is not None else 0.0)
    return None


@never_raises
def check_multi_head(cls: Callable[..., nn.Module], d_model: int = 16,
                     num_heads: int = 4) -> CheckResult:
    """``cls(d_model, num_heads)``: a layer with ``forward(x, mask=None)``, x (B, T, C), mask
    boolean broadcastable to (B, H, T, S), returning (B, T, C) or ``(out, weights)``. Its
    projections are ``nn.Linear`` layers registered in the order query, key, value, output
    (or one fused C→3C, then the output). Compared, with the reader's weights copied in, with
    handformer's ``MultiHeadAttention``."""
    name = "check_multi_head"
    torch.manual_seed(0)
    try:
        layer = call_reader(name, f"cls({d_model}, {num_heads})", cls, d_model, num_heads)
        layer.eval()
        mha = MultiHeadAttention(d_model, num_heads, attention="manual").eval()
        why = copy_attention_weights(linears(layer), mha)
        if why is not None:
            return fail(name, f"cannot compare: {why}")
        x = torch.randn(B, T, d_model)  # (B, T, C)
        for label, mask in (("no mask", None), ("a causal mask", causal_mask(T))):
            with torch.no_grad():
                got = as_output(call_reader(name, f"forward(x, mask) with {label}", layer,
                                            x, mask))
                problem = shape_problem(f"with {label}, forward", got, (B, T, d_model))
                if problem is not None:
                    return fail(name, problem)
                got = got.float()  # a float64 answer is compared too
                want, _ = mha(x, mask=mask)  # (B, T, C)
                if not torch.allclose(got, want, atol=1e-5):
                    diff = (got - want).abs().max().item()
                    mistake = closest(got, multi_head_mistakes(mha, x, mask))
                    return fail(name, f"with {label}, the output differs from "
                                      f"MultiHeadAttention's by up to {diff:.3g}", mistake)
    except ReaderError as err:
        return err.result
    return passed(name, f"{num_heads} heads of width {d_model // num_heads}: output "
                        f"{(B, T, d_model)} equals MultiHeadAttention's with your weights, with "
                        "and without a causal mask")
