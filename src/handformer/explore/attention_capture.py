"""Every self-attention layer's weights *and the mask it applied*, for one forward pass.

Fast kernels (``attention="sdpa"`` / ``"tiled"``) never build the (T, S) weight matrix.
``handformer.doctor.capture.capture_attention`` wraps each ``MultiHeadAttention.forward``
for the duration of a ``with`` block so that it runs with ``need_weights=True`` (the manual
reference kernel, for that call only) and removes the wrappers on exit, even when the pass
raises: no attribute, hook or tensor stays on the model. The explorer reuses that one
wrapper rather than keeping a second copy, and adds what a picture needs: the layers in
order, and for each call the boolean mask the layer applied — rebuilt from the call's own
``mask`` / ``is_causal`` arguments, so the view shows what the model did, not what the
explorer assumes.

Shape legend: ``B`` batch, ``H`` heads, ``T`` query length, ``S`` key length.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from handformer.doctor.capture import AttentionRecord as _Call
from handformer.doctor.capture import capture_attention as _capture
from handformer.masks import causal_mask
from handformer.nn.attention import MultiHeadAttention

__all__ = ["AttentionRecord", "AttentionRecorder", "capture_attention", "self_attention_names"]


@dataclass(frozen=True)
class AttentionRecord:
    """One call of one attention layer.

    ``weights`` (B, H, T, S): softmax weights, exactly 0 where not allowed.
    ``allowed`` (B, H, T, S) bool: the mask the layer applied (padding & causal), ``True`` =
    may attend.
    """

    name: str
    weights: Tensor
    allowed: Tensor


def self_attention_names(model: nn.Module) -> list[str]:
    """Names of the self-attention modules of ``model``, in layer order."""
    return [name for name, module in model.named_modules()
            if isinstance(module, MultiHeadAttention) and name.split(".")[-1] == "self_attn"]


def allowed_mask(weights: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
    """The mask a call applied, as (B, H, T, S) bool (an expanded view: no copy per head)."""
    b, h, t, s = weights.shape
    allowed = torch.ones(b, 1, t, s, dtype=torch.bool, device=weights.device)  # (B, 1, T, S)
    if mask is not None:
        allowed = allowed & mask  # broadcasts (T, S), (B, 1, 1, S), (B, 1|H, T, S)
    if is_causal:
        allowed = allowed & causal_mask(t, s, device=weights.device)  # (B, 1|H, T, S)
    return allowed.expand(b, h, t, s)  # (B, H, T, S)


class AttentionRecorder:
    """What a ``capture_attention`` block saw, by layer name, in call order."""

    def __init__(self, calls: list[_Call]) -> None:
        self._calls = calls  # filled by the doctor's wrapper during the forward pass

    @property
    def names(self) -> list[str]:
        """Layers that were called, each once, in first-call order."""
        return list(dict.fromkeys(call.name for call in self._calls))

    def all(self, name: str) -> list[AttentionRecord]:
        return [self._convert(c) for c in self._calls if c.name == name]

    def last(self, name: str) -> AttentionRecord:
        """The latest call of layer ``name``; ``KeyError`` if it was never called."""
        for call in reversed(self._calls):
            if call.name == name:
                return self._convert(call)
        raise KeyError(f"attention layer {name!r} was not called inside the capture "
                       f"(called: {self.names})")

    @staticmethod
    def _convert(call: _Call) -> AttentionRecord:
        if call.weights is None:  # handformer's MultiHeadAttention always returns them
            raise RuntimeError(f"attention layer {call.name!r} returned no weights")
        mask = call.kwargs.get("mask")
        allowed = allowed_mask(call.weights, mask, bool(call.kwargs.get("is_causal", False)))
        return AttentionRecord(call.name, call.weights, allowed)


@contextmanager
def capture_attention(model: nn.Module) -> Iterator[AttentionRecorder]:
    """Inside the block, every ``MultiHeadAttention`` of ``model`` records its weights and
    mask into the yielded recorder; the model is restored on exit."""
    with _capture(model) as calls:
        yield AttentionRecorder(calls)
