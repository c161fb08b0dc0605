"""Scaled dot-product attention and multi-head attention.

Three kernels behind one interface:

* ``manual`` — the readable reference: scores = q·kᵀ/√D, mask, softmax, weights·v. It is the
  only path that can return the attention weights.
* ``sdpa`` — torch's fused ``F.scaled_dot_product_attention`` (flash / memory-efficient
  kernels).
* ``tiled`` — hand-written memory-efficient attention (``handformer.nn.tiled_attention``):
  keys visited tile by tile with an online softmax, memory linear in T.

A cached decoding step (one query row, no mask or bias, float32 on the CPU, no gradient)
runs the hand-written decoding loop (``handformer.nn.decode_attention``) under ``sdpa``,
``tiled`` and ``auto``: it reads the cache once, where the kernels above are built for
blocks of queries.

Tests hold all of them equal. ``auto`` picks ``manual`` or ``sdpa`` per call from the tensors'
dtype and device (``_auto_kernel``: the faster of the two for what is running).

Shape legend: ``B`` batch, ``T`` query length, ``S`` key length, ``H`` query heads,
``Hkv`` key/value heads (``H`` for multi-head, 1 for multi-query, in between for grouped-query
attention), ``G = H / Hkv`` query heads per key/value head, ``D`` head dim, ``C`` model dim
(usually ``C = H · D``; some published models set ``D`` apart, e.g. Qwen3-0.6B: C 1024,
H 16, D 128, so the heads span ``H · D`` = 2048 features before ``out_proj`` maps back to C).

Masks are boolean with ``True`` = "may attend" (see ``handformer.masks``). A query row that
may attend to nothing returns zeros, never NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from handformer.masks import causal_mask
from handformer.nn import decode_attention as decode
from handformer.nn.kv_cache import KVCache
from handformer.nn.norm import RMSNorm
from handformer.nn.positional import RopeScaling, RotaryEmbedding, alibi_bias, alibi_slopes
from handformer.nn.tiled_attention import tiled_attention

AttentionKind = Literal["manual", "sdpa", "tiled", "auto"]
ATTENTION_KINDS: tuple[str, ...] = ("manual", "sdpa", "tiled", "auto")
# Position information applied inside attention (the rest is added to the embeddings).
ATTENTION_POSITIONAL: tuple[str, ...] = ("none", "rope", "alibi")

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
    if k.shape[-2] != v.shape[-2] or k.shape[1] != v.shape[1]:
        raise ValueError(
            f"k and v disagree on heads or key length: k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"query heads H={q.shape[1]} must be a multiple of key/value heads "
            f"Hkv={k.shape[1]}: q {tuple(q.shape)}, k {tuple(k.shape)}"
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
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The reference attention, written out. Returns ``(output, weights)``.

    q (B, H, T, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), ``mask`` bool broadcastable to
    (B, H, T, S), True = may attend; ``is_causal`` adds an end-aligned causal mask; ``bias``
    is added to the scores (ALiBi). Scores are scaled by ``scale`` (default 1/√D). Output
    (B, H, T, Dv), weights (B, H, T, S); a query row with nothing to attend to gives zeros.
    Raises ``ValueError`` for mismatched shapes, a non-boolean mask or one that does not
    broadcast.
    """
    _check_qkv(q, k, v)
    if mask is not None:
        _check_mask(mask, (q.shape[0], q.shape[1], q.shape[-2], k.shape[-2]))
    return _manual_attention(q, k, v, mask, dropout_p, is_causal=is_causal, scale=scale,
                             bias=bias)


