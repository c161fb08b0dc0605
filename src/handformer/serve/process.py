"""The engine in a process of its own: the HTTP side submits, cancels and reads each step's
outputs through a pipe, and never shares a GIL with a forward pass.

Why a process: the event loop and an engine thread in one process take turns on one GIL.
Every torch op releases and retakes it, so whenever the loop holds it the engine waits, and
each hand-over between two threads on two cores costs more than the loop's own share of the
time (``benchmarks/serve_engine.py --gil-noise`` measures it). vLLM splits its API server from
its engine core for the same reason.

``EngineProcess(build, *args)``: ``start()`` spawns a child (a fresh interpreter: torch's
thread pools start clean, whatever the parent ran; it takes the parent's thread count) that
calls ``build(*args)`` for its ``Engine`` and steps it in an ``EngineThread``, while the
child's main thread reads commands and a sender thread writes messages back, so neither side
ever waits on the other's reads. The parent keeps the tokenizer and the limits it checks
before anything is sent (a request that can never fit the pool, a full queue), and hands
each step's outputs, by request id, to the requests it submitted — on its event loop, which
reads the pipe as it reads sockets.

Messages, parent → child: ``("submit", id, prompt, params, arrival)``, ``("cancel", id)``,
``("reject", cause)``, ``("metrics", token)``, ``("stop", drain)``. Child → parent: once
``("ready", info)`` or ``("failed", error)``; then ``("outputs", [(id, output), ...])``
(one message a step) and ``("metrics", token, text)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from handformer.serve.engine import (
    Engine,
    EngineThread,
    Outputs,
    QueueFullError,
    RequestLimits,
)
from handformer.serve.request import Request, RequestOutput

__all__ = ["EngineGoneError", "EngineInfo", "EngineProcess"]

Build = Callable[..., tuple[Engine, dict[str, Any]]]

log = logging.getLogger("handformer.serve")


class EngineGoneError(RuntimeError):
    """The engine's process is not running (it failed, was killed, or was stopped)."""


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side knows of the engine: its tokenizer, the ``limits`` it checks before
    sending a request, and ``extra`` — what ``build`` said of the model (a chat template)."""

    tokenizer: Any
    limits: RequestLimits
    max_batch: int
    max_waiting: int
    pool_bytes: int
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, engine: Engine, extra: dict[str, Any]) -> EngineInfo:
        return cls(engine.tokenizer, engine.limits, engine.scheduler.max_batch,
                   engine.max_waiting, engine.pool.nbytes(), extra)


class EngineProcess:
    """The HTTP side's handle on an ``Engine`` that ``build(*args)`` makes in a child process.

    ``build`` must be importable by name (a module-level function) and ``args`` picklable: the
    child is a fresh interpreter. ``start()`` waits until the engine is built (its errors are
    raised here, as ``build`` raised them); ``attach(loop)`` routes outputs on that event loop;
    ``stop()`` lets the requests in flight finish (or not) and ends the child.

    The queue ``max_waiting`` bounds is counted here: requests sent that have had no output
    yet (a request the engine has admitted but not answered still counts), so a refusal (429)
    never waits on the child.
    """

    def __init__(self, build: Build, *args: Any) -> None:
        self._build, self._args = build, args
        self._info: EngineInfo | None = None
        self._conn: Connection | None = None
        self._process: Any = None
        self._send_lock = threading.Lock()
        self._requests: dict[int, Request] = {}  # sent, not finished
        self._unanswered: set[int] = set()  # sent, no output yet
        self._replies: dict[int, asyncio.Future[str]] = {}
        self._tokens = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._gone: str | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, *, step: bool = True) -> EngineInfo:
        """Spawn the child and wait until its engine is built. ``step=False``: the child
        takes requests but never steps them (for tests of the queue)."""
        context = multiprocessing.get_context("spawn")
        conn, child_conn = context.Pipe()
        process = context.Process(target=_child_main, name="handformer-engine", daemon=True,
                                  args=(child_conn, self._build, self._args, step,
                                        torch.get_num_threads()))
        process.start()
        child_conn.close()
        try:
            message = conn.recv()
        except EOFError:
            process.join()
            conn.close()
            raise EngineGoneError(f"the engine's process exited (code {process.exitcode}) "
                                  "before its engine was built") from None
        if message[0] == "failed":
            process.join()
            conn.close()
            raise message[1]
        self._conn, self._process, self._info = conn, process, message[1]
        return message[1]

    @property
    def info(self) -> EngineInfo:
        """What ``start`` learnt of the engine (``EngineGoneError`` before it)."""
        if self._info is None:
            raise EngineGoneError("the engine's process was not started")
        return self._info

    @property
    def gone(self) -> str | None:
        """Why the engine's process is no longer there (None while it runs)."""
        return self._gone

    @property
    def pid(self) -> int | None:
        """The engine's process id, once started."""
        return None if self._process is None else self._process.pid

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the child's messages on ``loop`` (the server's), from now on."""
        if self._conn is None or self._gone is not None:
            return
        previous, self._loop = self._loop, loop
        if previous is not None and previous is not loop and not previous.is_closed():
            previous.remove_reader(self._conn.fileno())
        loop.add_reader(self._conn.fileno(), self._read)

    def stop(self, timeout: float | None = None, *, drain: bool = True) -> None:
        """Stop the engine once the submitted requests are done (``drain``), or at the end of
        its current step, ending the rest with an error; then wait for the child (killed
        after ``timeout`` seconds). Callable from any thread, more than once."""
        process = self._process
        if process is None or not process.is_alive():
            return
        self._stopping = True
        with contextlib.suppress(OSError, EngineGoneError):
            self._send(("stop", drain))
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
        if self._loop is None or self._loop.is_closed():  # nobody will read the pipe's end
            self._lost()

    def kill(self) -> None:
        """End the child at once (a forced exit: nobody waits for its requests). Safe in a
        signal handler: it sends nothing."""
        if self._process is not None and self._process.is_alive():
            self._stopping = True
            self._process.kill()

    # -- the HTTP side's calls (on the event loop) ---------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (a copy: the HTTP side encodes prompts with it)."""
        return self.info.tokenizer

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size."""
        return self.info.limits.vocab_size

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """``RequestTooLargeError`` when a request could never be held by the pool."""
        self.info.limits.check_fits(prompt_len, max_tokens)

    def submit(self, request: Request) -> None:
        """Send ``request`` to the engine; its outputs reach ``request.on_output`` on the
        event loop. Raises as ``Engine.submit`` raises, or ``EngineGoneError``."""
        if self._gone is not None:
            raise EngineGoneError(self._gone)
        info = self.info
        info.limits.check(request)
        if len(self._unanswered) >= info.max_waiting:
            raise QueueFullError(f"the queue is full ({info.max_waiting} requests waiting); "
                                 "retry shortly")
        self._requests[request.id] = request
        self._unanswered.add(request.id)
        self._send(("submit", request.id, request.prompt, request.params, request.arrival))

    def cancel(self, request: Request) -> None:
        """Stop ``request`` and free its blocks before the engine's next step."""
        if request.id in self._requests and self._gone is None:
            self._send(("cancel", request.id))

    def reject(self, cause: str) -> None:
        """Count a request refused before any work (``/metrics``)."""
        if self._gone is None:
            self._send(("reject", cause))

    async def metrics_text(self, timeout: float = 30.0) -> str:
        """``/metrics``' text, rendered by the engine between two steps at most."""
        if self._gone is not None:
            raise EngineGoneError(self._gone)
        token = next(self._tokens)
        reply = asyncio.get_running_loop().create_future()
        self._replies[token] = reply
        try:
            self._send(("metrics", token))
            return await asyncio.wait_for(reply, timeout)
        finally:
            self._replies.pop(token, None)

    # -- the pipe --------------------------------------------------------------------------
    def _send(self, message: tuple[Any, ...]) -> None:
        if self._conn is None:
            raise EngineGoneError("the engine's process was not started")
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        """Every message waiting in the pipe (the event loop calls this when it is
        readable)."""
        conn = self._conn
        assert conn is not None
        try:
            while conn.poll():
                message = conn.recv()
                if message[0] == "outputs":
                    self._route(message[1])
                elif message[0] == "metrics":
                    reply = self._replies.get(message[1])
                    if reply is not None and not reply.done():
                        reply.set_result(message[2])
        except (EOFError, OSError):
            self._lost()

    def _route(self, items: list[tuple[int, RequestOutput]]) -> None:
        for request_id, out in items:
            request = self._requests.get(request_id)
            if request is None:
                continue
            self._unanswered.discard(request_id)
            if out.finished:
                del self._requests[request_id]
                request.finished = True
            request.on_output(out)

    def _lost(self) -> None:
        """The child's end closed: it stopped, or it died. End what was in flight."""
        if self._conn is None or self._conn.closed:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._conn.fileno())
        self._conn.close()
        if self._stopping:  # ``stop`` waits for the child
            self._gone = "the engine stopped"
        else:
            process = self._process
            process.join(5)
            self._gone = ("the engine's process exited unexpectedly (code "
                          f"{process.exitcode})")
            log.error("handformer serve: %s; the requests in flight end with an error",
                      self._gone)
        requests, self._requests = self._requests, {}
        self._unanswered.clear()
        for request in requests.values():
            request.finished = True
            request.on_output(RequestOutput("", 0, True, "error", self._gone))
        for reply in self._replies.values():
            if not reply.done():
                reply.set_exception(EngineGoneError(self._gone))


