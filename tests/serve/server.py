"""A real ``handformer serve`` process for the tests: started on a free loopback port, awaited
on ``/health``, and always stopped (killed if the test left it running)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# The package from this checkout, one thread: the server's children see what the tests see.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(
    Path(__file__).resolve().parents[2] / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


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