def _manual_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    dropout_p: float,
    *,
    is_causal: bool,
    scale: float | None = None,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``scaled_dot_product_attention`` without the input checks (the caller made them)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        # Grouped-query attention: query head h reads key/value head h // G.
        k = k.repeat_interleave(groups, dim=1)  # (B, H, S, D)
        v = v.repeat_interleave(groups, dim=1)  # (B, H, S, Dv)
    t, s = q.shape[-2], k.shape[-2]
    if is_causal:
        causal = causal_mask(t, s, device=q.device)  # (T, S)
        mask = causal if mask is None else mask & causal
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale

    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, S)
    if bias is not None:
        scores = scores + bias
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
    bias: Tensor | None = None,
) -> Tensor:
    """torch's fused kernel, with handformer's mask convention and empty-row semantics
    (unchecked: ``attention`` or ``MultiHeadAttention`` validated the inputs)."""
    t, s = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if mask is None and bias is None:
        if is_causal and t != s:
            # torch's is_causal aligns to the top-left corner; ours is end-aligned.
            mask = causal_mask(t, s, device=q.device)
        else:
            # Square causal attention takes the fastest (flash) kernel via is_causal.
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=gqa
            )
    elif is_causal:
        causal = causal_mask(t, s, device=q.device)  # (T, S)
        mask = causal if mask is None else mask & causal
    row_has_key = None
    if mask is not None:
        # torch returns NaN for a row with no allowed key; let such rows see everything,
        # then zero their output so both paths agree.
        row_has_key = mask.any(dim=-1, keepdim=True)  # (…, T, 1)
        if q.device.type == "cpu" and not torch.compiler.is_compiling() and row_has_key.all():
            # No empty row (a padded batch's usual case): skip the output fill, a pass over
            # (B, H, T, D) each way. Asked on CPUs only, where reading the answer costs no sync.
            row_has_key = None
        else:
            mask = mask | ~row_has_key
    if bias is not None:
        # ALiBi on the fused path: one additive float mask, -inf where not allowed.
        attn_mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
    else:
        attn_mask = mask
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, enable_gqa=gqa
    )
    return out if row_has_key is None else out.masked_fill(~row_has_key, 0.0)  # (B, H, T, Dv)


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
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Dispatch to the chosen kernel. Weights are returned only by the manual kernel.

    Shapes and mask as in ``scaled_dot_product_attention``; checked here once, whichever
    kernel runs. ``need_weights=True`` always runs the manual kernel, since fused kernels
    never materialise the (T, S) weight matrix.
    """
    _check_qkv(q, k, v)
    if mask is not None:
        _check_mask(mask, (q.shape[0], q.shape[1], q.shape[-2], k.shape[-2]))
    return _run_kernel(q, k, v, mask, kind, dropout_p, is_causal, need_weights, bias)


def _auto_kernel(q: Tensor) -> str:
    """``attention='auto'``: the manual kernel for bfloat16 on a CPU, SDPA otherwise. SDPA's
    CPU flash kernel computes its bf16 backward block by block in a loop that small heads
    cannot amortise, while the manual kernel's two matmuls go to the BLAS's bf16 path; in
    fp32 (and on GPUs) the fused kernel is the faster one. Decided per call from the
    tensors, so the same model picks right under ``--precision bf16`` and fp32 alike."""
    return "manual" if q.dtype == torch.bfloat16 and q.device.type == "cpu" else "sdpa"


def _run_kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    kind: str,
    dropout_p: float,
    is_causal: bool,
    need_weights: bool,
    bias: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    """``attention`` without the input checks: the callers (``attention`` itself and
    ``MultiHeadAttention``, which builds q, k and v) have made them."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention kind {kind!r}; expected one of {ATTENTION_KINDS}")
    if is_causal and q.shape[-2] == 1:
        # One query at the end of the keys (a cached decoding step) may see every key: its
        # causal mask would be all True, so build none, whichever kernel runs.
        is_causal = False
    if kind == "auto":
        kind = _auto_kernel(q)
    if (kind != "manual" and q.shape[-2] == 1 and mask is None and bias is None
            and not need_weights and dropout_p == 0.0 and decode.usable(q, k, v)):
        # A decoding step (one query row over the cache): the hand-written loop that reads
        # the cache once (``nn.decode_attention``).
        return decode.attend(q, k, v), None
    if kind == "manual" or need_weights:
        out, weights = _manual_attention(q, k, v, mask, dropout_p, is_causal=is_causal,
                                         bias=bias)
        return out, (weights if need_weights else None)
    if kind == "tiled":
        if dropout_p > 0.0:
            raise ValueError("attention='tiled' has no attention dropout; train it with "
                             "dropout=0 or use attention='manual' or 'sdpa'")
        return tiled_attention(q, k, v, mask, is_causal=is_causal, bias=bias), None
    return _fused_attention(q, k, v, mask, dropout_p, is_causal, bias), None


