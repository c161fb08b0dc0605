"""The training engine: schedules as applied, gradient accumulation, the non-finite guard,
exact in-process resume, bf16 autocast, evaluation, best checkpoint and early stopping."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from handformer.config import TrainConfig
from handformer.data import Batch, collate_sequences
from handformer.loss import lm_loss
from handformer.train.checkpoint import list_checkpoints, load_weights, read_trainer_state
from handformer.train.distributed import DistContext
from handformer.train.optim import lr_at
from handformer.train.precision import resolve_precision
from handformer.train.trainer import NonFiniteError, Trainer
from tests.train.helpers import (
    TEXT,
    TOKENIZER,
    make_trainer,
    pause_and_resume,
    train_config,
    weights,
)


class Recorder:
    """Callback that keeps what the trainer reports."""

    def __init__(self) -> None:
        self.logs: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []

    def on_log(self, step: int, metrics: dict[str, Any]) -> None:
        self.logs.append(metrics)

    def on_eval(self, step: int, metrics: dict[str, Any]) -> None:
        self.evals.append(metrics)


def optimizer_snapshot(opt: torch.optim.Optimizer) -> dict[tuple[int, str], torch.Tensor]:
    return {(pid, k): v.clone() for pid, s in opt.state_dict()["state"].items()
            for k, v in s.items()}


# -- schedules ----------------------------------------------------------------------------
def test_linear_warmup_schedule_values_at_chosen_steps() -> None:
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110, schedule="linear")
    assert lr_at(0, cfg) == pytest.approx(1e-3 / 11)  # step 0 is not wasted at lr 0
    assert lr_at(9, cfg) == pytest.approx(1e-3 * 10 / 11)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(1e-3 - 9e-4 * 0.5)
    assert lr_at(110, cfg) == pytest.approx(1e-4)
    assert lr_at(500, cfg) == pytest.approx(1e-4)


def test_trainer_applies_the_schedule_step_by_step() -> None:
    rec = Recorder()
    cfg = train_config(max_steps=8, warmup_steps=3, schedule="cosine", eval_interval=8)
    trainer = make_trainer(cfg, callbacks=[rec])
    trainer.fit()
    assert [m["lr"] for m in rec.logs] == [lr_at(s, cfg) for s in range(8)]
    assert rec.logs[0]["lr"] > 0
    assert all(m["grad_norm"] > 0 for m in rec.logs)  # the pre-clip norm is reported


# -- gradient accumulation ----------------------------------------------------------------
def _ragged_batch(n: int, seed: int) -> list[list[int]]:
    """n sequences of different lengths: micro-batches then hold different token counts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.as_tensor(TOKENIZER.encode_array(TEXT[:4000]))
    out = []
    for _ in range(n):
        length = int(torch.randint(5, 16, (1,), generator=g))
        start = int(torch.randint(0, len(ids) - 20, (1,), generator=g))
        out.append(ids[start:start + length].tolist())
    return out


def test_grad_accumulation_4x3_equals_batch_12() -> None:
    seqs = _ragged_batch(12, seed=3)
    big = collate_sequences(seqs)
    micro = [collate_sequences(seqs[i:i + 4]) for i in range(0, 12, 4)]
    assert len({m.num_tokens for m in micro}) > 1  # unequal shares: weighting matters

    def trainer_for(batches: list[Batch], batch_size: int, accum: int) -> Trainer:
        stream = iter(batches)
        cfg = train_config(batch_size=batch_size, grad_accum_steps=accum, max_steps=1,
                           eval_interval=1)
        return make_trainer(cfg, model_seed=5, train_batch=lambda g: next(stream))

    a, b = trainer_for(micro, 4, 3), trainer_for([big], 12, 1)
    loss_a = a.accumulate_gradients(micro)
    loss_b = b.accumulate_gradients([big])
    torch.testing.assert_close(loss_a, loss_b)
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, msg=name)

    # One whole optimiser step through fit(): same weights within fp32 tolerance.
    a, b = trainer_for(micro, 4, 3), trainer_for([big], 12, 1)
    a.fit()
    b.fit()
    for (name, wa), wb in zip(weights(a.model).items(), weights(b.model).values(), strict=True):
        torch.testing.assert_close(wa, wb, msg=name)


