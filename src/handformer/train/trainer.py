"""A model-agnostic training loop.

The trainer knows three things: how to get a training batch, how to turn a batch into
logits (``forward_fn``, by default ``model(batch.ids, padding_mask=batch.padding_mask)``) and
how to turn logits into a loss (``loss_fn``). Everything else (logging, saving) hangs off
callbacks, so the same loop trains a decoder LM, a classifier or a seq2seq model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from handformer.config import TrainConfig
from handformer.data import Batch
from handformer.loss import lm_loss
from handformer.train.optim import build_optimizer, lr_at

__all__ = ["Callback", "TrainResult", "Trainer", "pick_device"]


def pick_device(name: str = "auto") -> torch.device:
    """``auto`` picks cuda, then mps, then cpu; anything else is passed to torch."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"unknown device {name!r}; expected auto, cpu, cuda[:N] or mps") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available here")
    return device


def default_forward(model: nn.Module, batch: Batch) -> Tensor:
    return model(batch.ids, padding_mask=batch.padding_mask)


class Callback(Protocol):
    """Hooks the trainer calls; implement any subset (missing ones are skipped)."""

    def on_log(self, step: int, metrics: dict[str, float]) -> None: ...
    def on_eval(self, step: int, metrics: dict[str, float]) -> None: ...
    def on_end(self, result: TrainResult) -> None: ...


@dataclass
class TrainResult:
    steps: int
    train_losses: list[float] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0
    step_ms: list[float] = field(default_factory=list)

    @property
    def final_val_loss(self) -> float:
        return self.evals[-1]["val_loss"] if self.evals else float("nan")

    @property
    def median_step_ms(self) -> float:
        if not self.step_ms:
            return float("nan")
        ordered = sorted(self.step_ms)
        return ordered[len(ordered) // 2]


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        *,
        train_batch: Callable[[torch.Generator], Batch],
        val_batches: Sequence[Batch] = (),
        loss_fn: Callable[[Tensor, Tensor], Tensor] = lm_loss,
        forward_fn: Callable[[nn.Module, Batch], Tensor] = default_forward,
        callbacks: Iterable[Any] = (),
        progress: bool = True,
    ) -> None:
        self.cfg = cfg
        self.device = pick_device(cfg.device)
        self.model = model.to(self.device)
        self.train_batch = train_batch
        self.val_batches = list(val_batches)
        self.loss_fn = loss_fn
        self.forward_fn = forward_fn
        self.callbacks = list(callbacks)
        self.progress = progress
        self.optimizer = build_optimizer(self.model, cfg)
        self.generator = torch.Generator().manual_seed(cfg.seed)

    def _emit(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(*args)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Token-weighted validation loss, perplexity and bits per token."""
        if not self.val_batches:
            return {}
        was_training = self.model.training
        self.model.eval()
        total, count = 0.0, 0
        for batch in self.val_batches:
            batch = batch.to(self.device)
            logits = self.forward_fn(self.model, batch)
            n = batch.num_tokens
            total += float(self.loss_fn(logits, batch.targets)) * n
            count += n
        self.model.train(was_training)
        loss = total / max(count, 1)
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)),
                "val_bits_per_token": loss / math.log(2)}

    def fit(self) -> TrainResult:
        cfg = self.cfg
        result = TrainResult(steps=cfg.max_steps)
        self.model.train()
        start = time.perf_counter()
        bar = tqdm(range(cfg.max_steps), disable=not self.progress, dynamic_ncols=True,
                   desc="train", mininterval=1.0)
        tokens_since, time_since = 0, time.perf_counter()
        for step in bar:
            t0 = time.perf_counter()
            lr = lr_at(step, cfg)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            batch = self.train_batch(self.generator).to(self.device)
            logits = self.forward_fn(self.model, batch)
            loss = self.loss_fn(logits, batch.targets)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf))
            self.optimizer.step()
            loss_value = float(loss.detach())
            result.step_ms.append((time.perf_counter() - t0) * 1000.0)
            result.train_losses.append(loss_value)
            tokens_since += batch.num_tokens

            last = step == cfg.max_steps - 1
            if (step + 1) % cfg.log_interval == 0 or last:
                now = time.perf_counter()
                metrics = {"step": step + 1, "loss": loss_value, "lr": lr,
                           "grad_norm": grad_norm,
                           "tokens_per_s": tokens_since / max(now - time_since, 1e-9)}
                tokens_since, time_since = 0, now
                bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.2e}",
                                tok_s=f"{metrics['tokens_per_s']:.0f}")
                self._emit("on_log", step + 1, metrics)
            if (step + 1) % cfg.eval_interval == 0 or last:
                metrics = {"step": step + 1, **self.evaluate()}
                if len(metrics) > 1:
                    result.evals.append(metrics)
                    bar.write(f"step {step + 1:>6}: train loss {loss_value:.4f}  "
                              f"val loss {metrics['val_loss']:.4f}")
                    self._emit("on_eval", step + 1, metrics)
        bar.close()
        result.seconds = time.perf_counter() - start
        self.model.eval()
        self._emit("on_end", result)
        return result
