"""The explorer's web server: the standard library's ``ThreadingHTTPServer``, nothing else.

* Binds to 127.0.0.1 by default and refuses any non-loopback address unless
  ``allow_remote=True`` (``--allow-remote``): the page drives a model and reads a run folder.
* When bound to loopback it also checks the ``Host`` header, so a web page elsewhere cannot
  reach it through DNS rebinding; POST bodies must be ``application/json`` (a plain HTML
  form from another site cannot send that without the browser asking first).
* Request bodies over ``max_body`` bytes (64 KiB) are answered 413 without being parsed.
* Every answer is JSON or one of the three shipped static files. Errors are
  ``{"error": message}`` — also for what ``http.server`` itself refuses (a garbled request
  line, an unsupported method, over-long headers): 4xx for anything the client sent wrong
  (wrong types, missing fields, numbers out of range, JSON nested too deep to parse, bad
  UTF-8, unknown paths), 500 only for a bug, with the traceback in the server's log and
  never in the answer. No request is answered by dropping the connection.
* A connection that sends nothing for ``idle_timeout`` seconds (5) is closed, so idle or
  half-sent requests do not hold a thread each forever.
* Up to ``REQUEST_QUEUE`` connections wait to be accepted (the standard library's default,
  5, left a burst of a few hundred page requests unanswered for a minute).
* Stopping (Ctrl-C, SIGTERM, ``shutdown``) lets every request in progress finish and joins
  its thread: handler threads are not daemons. A thread still inside a torch operation when
  the interpreter tears down is cut off mid-call, and the process then aborts ("terminate
  called without an active exception") instead of exiting 0. So a signal never raises
  inside the serving loop (``serve_until_stopped``): it could land while a handler thread is
  being started, leaving a thread nobody joins; and the helper thread it starts is joined
  too, or it could free the server's model itself during that teardown. Connections that
  are only waiting for their next request are woken (their reading side shut), so stopping
  waits for work, never for an idle client.

Routes::

    GET  /  /static/app.js  /static/style.css
    GET  /api/info
    POST /api/attention        {prompt, layer, head}
    POST /api/batch            {sentences, layer, head, pad_side}
    POST /api/generate/start   {prompt, layer, head, seed}
    POST /api/generate/step    {session, layer, head, temperature, top_k}
    POST /api/generate/view    {session, layer, head}

``head`` is a head index or ``"all"``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from handformer.explore.explorer import MAX_BATCH, Explorer
from handformer.explore.generation import Generator
from handformer.explore.payload import (
    InputError,
    get_float,
    get_int,
    get_optional_int,
    get_str,
    get_str_list,
    shown,
)

__all__ = ["IDLE_TIMEOUT_S", "MAX_BODY", "REQUEST_QUEUE", "ExploreServer", "RemoteBindError",
           "check_host", "is_loopback"]

MAX_BODY = 64 * 1024
IDLE_TIMEOUT_S = 5.0  # seconds a connection may stay silent before it is closed
REQUEST_QUEUE = 1024  # connections the kernel holds for accept() (listen's backlog)
_DRAIN_LIMIT = 1024 * 1024  # read (and drop) at most this much of a refused body
_LINGER_S = 1.0  # at most this long to read what a client still sends after our answer
STATIC_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
}
# The page loads only its own files: no CDN, no inline script.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'")


class RemoteBindError(ValueError):
    """Asked to listen on a non-loopback address without ``allow_remote``."""


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP literal (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_host(host: str, allow_remote: bool) -> None:
    """Raise ``RemoteBindError`` for a non-loopback ``host`` unless ``allow_remote``."""
    if not is_loopback(host) and not allow_remote:
        raise RemoteBindError(
            f"refusing to listen on {host!r}: it is not a loopback address, so other machines "
            "could drive the model and read the run folder's config. Use 127.0.0.1 (the "
            "default), or pass --allow-remote if you really mean it")


def _head(body: dict[str, Any]) -> int | str:
    head = body.get("head", 0)
    if head == "all":
        return "all"
    if isinstance(head, bool) or not isinstance(head, int):
        raise InputError(f"'head' must be a head index or 'all'; got {shown(head)}")
    return head


def _layer(body: dict[str, Any], explorer: Explorer) -> int:
    return get_int(body, "layer", 0, explorer.n_layers - 1, default=0)


class ExploreServer(ThreadingHTTPServer):
    """One run's explorer behind HTTP. ``port=0`` picks a free port (see ``url``)."""

    daemon_threads = False  # joined when the server closes: see the module docstring
    allow_reuse_address = True
    request_queue_size = REQUEST_QUEUE

    def __init__(self, explorer: Explorer, host: str = "127.0.0.1", port: int = 0, *,
                 allow_remote: bool = False, max_body: int = MAX_BODY,
                 idle_timeout: float = IDLE_TIMEOUT_S, verbose: bool = False) -> None:
        check_host(host, allow_remote)
        if not idle_timeout > 0:
            raise ValueError(f"idle_timeout must be > 0 seconds; got {idle_timeout}")
        self.explorer = explorer
        self.generator = Generator(explorer)
        self.check_host_header = is_loopback(host)
        self.max_body = max_body
        self.idle_timeout = idle_timeout
        self.verbose = verbose
        self._open: set[socket.socket] = set()  # connections a handler thread is serving
        self._handlers: list[threading.Thread] = []  # started handler threads, to join
        self._open_lock = threading.Lock()
        if ":" in host.strip("[]"):
            self.address_family = socket.AF_INET6
        super().__init__((host.strip("[]"), port), ExploreHandler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        shown = f"[{host}]" if ":" in str(host) else str(host)
        return f"http://{shown}:{port}/"

    def serve_until_stopped(self, on_ready: Callable[[], None] | None = None) -> int | None:
        """Serve until ``shutdown()``, Ctrl-C or SIGTERM, then ``server_close``; return the
        signal that stopped it (None for ``shutdown()``). ``on_ready()`` runs once the
        signals are handled, just before serving: a client told the URL there can stop the
        server the same way from then on.

        In the main thread the first SIGINT or SIGTERM asks a helper thread to call
        ``shutdown()``, so the loop stops between two requests and every handler thread is
        joined; the previous handlers come back at once, so a second signal interrupts as it
        would anywhere else (a ``KeyboardInterrupt`` while the requests finish)."""
        caught: list[int] = []
        previous: dict[int, Any] = {}  # each handler we replaced, once it is replaced
        stoppers: list[threading.Thread] = []
        serving = False

        def stop(signum: int, frame: Any) -> None:
            caught.append(signum)
            for number, handler in previous.items():
                signal.signal(number, handler)
            stopper = threading.Thread(target=self.shutdown, name="explore-stop", daemon=True)
            stoppers.append(stopper)
            stopper.start()

        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGINT, signal.SIGTERM):
                previous[number] = signal.signal(number, stop)
        try:
            if on_ready is not None:
                on_ready()
            serving = True
            self.serve_forever()
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
            if serving:  # shutdown() has returned or is about to: the loop ended
                for stopper in stoppers:
                    # Joined, so the helper drops its hold on the server (its target) here
                    # and not later: a daemon thread that frees the last reference to the
                    # model while the interpreter tears down is cut off inside torch's
                    # tensor destructor, and the process aborts. (RuntimeError: a second
                    # signal cut its start short, and it never ran.)
                    with contextlib.suppress(RuntimeError):
                        stopper.join()
            self.server_close()
        return caught[0] if caught else None

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Last resort for an exception that escaped a handler: a connection that ended (the
        client went away, or Ctrl-C closed it between its accept and its thread's start) is
        one log line; anything else is a bug, logged with its traceback. Every error of a
        request itself is answered inside the handler, so an ``OSError`` that escapes it is
        the socket's."""
        err = sys.exc_info()[1]
        if isinstance(err, OSError):
            if self.verbose:
                print(f"explore: connection from {client_address[0]} ended: {err!r}",
                      file=sys.stderr)
            return
        super().handle_error(request, client_address)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Hand the connection to a thread of its own, which alone closes it: from here on
        the serving loop does not (see ``shutdown_request``). The thread is recorded for
        ``server_close`` to join only once it has started (Ctrl-C may land inside
        ``start``; a thread that never started cannot be joined, and a started one is not a
        daemon: the interpreter joins it at exit in any case)."""
        with self._open_lock:
            self._open.add(request)
        thread = threading.Thread(target=self.process_request_thread,
                                  args=(request, client_address), daemon=False)
        thread.start()
        with self._open_lock:
            self._handlers = [t for t in self._handlers if t.is_alive()]
            self._handlers.append(thread)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self._close_connection(request)

    def shutdown_request(self, request: Any) -> None:
        """Called by the serving loop when handing a connection over failed — also when
        Ctrl-C lands between a handler thread's start and the loop's next line: a connection
        a thread already owns is left to it (closing it under the thread's feet would cut
        its answer off with a broken pipe)."""
        with self._open_lock:
            owned = request in self._open
        if not owned:
            self._close_connection(request)

    def server_close(self) -> None:
        """Stop listening, wake the connections that only wait for a next request, join
        every handler thread (requests in progress finish first), then close whatever no
        thread took over."""
        self.socket.close()
        with self._open_lock:
            waiting = list(self._open)
        for request in waiting:
            with contextlib.suppress(OSError):
                request.shutdown(socket.SHUT_RD)  # a blocked read returns: the handler ends
        super().server_close()
        with self._open_lock:
            handlers, self._handlers = self._handlers, []
        for thread in handlers:
            thread.join()
        with self._open_lock:
            left, self._open = list(self._open), set()
        for request in left:
            self.close_request(request)

    def _close_connection(self, request: Any) -> None:
        """A lingering close: say we are done writing, then read (and drop) what the client
        is still sending, for a bounded time, before closing. Closing a socket that holds
        unread bytes sends a reset, which can destroy the answer before the client reads it
        (a refused 70 KB request line, say)."""
        with contextlib.suppress(OSError):
            request.shutdown(socket.SHUT_WR)
            request.settimeout(_LINGER_S)
            deadline = time.monotonic() + _LINGER_S
            drained = 0
            while drained < _DRAIN_LIMIT and time.monotonic() < deadline:
                chunk = request.recv(65536)
                if not chunk:
                    break
                drained += len(chunk)
        with self._open_lock:
            self._open.discard(request)
        self.close_request(request)

    def routes(self) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
        ex, gen = self.explorer, self.generator
        return {
            "/api/attention": lambda b: ex.attention(
                get_str(b, "prompt"), _layer(b, ex), _head(b)),
            "/api/batch": lambda b: ex.batch(
                get_str_list(b, "sentences", MAX_BATCH), _layer(b, ex), _head(b),
                get_str(b, "pad_side", "right")),
            "/api/generate/start": lambda b: gen.start(
                get_str(b, "prompt"), _layer(b, ex), _head(b),
                get_int(b, "seed", 0, 2**63 - 1, default=0)),
            "/api/generate/step": lambda b: gen.step(
                get_str(b, "session"), _layer(b, ex), _head(b),
                # any finite temperature in [0, 100]: sample_next decodes tiny ones greedily
                get_float(b, "temperature", 0.0, 100.0, default=1.0),
                get_optional_int(b, "top_k", 1, 1 << 30)),
            "/api/generate/view": lambda b: gen.show(
                get_str(b, "session"), _layer(b, ex), _head(b)),
        }


class ExploreHandler(BaseHTTPRequestHandler):
    """Maps requests to ``ExploreServer`` routes; turns every failure into a JSON error."""

    server: ExploreServer
    server_version = "handformer-explore"
    # Answer even a garbled or versionless request line with a status line and headers
    # (http.server's default, HTTP/0.9, would send a bare body no client can read).
    default_request_version = "HTTP/1.0"

    def setup(self) -> None:
        # ``StreamRequestHandler.setup`` applies ``self.timeout`` to the socket: a client that
        # connects and sends nothing is dropped after it (``handle_one_request`` catches the
        # TimeoutError and closes the connection).
        self.timeout = self.server.idle_timeout
        self._answered = False
        super().setup()

    def parse_request(self) -> bool:
        if not self.raw_requestline.strip():  # a blank line: http.server would hang up
            self.command, self.requestline = None, ""
            self.request_version = self.default_request_version
            self.close_connection = True
            self.send_error(HTTPStatus.BAD_REQUEST,
                            "empty request line: expected e.g. 'GET / HTTP/1.1'")
            return False
        return super().parse_request()

    # -- responses ------------------------------------------------------------------------
    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self._answered = True
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", CSP)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload, allow_nan=False, separators=(",", ":")).encode("utf-8")
        self._send(status, body, "application/json; charset=utf-8")

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": message, "status": int(status)})

    def send_error(self, code: int, message: str | None = None,
                   explain: str | None = None) -> None:
        """``http.server``'s own refusals (a garbled request line, an unsupported method,
        headers too long or too many) as JSON like every other error, not its HTML page."""
        self.close_connection = True
        short = self.responses.get(code, ("error", ""))[0]
        text = message or short
        if code == HTTPStatus.NOT_IMPLEMENTED:
            text = f"{text}: the explorer answers GET, HEAD and POST only"
        self.log_error("code %d, message %s", code, text)
        self._error(code, text)

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)

    # -- checks ---------------------------------------------------------------------------
    def _host_ok(self) -> bool:
        if not self.server.check_host_header:
            return True
        host = (self.headers.get("Host") or "").strip()
        if host.startswith("["):  # [::1]:port
            name = host[1:host.find("]")] if "]" in host else host
        else:
            name = host.split(":", 1)[0]
        if is_loopback(name):
            return True
        self._error(HTTPStatus.FORBIDDEN, f"unexpected Host header {shown(host)}: the "
                    "explorer answers only requests addressed to localhost")
        return False

    def _read_raw_body(self) -> bytes | None:
        """The request body's bytes, or ``None`` after answering with an error (411 no
        length, 400 a bad one, 413 too long, 408 the body never came)."""
        length_text = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding") or length_text is None:
            self.close_connection = True
            self._error(HTTPStatus.LENGTH_REQUIRED, "a request body needs a Content-Length")
            return None
        try:
            length = int(length_text.strip())
            if length < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            self._error(HTTPStatus.BAD_REQUEST,
                        f"bad Content-Length {shown(length_text)}: expected a byte count")
            return None
        if length > self.server.max_body:
            self.close_connection = True
            self._drain(length)
            self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                        f"request body of {length} bytes is over the limit of "
                        f"{self.server.max_body} bytes: send a shorter text")
            return None
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            raw = b""
        if len(raw) < length:
            self.close_connection = True
            self._error(HTTPStatus.REQUEST_TIMEOUT,
                        f"the body ended after {len(raw)} of the {length} bytes its "
                        f"Content-Length announced (nothing more came for "
                        f"{self.server.idle_timeout:g} s)")
            return None
        return raw

    def _parse_json(self, raw: bytes) -> dict[str, Any] | None:
        """The JSON object in ``raw``, or ``None`` after answering 415 or 400."""
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if content_type != "application/json":
            self._error(HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                        f"send JSON with Content-Type: application/json; got "
                        f"{shown(content_type)}")
            return None
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            self._error(HTTPStatus.BAD_REQUEST, f"the request body is not UTF-8 text ({err})")
            return None
        except RecursionError:  # e.g. [[[[…]]]] thousands deep
            self._error(HTTPStatus.BAD_REQUEST,
                        "the request body is JSON nested too deeply to read: send a flat "
                        "object such as {\"prompt\": \"...\", \"layer\": 0}")
            return None
        except ValueError as err:  # JSONDecodeError; an integer of thousands of digits
            self._error(HTTPStatus.BAD_REQUEST, f"the request body is not valid JSON ({err})")
            return None
        if not isinstance(body, dict):
            self._error(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object, "
                        f"not {type(body).__name__}")
            return None
        return body

    def _drain(self, length: int) -> None:
        """Read a refused body (up to a bound) so the client can read the answer instead of
        seeing its connection reset mid-upload."""
        remaining = min(length, _DRAIN_LIMIT)
        try:
            self.connection.settimeout(min(2.0, self.server.idle_timeout))
            while remaining > 0:
                chunk = self.rfile.read(min(remaining, 65536))
                if not chunk:
                    break
                remaining -= len(chunk)
        except OSError:
            pass

    def _discard_body(self) -> None:
        """Drain the body of a request refused before reading it (bounded)."""
        try:
            length = int((self.headers.get("Content-Length") or "0").strip())
        except ValueError:
            return
        if length > 0:
            self._drain(length)

    # -- methods --------------------------------------------------------------------------
    def do_GET(self) -> None:
        try:
            self._get()
        except Exception as err:  # a bug: report it, keep serving
            self._internal_error(err)

    do_HEAD = do_GET

    def _get(self) -> None:
        if not self._host_ok():
            return
        path = self.path.split("?", 1)[0]
        if path == "/api/info":
            self._json(HTTPStatus.OK, self.server.explorer.info())
        elif path in STATIC_FILES:
            name, content_type = STATIC_FILES[path]
            data = resources.files("handformer.explore").joinpath("static", name)
            self._send(HTTPStatus.OK, data.read_bytes(), content_type)
        elif path == "/favicon.ico":
            self._send(HTTPStatus.NO_CONTENT, b"", "image/x-icon")
        elif path in self.server.routes():
            self._error(HTTPStatus.METHOD_NOT_ALLOWED, f"{path} takes a POST with a JSON body")
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no page at {shown(path)}")

    def do_POST(self) -> None:
        try:
            self._post()
        except Exception as err:  # a bug: report it, keep serving
            self._internal_error(err)

    def _post(self) -> None:
        if not self._host_ok():
            self.close_connection = True
            self._discard_body()
            return
        raw = self._read_raw_body()
        if raw is None:
            return
        path = self.path.split("?", 1)[0]
        route = self.server.routes().get(path)
        if route is None:
            self._error(HTTPStatus.NOT_FOUND, f"no API endpoint {shown(path)}")
            return
        body = self._parse_json(raw)
        if body is None:
            return
        try:
            payload = route(body)
        except ValueError as err:  # InputError and the model's own input checks
            self._error(HTTPStatus.BAD_REQUEST, str(err))
            return
        self._json(HTTPStatus.OK, payload)

    def _internal_error(self, err: Exception) -> None:
        """A 500 with a JSON body for a bug, its traceback in the server's log. If the answer
        had already begun (or the client is gone) there is nothing left to send; a client
        that went away mid-answer is not a bug, and leaves no traceback."""
        self.close_connection = True
        if isinstance(err, ConnectionError):
            if self.server.verbose:
                print(f"explore: {self.client_address[0]} went away: {err!r}", file=sys.stderr)
            return
        traceback.print_exc(file=sys.stderr)
        if self._answered:
            return
        what = str(err) if len(str(err)) <= 300 else str(err)[:300] + " …"
        with contextlib.suppress(OSError):  # the client may be gone
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR,
                        f"internal error ({type(err).__name__}: {what}); the server's log has "
                        "the details")
