"""The patient: a model, its data and its loss, behind one small interface the checks share.

The doctor works on any ``nn.Module`` that maps ids (B, T) to logits (B, T, V). What it can
additionally probe depends on what the model offers, discovered here and never assumed:

* ``padding_mask=`` in ``forward`` (True on real tokens) → the padding probes;
* handformer ``MultiHeadAttention`` modules → attention weights, the scale check, pictures,
  and the manual-vs-sdpa comparison;
* ``make_cache`` + ``forward(..., cache=)`` → cached-vs-uncached decoding.

Checks must leave no trace on the model: ``preserved_state`` snapshots parameters, buffers,
gradients and the train/eval flag, and puts them back.

Shape legend: ``B`` batch, ``T`` sequence, ``V`` vocabulary.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from handformer.capture import AttentionCapture, attention_modules, capture_attention
from handformer.data import Batch, LMWindows
from handformer.nn.attention import MultiHeadAttention

__all__ = ["DataLike", "LossFn", "Subject", "as_batches", "preserved_state"]

LossFn = Callable[[Tensor, Tensor], Tensor]
DataLike = Batch | Sequence[Batch] | LMWindows | Callable[..., Batch] | Tensor


def as_batches(data: Any, *, batch_size: int, generator: torch.Generator,
               max_batches: int = 4) -> list[Batch]:
    """Whatever the user has → a few ``Batch`` objects.

    Accepts a ``Batch``, a sequence of them, an ``LMWindows`` (evenly spaced fixed windows),
    a callable returning a ``Batch`` (called with a ``torch.Generator`` if it takes an
    argument, else with none), or a (B, T+1) tensor of token windows.
    """
    if isinstance(data, Batch):
        return [data]
    if isinstance(data, LMWindows):
        return data.fixed_batches(max_batches, batch_size)[:max_batches]
    if isinstance(data, Tensor):
        if data.dim() != 2 or data.shape[1] < 2:
            raise ValueError(f"a token tensor must be (B, T+1) windows with T >= 1; got "
                             f"{tuple(data.shape)}")
        return [Batch(ids=data[:, :-1].long(), targets=data[:, 1:].long())]
    if callable(data):
        takes_arg = bool(inspect.signature(data).parameters)
        batches = [data(generator) if takes_arg else data() for _ in range(max_batches)]
        bad = [type(b).__name__ for b in batches if not isinstance(b, Batch)]
        if bad:
            raise ValueError(f"the batch function returned {bad[0]}, expected handformer.Batch")
        return batches
    if isinstance(data, Sequence) and data and all(isinstance(b, Batch) for b in data):
        return list(data)[:max_batches]
    raise ValueError(
        f"cannot read batches from {type(data).__name__}: pass a handformer Batch, a list of "
        "them, an LMWindows, a function returning a Batch, or a (B, T+1) token tensor")


def _crop(batch: Batch, rows: int, cols: int) -> Batch:
    mask = None if batch.padding_mask is None else batch.padding_mask[:rows, :cols]
    return Batch(batch.ids[:rows, :cols], batch.targets[:rows, :cols], mask)


@contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Run a block that may train, zero or perturb ``model``; restore it exactly afterwards.

    Parameters and buffers are copied back *in place* (tied weights and optimizer
    references stay valid), gradients are put back as they were (``None`` included), and
    the train/eval flag is restored.
    """
    was_training = model.training
    state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    grads = {p: (None if p.grad is None else p.grad.detach().clone())
             for p in model.parameters()}
    try:
        yield
    finally:
        with torch.no_grad():
            current = model.state_dict(keep_vars=True)
            for k, saved in state.items():
                current[k].data.copy_(saved)
        for p, g in grads.items():
            p.grad = g
        model.train(was_training)