# -- the non-finite guard -----------------------------------------------------------------
def test_nan_loss_never_reaches_weights_or_optimizer() -> None:
    poison = {"on": False}

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(logits, targets)
        return loss * float("nan") if poison["on"] else loss

    rec = Recorder()
    trainer = make_trainer(train_config(max_steps=10), loss_fn=loss_fn, callbacks=[rec])
    trainer.fit(stop_at=3)
    before_w, before_o = weights(trainer.model), optimizer_snapshot(trainer.optimizer)
    poison["on"] = True
    trainer.fit(stop_at=4)
    assert trainer.step == 4 and trainer.nonfinite_steps == 1
    assert rec.logs[-1]["skipped"] is True and math.isnan(rec.logs[-1]["loss"])
    for k, v in weights(trainer.model).items():
        assert torch.equal(v, before_w[k]), k
    after_o = optimizer_snapshot(trainer.optimizer)
    assert after_o.keys() == before_o.keys()
    assert all(torch.equal(after_o[k], before_o[k]) for k in before_o)
    poison["on"] = False
    trainer.fit(stop_at=5)  # a good step trains again
    assert not torch.equal(weights(trainer.model)["blocks.0.ffn.fc_in.weight"],
                           before_w["blocks.0.ffn.fc_in.weight"])


def test_inf_gradient_with_finite_loss_is_skipped() -> None:
    trainer = make_trainer(train_config(max_steps=10))
    trainer.fit(stop_at=2)
    before = weights(trainer.model)
    param = trainer.model.blocks[0].ffn.fc_in.weight
    handle = param.register_hook(lambda g: g * float("inf"))
    trainer.fit(stop_at=3)
    handle.remove()
    assert trainer.nonfinite_steps == 1
    assert all(torch.equal(v, before[k]) for k, v in weights(trainer.model).items())


def test_too_many_nonfinite_steps_stop_with_last_good_checkpoint(tmp_path: Path) -> None:
    calls = {"n": 0}

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        loss = lm_loss(logits, targets)
        return loss * float("inf") if calls["n"] > 4 else loss  # diverges after step 4

    cfg = train_config(max_steps=20, checkpoint_interval=2, eval_interval=100,
                       max_nonfinite_steps=3)
    trainer = make_trainer(cfg, loss_fn=loss_fn, ckpt_dir=tmp_path / "ck")
    with pytest.raises(NonFiniteError, match=r"3 steps had a non-finite.*step-00000004"):
        trainer.fit()
    assert trainer.step == 7
    last = list_checkpoints(tmp_path / "ck")[-1]
    assert last.step == 4
    reloaded = make_trainer(cfg, model_seed=1)
    load_weights(reloaded.model, last.path)  # verifies the marker and hashes too
    for k, v in weights(reloaded.model).items():
        assert torch.equal(v, weights(trainer.model)[k]), k  # the skipped steps changed nothing
        assert torch.isfinite(v).all()


# -- exact resume -------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_pause_and_resume_equals_straight_run_with_dropout(tmp_path: Path,
                                                           precision: str) -> None:
    cfg = train_config(max_steps=12, checkpoint_interval=5, precision=precision,
                       grad_accum_steps=2)
    straight, losses, second, resumed = pause_and_resume(cfg, tmp_path / "ck", pause_at=5)
    assert resumed == losses
    for k, v in weights(straight.model).items():
        assert torch.equal(v, weights(second.model)[k]), k
    # Dropout really was on: the same run without it gives other losses.
    assert make_trainer(train_config(**{**cfg.to_dict(), "max_steps": 3})).fit() \
        .train_losses != losses[:3]