def _attend_each_row(q: Tensor, k: Tensor, v: Tensor, spans: Sequence[tuple[int, int, int, int]],
                     kind: str, dropout_p: float, is_causal: bool,
                     alibi: tuple[Tensor, Tensor, Tensor] | None) -> Tensor:
    """Attention for requests packed one after another along the sequence axis: q (B, H, T,
    D), k and v (B, Hkv, S, D); ``spans[i] = (query start, queries, key start, keys)`` is
    segment i's queries and the keys they attend over, the spans tiling T in order. Each
    segment runs the kernel on its own slices, with the causal mask end-aligned within it
    — the shapes it has alone — so no other segment's key enters any of its reductions
    and it needs no mask: its attention does not depend on what else is in the batch (nor,
    in bf16, does its rounding). ALiBi's bias (``alibi`` = slopes (H,), query positions
    (B|1, T), key positions (B|1, S)) is built per segment, so memory stays linear in the
    batch. The decoding segments (one query each, no ALiBi) go to the decoding kernel
    together, in one call, when the kernel would take each of them alone too
    (``_run_kernel``): it computes every segment on its own, so the bits are those alone.
    Returns (B, H, T, D)."""
    decoding: Tensor | None = None  # (1, H, n, D): the one-query segments, in order
    if (kind != "manual" and alibi is None and dropout_p == 0.0
            and any(n == 1 for _, n, _, _ in spans) and decode.usable(q, k, v)):
        decoding = decode.attend(q, k, v, [span for span in spans if span[1] == 1])
        if decoding.shape[2] == len(spans):
            return decoding  # (1, H, T, D): every segment was decoding
    pieces, done = [], 0
    for q_start, n_queries, k_start, n_keys in spans:
        if decoding is not None and n_queries == 1:
            pieces.append(decoding[:, :, done : done + 1])  # (1, H, 1, D)
            done += 1
            continue
        queries, keys = slice(q_start, q_start + n_queries), slice(k_start, k_start + n_keys)
        bias = None
        if alibi is not None:
            slopes, q_pos, k_pos = alibi
            bias = alibi_bias(slopes, q_pos[:, queries], k_pos[:, keys]).to(q.dtype)
        pieces.append(_run_kernel(q[:, :, queries], k[:, :, keys], v[:, :, keys], None, kind,
                                  dropout_p, is_causal, False, bias)[0])  # (B, H, t_i, D)
    return torch.cat(pieces, dim=2)  # (B, H, T, D)


