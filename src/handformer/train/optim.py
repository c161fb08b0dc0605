"""Optimizers and learning-rate schedules.

AdamW with decay / no-decay parameter groups: weight decay pulls weights toward zero; that is
right for matrices that mix features and wrong for LayerNorm gains, biases and position
tables, which get no decay.

Muon (``torch.optim.Muon``, ``TrainConfig.optimizer="muon"``) replaces each hidden weight
matrix's update with its orthogonalised momentum: every direction of the matrix moves at the
same rate. It is meant for the 2-D matrices *inside* the blocks; embeddings, the output head,
gains and biases keep AdamW. The two optimizers travel together as one ``SplitOptimizer``,
which the trainer, its checkpoints and ``GradScaler`` use like a single optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from handformer.config import TrainConfig

__all__ = ["SplitOptimizer", "batch_rows_at", "build_optimizer", "is_hidden_matrix", "lr_at",
           "lr_scale", "param_groups", "parameter_split", "set_lr", "window_at"]


def _unique_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters by name, a tied weight once (under its first name)."""
    out, seen = [], set()
    for name, param in model.named_parameters():
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            out.append((name, param))
    return out


def _is_position_table(name: str) -> bool:
    return "positions" in name.split(".")[0] or ".positions." in name


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """A 2-D weight inside the block stack (a path component named ``blocks``): attention's
    projections and the FFN's. The trainer knows no model, so this goes by the name every
    handformer model gives its stack; embeddings, heads, gains and biases are not."""
    return param.dim() == 2 and "blocks" in name.split(".")


def _is_embedding(name: str) -> bool:
    return name.endswith("token.weight") or name.startswith("lm_head.")


def param_groups(model: nn.Module, weight_decay: float, *,
                 include: Callable[[str, torch.Tensor], bool] = lambda n, p: True,
                 embed_lr: float = 0.0) -> list[dict]:
    """AdamW's groups over the parameters ``include`` accepts: ≥2-D weights (decayed) and
    everything else plus positional tables (not decayed); with ``embed_lr`` > 0 the token
    embedding and head form a third group carrying ``base_lr = embed_lr``."""
    decay, no_decay, embed = [], [], []
    for name, param in _unique_params(model):
        if not include(name, param):
            continue
        if embed_lr > 0 and _is_embedding(name):
            embed.append(param)
        elif param.dim() >= 2 and not _is_position_table(name):
            decay.append(param)
        else:
            no_decay.append(param)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if embed:
        groups.append({"params": embed, "weight_decay": weight_decay, "base_lr": embed_lr})
    return groups


def parameter_split(model: nn.Module, cfg: TrainConfig) -> dict[str, list[str]]:
    """Which parameter names each optimizer trains (``{"adamw": [...], "muon": [...]}``),
    as recorded in a run's summary."""
    muon = cfg.optimizer == "muon"
    split: dict[str, list[str]] = {"adamw": [], "muon": []}
    for name, param in _unique_params(model):
        split["muon" if muon and is_hidden_matrix(name, param) else "adamw"].append(name)
    return split


