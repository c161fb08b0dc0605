"""One Transformer block: attention and feed-forward, each wrapped in a residual + LayerNorm.

``norm="post"`` is the original paper's order, ``x = LN(x + sublayer(x))``; ``norm="pre"``
normalises the sublayer's *input*, ``x = x + sublayer(LN(x))``, leaving an untouched
residual path from input to output — which is why deep pre-norm stacks train stably
without a long warm-up.

Shape legend: ``B`` batch, ``T`` query length, ``S`` key/context length, ``C`` model dim.
"""

from __future__ import annotations

from torch import Tensor, nn

from handformer.nn import decode_block
from handformer.nn.attention import AttentionKind, MultiHeadAttention
from handformer.nn.dropout import apply_dropout
from handformer.nn.feedforward import FeedForward
from handformer.nn.kv_cache import KVCache
from handformer.nn.norm import make_norm
from handformer.nn.positional import RopeScaling

__all__ = ["NORM_KINDS", "TransformerBlock"]

NORM_KINDS: tuple[str, ...] = ("pre", "post")


class TransformerBlock(nn.Module):
    """Self-attention (+ optional cross-attention) + FFN, pre- or post-norm.

    ``forward(x, *, mask=None, is_causal=False, context=None, context_mask=None, ...)``:
    x (B, T, C) → (B, T, C). Masks are bool with True = may attend. Defaults:
    ``norm="pre"`` (``x + f(LN(x))``; ``"post"`` is ``LN(x + f(x))``), ``activation="gelu"``,
    ``attention="manual"``, ``dropout=0.0``, no cross-attention, ``norm_type="layernorm"``
    (or ``"rmsnorm"``), ``qk_norm=False``, ``head_dim=None`` and ``rope_scaling=None`` (see
    ``MultiHeadAttention``); ``layer_norm_eps`` is every norm's epsilon, QK-norm's included.
    Raises ``ValueError`` for an unknown ``norm`` (and whatever ``MultiHeadAttention``
    refuses), and when a block with cross-attention is called without ``context``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        *,
        dropout: float = 0.0,
        norm: str = "pre",
        activation: str = "gelu",
        attention: AttentionKind = "manual",
        bias: bool = True,
        cross_attention: bool = False,
        layer_norm_eps: float = 1e-5,
        n_kv_heads: int | None = None,
        positional: str = "none",
        rope_base: float = 10000.0,
        rope_scaling: RopeScaling | None = None,
        norm_type: str = "layernorm",
        qk_norm: bool = False,
        head_dim: int | None = None,
    ) -> None:
        super().__init__()
        if norm not in NORM_KINDS:
            raise ValueError(f"unknown norm placement {norm!r}; expected one of {NORM_KINDS}")
        self.norm = norm
        self.self_attn = MultiHeadAttention(
            d_model, n_heads, n_kv_heads=n_kv_heads, dropout=dropout, bias=bias,
            attention=attention, positional=positional, rope_base=rope_base,
            rope_scaling=rope_scaling, qk_norm=qk_norm, head_dim=head_dim, norm_eps=layer_norm_eps,
        )
        self.norm1 = make_norm(norm_type, d_model, eps=layer_norm_eps, bias=bias)
        self.dropout1 = nn.Dropout(dropout)
        self.cross_attn: MultiHeadAttention | None = None
        if cross_attention:
            self.cross_attn = MultiHeadAttention(
                d_model, n_heads, dropout=dropout, bias=bias, attention=attention,
                qk_norm=qk_norm, head_dim=head_dim, norm_eps=layer_norm_eps,
            )
            self.norm_cross = make_norm(norm_type, d_model, eps=layer_norm_eps, bias=bias)
            self.dropout_cross = nn.Dropout(dropout)
        self.ffn = FeedForward(d_model, d_ff, activation=activation, dropout=dropout, bias=bias)
        self.norm2 = make_norm(norm_type, d_model, eps=layer_norm_eps, bias=bias)
        self.dropout2 = nn.Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        is_causal: bool = False,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        positions: Tensor | None = None,
        key_positions: Tensor | None = None,
        cache: KVCache | None = None,
        cache_start: int = 0,
    ) -> Tensor:
        """x (B, T, C) → (B, T, C). ``mask`` is the self-attention mask (True = may attend);
        ``context`` (B, S, C) and ``context_mask`` feed the cross-attention, if present.
        ``positions``, ``key_positions``, ``cache`` and ``cache_start`` go to the
        self-attention (see ``MultiHeadAttention.forward``)."""
        if cache is not None and mask is None and context is None and not self.training \
                and x.shape[0] == 1 and x.shape[1] == 1:
            # One token of one request: the whole block as one kernel, where it serves
            # (``decode_block``: same arithmetic; None for anything it was not written for).
            y = decode_block.step(self, x, cache, cache_start)
            if y is not None:
                return y  # (1, 1, C)
        pre = self.norm == "pre"
        # Each sub-layer f: x + f(LN(x)) with pre-norm, LN(x + f(x)) with post-norm.
        h, _ = self.self_attn(
            self.norm1(x) if pre else x, mask=mask, is_causal=is_causal, positions=positions,
            key_positions=key_positions, cache=cache, cache_start=cache_start,
        )  # (B, T, C)
        x = x + apply_dropout(self.dropout1, h)
        if not pre:
            x = self.norm1(x)
        if self.cross_attn is not None:
            if context is None:
                raise ValueError("this block has cross-attention: pass context (B, S, C)")
            h, _ = self.cross_attn(self.norm_cross(x) if pre else x, context,
                                   mask=context_mask)  # (B, T, C)
            x = x + apply_dropout(self.dropout_cross, h)
            if not pre:
                x = self.norm_cross(x)
        x = x + apply_dropout(self.dropout2, self.ffn(self.norm2(x) if pre else x))  # (B, T, C)
        return x if pre else self.norm2(x)
