"""Shared test helpers: tiny configs, deterministic seeds, no network and no ../shared."""

from __future__ import annotations

import pytest
import torch

from handformer.config import ModelConfig


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=37, d_model=32, n_heads=4, n_layers=2, max_len=16, dropout=0.0)
    base.update(overrides)
    return ModelConfig(**base)