def test_state_records_best_and_counters(tmp_path: Path) -> None:
    trainer = make_trainer(train_config(max_steps=8, eval_interval=4), ckpt_dir=tmp_path)
    result = trainer.fit()
    meta = read_trainer_state(list_checkpoints(tmp_path)[-1].path).meta
    assert meta["step"] == 8 and meta["finished"] is True
    assert meta["best_val_loss"] == result.best_val_loss
    assert meta["best_step"] == result.best_step
    assert meta["nonfinite_steps"] == 0


# -- precision ----------------------------------------------------------------------------
def test_bf16_autocast_trains_on_cpu_and_the_loss_falls() -> None:
    seen: list[tuple[bool, torch.dtype]] = []

    def forward(model: nn.Module, batch: Batch) -> torch.Tensor:
        logits = model(batch.ids, padding_mask=batch.padding_mask)
        seen.append((torch.is_autocast_enabled("cpu"), logits.dtype))
        return logits

    cfg = train_config(max_steps=40, precision="bf16", eval_interval=40, eval_batches=4)
    trainer = make_trainer(cfg, forward_fn=forward)
    before = trainer.evaluate()["val_loss"]
    result = trainer.fit()
    assert all(on and dtype == torch.bfloat16 for on, dtype in seen)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert result.final_val_loss < before - 0.5, (before, result.final_val_loss)


def test_precision_choices_fail_clearly() -> None:
    with pytest.raises(ValueError, match=r"fp16.*needs CUDA"):
        resolve_precision("fp16", torch.device("cpu"))
    with pytest.raises(ValueError, match="precision='fp8' is not one of"):
        TrainConfig(precision="fp8")
    assert resolve_precision("fp32", torch.device("cpu")).scaler is None


