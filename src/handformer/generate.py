"""Autoregressive sampling: greedy, temperature and top-k.

Each step feeds the model at most ``max_len`` of the most recent tokens, so generation can
run past the training window (a model with learned positions has no vectors beyond it).

Shape legend: ``B`` batch, ``T`` context length, ``V`` vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["generate", "sample_next"]


def sample_next(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """logits (B, V) → next ids (B,). ``temperature == 0`` is greedy (argmax)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0; got {temperature}")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k must be a positive int or None; got {top_k}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: nn.Module,
    ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    eos_id: int | None = None,
) -> Tensor:
    """Extend ``ids`` (B, T) by up to ``max_new_tokens`` tokens; returns (B, T + new).

    Stops early when every row has produced ``eos_id`` (if given).
    """
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"generate expects a non-empty prompt of shape (B, T); got "
                         f"{tuple(ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0; got {max_new_tokens}")
    max_len = model.config.max_len  # type: ignore[union-attr]
    device = next(model.parameters()).device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    out = ids.to(device)
    finished = torch.zeros(out.shape[0], dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        context = out[:, -max_len:]  # (B, ≤max_len)
        logits = model(context)[:, -1, :]  # (B, V)
        nxt = sample_next(logits, temperature=temperature, top_k=top_k, generator=generator)
        out = torch.cat([out, nxt[:, None]], dim=1)  # (B, T+1)
        if eos_id is not None:
            finished |= nxt == eos_id
            if bool(finished.all()):
                break
    model.train(was_training)
    return out
