"""Servers for the HTTP tests: ``serving`` runs a model's app in-process (uvicorn in a
thread, on a port of its own; the engine in a process of its own, as ``handformer serve``
runs it); ``running_server`` starts a real ``handformer serve`` process
on a free loopback port, waits for ``/health`` and always stops it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from handformer.serve.engine import Engine

# For a server process: the package from this checkout, one thread.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(
    Path(__file__).resolve().parents[2] / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def engine_of(model: Any, tokenizer: Any, engine: dict[str, Any]) -> tuple[Engine, dict]:
    """``EngineProcess``'s build for the tests: ``model`` (pickled over to the engine's
    process, so it is the very same weights) served with ``tokenizer``."""
    return Engine(model, tokenizer, **engine), {}


@contextmanager
def serving(model: Any, tokenizer: Any, *, engine: dict[str, Any] | None = None,
            send_buffer: int | None = None, run_engine: bool = True,
            **settings) -> Iterator[str]:
    """Serve ``model`` on 127.0.0.1 — its engine (``Engine(model, tokenizer, **engine)``) in
    a process of its own, uvicorn in a thread — and yield the base URL; stop both on the way
    out. ``run_engine=False``: the engine takes requests but never steps them.
    ``send_buffer`` shrinks the kernel's send buffer of every connection (inherited from the
    listening socket), so a client that stops reading blocks the server within kilobytes."""
    import uvicorn

    from handformer.serve.app import ServeSettings, create_app
    from handformer.serve.process import EngineProcess

    process = EngineProcess(engine_of, model, tokenizer, engine or {})
    process.start(step=run_engine)
    try:
        app = create_app(process, ServeSettings(**{"model_name": "tiny", **settings}))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if send_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                               timeout_graceful_shutdown=10))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            thread.join(30)
            sock.close()
    finally:
        process.stop(30, drain=False)


def metrics(base: str) -> dict[str, float]:
    """``/metrics`` as {sample name with labels: value}."""
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_server(run: str | Path, *args: str,
                   timeout: float = 90) -> Iterator[tuple[subprocess.Popen, str]]:
    """``handformer serve --run RUN ARGS`` → (the process, its base URL) once it answers
    ``/health``; fails naming the server's stderr if it exits first, or after ``timeout``."""
    import httpx  # a test extra: imported by the tests that use a server

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "handformer", "serve", "--run", str(run), "--port", str(port),
         *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert server.poll() is None, server.communicate()[1]
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        yield server, base
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
