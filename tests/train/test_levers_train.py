"""Every ``TrainConfig`` lever pinned to its exact meaning, against formulas written out here.

* The schedules: typed-in values at chosen steps (the warm-up's first and last step, the
  turn, fractions of the decay, ``min_lr`` at and past the end) for cosine, linear, wsd and
  constant, and the rate every optimizer group actually trains at, step by step.
* The optimiser step, replayed by hand: the trainer runs a few steps and a float64 replay
  written here — the token-weighted loss over ``grad_accum_steps`` micro-batches, clipping
  by the global norm, AdamW with the configured betas, decoupled weight decay on exactly the
  ≥2-D non-position weights, ``embed_lr`` for the token embedding and head — must land on
  the same weights and the same clipped gradients.
* Muon: which parameters it trains (read from how far each one moves), and its step
  replayed by hand (Nesterov momentum, the quintic Newton–Schulz in bfloat16 for
  ``muon_ns_steps`` iterations, ``muon_lr_adjust``, decoupled decay).
* The gradient scaler's order on CPU: unscale → clip → step, so clipping and the reported
  norm see the true gradients.
* The warm-ups of the window and the batch, typed in; the step counters (log, eval,
  checkpoint intervals, ``keep_last``, patience, the non-finite limit).

Each check is made at values where a wrong choice moves the result far past its tolerance.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

from handformer.config import TrainConfig
from handformer.data import Batch, collate_sequences
from handformer.loss import IGNORE_INDEX
from handformer.models.decoder_lm import DecoderLM
from handformer.train.checkpoint import list_checkpoints
from handformer.train.optim import batch_rows_at, lr_at, window_at
from handformer.train.trainer import NonFiniteError, Trainer
from tests.train.helpers import TEXT, TOKENIZER, make_trainer, model_config, train_config

# -- schedules: typed-in values ---------------------------------------------------------------
SCHEDULE = dict(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
# step → lr. Warm-up: (step + 1) / (warmup + 1) of lr, so step 0 trains at lr / 11 and step 9
# at lr · 10 / 11; decay from step 10 over the remaining 100 steps; min_lr from step 110 on.
TABLES: dict[str, tuple[dict[str, Any], dict[int, float]]] = {
    "cosine": ({}, {0: 1e-3 / 11, 9: 1e-3 * 10 / 11, 10: 1e-3,
                    35: 1e-4 + 4.5e-4 * (1 + math.cos(math.pi / 4)),  # a quarter of the way
                    60: 5.5e-4, 85: 1e-4 + 4.5e-4 * (1 + math.cos(3 * math.pi / 4)),
                    109: 1e-4 + 4.5e-4 * (1 + math.cos(math.pi * 0.99)), 110: 1e-4,
                    500: 1e-4}),
    "linear": ({}, {0: 1e-3 / 11, 9: 1e-3 * 10 / 11, 10: 1e-3, 35: 7.75e-4, 60: 5.5e-4,
                    109: 1e-4 + 9e-6, 110: 1e-4, 500: 1e-4}),
    # decay over the last round(0.3 · 110) = 33 steps: from step 77 to 110.
    "wsd": ({"decay_fraction": 0.3}, {0: 1e-3 / 11, 9: 1e-3 * 10 / 11, 10: 1e-3, 50: 1e-3,
                                      77: 1e-3, 88: 7e-4, 99: 4e-4, 110: 1e-4, 500: 1e-4}),
    # decay_fraction 1: the decay cannot start before the warm-up ends (step 10).
    "wsd-whole": ({"schedule": "wsd", "decay_fraction": 1.0},
                  {0: 1e-3 / 11, 10: 1e-3, 35: 7.75e-4, 60: 5.5e-4, 110: 1e-4}),
    # constant is lr from step 0: it has no warm-up (warmup_steps is ignored).
    "constant": ({}, {0: 1e-3, 5: 1e-3, 10: 1e-3, 110: 1e-3, 500: 1e-3}),
}


@pytest.mark.parametrize("name", list(TABLES))
def test_schedule_values_at_chosen_steps(name: str) -> None:
    extra, table = TABLES[name]
    cfg = TrainConfig(**{**SCHEDULE, "schedule": name.split("-")[0], **extra})
    for step, expected in table.items():
        assert lr_at(step, cfg) == pytest.approx(expected, rel=1e-12, abs=1e-15), step


def test_zero_warmup_starts_the_decay_at_step_zero() -> None:
    cfg = TrainConfig(lr=1e-3, min_lr=0.0, warmup_steps=0, max_steps=4, schedule="linear")
    assert [lr_at(s, cfg) for s in range(5)] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0])


class GroupRates:
    """Records, at every step's end, the lr of every optimizer group (the rate it trained at)."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.rates: list[list[float]] = []

    def on_step_end(self, step: int) -> None:
        assert self.trainer is not None
        self.rates.append([g["lr"] for g in self.trainer.optimizer.param_groups])


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_every_group_trains_at_its_base_rate_times_the_schedule(optimizer: str) -> None:
    """AdamW's groups at lr, the embedding group at embed_lr, Muon's at muon_lr: each × the
    same factor lr_at(step) / lr, step by step (cosine, 3 warm-up steps, 8 steps)."""
    cfg = train_config(max_steps=8, warmup_steps=3, lr=2e-3, min_lr=2e-4, embed_lr=5e-3,
                       optimizer=optimizer, muon_lr=0.04, eval_interval=8)
    rec = GroupRates()
    trainer = make_trainer(cfg, callbacks=[rec])
    rec.trainer = trainer
    trainer.fit()
    for step, rates in enumerate(rec.rates):
        factor = {0: 1 / 4, 1: 2 / 4, 2: 3 / 4}.get(step)
        if factor is None:  # cosine from step 3 over 5 steps down to 0.1 of lr
            factor = 0.1 + 0.45 * (1 + math.cos(math.pi * (step - 3) / 5))
        bases = [2e-3, 5e-3] + ([0.04] if optimizer == "muon" else [])
        assert sorted({round(r / factor, 12) for r in rates}) == bases, (step, rates)