@dataclass
class Subject:
    """Model + data + loss, with what the model can do discovered up front."""

    model: nn.Module
    batches: list[Batch]
    loss_fn: LossFn
    pad_id: int = 0
    vocab_size: int | None = None
    lr: float = 1e-3
    initial: bool = True
    seed: int = 0
    decode: Callable[[int], str] | None = None
    probe_rows: int = 4
    probe: Batch = field(init=False)
    generator: torch.Generator = field(init=False)
    device: torch.device = field(init=False)
    accepts_padding_mask: bool = field(init=False)
    attention: dict[str, MultiHeadAttention] = field(init=False)
    has_cache: bool = field(init=False)
    memo: dict[str, Any] = field(init=False, default_factory=dict)  # results checks share

    def __post_init__(self) -> None:
        if not self.batches:
            raise ValueError("the doctor needs at least one batch")
        self.generator = torch.Generator().manual_seed(self.seed)
        params = list(self.model.parameters())
        self.device = params[0].device if params else torch.device("cpu")
        config = getattr(self.model, "config", None)
        if self.vocab_size is None:
            self.vocab_size = getattr(config, "vocab_size", None)
        max_len = getattr(config, "max_len", None)
        first = self.batches[0]
        cols = first.ids.shape[1] if max_len is None else min(first.ids.shape[1], max_len)
        self.probe = _crop(first, self.probe_rows, cols).to(self.device)  # (≤ rows, ≤ max_len)
        self.batches = [b.to(self.device) for b in self.batches]
        names = inspect.signature(self.model.forward).parameters
        self.accepts_padding_mask = "padding_mask" in names
        self.attention = attention_modules(self.model)
        self.has_cache = callable(getattr(self.model, "make_cache", None)) and "cache" in names

    # -- running the model --------------------------------------------------------------
    def forward(self, ids: Tensor, padding_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
        """logits (B, T, V) for ids (B, T); the padding mask only if the model takes one."""
        if padding_mask is not None:
            if not self.accepts_padding_mask:
                raise ValueError("this model's forward takes no padding_mask")
            kwargs["padding_mask"] = padding_mask
        return self.model(ids, **kwargs)

    def captured_forward(self, ids: Tensor, padding_mask: Tensor | None = None
                         ) -> tuple[Tensor, AttentionCapture]:
        """logits (B, T, V) and every attention call of one no-grad forward pass; the model
        is left exactly as it was (see ``handformer.capture``)."""
        with torch.no_grad(), capture_attention(self.model) as records:
            logits = self.forward(ids, padding_mask)
        return logits, records

    def probe_logits(self) -> Tensor:
        """The probe batch's logits (B, T, V), computed once without gradients."""
        if "probe_logits" not in self.memo:
            with torch.no_grad():
                self.memo["probe_logits"] = self.forward(
                    self.probe.ids, self.probe.padding_mask if self.accepts_padding_mask
                    else None)
        return self.memo["probe_logits"]

    @property
    def vocab(self) -> int:
        """V: as given, or the model config's, or the logits' last dimension."""
        return self.vocab_size if self.vocab_size is not None else self.probe_logits().shape[-1]

    def random_tokens(self, shape: tuple[int, ...], *, avoid: Tensor | None = None,
                      generator: torch.Generator | None = None) -> Tensor:
        """Random ids in [0, V), never the pad id and, where ``avoid`` is given, never equal
        to it elementwise — so a "perturbation" always changes every token it touches.
        Drawn from ``generator`` (default: the subject's own)."""
        v = self.vocab
        choices = torch.tensor([i for i in range(v) if i != self.pad_id])
        out = choices[torch.randint(0, len(choices), shape,
                                    generator=generator or self.generator)]
        if avoid is not None:
            same = out == avoid.cpu()
            out[same] = choices[(torch.searchsorted(choices, out[same]) + 1) % len(choices)]
        return out.to(self.device)

    def tolerance(self, reference: Tensor) -> float:
        """Absolute tolerance for "unchanged": float32 noise scaled to the logits' size."""
        return 1e-4 * max(1.0, float(reference.abs().max()))

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return self.loss_fn(logits, targets)

    def describe(self) -> dict[str, Any]:
        model = self.model
        seen: set[int] = set()
        n_params = 0
        for p in model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n_params += p.numel()
        config = getattr(model, "config", None)
        info: dict[str, Any] = {
            "model": type(model).__name__, "parameters": n_params,
            "batch": list(self.probe.ids.shape), "vocab_size": self.vocab_size,
            "lr": self.lr, "initial": self.initial,
            "padding_mask": self.accepts_padding_mask,
            "attention_modules": len(self.attention), "kv_cache": self.has_cache,
        }
        if config is not None and hasattr(config, "to_dict"):
            info["config"] = config.to_dict()
        return info
