"""Scaled dot-product attention and multi-head attention.

Two kernels behind one interface:

* ``manual`` — the readable reference: scores = q·kᵀ/√D, mask, softmax, weights·v. It is the
  only path that can return the attention weights.
* ``sdpa`` — torch's fused ``F.scaled_dot_product_attention`` (flash / memory-efficient
  kernels). Tests hold both equal.

Shape legend: ``B`` batch, ``T`` query length, ``S`` key length, ``H`` heads, ``D`` head dim,
``C`` model dim (``C = H · D``).

Masks are boolean with ``True`` = "may attend" (see ``handformer.masks``). A query row that
may attend to nothing returns zeros, never NaN.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from handformer.masks import causal_mask

AttentionKind = Literal["manual", "sdpa"]
ATTENTION_KINDS: tuple[str, ...] = ("manual", "sdpa")

__all__ = [
    "ATTENTION_KINDS",
    "MultiHeadAttention",
    "attention",
    "scaled_dot_product_attention",
]


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "attention expects q (B, H, T, D), k (B, H, S, D), v (B, H, S, Dv); got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q head dim {q.shape[-1]} != k head dim {k.shape[-1]}: "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v disagree on key length S: k {tuple(k.shape)}, v {tuple(v.shape)}"
        )


def _check_mask(mask: Tensor, scores_shape: tuple[int, ...]) -> None:
    if mask.dtype != torch.bool:
        raise ValueError(
            f"attention mask must be boolean (True = may attend); got dtype {mask.dtype}. "
            "Convert a 0/1 mask with `mask.bool()`; a torch-style mask with handformer.masks."
        )
    try:
        torch.broadcast_shapes(mask.shape, scores_shape)
    except RuntimeError:
        b, _h, t, s = scores_shape
        raise ValueError(
            f"mask shape {tuple(mask.shape)} does not broadcast to scores {scores_shape}; "
            f"expected (B, 1, T, S) = ({b}, 1, {t}, {s}), (T, S) = ({t}, {s}) "
            f"or a padding mask (B, S) = ({b}, {s}) passed through handformer.masks.combine_masks"
        ) from None


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    dropout_p: float = 0.0,
    *,
    is_causal: bool = False,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """The reference attention, written out. Returns ``(output, weights)``.

    q (B, H, T, D), k (B, H, S, D), v (B, H, S, Dv), ``mask`` bool broadcastable to
    (B, H, T, S); ``is_causal`` adds an end-aligned causal mask. Output (B, H, T, Dv),
    weights (B, H, T, S).
    """
    _check_qkv(q, k, v)
    t, s = q.shape[-2], k.shape[-2]
    scores_shape = (q.shape[0], q.shape[1], t, s)
    if mask is not None:
        _check_mask(mask, scores_shape)
    if is_causal:
        causal = causal_mask(t, s, device=q.device)  # (T, S)
        mask = causal if mask is None else mask & causal
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale

    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, S)
    if mask is not None:
        # A large negative (not -inf) keeps fully-masked rows finite; zeroing the weights
        # afterwards makes masked keys contribute exactly nothing and empty rows return zeros.
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1)  # (B, H, T, S)
    if mask is not None:
        weights = weights.masked_fill(~mask, 0.0)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)
    return weights @ v, weights  # (B, H, T, Dv), (B, H, T, S)


def _fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
) -> Tensor:
    """torch's fused kernel, with handformer's mask convention and empty-row semantics."""
    _check_qkv(q, k, v)
    t, s = q.shape[-2], k.shape[-2]
    if mask is None:
        # Square causal attention takes the fastest (flash) kernel via is_causal.
        if is_causal and t != s:
            # torch's is_causal aligns to the top-left corner; ours is end-aligned.
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=causal_mask(t, s, device=q.device), dropout_p=dropout_p
            )
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal)
    _check_mask(mask, (q.shape[0], q.shape[1], t, s))
    if is_causal:
        mask = mask & causal_mask(t, s, device=q.device)
    # torch returns NaN for a row with no allowed key; let such rows see everything, then
    # zero their output so both paths agree.
    row_has_key = mask.any(dim=-1, keepdim=True)  # (…, T, 1)
    safe_mask = mask | ~row_has_key
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe_mask, dropout_p=dropout_p)
    return out.masked_fill(~row_has_key, 0.0)  # (B, H, T, Dv)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    kind: AttentionKind = "manual",
    dropout_p: float = 0.0,
    is_causal: bool = False,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Dispatch to the chosen kernel. Weights are returned only by the manual kernel.

    ``need_weights=True`` always runs the manual kernel, since fused kernels never
    materialise the (T, S) weight matrix.
    """
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention kind {kind!r}; expected one of {ATTENTION_KINDS}")
    if kind == "manual" or need_weights:
        out, weights = scaled_dot_product_attention(
            q, k, v, mask, dropout_p, is_causal=is_causal
        )
        return out, (weights if need_weights else None)
    return _fused_attention(q, k, v, mask, dropout_p, is_causal), None


class MultiHeadAttention(nn.Module):
    """Multi-head attention with a fused input projection.

    One ``in_proj`` (C → 3C) holds the query, key and value projections side by side, the
    layout ``nn.MultiheadAttention`` uses, so weights copy across without reshuffling. For
    self-attention one matmul computes all three; for cross-attention the query rows are
    applied to ``x`` and the key/value rows to ``context``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        dropout: float = 0.0,
        bias: bool = True,
        attention: AttentionKind = "manual",
    ) -> None:
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(
                f"d_model={d_model} must be divisible by n_heads={n_heads} "
                f"(head dim D = d_model / n_heads)"
            )
        if attention not in ATTENTION_KINDS:
            raise ValueError(
                f"unknown attention kind {attention!r}; expected one of {ATTENTION_KINDS}"
            )
        self.d_model = d_model
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.dropout = dropout
        self.attention = attention
        self.in_proj = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def _split_heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, T, C); context (B, S, C) for cross-attention (default: x itself).

        ``mask`` bool, broadcastable to (B, H, T, S), ``True`` = may attend. Returns the
        output (B, T, C) and, with ``need_weights``, the weights (B, H, T, S).
        """
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"MultiHeadAttention expects x of shape (B, T, {self.d_model}); "
                f"got {tuple(x.shape)}"
            )
        b, t, c = x.shape
        if context is None:
            qkv = self.in_proj(x)  # (B, T, 3C)
            q, k, v = qkv.split(c, dim=-1)  # 3 × (B, T, C)
        else:
            if context.dim() != 3 or context.shape[0] != b or context.shape[-1] != c:
                raise ValueError(
                    f"cross-attention context must be (B, S, C) = ({b}, S, {c}); "
                    f"got {tuple(context.shape)}"
                )
            w, bias = self.in_proj.weight, self.in_proj.bias
            q = F.linear(x, w[:c], None if bias is None else bias[:c])  # (B, T, C)
            kv = F.linear(context, w[c:], None if bias is None else bias[c:])  # (B, S, 2C)
            k, v = kv.split(c, dim=-1)  # 2 × (B, S, C)
        q, k, v = self._split_heads(q), self._split_heads(k), self._split_heads(v)
        out, weights = attention(
            q,
            k,
            v,
            mask,
            kind=self.attention,  # type: ignore[arg-type]
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal,
            need_weights=need_weights,
        )  # (B, H, T, D)
        out = out.transpose(1, 2).reshape(b, t, c)  # (B, T, C)
        return self.out_proj(out), weights
