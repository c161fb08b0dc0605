"""The main job, wired end to end: text → tokenizer → windows → DecoderLM → Trainer → run.

The CLI's ``handformer train`` is a thin shell around ``train_char_lm``.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from handformer.config import ModelConfig, TrainConfig, get_preset
from handformer.data import LMWindows, train_val_split
from handformer.generate import generate
from handformer.models.decoder_lm import DecoderLM
from handformer.tokenizers import CharTokenizer
from handformer.train.run_folder import METRICS, MetricsWriter, save_run
from handformer.train.trainer import Trainer, TrainResult

__all__ = ["LMRun", "build_configs", "train_char_lm"]


@dataclass
class LMRun:
    run_dir: Path
    model: DecoderLM
    tokenizer: CharTokenizer
    model_config: ModelConfig
    train_config: TrainConfig
    result: TrainResult
    unigram_loss: float
    sample: str


def build_configs(
    preset: str, vocab_size: int, model_overrides: dict[str, Any] | None = None,
    train_overrides: dict[str, Any] | None = None,
) -> tuple[ModelConfig, TrainConfig]:
    p = get_preset(preset)
    train_cfg = TrainConfig.from_dict({**p.train, **(train_overrides or {})})
    model_kwargs = {**p.model, **(model_overrides or {})}
    model_kwargs.setdefault("max_len", train_cfg.block_size)
    model_cfg = ModelConfig.from_dict({**model_kwargs, "vocab_size": vocab_size})
    if train_cfg.block_size > model_cfg.max_len:
        raise ValueError(f"training window block_size={train_cfg.block_size} exceeds the model's "
                         f"max_len={model_cfg.max_len}")
    return model_cfg, train_cfg


def unigram_loss(train_ids: torch.Tensor, val_ids: torch.Tensor, vocab_size: int) -> float:
    """Validation cross-entropy of the best context-free model (train-set frequencies)."""
    counts = torch.bincount(train_ids, minlength=vocab_size).double() + 1.0  # add-one
    logp = (counts / counts.sum()).log()
    return float(-logp[val_ids].mean())


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train_char_lm(
    text: str,
    *,
    out_dir: str | Path,
    preset: str = "default",
    model_overrides: dict[str, Any] | None = None,
    train_overrides: dict[str, Any] | None = None,
    progress: bool = True,
    sample_prompt: str = "\n",
    sample_tokens: int = 200,
) -> LMRun:
    tokenizer = CharTokenizer.from_text(text)
    model_cfg, train_cfg = build_configs(preset, tokenizer.vocab_size, model_overrides,
                                         train_overrides)
    seed_everything(train_cfg.seed)
    ids = tokenizer.encode_array(text)
    train_ids, val_ids = train_val_split(ids, train_cfg.val_fraction)
    train_windows = LMWindows(train_ids, train_cfg.block_size, name="training split")
    val_windows = LMWindows(val_ids, train_cfg.block_size, name="validation split")
    val_batches = val_windows.fixed_batches(train_cfg.eval_batches, train_cfg.batch_size)

    model = DecoderLM(model_cfg)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(
        model,
        train_cfg,
        train_batch=lambda g: train_windows.random_batch(train_cfg.batch_size, g),
        val_batches=val_batches,
        callbacks=[MetricsWriter(out_dir / METRICS)],
        progress=progress,
    )
    result = trainer.fit()
    baseline = unigram_loss(train_ids, val_ids, tokenizer.vocab_size)
    summary = {
        "final_val_loss": result.final_val_loss,
        "unigram_val_loss": baseline,
        "ln_vocab": math.log(tokenizer.vocab_size),
        "seconds": result.seconds,
        "median_step_ms": result.median_step_ms,
        "parameters": model.num_parameters(),
    }
    save_run(out_dir, model, model_cfg, tokenizer, train_cfg, extra={"summary": summary})
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")

    prompt = torch.tensor([tokenizer.encode(sample_prompt)], dtype=torch.long)
    sample_ids = generate(model, prompt, sample_tokens, temperature=0.8, top_k=None,
                          seed=train_cfg.seed)
    sample = tokenizer.decode(sample_ids[0].tolist())
    return LMRun(out_dir, model, tokenizer, model_cfg, train_cfg, result, baseline, sample)
