"""The scheduler: which requests run in the next engine step, and with how many tokens.

Continuous batching: between two steps, finished or cancelled requests leave at once and
waiting ones join, so the batch is never held back by its longest member (static batching
pads every request to the longest and runs until it ends). Each step it plans:

* every running request that is decoding feeds its one newest token; they run together as
  one batch;
* a request still reading its context (a new prompt, a window that slid, a recompute after
  preemption) feeds a chunk of at most ``prefill_chunk`` tokens, within ``step_tokens`` per
  step for all chunks together — a long prompt is read over several steps while the
  decoding requests keep streaming instead of waiting for it;
* waiting requests are admitted oldest first while the pool has the blocks for their first
  chunk and fewer than ``max_batch`` run;
* when a running request needs a block the pool does not have, the *newest* running request
  is preempted: its blocks go back to the pool, it returns to the front of the queue, and
  when it is admitted again its context is recomputed (the tokens it generated are kept, so
  its output does not change; its random generator lives on with it).

The scheduler knows nothing of tensors: it moves integers (token ids, block ids, counts).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from handformer.generate.plain import slide_window
from handformer.serve.blocks import BlockManager
from handformer.serve.request import Request

__all__ = ["Plan", "Scheduler", "max_cached"]


def max_cached(prompt_len: int, max_tokens: int, max_len: int) -> int:
    """The most context tokens a request ever holds in blocks: the context before its last
    token, at most one window of ``max_len``."""
    return min(prompt_len + max_tokens - 1, max_len)


@dataclass
class Plan:
    """One step: ``prefills`` (request, tokens to feed) run one call each; ``decodes`` feed
    one token each, in one batched call. ``preempted`` lost their blocks this step."""

    prefills: list[tuple[Request, int]] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


class Scheduler:
    """Waiting queue, running batch and the block manager they share."""

    def __init__(self, blocks: BlockManager, *, max_len: int, max_batch: int = 32,
                 step_tokens: int = 256, prefill_chunk: int = 64) -> None:
        if min(max_batch, step_tokens, prefill_chunk) <= 0:
            raise ValueError(f"max_batch, step_tokens and prefill_chunk must be > 0; got "
                             f"{max_batch}, {step_tokens}, {prefill_chunk}")
        self.blocks = blocks
        self.max_len = max_len
        self.max_batch = max_batch
        self.step_tokens = step_tokens
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take ``request`` out (finished, cancelled or failed) and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.release(request.table)
        request.cached = 0

    def _slide(self, request: Request) -> None:
        """Move the request's window as ``generate`` does; its cache is refilled from the
        kept tokens."""
        start = slide_window(request.window_start, len(request.tokens), self.max_len)
        if start != request.window_start:
            self.blocks.release(request.table)
            request.window_start, request.cached = start, 0

    def _preempt(self, plan: Plan) -> Request:
        victim = self.running.pop()  # the newest
        self.blocks.release(victim.table)
        victim.cached = 0
        self.waiting.appendleft(victim)
        plan.preempted.append(victim)
        self.preemptions += 1
        return victim

    def schedule(self) -> Plan:
        """Plan the next step (allocating the blocks it writes); see the module docstring."""
        plan = Plan()
        budget = self.step_tokens
        for request in list(self.running):  # oldest first
            if request not in self.running:  # preempted for an older one this step
                continue
            self._slide(request)
            n = request.to_compute
            if n > 1:
                n = min(n, self.prefill_chunk, budget)
                if n == 0:
                    continue  # this step's prefill budget is spent: next step
            while not self.blocks.allocate(request.table, request.cached + n):
                if self._preempt(plan) is request:
                    break
            if request not in self.running:
                continue
            if n == 1:
                plan.decodes.append(request)
            else:
                plan.prefills.append((request, n))
                budget -= n
        if plan.preempted:  # the pool is short already: admit no one this step
            return plan
        while self.waiting and len(self.running) < self.max_batch and budget > 0:
            request = self.waiting[0]
            self._slide(request)
            n = min(request.to_compute, self.prefill_chunk, budget)
            if not self.blocks.allocate(request.table, request.cached + n):
                break
            self.waiting.popleft()
            self.running.append(request)
            if n == 1:
                plan.decodes.append(request)
            else:
                plan.prefills.append((request, n))
                budget -= n
        return plan
