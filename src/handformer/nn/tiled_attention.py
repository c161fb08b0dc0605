"""Memory-efficient attention, written out: tiles over the keys with an online softmax.

The reference kernel materialises the (T, S) score matrix, so memory grows with T·S. Here
the keys are visited one tile of ``block`` columns at a time and the softmax is computed
*online*: keep, per query row, the running maximum ``m``, the running normaliser ``l`` and
the running weighted sum ``acc``; when a new tile raises the maximum, rescale what was
accumulated so far by ``exp(m_old − m_new)``. After the last tile ``acc / l`` is exactly
softmax(scores)·V, and at no point did more than a (T, block) tile exist.

The backward pass is a hand-written ``autograd.Function`` that stores only q, k, v, the
output and the per-row log-sum-exp, and recomputes each tile's probabilities from them
(the FlashAttention recipe, in plain PyTorch ops rather than a fused kernel).

With a causal mask, the query rows that lie entirely above the diagonal of a key tile (they
may attend to none of its keys) are skipped, forward and backward: their probabilities are
exactly zero, so nothing changes but the work, which halves for square attention.

Shape legend: ``B`` batch, ``H`` heads, ``T`` queries, ``S`` keys, ``K`` keys in one tile,
``D`` head dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["DEFAULT_BLOCK", "tiled_attention"]

DEFAULT_BLOCK = 256


def _tile(x: Tensor | None, j0: int, j1: int) -> Tensor | None:
    """Columns [j0, j1) of a mask/bias whose last axis is S, or the broadcast axis as is."""
    if x is None or x.shape[-1] == 1:
        return x
    return x[..., j0:j1]


def _rows(x: Tensor | None, r0: int) -> Tensor | None:
    """Query rows [r0, T) of a mask/bias whose second-to-last axis is T (a broadcast axis, or
    a mask with no query axis, stays as is)."""
    if x is None or r0 == 0 or x.dim() < 2 or x.shape[-2] == 1:
        return x
    return x[..., r0:, :]


def _first_row(j0: int, causal_offset: int | None) -> int:
    """The first query row that may attend to key column j0 (0 without a causal mask)."""
    return 0 if causal_offset is None else max(0, j0 - causal_offset)


def _tile_scores(q: Tensor, k_tile: Tensor, scale: float, j0: int, allowed: Tensor | None,
                 bias: Tensor | None, causal_offset: int | None) -> tuple[Tensor, Tensor | None]:
    """Scores of all queries against one key tile, and the tile's 'may attend' mask."""
    scores = (q @ k_tile.transpose(-2, -1)) * scale  # (B, H, T, K)
    if bias is not None:
        scores = scores + bias
    if causal_offset is not None:
        t, kk = q.shape[-2], k_tile.shape[-2]
        rows = torch.arange(t, device=q.device)[:, None] + causal_offset  # (T, 1) positions
        cols = torch.arange(j0, j0 + kk, device=q.device)[None, :]  # (1, K)
        causal = cols <= rows  # (T, K)
        allowed = causal if allowed is None else allowed & causal
    return scores, allowed


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                bias: Tensor | None, is_causal: bool, scale: float, block: int) -> Tensor:
        b, h, t, _ = q.shape
        s = k.shape[-2]
        causal_offset = s - t if is_causal else None  # end-aligned, as in handformer.masks
        m = torch.full((b, h, t, 1), float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros((b, h, t, 1), dtype=q.dtype, device=q.device)  # noqa: E741
        acc = torch.zeros((b, h, t, v.shape[-1]), dtype=q.dtype, device=q.device)
        for j0 in range(0, s, block):
            j1 = min(j0 + block, s)
            r0 = _first_row(j0, causal_offset)  # rows above it see nothing of this tile
            if r0 >= t:
                break  # this tile and every later one lie above the diagonal
            offset = None if causal_offset is None else causal_offset + r0
            scores, allowed = _tile_scores(
                q[..., r0:, :], k[..., j0:j1, :], scale, j0, _rows(_tile(mask, j0, j1), r0),
                _rows(_tile(bias, j0, j1), r0), offset)  # (B, H, T', K), T' = T - r0
            if allowed is not None:
                scores = scores.masked_fill(~allowed, float("-inf"))
            m_old = m[..., r0:, :]  # (B, H, T', 1)
            m_new = torch.maximum(m_old, scores.amax(dim=-1, keepdim=True))
            # Rows that have seen no allowed key yet keep m = -inf: use 0 so exp() stays finite.
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(scores - m_safe)  # (B, H, T', K); masked entries are exp(-inf) = 0
            correction = torch.exp(m_old - m_safe)  # (B, H, T', 1); 0 where m was -inf
            l[..., r0:, :] = l[..., r0:, :] * correction + p.sum(dim=-1, keepdim=True)
            acc[..., r0:, :] = acc[..., r0:, :] * correction + p @ v[..., j0:j1, :]
            m[..., r0:, :] = m_new
        empty = l == 0  # rows that may attend to nothing: output zeros, as the reference
        out = torch.where(empty, torch.zeros_like(acc), acc / torch.where(empty, 1.0, l))
        lse = torch.where(empty, torch.full_like(m, float("inf")), m + torch.log(l))  # (B,H,T,1)
        ctx.save_for_backward(q, k, v, out, lse, mask, bias)
        ctx.is_causal, ctx.scale, ctx.block = is_causal, scale, block
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse, mask, bias = ctx.saved_tensors
        scale, block = ctx.scale, ctx.block
        t, s = q.shape[-2], k.shape[-2]
        causal_offset = s - t if ctx.is_causal else None
        grad_q = torch.zeros_like(q)
        grad_k = torch.zeros_like(k)
        grad_v = torch.zeros_like(v)
        # d(softmax)/d(scores) needs Σ_j P_ij dP_ij = rowsum(dO ∘ O), computed once.
        delta = (grad_out * out).sum(dim=-1, keepdim=True)  # (B, H, T, 1)
        for j0 in range(0, s, block):
            j1 = min(j0 + block, s)
            r0 = _first_row(j0, causal_offset)  # rows above it have p = 0 on this tile
            if r0 >= t:
                break
            offset = None if causal_offset is None else causal_offset + r0
            q_r, grad_out_r = q[..., r0:, :], grad_out[..., r0:, :]  # (B, H, T', D)
            k_tile, v_tile = k[..., j0:j1, :], v[..., j0:j1, :]  # (B, H, K, D)
            scores, allowed = _tile_scores(q_r, k_tile, scale, j0, _rows(_tile(mask, j0, j1), r0),
                                           _rows(_tile(bias, j0, j1), r0), offset)
            # (B, H, T', K): the forward's probabilities, recomputed
            p = torch.exp(scores - lse[..., r0:, :])
            if allowed is not None:
                p = p.masked_fill(~allowed, 0.0)
            grad_v[..., j0:j1, :] = p.transpose(-2, -1) @ grad_out_r  # (B, H, K, D)
            grad_p = grad_out_r @ v_tile.transpose(-2, -1)  # (B, H, T', K)
            grad_scores = p * (grad_p - delta[..., r0:, :]) * scale  # (B, H, T', K)
            grad_q[..., r0:, :] += grad_scores @ k_tile  # (B, H, T', D)
            grad_k[..., j0:j1, :] = grad_scores.transpose(-2, -1) @ q_r  # (B, H, K, D)
        return grad_q, grad_k, grad_v, None, None, None, None, None


def tiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    bias: Tensor | None = None,
    scale: float | None = None,
    block: int = DEFAULT_BLOCK,
) -> Tensor:
    """Attention in O(T·block) extra memory. Same contract as the reference kernel:
    q (B, H, T, D), k/v (B, Hkv, S, D), bool ``mask`` broadcastable to (B, H, T, S),
    end-aligned ``is_causal``, additive ``bias`` (treated as a constant: no gradient).
    Returns (B, H, T, D); rows with nothing to attend to are zeros."""
    if block <= 0:
        raise ValueError(f"block must be positive; got {block}")
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # grouped-query attention: autograd sums the repeated heads' gradients
        k = k.repeat_interleave(groups, dim=1)  # (B, H, S, D)
        v = v.repeat_interleave(groups, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if bias is not None:
        bias = bias.detach()
    return _TiledAttention.apply(q, k, v, mask, bias, is_causal, scale, block)
