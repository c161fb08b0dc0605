"""AdamW with decay / no-decay parameter groups, and learning-rate schedules.

Weight decay pulls weights toward zero; that is right for matrices that mix features and
wrong for LayerNorm gains, biases and position tables, which get no decay.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from handformer.config import TrainConfig

__all__ = ["build_optimizer", "lr_at", "param_groups"]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: ≥2-D weights (decayed) and everything else plus positional tables."""
    decay, no_decay, seen = [], [], set()
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in seen:
            continue  # tied weights appear once
        seen.add(id(param))
        is_position_table = "positions" in name.split(".")[0] or ".positions." in name
        if param.dim() >= 2 and not is_position_table:
            decay.append(param)
        else:
            no_decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    groups = param_groups(model, cfg.weight_decay)
    # The fused kernel updates every parameter in one call; the default on CPU is a Python
    # loop over parameters (measured here: ~20x slower for a 4-layer model's step).
    devices = {p.device.type for g in groups for p in g["params"]}
    fused = devices <= {"cpu", "cuda"}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=fused)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for 0-based ``step``. Warm-up is linear and starts above zero:
    step 0 trains at lr/(warmup+1), not at 0 (a wasted step)."""
    if cfg.schedule == "constant":
        return cfg.lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    decay_steps = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))
