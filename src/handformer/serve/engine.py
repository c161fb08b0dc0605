"""The engine: runs the model on the scheduler's plan, one step at a time, and samples.

``Engine.step()`` asks the ``Scheduler`` for a plan and runs its prefill chunks and its
decoding requests in one forward call — packed one after another into one row, each
reading and writing its own blocks through a ``PagedBatchCache``, the model's own
``forward``, so a step reads the weights once — then samples every request whose
context is complete with ``generate.sample_next`` and *its own* ``torch.Generator``, so a
seeded request draws the same numbers whatever else is in the batch. A step's new text is
handed over once, at the step's end: ``Engine.deliver`` gets every (request, output) pair of
the step in order (by default it calls each request's ``on_output``; the server's engine
process sends the whole batch in one message, so the HTTP side wakes once a step, not once a
token); a request that ends (end-of-text token, stop string, ``max_tokens``, cancel) leaves
the batch and frees its blocks at once.

``EngineThread`` runs steps in a thread of its own, so whoever owns the engine only submits
and cancels (both thread-safe) and never waits on a forward pass; the server runs both in a
process of their own (``serve.process``). The engine knows nothing of HTTP.

Shape legend: ``B`` requests in a forward call, ``T`` new tokens of all of them, ``V``
vocabulary.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from handformer.generate.plain import (
    GREEDY_TEMPERATURE,
    NonFiniteLogitsError,
    sample_next,
    small_op_kernels,
)
from handformer.models.budget import Estimate, available_memory, check_fits
from handformer.serve.blocks import BlockManager, blocks_for
from handformer.serve.detokenize import TextStream
from handformer.serve.metrics import ServerMetrics
from handformer.serve.paged import KVPool, PagedBatchCache
from handformer.serve.request import Request, RequestOutput
from handformer.serve.scheduler import Scheduler, max_cached

__all__ = [
    "Engine",
    "EngineThread",
    "Outputs",
    "QueueFullError",
    "RequestLimits",
    "RequestTooLargeError",
]

Outputs = list[tuple[Request, RequestOutput]]

log = logging.getLogger("handformer.serve")


def deliver_each(outputs: Outputs) -> None:
    """``Engine.deliver``'s default: each output to its request's ``on_output``, in order."""
    for request, out in outputs:
        request.on_output(out)


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting`` requests already (HTTP 429)."""


class RequestTooLargeError(ValueError):
    """A request whose prompt and ``max_tokens`` can never fit the KV pool (HTTP 400)."""


@dataclass(frozen=True)
class RequestLimits:
    """What a request must meet to be queued: a prompt of ids in the vocabulary, and a prompt
    and ``max_tokens`` that a pool of ``num_blocks`` × ``block_size`` slots could hold (a
    context holds at most one window of ``max_len``). Plain data: the server's HTTP process
    checks each request by the engine's own rules before sending it."""

    vocab_size: int
    max_len: int
    block_size: int
    num_blocks: int

    def check(self, request: Request) -> None:
        """``ValueError`` for an empty prompt or ids outside the vocabulary,
        ``RequestTooLargeError`` for a request the pool could never hold."""
        if not request.prompt:
            raise ValueError("the prompt has no tokens")
        if not 0 <= min(request.prompt) <= max(request.prompt) < self.vocab_size:
            raise ValueError(f"prompt ids must lie in [0, {self.vocab_size}); got "
                             f"{min(request.prompt)}..{max(request.prompt)}")
        self.check_fits(len(request.prompt), request.params.max_tokens)

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """``RequestTooLargeError`` when a request could never be held by the pool."""
        tokens = max_cached(prompt_len, max_tokens, self.max_len)
        need = blocks_for(tokens, self.block_size)
        if need > self.num_blocks:
            raise RequestTooLargeError(
                f"this request can never fit the KV pool: its prompt ({prompt_len} tokens) "
                f"and max_tokens ({max_tokens}) need up to {tokens} cached tokens = {need} "
                f"blocks of {self.block_size}, and the pool has {self.num_blocks}; send a "
                "shorter prompt or fewer max_tokens")


