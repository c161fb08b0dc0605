"""Shared test helpers: tiny configs, deterministic seeds, no network and no ../shared."""

from __future__ import annotations

import os

import pytest
import torch

from handformer.config import ModelConfig


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_configure(config: pytest.Config) -> None:
    """One intra-op thread by default: the test models are tiny, and on a busy 2-core
    machine OpenMP threads that wait on each other make small ops many times slower.
    Set HANDFORMER_TEST_THREADS to override."""
    torch.set_num_threads(int(os.environ.get("HANDFORMER_TEST_THREADS", "1")))


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=37, d_model=32, n_heads=4, n_layers=2, max_len=16, dropout=0.0)
    base.update(overrides)
    return ModelConfig(**base)
