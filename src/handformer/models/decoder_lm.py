"""DecoderLM: a GPT-style causal language model built from handformer's pieces.

ids (B, T) → token embedding (+ positions) → N × TransformerBlock (causal) → [LayerNorm] →
linear head → logits (B, T, V). The model returns logits; losses live in ``handformer.loss``.

For decoding, ``make_cache`` builds a ``DecoderCache`` that the caller passes back into
``forward``: the cache is explicit state, never hidden on the module.

Shape legend: ``B`` batch, ``T`` new tokens, ``S`` cached + new tokens, ``C`` model dim,
``V`` vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from handformer.config import ModelConfig
from handformer.masks import combine_masks
from handformer.models.stack import build_blocks
from handformer.nn.dropout import apply_dropout
from handformer.nn.init import init_weights
from handformer.nn.kv_cache import DecoderCache
from handformer.nn.positional import build_positional

__all__ = ["DecoderLM", "positions_from_padding"]


def positions_from_padding(padding_mask: Tensor) -> Tensor:
    """Position ids that count only real tokens: (B, T) bool → (B, T) long.

    A left-padded row ``[pad, pad, a, b]`` gets positions ``[0, 0, 0, 1]``, so a prompt has
    the same positions however much padding precedes it; right padding leaves 0..n-1.
    """
    return (padding_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


class DecoderLM(nn.Module):
    """Causal language model. ``forward(ids, padding_mask=None) -> logits (B, T, V)``.

    Built from a ``ModelConfig``: token embedding (+ the ``positional`` kind), ``n_layers``
    causal ``TransformerBlock``s, a final LayerNorm for pre-norm stacks and a linear head,
    tied to the embedding when ``tie_weights`` (the default). ``ids`` are (B, T) long;
    ``padding_mask`` is (B, T) bool, True on real tokens (left or right padding; position
    ids then count real tokens only). Returns logits, never a loss (see ``lm_loss``).

    For decoding, ``make_cache(B)`` builds a KV cache that ``forward(..., cache=cache)``
    takes explicitly (``generate`` does this). ``forward`` raises ``ValueError`` for ids that
    are not (B, T) integers, ids outside [0, vocab_size), or a padding mask of another shape;
    learned positions raise ``ValueError`` past ``max_len``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.token_embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.positions = build_positional(c.positional, c.d_model, c.max_len)  # None: in attn
        # Sinusoidal values are O(1) while embeddings start at std 0.02: scale the embeddings
        # by √C as in the original paper so the tokens are not drowned out.
        self.embed_scale = math.sqrt(c.d_model) if c.positional == "sinusoidal" else 1.0
        self.dropout = nn.Dropout(c.dropout)
        self.blocks = build_blocks(c)
        # Pre-norm leaves the residual stream un-normalised, so it needs a final LayerNorm;
        # post-norm blocks already end in one.
        self.final_norm: nn.Module = (
            nn.LayerNorm(c.d_model, eps=c.layer_norm_eps, bias=c.bias) if c.norm == "pre"
            else nn.Identity()
        )
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_weights:
            self.lm_head.weight = self.token_embedding.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation (``handformer.nn.init``)."""
        init_weights(self, self.config.n_layers)

    def num_parameters(self, *, exclude_positions: bool = False) -> int:
        """Parameter count (a tied head counted once), optionally without the position table."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_positions and self.positions is not None:
            total -= sum(p.numel() for p in self.positions.parameters())
        return total

    def make_cache(self, batch_size: int, max_len: int | None = None) -> DecoderCache:
        """Preallocated KV buffers for ``batch_size`` rows and up to ``max_len`` tokens
        (default: the model's window). Keys/values are stored once per KV head, so
        grouped-query attention shrinks the cache by ``n_heads / n_kv_heads``."""
        c = self.config
        param = next(self.parameters())
        return DecoderCache(c.n_layers, batch_size, c.n_kv_heads, max_len or c.max_len,
                            c.head_dim, dtype=param.dtype, device=param.device)

    def _check_inputs(self, ids: Tensor, padding_mask: Tensor | None) -> None:
        if ids.dim() != 2:
            raise ValueError(f"DecoderLM expects ids of shape (B, T); got {tuple(ids.shape)}")
        if ids.dtype not in (torch.long, torch.int32):
            raise ValueError(f"ids must be an integer tensor; got {ids.dtype}")
        if padding_mask is not None and padding_mask.shape != ids.shape:
            raise ValueError(
                f"padding_mask shape {tuple(padding_mask.shape)} != ids shape {tuple(ids.shape)};"
                " expected (B, T) bool with True on real tokens"
            )
        vocab = self.config.vocab_size
        if ids.numel():
            lo, hi = (int(v) for v in torch.aminmax(ids))  # one pass, one sync
            if lo < 0 or hi >= vocab:
                raise ValueError(
                    f"token ids must lie in [0, {vocab}); got min {lo}, max {hi} — was the "
                    "tokenizer built for this model?"
                )

    def forward(
        self,
        ids: Tensor,
        padding_mask: Tensor | None = None,
        *,
        cache: DecoderCache | None = None,
    ) -> Tensor:
        """ids (B, T) long; ``padding_mask`` (B, T) bool, True on real tokens (left or right
        padding). With ``cache``, ``ids`` are the *new* tokens, appended after the cached
        ones. Returns logits (B, T, V)."""
        self._check_inputs(ids, padding_mask)
        t = ids.shape[1]
        cache_start = 0
        if cache is not None:
            new_mask = None if padding_mask is None else padding_mask.bool()
            positions, cache_start = cache.append_tokens(new_mask, t)  # (B, T)
            key_mask = cache.key_mask[:, : cache_start + t]  # (B, S)
            key_positions = cache.key_positions[:, : cache_start + t]  # (B, S)
            # Only padding needs a key mask; a fully real cache attends everywhere.
            mask = combine_masks(key_mask) if cache.has_padding else None  # (B, 1, 1, S)
        elif padding_mask is None:
            positions = torch.arange(t, device=ids.device)  # (T,)
            key_positions = positions
            mask = None  # plain causal attention: lets the fused kernel take its fastest path
        else:
            positions = positions_from_padding(padding_mask)  # (B, T)
            key_positions = positions
            mask = combine_masks(padding_mask.bool())  # (B, 1, 1, T)

        x = self.token_embedding(ids)  # (B, T, C)
        if self.embed_scale != 1.0:  # a ×1 would cost a (B, T, C) pass forward and backward
            x = x * self.embed_scale
        if self.positions is not None:
            x = x + self.positions(positions).to(x.dtype)  # (B, T, C)
        x = apply_dropout(self.dropout, x)
        for i, block in enumerate(self.blocks):
            x = block(
                x, mask=mask, is_causal=True, positions=positions, key_positions=key_positions,
                cache=None if cache is None else cache.layers[i], cache_start=cache_start,
            )  # (B, T, C)
        if cache is not None:
            cache.commit(t)
        return self.lm_head(self.final_norm(x))  # (B, T, V)

    def decode_step(self, ids: Tensor, cache: DecoderCache) -> Tensor:
        """One decoding step: ``ids`` (B, 1) holds one new real token per row, appended
        after the cached ones. Returns the next-token logits (B, V).

        The same numbers as ``forward(ids, cache=cache)[:, -1]`` (the tests hold them
        equal), leaner for the per-token loop of ``generate``: the ids are the model's own
        output, so they are not validated again; no causal mask, and a key mask only when
        the cache holds padding; layers applied as plain functions of their weights (no
        module calls, so no hooks). Inference only (no dropout); prefill with ``forward``.
        """
        if self.training:
            raise ValueError("decode_step is for inference; call model.eval() first")
        positions, start = cache.append_step()  # (B, 1)
        x = F.embedding(ids, self.token_embedding.weight)  # (B, 1, C)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        if self.positions is not None:
            x = x + self.positions.forward(positions).to(x.dtype)  # (B, 1, C)
        key_positions = cache.key_positions[:, : start + 1]  # (B, S)
        mask = combine_masks(cache.key_mask[:, : start + 1]) if cache.has_padding else None
        for block, layer_cache in zip(self.blocks, cache.layers, strict=True):
            x = block.decode_step(x, layer_cache, start, positions, key_positions, mask)
        cache.commit(1)
        x = self.final_norm.forward(x[:, -1])  # (B, C)
        return F.linear(x, self.lm_head.weight)  # (B, V)