class MultiHeadAttention(nn.Module):
    """Multi-head attention with a fused input projection, grouped-query heads and
    in-attention positions (RoPE / ALiBi).

    One ``in_proj`` (C → H·D + 2·Hkv·D) holds the query, key and value projections side by
    side. With ``n_kv_heads == n_heads`` that is the layout ``nn.MultiheadAttention`` uses,
    so weights copy across without reshuffling. For self-attention one matmul computes all
    three; for cross-attention the query rows apply to ``x`` and the key/value rows to
    ``context``.

    ``forward(x, context=None, *, mask=None, is_causal=False, need_weights=False, ...)``:
    x (B, T, C) → (B, T, C) and the weights (B, H, T, S) when ``need_weights``. ``mask`` is
    bool, broadcastable to (B, H, T, S), with True = may attend (torch's
    ``nn.MultiheadAttention`` uses the opposite; convert with ``handformer.masks``).

    ``qk_norm=True`` normalises each head's queries and keys (RMSNorm over D with epsilon
    ``norm_eps``, one gain per feature shared by the heads) right after the projection and
    before RoPE, as Qwen3 does: the scores
    q·kᵀ stay bounded however large the projections grow, which lets a run use a higher
    learning rate. A cache then holds normalised (and rotated) keys, so a decoding step
    matches the full forward.

    Defaults: ``n_kv_heads=None`` (= ``n_heads``), ``head_dim=None`` (= ``d_model / n_heads``),
    ``dropout=0.0``, ``bias=True``, ``attention="manual"``, ``positional="none"`` (or
    ``"rope"`` / ``"alibi"``; ``rope_scaling`` stretches RoPE's frequencies as long-context
    checkpoints do), ``qk_norm=False``. Raises
    ``ValueError`` when ``n_heads`` does not divide ``d_model`` (and no ``head_dim`` is
    given), ``n_kv_heads`` does not
    divide ``n_heads``, for an unknown kernel or positional kind, and for inputs or masks of
    the wrong shape or dtype.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        attention: AttentionKind = "manual",
        positional: str = "none",
        rope_base: float = 10000.0,
        rope_scaling: RopeScaling | None = None,
        qk_norm: bool = False,
        head_dim: int | None = None,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if head_dim is None and d_model % n_heads != 0:
            raise ValueError(
                f"d_model={d_model} must be divisible by n_heads={n_heads} "
                f"(head dim D = d_model / n_heads)"
            )
        if n_kv_heads <= 0 or n_heads % n_kv_heads != 0:
            raise ValueError(
                f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads} "
                "(n_kv_heads = n_heads: multi-head; 1: multi-query; else grouped-query)"
            )
        if attention not in ATTENTION_KINDS:
            raise ValueError(
                f"unknown attention kind {attention!r}; expected one of {ATTENTION_KINDS}"
            )
        if positional not in ATTENTION_POSITIONAL:
            raise ValueError(f"attention positional={positional!r}; expected one of "
                             f"{ATTENTION_POSITIONAL}")
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = d_model // n_heads if head_dim is None else head_dim
        self.q_dim = n_heads * self.head_dim
        self.kv_dim = n_kv_heads * self.head_dim
        self.dropout = dropout
        self.attention = attention
        self.positional = positional
        self.in_proj = nn.Linear(d_model, self.q_dim + 2 * self.kv_dim, bias=bias)
        self.out_proj = nn.Linear(self.q_dim, d_model, bias=bias)
        self.rotary = (RotaryEmbedding(self.head_dim, rope_base, rope_scaling)
                       if positional == "rope" else None)
        self.q_norm = RMSNorm(self.head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=norm_eps) if qk_norm else None
        if positional == "alibi":
            self.register_buffer("alibi_slopes", alibi_slopes(n_heads), persistent=False)

    def _project(self, x: Tensor, context: Tensor | None) -> tuple[Tensor, Tensor]:
        """Queries from ``x``, keys and values from ``context`` (default: ``x``), split into
        heads: q (B, H, T, D) and kv (B, 2·Hkv, S_new, D), the Hkv key heads first, then the
        Hkv value heads — what ``KVCache.update`` takes."""
        c, h, hkv, d = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim
        if context is None:
            b, t, _ = x.shape
            # One matmul, then one view: the fused projection's columns are H query heads,
            # then Hkv key heads, then Hkv value heads, each D wide.
            # Split before moving heads forward: the backward then joins the two gradients
            # straight into the projection's (B, T, ·) layout, with no copy after the join.
            qkv = self.in_proj(x).view(b, t, h + 2 * hkv, d)  # (B, T, H + 2·Hkv, D)
            q, kv = qkv.split_with_sizes([h, 2 * hkv], dim=2)
            return q.transpose(1, 2), kv.transpose(1, 2)  # (B, H, T, D), (B, 2·Hkv, T, D)
        b = x.shape[0]
        if context.dim() != 3 or context.shape[0] != b or context.shape[-1] != c:
            raise ValueError(
                f"cross-attention context must be (B, S, C) = ({b}, S, {c}); "
                f"got {tuple(context.shape)}"
            )
        w, bias, qd = self.in_proj.weight, self.in_proj.bias, self.q_dim
        q = F.linear(x, w[:qd], None if bias is None else bias[:qd])  # (B, T, H·D)
        kv = F.linear(context, w[qd:], None if bias is None else bias[qd:])  # (B, S, 2·Hkv·D)
        s = context.shape[1]
        q = q.view(b, x.shape[1], h, d).transpose(1, 2)  # (B, H, T, D)
        return q, kv.view(b, s, 2 * hkv, d).transpose(1, 2)  # (B, 2·Hkv, S, D)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        positions: Tensor | None = None,
        key_positions: Tensor | None = None,
        cache: KVCache | None = None,
        cache_start: int = 0,
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, T, C); context (B, S, C) for cross-attention (default: x itself).

        ``mask`` bool, broadcastable to (B, H, T, S), ``True`` = may attend.
        ``positions`` (T,) or (B, T) are the queries' positions and ``key_positions`` the
        keys' (default: the same), used by RoPE / ALiBi. With ``cache``, the new keys and
        values are written at column ``cache_start`` and attention runs over every cached
        column. Returns the output (B, T, C) and, with ``need_weights``, the weights
        (B, H, T, S).
        """
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"MultiHeadAttention expects x of shape (B, T, {self.d_model}); "
                f"got {tuple(x.shape)}"
            )
        b, t, _ = x.shape
        hkv = self.n_kv_heads
        q, kv = self._project(x, context)  # (B, H, T, D), (B, 2·Hkv, S_new, D) keys first
        rotate_keys = self.rotary is not None and context is None
        if self.q_norm is not None:
            q = self.q_norm(q)  # (B, H, T, D)
        if self.k_norm is not None or rotate_keys:
            if positions is None and self.positional != "none":
                positions = torch.arange(t, device=x.device)  # (T,)
            # Keys are normalised and rotated once, then cached that way.
            k, v = kv.split_with_sizes([hkv, hkv], dim=1)  # (B, Hkv, S_new, D) each
            if self.k_norm is not None:
                k = self.k_norm(k)
            if rotate_keys:
                k = self.rotary(k, positions)  # type: ignore[misc]
            kv = torch.cat([k, v], dim=1)  # (B, 2·Hkv, S_new, D)

        # A packed batch of requests (``row_spans``: see ``serve.paged``) attends segment by
        # segment over its own keys.
        spans = cache.row_spans if cache is not None else None
        bias = None
        segment_alibi = None
        if self.positional != "none":
            if positions is None:
                positions = torch.arange(t, device=x.device)  # (T,)
            if self.rotary is not None:
                q = self.rotary(q, positions)
            else:  # ALiBi
                q_pos = positions if positions.dim() == 2 else positions[None]  # (B|1, T)
                if key_positions is None:
                    key_positions = q_pos
                k_pos = key_positions if key_positions.dim() == 2 else key_positions[None]
                if spans is None:  # (B|1, H, T, S)
                    bias = alibi_bias(self.alibi_slopes, q_pos, k_pos).to(q.dtype)
                else:  # built per segment
                    segment_alibi = (self.alibi_slopes, q_pos, k_pos)
        if cache is not None:
            k, v = cache.update(kv, cache_start)  # (B, Hkv, S, D) each
        else:
            k, v = kv.split_with_sizes([hkv, hkv], dim=1)  # (B, Hkv, S, D) each
        dropout_p = self.dropout if self.training else 0.0
        if spans is not None:
            if need_weights or mask is not None:
                raise ValueError("a packed cache batch (row_spans) attends each request over "
                                 "its own keys: it takes no mask and returns no weights")
            out, weights = _attend_each_row(q, k, v, spans, self.attention, dropout_p,
                                            is_causal, segment_alibi), None
        else:
            if mask is not None:
                _check_mask(mask, (b, self.n_heads, t, k.shape[-2]))
            # q, k and v were built above with consistent shapes: run the kernel unchecked.
            out, weights = _run_kernel(q, k, v, mask, self.attention, dropout_p, is_causal,
                                       need_weights, bias)  # (B, H, T, D)
        out = out.transpose(1, 2).reshape(b, t, self.q_dim)  # (B, T, H·D)
        return self.out_proj(out), weights  # (B, T, C)