class SplitOptimizer:
    """Several optimizers over disjoint parameters, used as one.

    ``param_groups`` lists every group of every optimizer (setting ``lr`` on them reaches the
    real optimizers), and ``state_dict`` is one optimizer-style dict — parameter ids numbered
    on across the optimizers, groups in order — so checkpoints flatten and restore it like
    any optimizer's. ``GradScaler.unscale_`` / ``step`` accept it as they accept one.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self, closure: None = None) -> None:
        for opt in self.optimizers:
            opt.step()

    def state_dict(self) -> dict[str, Any]:
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for opt in self.optimizers:
            sd = opt.state_dict()
            state.update({pid + offset: s for pid, s in sd["state"].items()})
            for g in sd["param_groups"]:
                groups.append({**g, "params": [pid + offset for pid in g["params"]]})
            offset += sum(len(g["params"]) for g in sd["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups, state = state_dict["param_groups"], state_dict["state"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"expected {len(self.param_groups)} parameter groups; got "
                             f"{len(groups)}")
        start = offset = 0
        for opt in self.optimizers:
            mine = groups[start:start + len(opt.param_groups)]
            start += len(opt.param_groups)
            count = sum(len(g["params"]) for g in mine)
            ids = [pid for g in mine for pid in g["params"]]
            opt.load_state_dict({
                "state": {pid - offset: state[pid] for pid in ids if pid in state},
                "param_groups": [{**g, "params": [pid - offset for pid in g["params"]]}
                                 for g in mine]})
            offset += count


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer | SplitOptimizer:
    """AdamW over every parameter, or (``cfg.optimizer == "muon"``) Muon over the hidden
    matrices and AdamW over the rest. Each group's ``base_lr`` is what the schedule scales
    (``set_lr``)."""
    muon = cfg.optimizer == "muon"
    groups = param_groups(model, cfg.weight_decay, embed_lr=cfg.embed_lr,
                          include=lambda n, p: not (muon and is_hidden_matrix(n, p)))
    for g in groups:
        g.setdefault("base_lr", cfg.lr)
    # The fused kernel updates every parameter in one call; the default on CPU is a Python
    # loop over parameters (measured here: ~20x slower for a 4-layer model's step).
    devices = {p.device.type for g in groups for p in g["params"]}
    fused = devices <= {"cpu", "cuda"}
    adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=fused)
    if not muon:
        return adamw
    hidden = [p for n, p in _unique_params(model) if is_hidden_matrix(n, p)]
    if not hidden:
        raise ValueError("optimizer='muon' found no hidden weight matrices (2-D parameters "
                         "inside 'blocks') in this model; use optimizer='adamw'")
    muon_opt = torch.optim.Muon(hidden, lr=cfg.muon_lr, weight_decay=cfg.weight_decay,
                                momentum=cfg.muon_momentum, nesterov=True,
                                ns_steps=cfg.muon_ns_steps, adjust_lr_fn=cfg.muon_lr_adjust)
    for g in muon_opt.param_groups:
        g["base_lr"] = cfg.muon_lr
    return SplitOptimizer([adamw, muon_opt])


def lr_scale(step: int, cfg: TrainConfig) -> float:
    """The schedule's factor at 0-based ``step``: ``lr_at(step) / lr``; every group's
    ``base_lr`` (AdamW's ``lr``, Muon's ``muon_lr``, ``embed_lr``) is scaled by it."""
    return lr_at(step, cfg) / cfg.lr


def set_lr(optimizer: torch.optim.Optimizer | SplitOptimizer, step: int,
           cfg: TrainConfig) -> float:
    """Set every group's lr for ``step`` (its ``base_lr`` × the schedule's factor; a group
    restored from an older checkpoint without one takes ``cfg.lr``); returns AdamW's lr."""
    scale = lr_scale(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = group.get("base_lr", cfg.lr) * scale
    return lr_at(step, cfg)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for 0-based ``step``. Warm-up is linear and starts above zero:
    step 0 trains at lr/(warmup+1), not at 0 (a wasted step). ``wsd`` then holds ``lr`` and
    decays linearly to ``min_lr`` over the last ``decay_fraction`` of ``max_steps``."""
    if cfg.schedule == "constant":
        return cfg.lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * cfg.max_steps))
        decay_start = max(cfg.warmup_steps, cfg.max_steps - decay_steps)
        progress = min(1.0, max(0.0, step - decay_start) / max(1, cfg.max_steps - decay_start))
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    decay_steps = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def window_at(step: int, cfg: TrainConfig) -> int:
    """Training window length at 0-based ``step``: ``seq_warmup_start`` at step 0, growing
    linearly to ``block_size`` at ``seq_warmup_steps`` (rounded down to a multiple of 8
    while growing, so few distinct shapes appear); ``block_size`` when the warm-up is off."""
    if step >= cfg.seq_warmup_steps:
        return cfg.block_size
    grown = cfg.seq_warmup_start + (cfg.block_size - cfg.seq_warmup_start) * step \
        / cfg.seq_warmup_steps
    return max(cfg.seq_warmup_start, min(cfg.block_size, int(grown) // 8 * 8))


def batch_rows_at(step: int, cfg: TrainConfig, multiple: int = 1) -> int:
    """Windows trained per micro-batch at 0-based ``step``: ``batch_warmup_start`` at step 0,
    growing linearly to ``batch_size`` at ``batch_warmup_steps`` (rounded down to a multiple
    of ``multiple`` — the number of ranks, which must each get an equal share — but never
    below the start); ``batch_size`` when the warm-up is off."""
    if step >= cfg.batch_warmup_steps:
        return cfg.batch_size
    grown = cfg.batch_warmup_start + (cfg.batch_size - cfg.batch_warmup_start) * step \
        / cfg.batch_warmup_steps
    return max(cfg.batch_warmup_start, min(cfg.batch_size, int(grown) // multiple * multiple))
