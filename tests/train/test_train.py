"""The first training loop: schedule, parameter groups, and a run that must actually learn."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from handformer.config import TrainConfig
from handformer.data import LMWindows, train_val_split
from handformer.data.corpora import builtin_text
from handformer.models.decoder_lm import DecoderLM
from handformer.tokenizers import CharTokenizer
from handformer.train.optim import lr_at, param_groups
from handformer.train.trainer import Trainer, pick_device
from tests.conftest import tiny_config


def test_warmup_cosine_schedule_values() -> None:
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=100, max_steps=2000)
    assert lr_at(0, cfg) == pytest.approx(1e-3 / 101)  # step 0 already trains
    assert lr_at(99, cfg) == pytest.approx(1e-3 * 100 / 101)
    assert lr_at(100, cfg) == pytest.approx(1e-3)
    assert lr_at(1050, cfg) == pytest.approx(1e-4 + 0.5 * 9e-4)  # half-way: cos = 0
    assert lr_at(2000, cfg) == pytest.approx(1e-4)
    assert lr_at(5000, cfg) == pytest.approx(1e-4)
    lrs = [lr_at(s, cfg) for s in range(100, 2001)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))


def test_linear_and_constant_schedules() -> None:
    lin = TrainConfig(lr=1e-3, min_lr=0.0, warmup_steps=0, max_steps=100, schedule="linear")
    assert lr_at(0, lin) == pytest.approx(1e-3)
    assert lr_at(50, lin) == pytest.approx(5e-4)
    const = TrainConfig(lr=3e-4, schedule="constant")
    assert {lr_at(s, const) for s in (0, 10, 10_000)} == {3e-4}


def test_param_groups_skip_decay_on_norms_biases_and_positions() -> None:
    model = DecoderLM(tiny_config(positional="learned", tie_weights=True))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    not_decayed = {names[id(p)] for p in no_decay["params"]}
    assert "embed.token.weight" in decayed  # tied with the head: listed once
    assert "embed.positions.table.weight" in not_decayed
    assert all("norm" in n or n.endswith("bias") or "positions" in n for n in not_decayed)
    assert all(p.dim() >= 2 for p in decay["params"])
    total = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert total == model.num_parameters()


def test_pick_device() -> None:
    assert pick_device("cpu").type == "cpu"
    assert pick_device("auto").type in ("cpu", "cuda", "mps")
    with pytest.raises(ValueError, match="unknown device"):
        pick_device("tpu-ish")


def test_short_run_on_builtin_text_learns() -> None:
    """~10 s: a tiny model must beat the unigram baseline clearly, not just move."""
    text = builtin_text()[:120_000]
    tok = CharTokenizer.from_text(text)
    train_ids, val_ids = train_val_split(tok.encode_array(text), 0.1)
    cfg = TrainConfig(batch_size=16, block_size=32, max_steps=300, lr=3e-3, min_lr=3e-4,
                      warmup_steps=20, eval_interval=150, eval_batches=8, device="cpu")
    train_w, val_w = LMWindows(train_ids, 32), LMWindows(val_ids, 32)
    model = DecoderLM(tiny_config(vocab_size=tok.vocab_size, max_len=32, d_model=64))
    trainer = Trainer(model, cfg, train_batch=lambda g: train_w.random_batch(16, g),
                      val_batches=val_w.fixed_batches(8, 16), progress=False)
    first_eval = trainer.evaluate()["val_loss"]
    result = trainer.fit()
    assert abs(first_eval - math.log(tok.vocab_size)) < 0.2
    assert result.final_val_loss < 2.5, result.evals  # unigram baseline here is ~3.2
    assert len(result.train_losses) == 300 and all(map(math.isfinite, result.train_losses))


def test_training_is_reproducible_with_a_seed() -> None:
    tok = CharTokenizer.from_text("abcdefgh " * 50)
    windows = LMWindows(torch.as_tensor(tok.encode_array("abcdefgh " * 50)), 8)
    losses = []
    for _ in range(2):
        torch.manual_seed(1)
        model = DecoderLM(tiny_config(vocab_size=tok.vocab_size, max_len=8))
        cfg = TrainConfig(batch_size=4, block_size=8, max_steps=5, eval_interval=5,
                          eval_batches=1, device="cpu", seed=7)
        trainer = Trainer(model, cfg, train_batch=lambda g: windows.random_batch(4, g),
                          progress=False)
        losses.append(trainer.fit().train_losses)
    assert losses[0] == losses[1]
