"""Shared test helpers: tiny configs, deterministic seeds, no network and no ../shared."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
import torch

from handformer.config import ModelConfig


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# One intra-op thread by default: the test models are tiny, and on a busy 2-core machine
# OpenMP threads that wait on each other make small ops many times slower. Set
# HANDFORMER_TEST_THREADS to override. This is the suite's only thread setting: test files
# do not set their own (subprocess tests pass OMP_NUM_THREADS to their children instead).
THREADS = int(os.environ.get("HANDFORMER_TEST_THREADS", "1"))


def pytest_configure(config: pytest.Config) -> None:
    torch.set_num_threads(THREADS)  # before any fixture, module-scoped ones included
    # A shell without job control starts a background command (`pytest &`, as .ci/run
    # starts its knob runs) with Ctrl-C ignored, and every process it starts inherits that:
    # the tests that press Ctrl-C on a command would find it deaf. Ctrl-C as a terminal
    # gives it, for this process and (reset to the default at exec) for its children.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    """Put the thread count back after a test whose code changed it (``--threads`` options,
    scripts that set their own), so that it cannot leak into the next test."""
    yield
    if torch.get_num_threads() != THREADS:
        torch.set_num_threads(THREADS)


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=37, d_model=32, n_heads=4, n_layers=2, max_len=16, dropout=0.0)
    base.update(overrides)
    return ModelConfig(**base)


class TokenKernelSpy:
    """Spies on the int8 token kernel (``nn.decode_block``): ``checks`` lists each model it
    checked in full (``_ends``: every unheld call), ``calls`` counts the calls that ask it
    for a token (``token_step``, and ``greedy_token`` for greedy decoding)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from handformer.nn import decode_block

        self.checks: list[object] = []
        self.calls = 0
        ends, token_step = decode_block._ends, decode_block.token_step
        greedy_token = decode_block.greedy_token

        def counting_ends(model: object) -> object:
            self.checks.append(model)
            return ends(model)

        def counting_token_step(*args: object) -> object:
            self.calls += 1
            return token_step(*args)

        def counting_greedy_token(*args: object) -> object:
            self.calls += 1
            return greedy_token(*args)

        monkeypatch.setattr(decode_block, "_ends", counting_ends)
        monkeypatch.setattr(decode_block, "greedy_token", counting_greedy_token)
        monkeypatch.setattr(decode_block, "token_step", counting_token_step)
