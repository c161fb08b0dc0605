"""Looking inside attention without changing the model's code: the one capture mechanism.

The doctor (its mask, scale and position checks, its pictures) and the explorer (the
browser's heatmaps and KV-cache view) both need each attention layer's weights and the mask
it applied, for one forward pass of a model they did not write. Fast kernels
(``attention="sdpa"`` / ``"tiled"``) never form the (T, S) weight matrix, and storing weights
on ``self`` would be a hidden side effect in every forward, so instead:

* ``capture_attention(model)`` replaces each ``MultiHeadAttention``'s ``forward`` with a
  wrapper, for the duration of a ``with`` block only. The wrapper calls the layer's own
  ``forward`` with ``need_weights=True`` (which runs the readable manual kernel for that call:
  same scores, same mask, so any kernel's model yields the manual weights) and appends an
  ``AttentionRecord``; the caller still receives what it asked for. On exit — also when the
  forward raises — every wrapper is removed: no attribute, hook or tensor stays on the model.
* ``forced_attention_kind(model, kind)`` switches every layer to one kernel for a block and
  switches each back to its own kernel on exit, so two paths can be compared on one model.
* ``attention_modules`` / ``self_attention_names`` list layers in layer order (the order of
  ``named_modules``), the order a picture shows them in.

Each record carries the mask the call's own ``mask`` / ``is_causal`` arguments ask for
(``allowed``), rebuilt the way the kernels build it (causal end-aligned for a cached step), so
a view shows what the model was told rather than what the viewer assumes. A correct layer
applies exactly that mask; a broken one may not — compare ``weights > 0`` with ``allowed``.

Shape legend: ``B`` batch, ``H`` heads, ``T`` query length, ``S`` key length (cached keys
included), ``C`` model dim.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, overload

import torch
from torch import Tensor, nn

from handformer.masks import causal_mask
from handformer.nn.attention import ATTENTION_KINDS, MultiHeadAttention

__all__ = [
    "AttentionCapture",
    "AttentionRecord",
    "allowed_mask",
    "attention_modules",
    "capture_attention",
    "forced_attention_kind",
    "self_attention_names",
]

_NOT_SET = object()  # "the instance had no forward of its own": restore by deleting ours


@dataclass(frozen=True)
class AttentionRecord:
    """One call of one attention layer: who, on what input, with which weights and mask.

    ``x`` (B, T, C) is the layer's input (after any pre-norm), so a check can recompute the
    raw scores from the layer's own projections. ``weights`` (B, H, T, S) are the softmax
    weights, exactly 0 where not allowed. ``allowed`` (B, H, T, S) bool, ``True`` = may
    attend, is the mask the call's arguments ask for (an expanded view, no copy per head).
    ``kwargs`` are the call's keyword arguments (``mask``, ``is_causal``, ``positions``, …)
    minus the KV cache, which keeps changing after the call.
    """

    name: str
    module: MultiHeadAttention
    x: Tensor  # (B, T, C)
    weights: Tensor  # (B, H, T, S)
    allowed: Tensor  # (B, H, T, S) bool
    self_attention: bool  # False for cross-attention (the call passed a context)
    kwargs: dict[str, Any] = field(default_factory=dict)


class AttentionCapture(Sequence[AttentionRecord]):
    """The records of one ``capture_attention`` block, in call order, with look-ups by layer.

    A layer called several times (a prompt, then cached steps) has several records; ``last``
    gives the latest. A layer whose ``forward`` ignores ``need_weights`` (a subclass that
    overrides it) returns no weights and is listed in ``unweighted`` instead of recorded.
    """

    def __init__(self) -> None:
        self._records: list[AttentionRecord] = []
        self.unweighted: list[str] = []

    def _add(self, record: AttentionRecord) -> None:
        self._records.append(record)

    def __len__(self) -> int:
        return len(self._records)

    @overload
    def __getitem__(self, index: int) -> AttentionRecord: ...

    @overload
    def __getitem__(self, index: slice) -> list[AttentionRecord]: ...

    def __getitem__(self, index: int | slice) -> AttentionRecord | list[AttentionRecord]:
        return self._records[index]

    def __repr__(self) -> str:
        return f"AttentionCapture({len(self)} calls of {self.names})"

    @property
    def names(self) -> list[str]:
        """Layers that were recorded, each once, in first-call order."""
        return list(dict.fromkeys(r.name for r in self._records))

    def all(self, name: str) -> list[AttentionRecord]:
        """Every recorded call of layer ``name``, oldest first."""
        return [r for r in self._records if r.name == name]

    def last(self, name: str) -> AttentionRecord:
        """The latest call of layer ``name``; ``KeyError`` saying why when there is none."""
        for record in reversed(self._records):
            if record.name == name:
                return record
        if name in self.unweighted:
            raise KeyError(f"attention layer {name!r} returned no weights (its forward "
                           "ignores need_weights)")
        raise KeyError(f"attention layer {name!r} was not called inside the capture "
                       f"(called: {self.names})")


def attention_modules(model: nn.Module) -> dict[str, MultiHeadAttention]:
    """Every ``MultiHeadAttention`` of ``model`` (itself included) by name, in layer order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, MultiHeadAttention)}