# -- the AdamW step, replayed by hand ----------------------------------------------------------
def _ragged_batches(n: int, rows: int, seed: int) -> list[Batch]:
    """``n`` right-padded batches of ``rows`` sequences of different lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = TOKENIZER.encode(TEXT[:3000])
    out = []
    for _ in range(n):
        seqs = []
        for _ in range(rows):
            length = int(torch.randint(5, 17, (1,), generator=g))
            start = int(torch.randint(0, len(ids) - 20, (1,), generator=g))
            seqs.append(ids[start:start + length])
        out.append(collate_sequences(seqs, pad_id=TOKENIZER.pad_id))
    return out


def expected_lr(step: int, cfg: TrainConfig) -> float:
    """The schedule written out (cosine and linear with warm-up; constant)."""
    if cfg.schedule == "constant":
        return cfg.lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    progress = min(1.0, (step - cfg.warmup_steps) / (cfg.max_steps - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress)) / 2


def token_mean_loss(model: nn.Module, params: dict[str, Tensor], batches: list[Batch]) -> Tensor:
    """Cross-entropy summed over every real target of every micro-batch / their count:
    the loss of one batch holding them all."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for b in batches:
        logits = functional_call(model, params, (b.ids,), {"padding_mask": b.padding_mask})
        logp = logits.double().log_softmax(-1)  # (B, T, V)
        real = b.targets != IGNORE_INDEX
        picked = logp.gather(-1, b.targets.clamp(min=0)[..., None])[..., 0]  # (B, T)
        total = total - picked[real].sum()
        count += int(real.sum())
    return total / count


def decayed(name: str, param: Tensor) -> bool:
    """Weight decay on ≥2-D weights, except the learned position table."""
    return param.dim() >= 2 and "positions" not in name


def on_embed_rate(name: str) -> bool:
    """With embed_lr > 0: the token embedding (a tied head with it) and an untied head."""
    return name == "embed.token.weight" or name == "lm_head.weight"


