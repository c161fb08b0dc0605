"""One request as the engine tracks it: its tokens, its window, its blocks, its settings.

A request's *context* is ``tokens[window_start:]`` — the prompt and what was generated so far,
from the start of the model's window (``generate.slide_window``: for a model of window
``max_len`` it moves forward half a window at a time, exactly as ``handformer generate``
moves it). ``cached`` of those tokens have their keys and values in the request's blocks
(``table``); the rest are computed by the next forward calls — all of them after admission
or preemption (a prefill, in chunks), one per step while decoding. Plain data: no tensors.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Request", "RequestOutput", "SamplingParams"]

_ids = itertools.count()


@dataclass(frozen=True)
class SamplingParams:
    """How a request samples and when it stops. ``temperature`` 0 is greedy; ``seed`` makes
    sampling reproducible (one generator per request, so the crowd around it changes
    nothing); ``stop`` strings end the text before them."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass
class RequestOutput:
    """What the engine tells a request's owner after a step: the ``text`` it may show now
    (stop strings held back until they are ruled out), and when it ends, why."""

    text: str
    completion_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error"
    error: str | None = None


@dataclass(eq=False)
class Request:
    """A prompt (token ids), its sampling settings and the engine's state for it."""

    prompt: list[int]
    params: SamplingParams
    on_output: Callable[[RequestOutput], None] = lambda out: None
    id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(init=False)
    window_start: int = 0
    cached: int = 0
    table: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def generated(self) -> int:
        """How many tokens were generated so far."""
        return len(self.tokens) - len(self.prompt)

    @property
    def context_len(self) -> int:
        """Tokens the model reads for the next one: ``tokens[window_start:]``."""
        return len(self.tokens) - self.window_start

    @property
    def to_compute(self) -> int:
        """Context tokens whose keys and values are not in the blocks yet."""
        return self.context_len - self.cached
