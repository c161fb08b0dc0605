"""Small builders shared by the training-engine tests: a seeded toy corpus, a tiny model and a
Trainer around them. Everything is small enough that one step takes milliseconds."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from handformer.config import ModelConfig, TrainConfig
from handformer.data import LMWindows, train_val_split
from handformer.models.decoder_lm import DecoderLM
from handformer.tokenizers import CharTokenizer
from handformer.train.checkpoint import CheckpointManager, list_checkpoints
from handformer.train.trainer import Trainer

WORDS = ["the cat", "a dog", "sees", "likes", "the sun", "an apple", "old boats", "hears"]
BLOCK = 16


def toy_text(n_sentences: int = 600, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(f"{rng.choice(WORDS)} {rng.choice(WORDS)} {rng.choice(WORDS)}.\n"
                   for _ in range(n_sentences))


TEXT = toy_text()
TOKENIZER = CharTokenizer.from_text(TEXT)
_TRAIN_IDS, _VAL_IDS = train_val_split(TOKENIZER.encode_array(TEXT), 0.1)
TRAIN_WINDOWS = LMWindows(_TRAIN_IDS, BLOCK)
VAL_WINDOWS = LMWindows(_VAL_IDS, BLOCK)


def model_config(**overrides: Any) -> ModelConfig:
    base: dict[str, Any] = dict(vocab_size=TOKENIZER.vocab_size, d_model=32, n_heads=4,
                                n_layers=2, max_len=BLOCK, dropout=0.0)
    base.update(overrides)
    return ModelConfig(**base)


def train_config(**overrides: Any) -> TrainConfig:
    base: dict[str, Any] = dict(batch_size=4, block_size=BLOCK, max_steps=12, lr=3e-3,
                                min_lr=3e-4, warmup_steps=2, eval_interval=4, eval_batches=2,
                                log_interval=1, device="cpu", seed=7)
    base.update(overrides)
    return TrainConfig(**base)


def make_trainer(cfg: TrainConfig, *, model_seed: int = 0, dropout: float = 0.0,
                 ckpt_dir: Path | None = None, **kwargs: Any) -> Trainer:
    """A fresh model (initialised from ``model_seed``) in a Trainer over the toy corpus."""
    torch.manual_seed(model_seed)
    model = DecoderLM(model_config(dropout=dropout))
    manager = None if ckpt_dir is None else CheckpointManager(ckpt_dir, keep_last=cfg.keep_last)
    kwargs.setdefault("train_batch", lambda g: TRAIN_WINDOWS.random_batch(cfg.batch_size, g))
    kwargs.setdefault("val_batches", VAL_WINDOWS.fixed_batches(cfg.eval_batches, cfg.batch_size))
    return Trainer(model, cfg, progress=False, checkpoints=manager, **kwargs)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def pause_and_resume(cfg: TrainConfig, ckpt_dir: Path, *, pause_at: int,
                     dropout: float = 0.2) -> tuple[Trainer, list[float], Trainer, list[float]]:
    """The same run twice: straight through, and paused at ``pause_at`` then continued by a
    fresh Trainer (another initial model, the process's random state disturbed) resumed from
    the checkpoint, as after a crash. Returns (straight trainer, its losses, resumed trainer,
    the paused and resumed losses end to end): an exact resume makes them equal."""
    straight = make_trainer(cfg, dropout=dropout)
    losses = straight.fit().train_losses
    head = make_trainer(cfg, dropout=dropout, ckpt_dir=ckpt_dir).fit(stop_at=pause_at)
    torch.manual_seed(999)  # anything the process did in between must not matter
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(999)  # nor the GPU's generators
    resumed = make_trainer(cfg, dropout=dropout, model_seed=31, ckpt_dir=ckpt_dir)
    resumed.resume(list_checkpoints(ckpt_dir)[-1].path)
    tail = resumed.fit().train_losses
    return straight, losses, resumed, head.train_losses + tail
