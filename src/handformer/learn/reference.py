"""The references a reader's code is compared with, and the classic mistakes reproduced on them.

The correct answer always comes from the library's own layers (``scaled_dot_product_attention``,
``MultiHeadAttention``, ``SinusoidalPositions``, ``nn.LayerNorm``, ``FeedForward``,
``TransformerBlock``). A mistake is reproduced by changing *one* thing on the way into or out
of those layers — the scale, the mask, the axis of the softmax, the order of a reshape — so a
checker can tell which mistake the reader's output matches.

Shape legend: ``B`` batch, ``H`` heads, ``T`` queries, ``S`` keys, ``D`` head dim, ``C`` model
dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from handformer.nn.attention import MultiHeadAttention, scaled_dot_product_attention

__all__ = ["attention_mistakes", "closest", "multi_head_mistakes"]


def _mistaken(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, scale: float,
              axis: int = -1) -> Tensor:
    """Attention as a hand-written version computes it, with one thing changed: masked
    scores filled with a huge negative number and *not* zeroed after the softmax, so a row a
    wrong mask leaves empty comes out uniform, as the tutorial's ``-1e9`` fill makes it."""
    scores = q @ k.transpose(-2, -1) * scale  # (B, H, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return scores.softmax(dim=axis) @ v  # (B, H, T, D)


def attention_mistakes(q: Tensor, k: Tensor, v: Tensor,
                       mask: Tensor | None) -> dict[str, Tensor]:
    """The output under each classic attention mistake; q, k, v (B, H, T|S, D)."""
    scale = 1 / math.sqrt(q.size(-1))
    out = {"unscaled": _mistaken(q, k, v, mask, scale=1.0),
           "softmax_axis": _mistaken(q, k, v, mask, scale=scale, axis=-2)}
    if mask is not None and not bool(mask.all()):
        out["mask_polarity"] = _mistaken(q, k, v, ~mask, scale=scale)
        if mask.shape[-1] == mask.shape[-2]:
            out["mask_transposed"] = _mistaken(q, k, v, mask.transpose(-2, -1), scale=scale)
    return out


def multi_head_mistakes(mha: MultiHeadAttention, x: Tensor,
                        mask: Tensor | None) -> dict[str, Tensor]:
    """``mha``'s output under each classic mistake of the multi-head wiring; x (B, T, C)."""
    b, t, c = x.shape
    h, d = mha.n_heads, mha.head_dim
    q, k, v = mha.in_proj(x).split(c, dim=-1)  # each (B, T, C)
    split = [z.view(b, t, h, d).transpose(1, 2) for z in (q, k, v)]  # each (B, H, T, D)
    wrong_split = [z.reshape(b, h, t, d) for z in (q, k, v)]  # the mistake: across tokens

    def merge(heads: Tensor) -> Tensor:  # (B, H, T, D) → (B, T, C)
        return mha.out_proj(heads.transpose(1, 2).reshape(b, t, c))

    out = {name: merge(o) for name, o in attention_mistakes(*split, mask).items()}
    right = scaled_dot_product_attention(*split, mask)[0]  # (B, H, T, D)
    out["heads_merged"] = mha.out_proj(right.reshape(b, t, c))  # the mistake: no transpose
    out["heads_split"] = merge(scaled_dot_product_attention(*wrong_split, mask)[0])
    return out


def closest(got: Tensor, candidates: dict[str, Tensor], atol: float = 1e-4) -> str | None:
    """The key of the candidate ``got`` equals (within ``atol``), or None."""
    for key, value in candidates.items():
        if value.shape == got.shape and torch.allclose(got, value, atol=atol):
            return key
    return None