def _child_main(conn: Connection, build: Build, args: tuple[Any, ...], step: bool,
                threads: int) -> None:
    """The engine's process: build the engine, step it, answer the parent's commands."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    torch.set_num_threads(threads)  # the parent's: a fresh interpreter would take every core
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        engine, extra = build(*args)
        ready: tuple[Any, ...] = ("ready", EngineInfo.of(engine, extra))
    except BaseException as err:  # the parent raises it: the command's own one-line error
        conn.send(("failed", _picklable(err)))
        conn.close()
        return
    conn.send(ready)
    outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
    sender = threading.Thread(target=_send_all, args=(conn, outbox),
                              name="handformer-engine-sender")
    sender.start()
    requests: dict[int, Request] = {}

    def deliver(outputs: Outputs) -> None:
        items = []
        for request, out in outputs:
            if out.finished:
                requests.pop(request.id, None)
            items.append((request.id, out))
        outbox.put(("outputs", items))

    engine.deliver = deliver
    worker = EngineThread(engine)
    if step:
        worker.start()
    try:
        _serve_commands(conn, engine, worker, requests, outbox)
    except Exception as err:  # a bug: one line, never a traceback; the parent fails the rest
        log.error("handformer serve: the engine's process failed (%s)",
                  f"{type(err).__name__}: {err}".splitlines()[0])
        worker.stop(30, drain=False)
        raise SystemExit(1) from None
    finally:
        outbox.put(None)
        sender.join()
        conn.close()


def _serve_commands(conn: Connection, engine: Engine, worker: EngineThread,
                    requests: dict[int, Request], outbox: queue.SimpleQueue[Any]) -> None:
    """Until the parent says stop (and the engine has stopped) or is gone. Commands are read
    while the engine finishes its requests, so a client that leaves then is still cancelled."""
    stopping = False
    while not (stopping and not worker.alive):
        try:
            if not conn.poll(0.1 if stopping else None):
                continue
            message = conn.recv()
        except (EOFError, OSError):  # the parent is gone: nobody waits for the rest
            worker.stop(30, drain=False)
            return
        kind = message[0]
        if kind == "submit":
            _, request_id, prompt, params, arrival = message
            request = Request(prompt, params, id=request_id, arrival=arrival)
            requests[request_id] = request
            try:
                if stopping:
                    raise ValueError("the server is stopping")
                engine.submit(request)
            except (ValueError, QueueFullError) as err:  # the parent checked: a race at most
                requests.pop(request_id, None)
                outbox.put(("outputs", [(request_id, RequestOutput("", 0, True, "error",
                                                                   str(err)))]))
        elif kind == "cancel":
            request = requests.get(message[1])
            if request is not None:
                engine.cancel(request)
        elif kind == "reject":
            engine.metrics.reject(message[1])
        elif kind == "metrics":
            outbox.put(("metrics", message[1],
                        engine.metrics.render(engine.gauges(), engine.counters())))
        elif kind == "stop":
            stopping = True
            worker.stop(0, drain=message[1])  # returns at once; the loop waits for it


def _send_all(conn: Connection, outbox: queue.SimpleQueue[tuple[Any, ...] | None]) -> None:
    """The child's one writer: messages in order until ``None``; a parent that is gone
    reads nothing more, so the rest are dropped."""
    while (message := outbox.get()) is not None:
        try:
            conn.send(message)
        except OSError:
            pass
        except Exception as err:  # a message that does not pickle: a bug, said in one line
            log.error("handformer serve: a message to the server was lost (%s: %s)",
                      type(err).__name__, err)


def _picklable(err: BaseException) -> BaseException:
    """``err`` itself where it survives pickling, else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")