def _float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype activations (and so keys and values) have: the first float parameter's
    (an int8 model's embedding stays float)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


class Engine:
    """A model, its tokenizer, one KV pool and the scheduler that shares it out.

    ``num_blocks`` × ``block_size`` token slots are allocated up front (default:
    ``default_blocks``); ``MemoryBudgetError`` if they cannot fit.
    ``max_waiting`` bounds the queue (``submit`` raises ``QueueFullError`` past it).
    ``deliver`` receives each step's outputs, in order, from the thread that steps the
    engine (default: ``deliver_each``).
    """

    def __init__(self, model: nn.Module, tokenizer: Any, *, num_blocks: int | None = None,
                 block_size: int = 16, max_batch: int = 32, max_waiting: int = 256,
                 step_tokens: int = 256, prefill_chunk: int = 64) -> None:
        config = model.config  # a DecoderLM's ModelConfig
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eos_id: int | None = tokenizer.eos_id
        self.vocab_size: int = config.vocab_size
        self.max_len: int = config.max_len
        param = next(model.parameters())
        self.device = param.device
        dtype = _float_dtype(model)
        block_bytes = (config.n_layers * block_size * 2 * config.n_kv_heads * config.head_dim
                       * torch.finfo(dtype).bits // 8)
        if num_blocks is None:
            num_blocks = self.default_blocks(max_batch, block_size, block_bytes)
        check_fits(Estimate("the KV pool", {"KV blocks": num_blocks * block_bytes},
                            hint="ask for fewer --kv-blocks or a smaller --block-size"),
                   self.device)
        self.pool = KVPool(config, num_blocks, block_size, dtype=dtype, device=self.device)
        self.blocks = BlockManager(num_blocks, block_size)
        self.limits = RequestLimits(self.vocab_size, self.max_len, block_size, num_blocks)
        self.scheduler = Scheduler(self.blocks, max_len=self.max_len, max_batch=max_batch,
                                   step_tokens=step_tokens, prefill_chunk=prefill_chunk)
        self.max_waiting = max_waiting
        self.metrics = ServerMetrics()
        self._inbox: queue.SimpleQueue[tuple[str, Request]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0  # submitted, not yet admitted to the running batch once
        self._admitted: set[int] = set()
        self._streams: dict[int, TextStream] = {}
        self._generators: dict[int, torch.Generator] = {}
        self.wake = threading.Event()
        self._outputs: Outputs = []  # this step's, handed to ``deliver`` at its end
        self.deliver: Callable[[Outputs], None] = deliver_each

    def default_blocks(self, max_batch: int, block_size: int, block_bytes: int) -> int:
        """A full window for each of ``max_batch`` requests, but no more than a quarter of
        the memory free on the device (a long-context model's windows could ask for more
        than the machine has); at least one block."""
        wanted = max_batch * blocks_for(self.max_len, block_size)
        free = available_memory(self.device)
        if free is None:
            return wanted
        return max(1, min(wanted, free // 4 // block_bytes))

    # -- the owner's side (any thread) ---------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue ``request`` (thread-safe). Raises as ``RequestLimits.check`` raises, or
        ``QueueFullError``."""
        self.limits.check(request)
        with self._lock:
            if self._queued >= self.max_waiting:
                raise QueueFullError(f"the queue is full ({self.max_waiting} requests "
                                     "waiting); retry shortly")
            self._queued += 1
        self._inbox.put(("add", request))
        self.wake.set()

    def cancel(self, request: Request) -> None:
        """Stop ``request`` and free its blocks before the next step (thread-safe)."""
        self._inbox.put(("cancel", request))
        self.wake.set()

    @property
    def queued(self) -> int:
        return self._queued

    def gauges(self) -> dict[str, tuple[str, float]]:
        """The live numbers ``/metrics`` shows (read without a lock: each is one int)."""
        s, b = self.scheduler, self.blocks
        return {
            "requests_running": ("Requests in the running batch.", len(s.running)),
            "requests_waiting": ("Requests queued, not running.", self._queued
                                 + sum(r.id in self._admitted for r in list(s.waiting))),
            "kv_blocks_used": ("KV blocks held by requests.", b.used),
            "kv_blocks_free": ("KV blocks free in the pool.", b.free),
            "kv_blocks_peak": ("The most KV blocks held at once since the server started.",
                               b.peak),
            "kv_block_size_tokens": ("Token slots per KV block.", b.block_size),
        }

    def counters(self) -> dict[str, tuple[str, int]]:
        """The counts ``/metrics`` shows that the scheduler keeps."""
        return {"preemptions_total": ("Requests preempted (blocks freed, recomputed later).",
                                      self.scheduler.preemptions)}

    # -- the engine's side (one thread) --------------------------------------------------
    def _drain_inbox(self) -> None:
        while True:
            try:
                what, request = self._inbox.get_nowait()
            except queue.Empty:
                return
            if what == "add":
                seed = request.params.seed
                self._generators[request.id] = torch.Generator(device=self.device).manual_seed(
                    secrets.randbits(63) if seed is None else seed)
                self._streams[request.id] = TextStream(self.tokenizer, request.params.stop)
                self.metrics.prompt(len(request.prompt))
                self.scheduler.add(request)
            elif not request.finished:
                self._finish(request, "cancelled", "")

    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty()

    def step(self) -> None:
        """One scheduling round: every prefill chunk and every decoding request in one
        forward call; then the round's outputs go to ``deliver`` together."""
        try:
            self._step()
        finally:
            self._hand_over()

    def _hand_over(self) -> None:
        if self._outputs:
            outputs, self._outputs = self._outputs, []
            self.deliver(outputs)

    def _step(self) -> None:
        self._drain_inbox()
        plan = self.scheduler.schedule()
        for request in self.scheduler.running:
            if request.id not in self._admitted:
                self._admitted.add(request.id)
                with self._lock:
                    self._queued -= 1
        work = [*plan.prefills, *((request, 1) for request in plan.decodes)]
        if work:
            self._forward([request for request, _ in work], [n for _, n in work])

    def _forward(self, requests: list[Request], counts: list[int]) -> None:
        """Feed ``counts[i]`` uncached context tokens of request i, all requests packed into
        one row; sample for those whose context is then complete."""
        ids: list[int] = []
        for r, n in zip(requests, counts, strict=True):
            start = r.window_start + r.cached
            ids += r.tokens[start : start + n]
        cache = PagedBatchCache(self.pool, [r.table for r in requests],
                                [r.cached for r in requests], counts)
        packed = torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, T)
        logits = self.model(packed, cache=cache, validate=False)[0]  # (T, V)
        if len(counts) < len(ids):  # each request's last new token
            last = torch.tensor(counts, device=self.device).cumsum(0) - 1  # (B,)
            logits = logits.index_select(0, last)  # (B, V)
        ready = []
        for i, request in enumerate(requests):
            request.cached += counts[i]
            if request.to_compute == 0:
                ready.append(i)
        greedy = [i for i in ready if requests[i].params.temperature < GREEDY_TEMPERATURE]
        tokens: dict[int, int | None] = {}
        if len(greedy) > 1:  # one argmax (and one finiteness check) for all greedy rows
            try:
                picked = sample_next(logits[greedy], temperature=0.0).tolist()  # (G,)
                tokens.update(zip(greedy, picked, strict=True))
            except NonFiniteLogitsError:
                pass  # sampled row by row below, so that only the bad row fails
        for i in ready:
            request = requests[i]
            token = tokens.get(i)
            if token is None:
                token = self._sample_row(request, logits[i : i + 1])
            if token is not None:
                self._emit(request, token)

    def _sample_row(self, request: Request, logits: Tensor) -> int | None:
        """logits (1, V) → the request's next token with its own generator; None (and the
        request ended with an error) if they cannot be sampled from."""
        p = request.params
        try:
            return int(sample_next(logits, temperature=p.temperature, top_k=p.top_k,
                                   top_p=p.top_p, generator=self._generators[request.id])[0])
        except NonFiniteLogitsError as err:
            self._finish(request, "error", "", error=f"the model's logits cannot be sampled "
                         f"from at generated token {request.generated + 1}: {err}")
            return None

    def _emit(self, request: Request, token: int) -> None:
        """Append ``token``, count it, release its text; end the request where it ends."""
        p = request.params
        now = time.monotonic()
        first = request.first_token_at is None
        self.metrics.token(now - request.arrival if first else None,
                           None if first else now - (request.last_token_at or now))
        if first:
            request.first_token_at = now
        request.last_token_at = now
        request.tokens.append(token)
        stream = self._streams[request.id]
        if token == self.eos_id:
            self._finish(request, "stop", stream.flush())
            return
        text, stopped = stream.push(token)
        if stopped:
            self._finish(request, "stop", text)
        elif request.generated >= p.max_tokens:
            self._finish(request, "length", text + stream.flush())
        elif text:
            self._outputs.append((request, RequestOutput(text, request.generated)))

    def _finish(self, request: Request, reason: str, text: str, *,
                error: str | None = None) -> None:
        """End ``request``: out of the batch, its blocks back to the pool, its last words."""
        if request.id not in self._admitted:
            with self._lock:
                self._queued -= 1
        self._admitted.discard(request.id)
        self.scheduler.remove(request)
        request.finished = True
        self._streams.pop(request.id, None)
        self._generators.pop(request.id, None)
        self.metrics.finish(reason)
        self._outputs.append((request, RequestOutput(text, request.generated, True, reason,
                                                     error)))

    def fail_all(self, message: str) -> None:
        """After an unexpected failure of a step: end every request with ``message``."""
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            self._finish(request, "error", "", error=message)
        self._hand_over()


class EngineThread:
    """Runs ``engine.step()`` while there is work, sleeping on ``engine.wake`` otherwise.

    ``stop()`` lets the requests already submitted finish, then joins the thread (not a
    daemon: a daemon cut off inside a torch call at exit aborts the process). A step that
    fails unexpectedly fails its requests with a one-line error, logged once; the thread
    keeps serving.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._stopping = threading.Event()
        self._abandon = threading.Event()
        self._thread = threading.Thread(target=self._run, name="handformer-engine")

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the thread is stepping (started and not yet stopped)."""
        return self._thread.is_alive()

    def stop(self, timeout: float | None = None, *, drain: bool = True) -> None:
        """Stop once the submitted requests are done (``drain``), or at the end of the
        current step, ending the rest with an error (a forced exit: nobody waits for
        them). A thread that was never started or has stopped already is left alone."""
        if not drain:
            self._abandon.set()
        self._stopping.set()
        self.engine.wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        engine = self.engine
        param = next(engine.model.parameters())
        with torch.inference_mode(), small_op_kernels(param):
            while True:
                if self._abandon.is_set():
                    engine.fail_all("the server stopped before this request finished")
                    return
                if not engine.has_work():
                    if self._stopping.is_set():
                        return
                    engine.wake.wait(0.1)
                    engine.wake.clear()
                    continue
                try:
                    engine.step()
                except Exception as err:  # a bug or an allocator failure: no traceback out
                    message = f"{type(err).__name__}: {err}".splitlines()[0]
                    log.error("handformer serve: a step failed (%s); its requests end with "
                              "an error", message)
                    engine.fail_all(f"the server failed while generating ({message})")
