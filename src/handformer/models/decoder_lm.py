"""DecoderLM: a GPT-style causal language model built from handformer's pieces.

ids (B, T) → TokenEmbedding (+ positions) → N × TransformerBlock (causal) → [final norm] →
linear head → logits (B, T, V): the shared ``Trunk`` (``models/trunk.py``) run causally. The
model returns logits; losses live in ``handformer.loss``.

For decoding, ``make_cache`` builds a ``DecoderCache`` that the caller passes back into
``forward``: the cache is explicit state, never hidden on the module. A decoding step is
``forward`` itself with one new token per row — there is no second, hand-kept copy of the
model for speed. (A block of an int8 model may run one request's step as one C call,
``nn.decode_block``: a kernel of that block's own arithmetic, tested equal to its modules,
which steps aside whenever a hook or a capture watches a module — so hooks and attention
captures still see every step.) What keeps the step lean:
``validate=False`` for ids the caller produced (``generate``'s own samples), no causal mask
for a lone query at the end of the keys, and no key mask unless the cache holds padding.

Shape legend: ``B`` batch, ``T`` new tokens, ``S`` cached + new tokens, ``C`` model dim,
``V`` vocabulary.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from handformer.config import ModelConfig
from handformer.masks import combine_masks
from handformer.models.budget import check_model_fits
from handformer.models.embedding import check_ids, positions_from_padding
from handformer.models.stack import make_cache
from handformer.models.trunk import Trunk
from handformer.nn import decode_block
from handformer.nn.kv_cache import DecoderCache

__all__ = ["DecoderLM", "positions_from_padding"]  # the latter re-exported from embedding

# Parameter names before the embedding moved into ``models/embedding.py`` → today's names, so
# checkpoints and run folders written before still load.
_LEGACY_KEYS = {"token_embedding.weight": "embed.token.weight",
                "positions.table.weight": "embed.positions.table.weight"}


def _rename_legacy_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                        *args: Any) -> None:
    for old, new in _LEGACY_KEYS.items():
        if prefix + old in state_dict and prefix + new not in state_dict:
            state_dict[prefix + new] = state_dict.pop(prefix + old)


class DecoderLM(Trunk):
    """Causal language model. ``forward(ids, padding_mask=None) -> logits (B, T, V)``.

    Built from a ``ModelConfig``: the shared ``TokenEmbedding`` (token vectors, the
    ``positional`` kind, the √C scale for sinusoidal positions), ``n_layers`` causal
    ``TransformerBlock``s, a final LayerNorm for pre-norm stacks and a linear head, tied to
    the token embedding when ``tie_weights`` (the default). ``ids`` are (B, T) long;
    ``padding_mask`` is (B, T) bool, True on real tokens (left or right padding; position
    ids then count real tokens only). Returns logits, never a loss (see ``lm_loss``).

    For decoding, ``make_cache(B)`` builds a KV cache that ``forward(..., cache=cache)``
    takes explicitly (``generate`` does this): the same ``forward``, one token per step.
    ``forward`` raises ``ValueError`` for ids that are not (B, T) integers, ids outside
    [0, vocab_size), or a padding mask that is not bool (B, T); learned positions raise
    ``ValueError`` past ``max_len`` (the two value checks run in eager calls; while torch
    traces the model — export, ONNX, ``torch.compile`` — they are left out, see
    ``check_ids``). A config whose weights cannot fit in memory is refused
    with ``MemoryBudgetError`` before anything is allocated (``models.budget``).
    """

    def __init__(self, config: ModelConfig) -> None:
        check_model_fits(config, "DecoderLM")  # MemoryBudgetError before torch allocates
        super().__init__(config)
        self._alibi = config.positional == "alibi"
        self.register_load_state_dict_pre_hook(_rename_legacy_keys)

    def num_parameters(self, *, exclude_positions: bool = False) -> int:
        """Parameter count (a tied head counted once), optionally without the position table."""
        total = sum(p.numel() for p in self.parameters())
        positions = self.embed.positions
        if exclude_positions and positions is not None:
            total -= sum(p.numel() for p in positions.parameters())
        return total

    def make_cache(self, batch_size: int, max_len: int | None = None) -> DecoderCache:
        """Preallocated KV buffers for ``batch_size`` rows and up to ``max_len`` tokens
        (default: the model's window); see ``handformer.models.stack.make_cache``."""
        return make_cache(self, self.config, batch_size, max_len)

    def forward(
        self,
        ids: Tensor,
        padding_mask: Tensor | None = None,
        *,
        cache: DecoderCache | None = None,
        validate: bool = True,
    ) -> Tensor:
        """ids (B, T) long; ``padding_mask`` (B, T) bool, True on real tokens (left or right
        padding). With ``cache``, ``ids`` are the *new* tokens, appended after the cached
        ones. Returns logits (B, T, V).

        ``validate=False`` skips the input checks (``check_ids``: shapes, dtypes and the id
        range, which reads the ids back to the host). It is for callers that checked the
        ids already or produced them themselves — ``generate`` validates the prompt once and
        feeds its own sampled tokens unchecked; a bad id then fails inside the embedding
        with a less helpful message.
        """
        if validate:
            check_ids(ids, padding_mask, self.config.vocab_size, "DecoderLM",
                      allow_empty_rows=True)
        t = ids.shape[1]
        cache_start = 0
        if cache is not None:
            if (t == 1 and padding_mask is None and type(cache) is DecoderCache
                    and not cache.has_padding):
                # One real token of one request: the whole token in one C call where the
                # kernel serves this model (``decode_block.token_step``; without padding a
                # token's position is its column). Else the modules below.
                logits = decode_block.token_step(self, ids, cache.layers, cache.length)
                if logits is not None:
                    cache.add_decoded_token()
                    return logits  # (1, 1, V)
            positions, cache_start = cache.append_tokens(padding_mask, t)  # (B, T)
            end = cache_start + t
            # Only ALiBi reads the keys' positions (RoPE rotated each key when it was cached).
            key_positions = cache.key_positions[:, :end] if self._alibi else None  # (B, S)
            # Only padding needs a key mask; a fully real cache attends everywhere (and one
            # new query at the end of the keys needs no causal mask either).
            mask = combine_masks(cache.key_mask[:, :end]) if cache.has_padding else None
        elif padding_mask is None:
            positions = None  # the embedding counts 0..T-1
            mask = None  # plain causal attention: lets the fused kernel take its fastest path
        else:
            positions = positions_from_padding(padding_mask)  # (B, T)
            mask = combine_masks(padding_mask)  # (B, 1, 1, T)

        x, positions = self.embed(ids, positions=positions)  # (B, T, C); (T,) or (B, T)
        if cache is None:
            key_positions = positions
        hidden = self.run_blocks(x, mask=mask, is_causal=True, positions=positions,
                                 key_positions=key_positions, cache=cache,
                                 cache_start=cache_start)  # (B, T, C)
        if cache is not None:
            cache.commit(t)
        return self.head_logits(hidden)  # (B, T, V)
