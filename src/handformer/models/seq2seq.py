"""EncoderDecoder: the original Transformer (Vaswani et al., 2017), from handformer's block.

    src (B, S) ─▶ Encoder (bidirectional, source padding mask) ─▶ memory (B, S, C)
    tgt (B, T) ─▶ Decoder: N × [causal self-attention ▶ cross-attention to memory ▶ FFN]
                 ─▶ LayerNorm ─▶ linear head ─▶ logits (B, T, V)

The cross-attention of every decoder block reads the encoder output through the *source*
padding mask, so no target position ever attends to a padded source position. Both stacks
end in a LayerNorm whatever the norm placement, as ``nn.Transformer`` builds them (for
post-norm that last norm is one more affine LayerNorm after the block's own: harmless, and
it keeps the two models the same function, which the parity tests check).

Training is teacher forcing: the decoder reads ``<bos> y1 … y(n-1)`` and is scored on
``y1 … yn <eos>``; the causal mask keeps each position from seeing its own answer.
``greedy_decode`` runs the encoder once; then, with its KV cache (the default), the
decoder's ``forward`` takes one new token per step and its self-attention reads the cached
keys and values of the earlier ones, while the cross-attention reads the fixed encoder
memory. ``use_cache=False`` re-runs the decoder over the whole prefix each step instead (the
same tokens, O(T²) work).

Shape legend: ``B`` batch, ``S`` source length, ``T`` target length, ``C`` model dim,
``V`` target vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from handformer.config import ModelConfig, Seq2SeqConfig
from handformer.masks import check_padding_mask, combine_masks
from handformer.models.budget import check_model_fits
from handformer.models.embedding import check_ids
from handformer.models.encoder import Encoder
from handformer.models.stack import make_cache
from handformer.models.trunk import Trunk
from handformer.nn.kv_cache import DecoderCache

__all__ = ["Decoder", "EncoderDecoder", "greedy_decode"]


class Decoder(Trunk):
    """Target embedding → N × block(causal self-attn, cross-attn, FFN) → norm → head: the
    shared ``Trunk`` with cross-attention, and a final norm whatever the norm placement (as
    ``nn.Transformer`` builds it)."""

    def __init__(self, config: ModelConfig) -> None:
        check_model_fits(config, "Decoder")  # before torch allocates anything
        super().__init__(config, cross_attention=True, final_norm=True)

    def forward(
        self,
        ids: Tensor,
        memory: Tensor,
        *,
        padding_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cache: DecoderCache | None = None,
    ) -> Tensor:
        """ids (B, T); memory (B, S, C); masks (B, T) / (B, S) bool, True on real tokens.
        With ``cache`` (from ``make_cache``), ``ids`` are the new target tokens only, after
        the cached ones (target padding is not supported there). Returns logits (B, T, V)."""
        check_ids(ids, padding_mask, self.config.vocab_size, "Decoder")
        if memory.dim() != 3 or memory.shape[0] != ids.shape[0]:
            raise ValueError(f"Decoder expects memory (B, S, C) with B = {ids.shape[0]}; got "
                             f"{tuple(memory.shape)}")
        if memory_mask is not None:
            check_padding_mask(memory_mask, tuple(memory.shape[:2]), "Decoder", "memory_mask")
        if cache is not None:
            if padding_mask is not None:
                raise ValueError("cached decoding takes no target padding_mask")
            positions, start = cache.append_tokens(None, ids.shape[1])
            x, _ = self.embed(ids, positions=positions)  # (B, T, C)
            key_positions = cache.key_positions[:, : start + ids.shape[1]]  # (B, S_tgt)
            hidden = self.decode_embedded(x, memory, None, memory_mask, positions,
                                          cache=cache, cache_start=start,
                                          key_positions=key_positions)
            cache.commit(ids.shape[1])
            return self.head_logits(hidden)  # (B, T, V)
        x, positions = self.embed(ids, padding_mask)  # (B, T, C)
        hidden = self.decode_embedded(x, memory, padding_mask, memory_mask, positions)
        return self.head_logits(hidden)  # (B, T, V)

    def make_cache(self, batch_size: int, max_len: int | None = None) -> DecoderCache:
        """KV buffers for the decoder's self-attention (the encoder memory is fixed), for up
        to ``max_len`` target tokens (default: the decoder's ``max_len``); see
        ``handformer.models.stack.make_cache``."""
        return make_cache(self, self.config, batch_size, max_len)

    def decode_embedded(
        self,
        x: Tensor,
        memory: Tensor,
        padding_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        positions: Tensor | None = None,
        *,
        cache: DecoderCache | None = None,
        cache_start: int = 0,
        key_positions: Tensor | None = None,
    ) -> Tensor:
        """The block stack alone: x (B, T, C), memory (B, S, C) → hidden (B, T, C)."""
        # Self-attention: causal, plus the target padding on the keys when there is any.
        self_mask = None if padding_mask is None else combine_masks(padding_mask)  # (B,1,1,T)
        # Cross-attention: every target query sees the real source tokens only.
        cross_mask = None if memory_mask is None else combine_masks(memory_mask)  # (B,1,1,S)
        return self.run_blocks(x, mask=self_mask, is_causal=True, positions=positions,
                               key_positions=key_positions, context=memory,
                               context_mask=cross_mask, cache=cache, cache_start=cache_start)


class EncoderDecoder(nn.Module):
    """``forward(src, tgt, src_mask=None, tgt_mask=None) -> logits (B, T, V)``."""

    def __init__(self, config: Seq2SeqConfig) -> None:
        check_model_fits(config, "EncoderDecoder")  # both halves together
        super().__init__()
        self.config = config
        self.encoder = Encoder(config.encoder, final_norm=True)
        self.decoder = Decoder(config.decoder)

    def num_parameters(self) -> int:
        """Parameter count (a tied weight counted once)."""
        return sum(p.numel() for p in self.parameters())

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """src (B, S) → memory (B, S, C). Run once per source, reused at every decode step."""
        return self.encoder(src, src_mask)

    def decode(
        self, tgt: Tensor, memory: Tensor, src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
    ) -> Tensor:
        """tgt (B, T), memory (B, S, C) → logits (B, T, V)."""
        return self.decoder(tgt, memory, padding_mask=tgt_mask, memory_mask=src_mask)

    def forward(
        self, src: Tensor, tgt: Tensor, src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
    ) -> Tensor:
        """src (B, S), tgt (B, T) long; masks (B, S) / (B, T) bool, True on real tokens.
        Returns logits (B, T, V) for teacher forcing."""
        if src.dim() == 2 and tgt.dim() == 2 and src.shape[0] != tgt.shape[0]:
            raise ValueError(f"src and tgt batch sizes differ: src {tuple(src.shape)}, "
                             f"tgt {tuple(tgt.shape)}")
        return self.decode(tgt, self.encode(src, src_mask), src_mask, tgt_mask)


@torch.no_grad()
def greedy_decode(
    model: EncoderDecoder,
    src: Tensor,
    src_mask: Tensor | None = None,
    *,
    bos_id: int,
    eos_id: int,
    max_new_tokens: int,
    pad_id: int = 0,
    use_cache: bool = True,
) -> Tensor:
    """Argmax decoding. Returns (B, N ≤ max_new_tokens) ids after ``<bos>``; a row that
    has produced ``<eos>`` keeps it and is padded with ``pad_id`` afterwards.

    The encoder runs once. With ``use_cache`` the decoder's self-attention keys and values
    are kept in a KV cache and each step feeds one token; without it the decoder is re-run
    over the whole prefix (same tokens, slower). Stops early when every row has finished.
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive; got {max_new_tokens}")
    was_training = model.training
    model.eval()
    memory = model.encode(src, src_mask)  # (B, S, C)
    b = src.shape[0]
    out = torch.full((b, 1), bos_id, dtype=torch.long, device=src.device)  # (B, 1)
    done = torch.zeros(b, dtype=torch.bool, device=src.device)  # (B,)
    cache = model.decoder.make_cache(b, max_new_tokens + 1) if use_cache else None
    for _ in range(max_new_tokens):
        if cache is None:
            logits = model.decode(out, memory, src_mask)[:, -1]  # (B, V)
        else:
            logits = model.decoder(out[:, -1:], memory, memory_mask=src_mask,
                                   cache=cache)[:, -1]  # (B, V)
        nxt = logits.argmax(dim=-1).masked_fill(done, pad_id)  # (B,)
        out = torch.cat([out, nxt[:, None]], dim=1)  # (B, t + 1)
        done |= nxt == eos_id
        if bool(done.all()):
            break
    model.train(was_training)
    return out[:, 1:]  # (B, N)