def test_compile_option_trains_the_uncompiled_weights(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    """torch.compile wraps the forward pass; checkpoints keep plain names. (The aot_eager
    backend traces exactly like the default one but skips C++ code generation, which takes a
    minute on CPU.)"""
    real_compile = torch.compile
    calls: list[nn.Module] = []

    def fake_compile(model: nn.Module, **kwargs: Any) -> nn.Module:
        calls.append(model)
        return real_compile(model, backend="aot_eager")

    monkeypatch.setattr(torch, "compile", fake_compile)
    cfg = train_config(max_steps=3, eval_interval=3, compile=True)
    trainer = make_trainer(cfg, ckpt_dir=tmp_path)
    result = trainer.fit()
    assert calls == [trainer.model] and trainer.forward_model is not trainer.model
    eager = make_trainer(train_config(max_steps=3, eval_interval=3)).fit()
    assert result.train_losses == pytest.approx(eager.train_losses, rel=1e-4)
    fresh = make_trainer(cfg.__class__(**{**cfg.to_dict(), "compile": False}), model_seed=3)
    load_weights(fresh.model, list_checkpoints(tmp_path)[-1].path)  # no _orig_mod. prefix


# -- evaluation, best checkpoint, early stopping --------------------------------------------
def test_evaluation_reports_perplexity_and_bits() -> None:
    trainer = make_trainer(train_config(), chars_per_token=1.0)
    m = trainer.evaluate()
    assert m["val_ppl"] == pytest.approx(math.exp(m["val_loss"]))
    assert m["val_bits_per_token"] == pytest.approx(m["val_loss"] / math.log(2))
    assert m["val_bits_per_char"] == pytest.approx(m["val_bits_per_token"])
    assert abs(m["val_loss"] - math.log(TOKENIZER.vocab_size)) < 0.3  # untrained ≈ uniform


def test_best_checkpoint_is_kept_and_early_stopping_ends_the_run(tmp_path: Path) -> None:
    val_losses = iter([3.0, 1.0, 2.0, 2.5, 2.7, 2.9, 3.1])
    cfg = train_config(max_steps=50, eval_interval=2, keep_last=1,
                       early_stopping_patience=3)
    trainer = make_trainer(cfg, ckpt_dir=tmp_path / "ck")
    trainer.evaluate = lambda: {"val_loss": next(val_losses)}  # type: ignore[method-assign]
    result = trainer.fit()
    assert result.stopped_early and result.steps == 10  # evals at 2, 4 (best), 6, 8, 10
    assert result.best_step == 4 and result.best_val_loss == 1.0
    assert [c.step for c in list_checkpoints(tmp_path / "ck")] == [4, 10]
    assert read_trainer_state(tmp_path / "ck" / "step-00000010").meta["finished"] is True


# -- callbacks ---------------------------------------------------------------------------
def test_on_step_end_comes_once_per_step_after_its_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    ends: list[tuple[int, list[int]]] = []

    class StepEnd:
        def on_step_end(self, step: int) -> None:
            ends.append((step, [c.step for c in list_checkpoints(root)]))

    cfg = train_config(max_steps=6, eval_interval=3, checkpoint_interval=3, keep_last=5)
    make_trainer(cfg, ckpt_dir=root, callbacks=[StepEnd()]).fit()
    assert [step for step, _ in ends] == [1, 2, 3, 4, 5, 6]
    assert ends[2] == (3, [3]) and ends[5] == (6, [3, 6])  # the step's checkpoint included


def test_only_every_rank_callbacks_run_on_other_ranks() -> None:
    calls: list[str] = []

    class Quiet:
        def on_step_end(self, step: int) -> None:
            calls.append("rank-0 only")

    class Everywhere(Quiet):
        every_rank = True

        def on_step_end(self, step: int) -> None:
            calls.append("every rank")

    trainer = make_trainer(train_config(), callbacks=[Quiet(), Everywhere()])
    trainer._emit("on_step_end", 1)
    assert calls == ["rank-0 only", "every rank"]
    calls.clear()
    trainer.dist = DistContext(rank=1, world_size=2)  # as rank 1 sees it (no collective here)
    trainer._emit("on_step_end", 1)
    assert calls == ["every rank"]


# -- model-agnostic -------------------------------------------------------------------------
def test_trainer_trains_a_classifier_it_knows_nothing_about() -> None:
    """Only ``forward_fn(model, batch) → logits`` and ``loss_fn(logits, targets)``: here a
    bag-of-characters classifier deciding whether a window contains 'dog'."""
    ids = torch.as_tensor(TOKENIZER.encode_array(TEXT))
    dog = torch.as_tensor(TOKENIZER.encode("dog"))

    def batch(g: torch.Generator) -> Batch:
        starts = torch.randint(0, len(ids) - 24, (16,), generator=g)
        windows = ids[starts[:, None] + torch.arange(24)]  # (B, T)
        has = windows.unfold(1, 3, 1).eq(dog).all(-1).any(-1).long()  # (B,)
        return Batch(ids=windows, targets=has)

    model = nn.Sequential(nn.Embedding(TOKENIZER.vocab_size, 16), nn.Flatten(),
                          nn.Linear(16 * 24, 2))
    cfg = train_config(max_steps=150, lr=1e-2, eval_interval=150, batch_size=16)
    g = torch.Generator().manual_seed(1)
    val = [batch(g) for _ in range(8)]
    trainer = Trainer(model, cfg, train_batch=batch, val_batches=val, progress=False,
                      forward_fn=lambda m, b: m(b.ids), loss_fn=F.cross_entropy)
    before = weights(model)
    result = trainer.fit()
    # About a quarter of the windows hold 'dog'. Learning the label frequency alone (the
    # output bias) scores the majority rate and a loss of the labels' entropy, ~0.55; telling
    # the windows apart needs the embeddings and the weights (it reaches ~98 %, loss ~0.1).
    labels = torch.cat([b.targets for b in val])
    rate = labels.float().mean().item()
    majority = max(rate, 1 - rate)
    entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    with torch.no_grad():
        predicted = torch.cat([model(b.ids).argmax(-1) for b in val])
    accuracy = (predicted == labels).float().mean().item()
    assert accuracy >= 0.9 and accuracy > majority + 0.1, (accuracy, majority)
    assert result.final_val_loss < entropy / 2, (result.final_val_loss, entropy)
    assert not torch.equal(before["0.weight"], model[0].weight)  # the embeddings trained too