def self_attention_names(model: nn.Module) -> list[str]:
    """Names of the self-attention layers of ``model``, in layer order.

    A layer only learns whether it attends to itself when it is called, so this reads the
    blocks' naming: ``self_attn`` (cross-attention is ``cross_attn``).
    """
    return [n for n in attention_modules(model) if n.split(".")[-1] == "self_attn"]


def allowed_mask(weights: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
    """The mask one call applied, rebuilt from its arguments as (B, H, T, S) bool.

    ``weights`` (B, H, T, S) give the shape; ``mask`` broadcasts to it ((T, S),
    (B, 1, 1, S), (B, 1|H, T, S)); ``is_causal`` adds ``causal_mask(T, S)``, end-aligned as
    the kernels apply it (a cached step's queries are the last T of S positions). Returns an
    expanded view: no copy per head.
    """
    b, h, t, s = weights.shape
    allowed = torch.ones(b, 1, t, s, dtype=torch.bool, device=weights.device)  # (B, 1, T, S)
    if mask is not None:
        allowed = allowed & mask.to(weights.device)  # (B, 1|H, T, S)
    if is_causal:
        allowed = allowed & causal_mask(t, s, device=weights.device)  # (B, 1|H, T, S)
    return allowed.expand(b, h, t, s)  # (B, H, T, S)


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, Tensor) else value


def _recording_forward(name: str, module: MultiHeadAttention, original: Any,
                       capture: AttentionCapture) -> Any:
    """A stand-in for ``module.forward`` that records each call into ``capture``."""

    def forward(x: Tensor, context: Tensor | None = None, *, need_weights: bool = False,
                **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        out, weights = original(x, context, need_weights=True, **kwargs)
        if weights is None:
            capture.unweighted.append(name)
        else:
            weights = weights.detach()  # (B, H, T, S)
            mask = kwargs.get("mask")
            capture._add(AttentionRecord(
                name=name, module=module, x=x.detach(), weights=weights,
                allowed=allowed_mask(weights, None if mask is None else mask.detach(),
                                     bool(kwargs.get("is_causal", False))),
                self_attention=context is None,
                kwargs={k: _detach(v) for k, v in kwargs.items() if k != "cache"}))
        return out, (weights if need_weights else None)  # what the caller asked for

    return forward


@contextmanager
def capture_attention(model: nn.Module) -> Iterator[AttentionCapture]:
    """Inside the block, every ``MultiHeadAttention`` of ``model`` records each call into the
    yielded ``AttentionCapture``; on exit the model is exactly as before, even on error.

    Outputs are unchanged up to float rounding (a fast kernel's layer runs the manual one
    while captured). Captures nest: the inner one wraps the outer's wrapper and unwinds first.
    """
    capture = AttentionCapture()
    saved: list[tuple[MultiHeadAttention, Any]] = []
    try:
        for name, module in attention_modules(model).items():
            saved.append((module, module.__dict__.get("forward", _NOT_SET)))
            module.forward = _recording_forward(  # type: ignore[method-assign]
                name, module, module.forward, capture)
        yield capture
    finally:
        for module, previous in reversed(saved):
            if previous is _NOT_SET:
                del module.forward
            else:
                module.forward = previous  # type: ignore[method-assign]


@contextmanager
def forced_attention_kind(model: nn.Module, kind: str) -> Iterator[int]:
    """Run every ``MultiHeadAttention`` of ``model`` with kernel ``kind`` inside the block;
    yields how many layers were switched and puts each one's own kernel back on exit.
    ``ValueError`` for an unknown kind, before anything is switched."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention kind {kind!r}; expected one of {ATTENTION_KINDS}")
    modules = list(attention_modules(model).values())
    previous = [m.attention for m in modules]
    try:
        for m in modules:
            m.attention = kind
        yield len(modules)
    finally:
        for m, kind_before in zip(modules, previous, strict=True):
            m.attention = kind_before