class StepRecorder:
    """Weights and (clipped) gradients at every step's end, and the logged metrics."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.weights: list[dict[str, Tensor]] = []
        self.grads: list[dict[str, Tensor]] = []
        self.logs: list[dict[str, Any]] = []

    def on_step_end(self, step: int) -> None:
        self.weights.append({n: p.detach().clone() for n, p in self.model.named_parameters()})
        self.grads.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters()
                           if p.grad is not None})

    def on_log(self, step: int, metrics: dict[str, Any]) -> None:
        self.logs.append(metrics)


def run_recorded(cfg: TrainConfig, batches: list[Batch], *, tie_weights: bool = True,
                 scaler: torch.amp.GradScaler | None = None
                 ) -> tuple[Trainer, StepRecorder, dict[str, Tensor], list[Batch]]:
    """Train ``cfg.max_steps`` steps on ``batches`` in order; returns the trainer, what it
    recorded, the initial weights and the micro-batches in the order they were drawn."""
    torch.manual_seed(0)
    model = DecoderLM(model_config(tie_weights=tie_weights))
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    stream = iter(batches)
    drawn: list[Batch] = []

    def draw(_: torch.Generator) -> Batch:
        drawn.append(next(stream))
        return drawn[-1]

    rec = StepRecorder(model)
    trainer = Trainer(model, cfg, train_batch=draw, progress=False, callbacks=[rec])
    if scaler is not None:
        trainer.precision.scaler = scaler  # the fp16 path's scaler, run on CPU
    trainer.fit()
    return trainer, rec, initial, drawn


REPLAYS: dict[str, dict[str, Any]] = {
    "cosine-betas-clip": dict(schedule="cosine", warmup_steps=2, betas=(0.7, 0.8),
                              weight_decay=0.3, grad_clip=0.3),
    "linear-accum3-embed_lr-noclip": dict(schedule="linear", warmup_steps=1, grad_accum_steps=3,
                                          embed_lr=1e-2, grad_clip=0.0, weight_decay=0.2),
    "constant-untied-embed_lr-accum2": dict(schedule="constant", grad_accum_steps=2,
                                            embed_lr=2e-2, betas=(0.5, 0.9), grad_clip=0.5),
}


@pytest.mark.parametrize("case", list(REPLAYS))
def test_the_adamw_step_equals_a_replay_written_out_by_hand(case: str) -> None:
    extra = REPLAYS[case]
    steps = 4
    cfg = train_config(max_steps=steps, lr=3e-3, min_lr=3e-4, eval_interval=100,
                       log_interval=1, **extra)
    untied = "untied" in case
    batches = _ragged_batches(steps * cfg.grad_accum_steps, rows=3, seed=len(case))
    _, rec, initial, drawn = run_recorded(cfg, batches, tie_weights=not untied)
    assert len(drawn) == steps * cfg.grad_accum_steps  # grad_accum_steps draws a step
    assert len(rec.weights) == steps  # max_steps

    torch.manual_seed(0)
    model = DecoderLM(model_config(tie_weights=not untied)).double().train()
    params = {n: p.double().clone() for n, p in initial.items()}
    m = {n: torch.zeros_like(p) for n, p in params.items()}
    v = {n: torch.zeros_like(p) for n, p in params.items()}
    b1, b2 = cfg.betas
    for step in range(steps):
        micro = drawn[step * cfg.grad_accum_steps:(step + 1) * cfg.grad_accum_steps]
        leaves = {n: p.detach().requires_grad_(True) for n, p in params.items()}
        grads = dict(zip(leaves, torch.autograd.grad(token_mean_loss(model, leaves, micro),
                                                     list(leaves.values())), strict=True))
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
        if cfg.grad_clip > 0:
            factor = min(1.0, cfg.grad_clip / (norm + 1e-6))
            grads = {n: g * factor for n, g in grads.items()}
        assert rec.logs[step]["grad_norm"] == pytest.approx(norm, rel=1e-4)  # pre-clip norm
        scale = expected_lr(step, cfg) / cfg.lr
        t = step + 1
        for n, mine in grads.items():
            torch.testing.assert_close(rec.grads[step][n].double(), mine, rtol=1e-3, atol=1e-6,
                                       msg=f"step {step} clipped grad {n}")
            # AdamW on the trainer's own gradient (just checked against the formula): an
            # element near Adam's eps turns a 1e-11 rounding difference into 1e-6 of a step.
            g = rec.grads[step][n].double()
            lr = (cfg.embed_lr if cfg.embed_lr > 0 and on_embed_rate(n) else cfg.lr) * scale
            p = params[n]
            if decayed(n, p):
                p = p * (1 - lr * cfg.weight_decay)
            m[n] = b1 * m[n] + (1 - b1) * g
            v[n] = b2 * v[n] + (1 - b2) * g * g
            m_hat, v_hat = m[n] / (1 - b1 ** t), v[n] / (1 - b2 ** t)
            params[n] = p - lr * m_hat / (v_hat.sqrt() + 1e-8)
        for n, p in params.items():
            torch.testing.assert_close(rec.weights[step][n].double(), p, rtol=0, atol=2e-6,
                                       msg=f"step {step} {n}")
    if cfg.grad_clip > 0:  # the clip really acted on some step
        assert max(log["grad_norm"] for log in rec.logs) > cfg.grad_clip


def test_the_replay_tells_each_lever_apart() -> None:
    """The replay above is sharp: one wrong lever moves the trained weights by far more than
    its 2e-6 tolerance."""
    base = dict(max_steps=3, lr=3e-3, min_lr=3e-4, eval_interval=100, warmup_steps=1,
                betas=(0.7, 0.8), weight_decay=0.3, grad_clip=0.3, embed_lr=1e-2)
    batches = _ragged_batches(6, rows=3, seed=1)

    def final(**change: Any) -> dict[str, Tensor]:
        cfg = train_config(**{**base, **change})
        return run_recorded(cfg, batches)[1].weights[-1]

    ref = final()
    for change in (dict(betas=(0.9, 0.99)), dict(weight_decay=0.1), dict(grad_clip=0.0),
                   dict(embed_lr=0.0), dict(warmup_steps=2), dict(grad_accum_steps=2)):
        moved = max(float((final(**change)[n] - w).abs().max()) for n, w in ref.items())
        assert moved > 2e-4, (change, moved)


# -- weight decay: exactly which parameters, exactly how much ----------------------------------
def test_weight_decay_shrinks_exactly_the_matrices_by_lr_times_wd() -> None:
    """A zero loss (zero gradients): AdamW's update is 0/(0 + eps) = 0, so one step is the
    decoupled decay alone, p ← p·(1 − lr·wd), on the ≥2-D weights other than the position
    table, and nothing on gains, biases and positions."""
    cfg = train_config(max_steps=1, lr=0.05, warmup_steps=0, schedule="constant",
                       weight_decay=0.4, eval_interval=100)
    torch.manual_seed(0)
    model = DecoderLM(model_config(tie_weights=False))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model, cfg, train_batch=lambda g: _ragged_batches(1, 2, 0)[0],
                      loss_fn=lambda logits, targets: logits.sum() * 0.0, progress=False)
    trainer.fit()
    names = set()
    for n, p in model.named_parameters():
        shrink = 1 - 0.05 * 0.4 if decayed(n, p) else 1.0
        torch.testing.assert_close(p.detach(), before[n] * shrink, rtol=1e-6, atol=0, msg=n)
        if shrink != 1.0:
            names.add(n)
    assert names == {"embed.token.weight", "lm_head.weight"} | {
        f"blocks.{i}.{m}.weight" for i in range(2)
        for m in ("self_attn.in_proj", "self_attn.out_proj", "ffn.fc_in", "ffn.fc_out")}


# -- Muon: the split, and its step by hand -----------------------------------------------------
MUON_MATRICES = {f"blocks.{i}.{m}.weight" for i in range(2)
                 for m in ("self_attn.in_proj", "self_attn.out_proj", "ffn.fc_in", "ffn.fc_out")}


def test_muon_trains_exactly_the_blocks_matrices() -> None:
    """AdamW at lr 1e-6 moves each element by at most lr on its first step (|m̂/√v̂| ≤ 1;
    fp32 rounding of weights near 1 adds up to 1.2e-7); Muon at 0.02 moves its matrices
    far more: which parameters moved far says which optimizer trained them."""
    cfg = train_config(max_steps=1, optimizer="muon", lr=1e-6, min_lr=0.0, muon_lr=0.02,
                       schedule="constant", weight_decay=0.0, grad_clip=0.0,
                       eval_interval=100)
    _, rec, initial, _ = run_recorded(cfg, _ragged_batches(1, 3, 2), tie_weights=False)
    moved = {n: float((rec.weights[0][n] - w).abs().max()) for n, w in initial.items()}
    assert {n for n, d in moved.items() if d > 1e-4} == MUON_MATRICES
    assert all(d <= 1.2e-6 for n, d in moved.items() if n not in MUON_MATRICES), moved


def newton_schulz(g: Tensor, steps: int) -> Tensor:
    """The quintic Newton–Schulz orthogonalisation in bfloat16: X = G/‖G‖ (the wide way
    round), then ``steps`` times X ← a·X + (b·A + c·A²)·X with A = X·Xᵀ. Written with
    ``addmm`` (one bf16 rounding per multiply-add, as torch's Muon rounds): separate bf16
    products and sums would round differently and drift by ~5% over five iterations."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    tall = g.shape[0] > g.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b·A + c·A·A
        x = torch.addmm(x, poly, x, beta=a)  # a·X + poly·X
    return (x.T if tall else x).float()


MUON_CASES: dict[str, dict[str, Any]] = {
    "match_rms_adamw": dict(muon_momentum=0.5, muon_ns_steps=5, muon_lr_adjust="match_rms_adamw"),
    "original-3-steps": dict(muon_momentum=0.6, muon_ns_steps=3, muon_lr_adjust="original"),
}


def muon_replay(initial: dict[str, Tensor], grads: list[dict[str, Tensor]], cfg: TrainConfig,
                **change: Any) -> dict[str, Tensor]:
    """Muon by hand over the recorded gradients: momentum buffer b ← μ·b + (1 − μ)·g, Nesterov
    update (1 − μ)·g + μ·b, orthogonalised, scaled by the adjusted rate, after the decay
    p ← p·(1 − lr·wd)."""
    mu = change.get("muon_momentum", cfg.muon_momentum)
    ns = change.get("muon_ns_steps", cfg.muon_ns_steps)
    adjust = change.get("muon_lr_adjust", cfg.muon_lr_adjust)
    params = {n: initial[n].clone() for n in MUON_MATRICES}
    buf = {n: torch.zeros_like(p) for n, p in params.items()}
    for step, g_step in enumerate(grads):
        lr = cfg.muon_lr * expected_lr(step, cfg) / cfg.lr
        for n, p in params.items():
            g = g_step[n]
            # lerp(a, b, w) = a + w·(b − a), rounded once, as torch's Muon computes them: a
            # one-ulp difference before the bf16 Newton–Schulz can grow past the tolerance.
            buf[n] = buf[n].lerp(g, 1 - mu)  # μ·b + (1 − μ)·g
            update = newton_schulz(g.lerp(buf[n], mu), ns)  # (1 − μ)·g + μ·b
            rows, cols = p.shape
            ratio = (0.2 * math.sqrt(max(rows, cols)) if adjust == "match_rms_adamw"
                     else math.sqrt(max(1.0, rows / cols)))
            params[n] = p * (1 - lr * cfg.weight_decay) - lr * ratio * update
    return params


@pytest.mark.parametrize("case", list(MUON_CASES))
def test_the_muon_step_equals_a_replay_written_out_by_hand(case: str) -> None:
    cfg = train_config(max_steps=3, optimizer="muon", muon_lr=0.02, warmup_steps=1,
                       schedule="cosine", weight_decay=0.1, grad_clip=0.0, eval_interval=100,
                       **MUON_CASES[case])
    _, rec, initial, _ = run_recorded(cfg, _ragged_batches(3, 3, 4))
    final = muon_replay(initial, rec.grads, cfg)
    # Steps are ~0.01 per element; the replay rounds as torch does (it agrees to ~1e-8), and
    # 1e-4 leaves room for a bf16 rounding flip while any wrong lever moves 2e-3 or more.
    for n in MUON_MATRICES:
        torch.testing.assert_close(rec.weights[-1][n], final[n], rtol=0, atol=1e-4, msg=n)
    for change in (dict(muon_momentum=0.95), dict(muon_ns_steps=1),
                   dict(muon_lr_adjust="original" if cfg.muon_lr_adjust == "match_rms_adamw"
                        else "match_rms_adamw")):
        wrong = muon_replay(initial, rec.grads, cfg, **change)
        moved = max(float((wrong[n] - rec.weights[-1][n]).abs().max()) for n in MUON_MATRICES)
        assert moved > 2e-3, (change, moved)


# -- the gradient scaler: unscale, then clip, then step ----------------------------------------
def test_clipping_sees_unscaled_gradients_under_a_grad_scaler_on_cpu() -> None:
    """torch's CPU GradScaler multiplies the loss by 2^12 (exact in fp32); unscaling before
    the clip must leave the reported norm, the clipped gradients and the weights exactly as
    without a scaler. Clipping the scaled gradients instead would report a norm 4096× too
    large and leave gradients 4096× too small."""
    cfg = train_config(max_steps=3, grad_clip=0.05, eval_interval=100, log_interval=1)
    batches = _ragged_batches(3, 3, 5)
    _, plain, _, _ = run_recorded(cfg, batches)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    _, scaled, _, _ = run_recorded(cfg, batches, scaler=scaler)
    assert scaler.get_scale() == 2.0 ** 12  # no overflow, no growth: it really scaled
    for step in range(3):
        assert plain.logs[step]["grad_norm"] > 0.05  # the clip acts
        assert scaled.logs[step]["grad_norm"] == pytest.approx(plain.logs[step]["grad_norm"],
                                                               rel=1e-6)
        for n, g in plain.grads[step].items():
            torch.testing.assert_close(scaled.grads[step][n], g, rtol=1e-6, atol=1e-12, msg=n)
        for n, w in plain.weights[step].items():
            torch.testing.assert_close(scaled.weights[step][n], w, rtol=1e-6, atol=1e-9, msg=n)


# -- window and batch warm-ups, typed in -------------------------------------------------------
def test_window_warmup_values() -> None:
    """16 + 48·step/8 tokens, rounded down to a multiple of 8, never below 16."""
    cfg = TrainConfig(block_size=64, seq_warmup_steps=8, seq_warmup_start=16)
    assert [window_at(s, cfg) for s in range(11)] == [16, 16, 24, 32, 40, 40, 48, 56, 64, 64,
                                                      64]
    assert window_at(0, TrainConfig(block_size=64)) == 64  # off: the whole window


def test_batch_warmup_values() -> None:
    """3 + 9·step/6 rows (rounded down), then 12; over two ranks, multiples of 2 from 4."""
    cfg = TrainConfig(batch_size=12, batch_warmup_steps=6, batch_warmup_start=3)
    assert [batch_rows_at(s, cfg) for s in range(8)] == [3, 4, 6, 7, 9, 10, 12, 12]
    two = TrainConfig(batch_size=12, batch_warmup_steps=6, batch_warmup_start=4)
    assert [batch_rows_at(s, two, multiple=2) for s in range(7)] == [4, 4, 6, 8, 8, 10, 12]
    assert batch_rows_at(0, TrainConfig(batch_size=12)) == 12


def test_the_trainer_trains_on_the_warmed_up_window_and_rows() -> None:
    cfg = train_config(batch_size=6, max_steps=5, seq_warmup_steps=4, seq_warmup_start=8,
                       batch_warmup_steps=4, batch_warmup_start=2, eval_interval=100)
    shapes: list[tuple[int, int]] = []

    def forward(model: nn.Module, batch: Batch) -> Tensor:
        if model.training:
            shapes.append(tuple(batch.ids.shape))  # type: ignore[arg-type]
        return model(batch.ids, padding_mask=batch.padding_mask)

    make_trainer(cfg, forward_fn=forward).fit()
    # rows 2 + 4·s/4 → 2, 3, 4, 5, 6; window 8 + 8·s/4 → 8, 8, 8, 8 (multiples of 8), 16.
    assert shapes == [(2, 8), (3, 8), (4, 8), (5, 8), (6, 16)]


# -- the step counters -------------------------------------------------------------------------
class Counter:
    def __init__(self) -> None:
        self.logged: list[int] = []
        self.evaluated: list[int] = []

    def on_log(self, step: int, metrics: dict[str, Any]) -> None:
        self.logged.append(step)

    def on_eval(self, step: int, metrics: dict[str, Any]) -> None:
        self.evaluated.append(step)


def test_log_and_eval_intervals_count_optimizer_steps_and_include_the_last() -> None:
    rec = Counter()
    cfg = train_config(max_steps=10, log_interval=3, eval_interval=4)
    result = make_trainer(cfg, callbacks=[rec]).fit()
    assert result.steps == 10 and len(result.train_losses) == 10
    assert rec.logged == [3, 6, 9, 10]
    assert rec.evaluated == [4, 8, 10]


def test_checkpoint_interval_and_keep_last(tmp_path: Path) -> None:
    """Without validation nothing is ever 'best': checkpoints at every 3rd step and the last;
    keep_last = 2 keeps the two newest."""
    cfg = train_config(max_steps=10, checkpoint_interval=3, keep_last=2, eval_interval=100)
    seen: list[list[int]] = []

    class Listing:
        def on_step_end(self, step: int) -> None:
            seen.append([c.step for c in list_checkpoints(tmp_path)])

    make_trainer(cfg, ckpt_dir=tmp_path, val_batches=[], callbacks=[Listing()]).fit()
    assert seen[2] == [3] and seen[5] == [3, 6] and seen[8] == [6, 9]
    assert seen[-1] == [9, 10]
    # checkpoint_interval = 0: at every evaluation.
    assert train_config(eval_interval=7, checkpoint_interval=0).effective_checkpoint_interval \
        == 7


def test_early_stopping_patience_counts_evaluations_without_improvement() -> None:
    """A validation loss that never improves on the first: patience 2 stops at the second
    evaluation after it (evals at 2, 4, 6 → stop at 6)."""
    cfg = train_config(max_steps=20, eval_interval=2, early_stopping_patience=2)
    trainer = make_trainer(cfg)
    trainer.evaluate = lambda: {"val_loss": 1.0}  # type: ignore[method-assign]
    result = trainer.fit()
    assert result.stopped_early and result.steps == 6 and result.best_step == 2


def test_target_val_loss_stops_at_the_first_evaluation_at_or_under_it() -> None:
    """Evaluations at 2, 4, 6, … see 1.0, 0.9, 0.8, …: a target of 0.8 stops at step 6 (0.8
    is "at"), marks the run finished, and keeps every later step untaken; 0 trains on."""
    losses = iter([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1])
    cfg = train_config(max_steps=20, eval_interval=2, target_val_loss=0.8)
    trainer = make_trainer(cfg)
    trainer.evaluate = lambda: {"val_loss": next(losses)}  # type: ignore[method-assign]
    result = trainer.fit()
    assert result.reached_target and not result.stopped_early
    assert result.steps == 6 and trainer.finished and result.final_val_loss == 0.8
    losses = iter([1.0] * 10)
    trainer = make_trainer(train_config(max_steps=20, eval_interval=2))
    trainer.evaluate = lambda: {"val_loss": next(losses)}  # type: ignore[method-assign]
    result = trainer.fit()
    assert result.steps == 20 and not result.reached_target


def test_max_nonfinite_steps_is_the_number_of_skipped_steps_that_stops_the_run() -> None:
    cfg = train_config(max_steps=20, max_nonfinite_steps=3, eval_interval=100)
    trainer = make_trainer(cfg, loss_fn=lambda logits, targets: logits.sum() * math.nan)
    before = copy.deepcopy(trainer.model.state_dict())
    with pytest.raises(NonFiniteError, match="max_nonfinite_steps=3"):
        trainer.fit()
    assert trainer.step == 3 and trainer.nonfinite_steps == 3
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in before.items())


# -- the data levers the LM job reads --------------------------------------------------------------
def test_val_fraction_holds_out_the_last_tokens_and_eval_batches_count_windows() -> None:
    """``val_fraction`` 0.25 of 1000 tokens: the last 250 are the validation stream (the LM job
    splits with it); ``eval_batches`` × ``batch_size`` evenly spaced windows of it are the
    validation batches, first and last window included."""
    from handformer.data import LMWindows, train_val_split

    ids = torch.arange(1000)
    train, val = train_val_split(ids, TrainConfig(val_fraction=0.25).val_fraction)
    assert torch.equal(train, ids[:750]) and torch.equal(val, ids[750:])
    batches = LMWindows(val, 16).fixed_batches(3, 4)  # eval_batches = 3, batch_size = 4
    assert [tuple(b.ids.shape) for b in batches] == [(4, 16)] * 3
    starts = [int(row[0]) - 750 for b in batches for row in b.ids]
    n_windows = 250 - 16  # starts 0 … 233
    assert starts == [k * (n_windows - 1) // 11 for k in range(12)]
