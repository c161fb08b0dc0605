"""A functional view of the KV cache, so that a cached decoding step can be exported.

``DecoderCache`` (``handformer.nn.kv_cache``) is state: preallocated buffers written in place
at a Python-int offset. An exported graph needs the opposite — the past keys and values come
in as an input and the extended ones go out as an output, so that a runtime (onnxruntime, a
browser, a phone) holds the state between calls. ``FunctionalCache`` offers the few members
``DecoderLM.forward`` uses of a ``DecoderCache`` and builds everything from its input:

* each layer's ``update`` concatenates the past and the new keys/values (no buffer) and
  keeps the result as that layer's ``present``;
* positions continue after the past (``past_length + 0..T-1``); every column is a real token
  (no padding), so no key mask is needed.

``CachedStep`` wraps a ``DecoderLM``: ``(input_ids, past) → (logits, present)``. It runs the
model's own ``forward`` — no second copy of the layers — with this cache passed in.

Shape legend: ``L`` layers, ``B`` batch, ``Hkv`` key/value heads, ``P`` past tokens, ``T`` new
tokens, ``D`` head dim, ``V`` vocabulary. ``past`` is (L, B, 2·Hkv, P, D): each layer's keys
in heads [0, Hkv) and values in [Hkv, 2·Hkv), the order ``KVCache.update`` takes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from handformer.models.decoder_lm import DecoderLM

__all__ = ["CachedStep", "FunctionalCache", "empty_past"]


class _PastLayer:
    """One layer's past keys/values; ``update`` returns them extended by the new ones."""

    row_spans = None  # every row holds the same columns: one attention call for the batch

    def __init__(self, past: Tensor) -> None:
        self.past = past  # (B, 2·Hkv, P, D)
        self.present: Tensor | None = None

    def update(self, kv_new: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """kv_new (B, 2·Hkv, T, D) → keys and values of all P + T columns, (B, Hkv, S, D)
        each (``start`` is the past length, implied by ``past`` here)."""
        kv = torch.cat([self.past, kv_new], dim=2)  # (B, 2·Hkv, P + T, D)
        self.present = kv
        h = kv.shape[1] // 2
        return kv[:, :h], kv[:, h:]


class FunctionalCache:
    """What ``DecoderLM.forward`` reads of a ``DecoderCache``, built from ``past``
    (L, B, 2·Hkv, P, D) for one call."""

    has_padding = False  # every cached column is a real token

    def __init__(self, past: Tensor) -> None:
        self.layers = [_PastLayer(p) for p in past.unbind(0)]
        self.past_length = past.shape[3]
        self.key_positions: Tensor | None = None

    def append_tokens(self, new_mask: Tensor | None, t: int | None = None
                      ) -> tuple[Tensor, int]:
        """Positions (1, T) of T new real tokens, and the write offset (the past length)."""
        if new_mask is not None or t is None:
            raise ValueError("the exported cached step takes real tokens only (no padding "
                             "mask)")
        p = self.past_length
        device = self.layers[0].past.device
        self.key_positions = torch.arange(p + t, device=device)[None]  # (1, S), for ALiBi
        return (p + torch.arange(t, device=device))[None], p  # (1, T)

    def commit(self, t: int) -> None:
        """Nothing to do: each layer's ``present`` already holds the new columns."""

    def present(self) -> Tensor:
        """Every layer's keys and values after the call: (L, B, 2·Hkv, P + T, D)."""
        return torch.stack([layer.present for layer in self.layers])  # type: ignore[misc]


class CachedStep(nn.Module):
    """``(input_ids (B, T), past (L, B, 2·Hkv, P, D)) → (logits (B, T, V), present
    (L, B, 2·Hkv, P + T, D))``: one decoding call of ``model`` with the cache as data."""

    def __init__(self, model: DecoderLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, past: Tensor) -> tuple[Tensor, Tensor]:
        cache = FunctionalCache(past)
        logits = self.model(input_ids, cache=cache)  # type: ignore[arg-type]  # (B, T, V)
        return logits, cache.present()


def empty_past(model: DecoderLM, batch_size: int) -> Tensor:
    """The ``past`` of a first call: (L, B, 2·Hkv, 0, D) zeros-sized."""
    c = model.config
    return torch.zeros(c.n_layers, batch_size, 2 * c.n_kv_heads, 0, c.head_dim)
