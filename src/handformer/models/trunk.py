"""The one trunk every handformer model is built from:

    ids (B, T) ─▶ TokenEmbedding ─▶ N × TransformerBlock ─▶ final norm ─▶ [head] ─▶ (B, T, ·)

``DecoderLM``, the ``Encoder`` and the encoder–decoder's ``Decoder`` are this trunk with
different masks and inputs: the decoder LM runs it causally and ends in the vocabulary head,
the encoder runs it bidirectionally and returns hidden states, the seq2seq decoder adds
cross-attention to every block. Writing embed → blocks → norm → head once means a lever
(``layer_norm_eps``, ``norm_type``, ``logit_softcap``, tied weights, positions) means the same
thing in every model that accepts it. The trunk is a base class, not a submodule, so the
parameter names (``embed.*``, ``blocks.N.*``, ``final_norm.*``, ``lm_head.*``) stay those every
checkpoint and converter uses.

Shape legend: ``B`` batch, ``T`` new tokens, ``S`` keys (cached + new) or context length,
``C`` model dim, ``V`` vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from handformer.config import ModelConfig
from handformer.models.embedding import TokenEmbedding
from handformer.models.stack import build_blocks
from handformer.nn import decode_block
from handformer.nn.init import init_weights
from handformer.nn.kv_cache import DecoderCache
from handformer.nn.norm import make_norm

__all__ = ["Trunk"]


class Trunk(nn.Module):
    """Embedding, ``config.n_layers`` blocks, the final norm and (``head=True``) the output head.

    ``final_norm=None`` follows the norm placement: pre-norm leaves the residual stream
    un-normalised and needs a last norm, post-norm blocks already end in one; the
    encoder–decoder asks for one either way, as ``nn.Transformer`` builds it. The head is
    bias-free and tied to the token embedding when ``config.tie_weights``; with
    ``config.logit_softcap`` > 0 logits become ``cap·tanh(logits/cap)``.
    """

    def __init__(self, config: ModelConfig, *, cross_attention: bool = False,
                 final_norm: bool | None = None, head: bool = True) -> None:
        super().__init__()
        self.config = config
        c = config
        self.embed = TokenEmbedding(c)
        self.blocks = build_blocks(c, cross_attention=cross_attention)
        use_norm = c.norm == "pre" if final_norm is None else final_norm
        self.final_norm: nn.Module = (
            make_norm(c.norm_type, c.d_model, eps=c.layer_norm_eps, bias=c.bias)
            if use_norm else nn.Identity()
        )
        self.lm_head: nn.Linear | None = None
        if head:
            self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
            if c.tie_weights:
                self.lm_head.weight = self.embed.token.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation (``handformer.nn.init``); zeroed output projections when
        ``config.zero_init_out``."""
        init_weights(self, self.config.n_layers, zero_out=self.config.zero_init_out)

    def run_blocks(
        self,
        x: Tensor,
        *,
        mask: Tensor | None,
        is_causal: bool,
        positions: Tensor | None,
        key_positions: Tensor | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        cache: DecoderCache | None = None,
        cache_start: int = 0,
    ) -> Tensor:
        """x (B, T, C) → every block, then the final norm → (B, T, C). ``positions`` are the
        queries' (read by RoPE / ALiBi; ``None`` = 0..T-1), ``key_positions`` the keys'
        (default: the same); ``cache`` holds each block's self-attention keys and values."""
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)  # (T,)
        if key_positions is None:
            key_positions = positions
        if cache is not None and mask is None and context is None and not self.training \
                and x.shape[0] == 1 and x.shape[1] == 1:
            # One token of one request: every block in one kernel call where it serves them
            # all (``decode_block.stack_step``); else block by block, each of which may
            # still take the kernel alone.
            y = decode_block.stack_step(self.blocks, x, cache.layers, cache_start)
            if y is not None:
                return self.final_norm(y)  # (1, 1, C)
        for i, block in enumerate(self.blocks):
            x = block(
                x, mask=mask, is_causal=is_causal, positions=positions,
                key_positions=key_positions, context=context, context_mask=context_mask,
                cache=None if cache is None else cache.layers[i], cache_start=cache_start,
            )  # (B, T, C)
        return self.final_norm(x)  # (B, T, C)

    def head_logits(self, hidden: Tensor) -> Tensor:
        """hidden (B, T, C) → logits (B, T, V), soft-capped when ``config.logit_softcap``."""
        assert self.lm_head is not None, "this trunk was built without a head"
        logits = self.lm_head(hidden)  # (B, T, V)
        cap = self.config.logit_softcap
        # Soft-capping squashes each logit smoothly into (-cap, cap); generate samples from
        # this same forward, so training and decoding see the same capped logits.
        return logits if cap == 0.0 else cap * torch.tanh(logits / cap)  # (B, T, V)
