"""Malformed requests against a live explorer (127.0.0.1, port 0): every one gets a 4xx with
a JSON ``{"error": ...}`` body — never a dropped connection, never an HTML page, never a
traceback — and the server keeps serving. A 500 is kept for real bugs (logged with their
traceback), and a connection that sends nothing is closed after the idle timeout.

Requests are written byte by byte on a plain socket, so the table can hold what no
well-behaved client would send (bad UTF-8, garbled request lines, lying Content-Lengths).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from handformer.explore.explorer import Explorer
from handformer.explore.run import load_explore_run
from handformer.explore.server import IDLE_TIMEOUT_S, MAX_BODY, ExploreServer
from tests.explore.test_explore_api import N_HEADS, N_LAYERS, make_lm_run

IDLE_S = 1.0  # the test server's idle timeout: short, so the slow cases stay quick


def request(method: str, path: str, body: bytes | None = None, *,
            content_type: str | None = "application/json",
            length: str | None = "auto", extra: str = "") -> bytes:
    """Raw HTTP/1.1 request bytes. ``length="auto"`` sends the body's true length, ``None``
    sends no Content-Length header, anything else is sent as given."""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    if content_type is not None:
        head += f"Content-Type: {content_type}\r\n"
    if length == "auto":
        length = str(len(body or b""))
    if length is not None:
        head += f"Content-Length: {length}\r\n"
    return (head + extra + "\r\n").encode("latin-1") + (body or b"")


def post(path: str, payload: Any) -> bytes:
    return request("POST", path, json.dumps(payload).encode())


def exchange(server: ExploreServer, raw: bytes, timeout: float = 20.0
             ) -> tuple[int, dict[str, Any], http.client.HTTPMessage]:
    """Send ``raw`` and read one answer; a dropped connection fails here."""
    host, port = server.server_address[:2]
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(raw)
        resp = http.client.HTTPResponse(sock)
        resp.begin()  # raises RemoteDisconnected if the server hung up without answering
        body = resp.read()
    assert resp.headers["Content-Type"].startswith("application/json"), body[:200]
    return resp.status, json.loads(body), resp.headers


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExploreServer]:
    run_dir = make_lm_run(tmp_path_factory.mktemp("malformed") / "lm")
    srv = ExploreServer(Explorer(load_explore_run(run_dir)), "127.0.0.1", 0,
                        idle_timeout=IDLE_S)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=10)


def _deep(depth: int) -> bytes:
    return b'{"prompt": "a", "layer": ' + b"[" * depth + b"]" * depth + b"}"


ATT = "/api/attention"
STEP = "/api/generate/step"
OK_ATT = {"prompt": "the", "layer": 0, "head": 0}
# (raw request, expected status, a piece of the error message). A step's fields are checked
# before its session is looked up, so session "s" (unknown) still reaches each check.
CASES: list[Any] = [
    # -- the body is not the JSON object it should be --
    pytest.param(request("POST", ATT, b"{not json"), 400, "not valid JSON", id="not-json"),
    pytest.param(request("POST", ATT, b""), 400, "not valid JSON", id="empty-body"),
    pytest.param(request("POST", ATT, b"[1, 2]"), 400, "JSON object", id="array"),
    pytest.param(request("POST", ATT, b"null"), 400, "JSON object", id="null"),
    pytest.param(request("POST", ATT, b'"prompt"'), 400, "JSON object", id="string"),
    pytest.param(request("POST", ATT, _deep(30_000)), 400, "nested too deeply",
                 id="nested-30000-deep"),
    pytest.param(request("POST", ATT, b'{"prompt": "\xff\xfe the"}'), 400, "not UTF-8",
                 id="bad-utf8"),
    pytest.param(request("POST", ATT, b'{"prompt": "a", "layer": ' + b"9" * 5000 + b"}"),
                 400, "not valid JSON", id="integer-of-5000-digits"),
    pytest.param(request("POST", ATT, b'{"prompt": "\\ud800", "layer": 0, "head": 0}'), 400,
                 "lone surrogate", id="lone-surrogate"),
    # -- wrong types, missing fields --
    pytest.param(post(ATT, {"layer": 0, "head": 0}), 400, "missing field 'prompt'",
                 id="missing-prompt"),
    pytest.param(post(ATT, {**OK_ATT, "prompt": ["a"]}), 400, "must be text", id="prompt-list"),
    pytest.param(post(ATT, {**OK_ATT, "prompt": {"a": 1}}), 400, "must be text",
                 id="prompt-object"),
    pytest.param(post(ATT, {**OK_ATT, "prompt": None}), 400, "must be text", id="prompt-null"),
    pytest.param(post(ATT, {**OK_ATT, "prompt": ""}), 400, "empty", id="prompt-empty"),
    pytest.param(post(ATT, {**OK_ATT, "layer": "0"}), 400, "must be an integer",
                 id="layer-string"),
    pytest.param(post(ATT, {**OK_ATT, "layer": 1.5}), 400, "must be an integer",
                 id="layer-float"),
    pytest.param(post(ATT, {**OK_ATT, "layer": None}), 400, "must be an integer",
                 id="layer-null"),
    pytest.param(post(ATT, {**OK_ATT, "layer": True}), 400, "must be an integer",
                 id="layer-bool"),
    pytest.param(post(ATT, {**OK_ATT, "layer": -1}), 400, f"[0, {N_LAYERS - 1}]",
                 id="layer-negative"),
    pytest.param(post(ATT, {**OK_ATT, "layer": N_LAYERS}), 400, f"[0, {N_LAYERS - 1}]",
                 id="layer-past-the-end"),
    pytest.param(post(ATT, {**OK_ATT, "layer": 10**30}), 400, f"[0, {N_LAYERS - 1}]",
                 id="layer-huge"),
    pytest.param(request("POST", ATT, b'{"prompt": "a", "layer": 1e999}'), 400,
                 "must be an integer", id="layer-1e999"),
    pytest.param(post(ATT, {**OK_ATT, "layer": [[[[0]]]]}), 400, "must be an integer",
                 id="layer-nested-list"),
    pytest.param(post(ATT, {**OK_ATT, "head": N_HEADS}), 400, "head must be 'all'",
                 id="head-past-the-end"),
    pytest.param(post(ATT, {**OK_ATT, "head": -1}), 400, "head must be 'all'",
                 id="head-negative"),
    pytest.param(post(ATT, {**OK_ATT, "head": 1.0}), 400, "head index or 'all'",
                 id="head-float"),
    pytest.param(post(ATT, {**OK_ATT, "head": "ALL"}), 400, "head index or 'all'",
                 id="head-ALL"),
    pytest.param(post(ATT, {**OK_ATT, "head": [0]}), 400, "head index or 'all'",
                 id="head-list"),
    # -- the batch view --
    pytest.param(post("/api/batch", {"layer": 0}), 400, "missing field 'sentences'",
                 id="batch-missing-sentences"),
    pytest.param(post("/api/batch", {"sentences": "the fox"}), 400, "list of texts",
                 id="batch-sentences-string"),
    pytest.param(post("/api/batch", {"sentences": ["a", 1]}), 400, "list of texts",
                 id="batch-sentences-mixed"),
    pytest.param(post("/api/batch", {"sentences": []}), 400, "at least one",
                 id="batch-empty"),
    pytest.param(post("/api/batch", {"sentences": ["a"] * 9}), 400, "at most 8",
                 id="batch-too-many"),
    pytest.param(post("/api/batch", {"sentences": ["a", ""]}), 400, "empty",
                 id="batch-empty-sentence"),
    pytest.param(post("/api/batch", {"sentences": ["a"], "pad_side": "middle"}), 400,
                 "'left' or 'right'", id="batch-pad-side"),
    pytest.param(post("/api/batch", {"sentences": ["a"], "pad_side": 1}), 400, "must be text",
                 id="batch-pad-side-number"),
    # -- generation --
    pytest.param(post("/api/generate/start", {"prompt": "a", "seed": -1}), 400, "'seed'",
                 id="start-seed-negative"),
    pytest.param(post("/api/generate/start", {"prompt": "a", "seed": 2**64}), 400, "'seed'",
                 id="start-seed-huge"),
    pytest.param(post("/api/generate/start", {"prompt": "a", "seed": "1"}), 400,
                 "must be an integer", id="start-seed-string"),
    pytest.param(post(STEP, {"layer": 0}), 400, "missing field 'session'",
                 id="step-missing-session"),
    pytest.param(post(STEP, {"session": 7}), 400, "must be text", id="step-session-number"),
    pytest.param(post(STEP, {"session": "nope"}), 400, "press Start", id="step-unknown-session"),
    pytest.param(post("/api/generate/view", {"session": "x" * 5000}), 400, "press Start",
                 id="view-long-unknown-session"),
    pytest.param(request("POST", STEP, b'{"session": "s", "temperature": NaN}'), 400,
                 "finite number", id="temperature-nan"),
    pytest.param(request("POST", STEP, b'{"session": "s", "temperature": Infinity}'), 400,
                 "finite number", id="temperature-infinity"),
    pytest.param(request("POST", STEP, b'{"session": "s", "temperature": 1e999}'), 400,
                 "finite number", id="temperature-1e999"),
    pytest.param(post(STEP, {"session": "s", "temperature": -1}), 400, "[0.0, 100.0]",
                 id="temperature-negative"),
    pytest.param(post(STEP, {"session": "s", "temperature": 10**400}), 400, "[0.0, 100.0]",
                 id="temperature-huge-integer"),
    pytest.param(post(STEP, {"session": "s", "temperature": "hot"}), 400, "finite number",
                 id="temperature-string"),
    pytest.param(post(STEP, {"session": "s", "top_k": 0}), 400, "'top_k'", id="top-k-zero"),
    pytest.param(post(STEP, {"session": "s", "top_k": 2.5}), 400, "must be an integer",
                 id="top-k-float"),
    pytest.param(post(STEP, {"session": "s", "top_k": 2**40}), 400, "'top_k'",
                 id="top-k-huge"),
    # -- the HTTP layer --
    pytest.param(post("/api/nothing", {}), 404, "no API endpoint", id="post-unknown-path"),
    pytest.param(request("POST", "/api/nothing", b"x", content_type="text/plain"), 404,
                 "no API endpoint", id="post-unknown-path-not-json"),
    pytest.param(request("GET", "/api/nothing"), 404, "no page", id="get-unknown-path"),
    pytest.param(request("GET", "/static/../../etc/passwd"), 404, "no page",
                 id="get-dot-dot"),
    pytest.param(request("GET", ATT), 405, "POST", id="get-an-api-endpoint"),
    pytest.param(request("PUT", ATT, b"{}"), 501, "GET, HEAD and POST", id="put"),
    pytest.param(request("DELETE", "/"), 501, "GET, HEAD and POST", id="delete"),
    pytest.param(request("OPTIONS", "/"), 501, "GET, HEAD and POST", id="options"),
    pytest.param(b"HELLO\r\n\r\n", 400, "request", id="garbled-request-line"),
    pytest.param(b"\r\n\r\n", 400, "empty request line", id="blank-request-line"),
    pytest.param(b"POST /api/attention\r\n\r\n", 400, "HTTP/0.9", id="http-0.9-post"),
    pytest.param(b"GET / HTTP/9.9\r\n\r\n", 505, "HTTP version", id="http-9.9"),
    pytest.param(b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414, "URI",
                 id="request-line-too-long"),
    pytest.param(request("GET", "/", extra="X-Long: " + "a" * 70_000 + "\r\n"), 431, "",
                 id="header-too-long"),
    pytest.param(request("GET", "/", extra="".join(f"X-{i}: 1\r\n" for i in range(120))), 431,
                 "", id="too-many-headers"),
    pytest.param(request("POST", ATT, b"{}", content_type="text/plain"), 415,
                 "application/json", id="content-type-text"),
    pytest.param(request("POST", ATT, b"{}", content_type=None), 415, "application/json",
                 id="content-type-missing"),
    pytest.param(request("POST", ATT, b"{}", length=None), 411, "Content-Length",
                 id="content-length-missing"),
    pytest.param(request("POST", ATT, b"{}", length="-5"), 400, "Content-Length",
                 id="content-length-negative"),
    pytest.param(request("POST", ATT, b"{}", length="lots"), 400, "Content-Length",
                 id="content-length-text"),
    pytest.param(request("POST", ATT, b"{}", length=str(10**30)), 413, "limit",
                 id="content-length-huge"),
    pytest.param(request("POST", ATT, b"2\r\n{}\r\n0\r\n\r\n", length=None,
                         extra="Transfer-Encoding: chunked\r\n"), 411, "Content-Length",
                 id="chunked"),
    pytest.param(request("POST", ATT, json.dumps({"prompt": "x" * (MAX_BODY + 1)}).encode()),
                 413, "limit", id="body-over-the-limit"),
    pytest.param(request("POST", ATT, b'{"prompt": "a"', length="100"), 408,
                 "Content-Length announced", id="body-shorter-than-announced"),
    pytest.param(request("GET", "/api/info").replace(b"Host: 127.0.0.1",
                                                     b"Host: evil.example"),
                 403, "Host header", id="foreign-host"),
]


@pytest.mark.parametrize(("raw", "status", "message"), CASES)
def test_a_malformed_request_gets_a_4xx_json_answer(
        server: ExploreServer, raw: bytes, status: int, message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    got, answer, _ = exchange(server, raw)
    assert (got, message in answer["error"]) == (status, True), answer
    assert answer["status"] == status
    assert "Traceback" not in answer["error"] and len(answer["error"]) < 1000
    assert "Traceback" not in capsys.readouterr().err  # nothing was treated as a bug
    # ... and the server still answers a good request.
    assert exchange(server, post(ATT, OK_ATT))[0] == 200


def test_a_tiny_temperature_steps_greedily(server: ExploreServer) -> None:
    """Not malformed: 1e-40 is a finite temperature in range; sampling takes the argmax
    (generate's rule for temperatures too small to divide by), never a 500."""
    status, start, _ = exchange(server, post("/api/generate/start",
                                             {"prompt": "the", "layer": 0, "head": 0}))
    assert status == 200, start
    status, step, _ = exchange(server, post(STEP, {"session": start["session"],
                                                   "temperature": 1e-40}))
    assert status == 200, step
    assert step["chosen"]["id"] == start["next"][0]["id"]


def test_a_bug_is_a_500_with_a_json_body_and_a_logged_traceback(
        server: ExploreServer, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def broken() -> dict[str, Any]:
        raise ZeroDivisionError("a bug in info()")

    monkeypatch.setattr(server.explorer, "info", broken)
    status, answer, _ = exchange(server, request("GET", "/api/info"))
    assert status == 500 and "ZeroDivisionError: a bug in info()" in answer["error"]
    assert "Traceback" not in answer["error"]
    log = capsys.readouterr().err
    assert "Traceback" in log and "a bug in info()" in log


def test_an_answer_that_is_not_strict_json_is_a_500_not_a_dropped_connection(
        server: ExploreServer, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(server.explorer, "info", lambda: {"loss": float("nan")})
    status, answer, _ = exchange(server, request("GET", "/api/info"))
    assert status == 500 and "ValueError" in answer["error"]
    capsys.readouterr()


def _closed_within(sock: socket.socket, limit: float) -> float:
    """Seconds until the server closes ``sock`` (recv returns b""); fails past ``limit``."""
    start = time.monotonic()
    sock.settimeout(limit)
    data = sock.recv(65536)
    elapsed = time.monotonic() - start
    assert data == b"", data[:200]
    return elapsed


def test_an_idle_connection_is_closed_after_the_timeout(server: ExploreServer) -> None:
    assert 1 <= IDLE_TIMEOUT_S <= 30  # the default: a few seconds
    host, port = server.server_address[:2]
    with socket.create_connection((host, port), timeout=10) as sock:
        elapsed = _closed_within(sock, IDLE_S + 5)
    assert IDLE_S * 0.8 <= elapsed <= IDLE_S + 4
    # a request line that never ends is dropped the same way
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(b"GET / HT")
        _closed_within(sock, IDLE_S + 5)
    assert exchange(server, post(ATT, OK_ATT))[0] == 200  # the server is not stuck


def test_many_idle_connections_do_not_block_others(server: ExploreServer) -> None:
    host, port = server.server_address[:2]
    idle = [socket.create_connection((host, port), timeout=10) for _ in range(20)]
    try:
        assert exchange(server, post(ATT, OK_ATT), timeout=10)[0] == 200
    finally:
        for sock in idle:
            sock.close()


def test_the_idle_timeout_must_be_positive(tmp_path: Path) -> None:
    explorer = Explorer(load_explore_run(make_lm_run(tmp_path / "lm")))
    with pytest.raises(ValueError, match="idle_timeout"):
        ExploreServer(explorer, "127.0.0.1", 0, idle_timeout=0)
