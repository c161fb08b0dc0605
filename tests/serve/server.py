"""An in-process server for the HTTP tests: uvicorn in a thread, on a port of its own."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from handformer.serve.engine import Engine


@contextmanager
def serving(engine: Engine, *, send_buffer: int | None = None, run_engine: bool = True,
            **settings) -> Iterator[str]:
    """Serve ``engine`` on 127.0.0.1 and yield its base URL; stop it on the way out.
    ``send_buffer`` shrinks the kernel's send buffer of every connection (inherited from the
    listening socket), so a client that stops reading blocks the server within kilobytes."""
    import uvicorn

    from handformer.serve.app import ServeSettings, create_app

    app = create_app(engine, ServeSettings(**{"model_name": "tiny", **settings}),
                     run_engine=run_engine)
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
