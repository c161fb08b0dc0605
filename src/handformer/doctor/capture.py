"""Looking inside attention without changing the model's code.

``capture_attention`` temporarily replaces each ``MultiHeadAttention``'s ``forward`` with a
wrapper that asks the layer for its weights (``need_weights=True``, which always runs the
readable manual kernel) and records them with the layer's input. ``forced_attention_kind``
temporarily switches every layer to one kernel. Both put the model back exactly as it was,
even if the forward pass raises — the doctor must leave no trace on the patient.

Shape legend: ``B`` batch, ``H`` heads, ``T`` query length, ``S`` key length, ``C`` model dim.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from handformer.nn.attention import MultiHeadAttention

__all__ = ["AttentionRecord", "attention_modules", "capture_attention", "forced_attention_kind"]

_SENTINEL = object()


@dataclass
class AttentionRecord:
    """One attention call: who, on what input, with which weights."""

    name: str
    module: MultiHeadAttention
    x: Tensor  # (B, T, C) the layer's input (after any pre-norm)
    weights: Tensor | None  # (B, H, T, S); None if the layer would not return them
    self_attention: bool
    kwargs: dict[str, Any] = field(default_factory=dict)  # positions, mask, is_causal, …


def attention_modules(model: nn.Module) -> dict[str, MultiHeadAttention]:
    return {n: m for n, m in model.named_modules() if isinstance(m, MultiHeadAttention)}


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, Tensor) else value


@contextmanager
def capture_attention(model: nn.Module) -> Iterator[list[AttentionRecord]]:
    """Record every attention layer's weights during the forward passes inside the block."""
    records: list[AttentionRecord] = []
    saved: list[tuple[MultiHeadAttention, Any]] = []

    def make_wrapper(name: str, module: MultiHeadAttention, original: Any) -> Any:
        def forward(x: Tensor, context: Tensor | None = None, *,
                    need_weights: bool = False, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
            out, weights = original(x, context, need_weights=True, **kwargs)
            records.append(AttentionRecord(
                name, module, x.detach(), None if weights is None else weights.detach(),
                context is None, {k: _detach(v) for k, v in kwargs.items() if k != "cache"}))
            return out, (weights if need_weights else None)

        return forward

    try:
        for name, module in attention_modules(model).items():
            saved.append((module, module.__dict__.get("forward", _SENTINEL)))
            module.forward = make_wrapper(name, module, module.forward)  # type: ignore[method-assign]
        yield records
    finally:
        for module, previous in saved:
            if previous is _SENTINEL:
                del module.forward
            else:
                module.forward = previous  # type: ignore[method-assign]


@contextmanager
def forced_attention_kind(model: nn.Module, kind: str) -> Iterator[int]:
    """Run every ``MultiHeadAttention`` with kernel ``kind``; yields how many were switched."""
    modules = list(attention_modules(model).values())
    previous = [m.attention for m in modules]
    try:
        for m in modules:
            m.attention = kind
        yield len(modules)
    finally:
        for m, kind_before in zip(modules, previous, strict=True):
            m.attention = kind_before


def captured_forward(subject: Any, ids: Tensor, padding_mask: Tensor | None = None
                     ) -> tuple[Tensor, list[AttentionRecord]]:
    """logits (B, T, V) and the attention records of one no-grad forward pass."""
    with torch.no_grad(), capture_attention(subject.model) as records:
        logits = subject.forward(ids, padding_mask)
    return logits, records
