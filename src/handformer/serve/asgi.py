"""The HTTP plumbing under the routes, in plain ASGI: OpenAI's error answers, the guard every
request passes, and the server-sent-event stream that notices a client leave.

* ``ApiError`` — a refusal with its status, message, the field at fault, and OpenAI's error
  object as its body.
* ``Guard`` — middleware around the whole app: 413 for a body over the limit (from its
  Content-Length, before reading, or while a chunked body arrives), 408 for a body that
  stops arriving, and a 500 with one log line for anything no route handled — never a
  traceback, to the client or the console.
* ``EventStream`` — an ASGI response streaming ``data: …`` events while it watches for the
  client to disconnect or to stop reading (a send blocked for ``timeout`` seconds); either
  closes the events' generator, whose ``finally`` cancels the engine work.

Needs starlette (with FastAPI, the ``serve`` extra).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar

from starlette.responses import Response

from handformer.serve.protocol import error_body

__all__ = ["ApiError", "DroppedStreamFilter", "EventStream", "Guard", "sse", "wait_disconnect"]

log = logging.getLogger("handformer.serve")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ApiError(Exception):
    """An answer with OpenAI's error object: ``status``, ``message``, the ``param`` at fault."""

    KINDS: ClassVar[dict[int, str]] = {400: "invalid_request_error", 401: "authentication_error",
                                       404: "not_found_error", 408: "timeout_error",
                                       413: "invalid_request_error", 429: "rate_limit_error",
                                       500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> bytes:
        kind = self.KINDS.get(self.status, "invalid_request_error")
        return json.dumps(error_body(self.message, kind, param=self.param,
                                     code=self.code)).encode()


async def _send_error(send: Send, err: ApiError) -> None:
    body = err.body()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(Exception):
    pass


class Guard:
    """Pure ASGI middleware around the whole app: body size (413, from Content-Length before
    reading, or while reading a chunked body), a body that stops arriving (408), and any
    exception no route handled (500, one log line, never a traceback)."""

    def __init__(self, app: Any, max_body: int, timeout: float) -> None:
        self.app, self.max_body, self.timeout = app, max_body, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            await _send_error(send, ApiError(
                413, f"the request body is {length.decode(errors='replace')} bytes; this "
                f"server takes at most {self.max_body}", code="request_too_large"))
            return
        state = {"received": 0, "body_done": False, "started": False, "refused": None}

        async def guarded_receive() -> Message:
            if state["body_done"]:
                return await receive()  # after the body: waits for a disconnect
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except asyncio.TimeoutError:
                state["refused"] = ApiError(408, f"the request body did not arrive within "
                                            f"{self.timeout:g} s")
                raise _BodyTooLarge() from None
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > self.max_body:
                    state["refused"] = ApiError(413, f"the request body is over "
                                                f"{self.max_body} bytes",
                                                code="request_too_large")
                    raise _BodyTooLarge()
                state["body_done"] = not message.get("more_body", False)
            return message

        async def tracking_send(message: Message) -> None:
            if state["refused"] is not None:
                return  # the app is answering an error of its own about it: ours goes out
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        try:
            await self.app(scope, guarded_receive, tracking_send)
        except asyncio.CancelledError:
            # The server is stopping and its grace period ran out: the request is dropped
            # (its engine work cancelled on the way out); nothing to report.
            return
        except Exception as err:
            if state["refused"] is None:
                first = (str(err).splitlines() or [""])[0]
                log.error("handformer serve: %s %s failed: %s: %s", scope.get("method"),
                          scope.get("path"), type(err).__name__, first)
            if not state["started"]:
                await _send_error(send, state["refused"] or ApiError(
                    500, "the server failed on this request"))


async def wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(Response):
    """An ASGI response sending server-sent events from ``events`` while watching for the
    client to go away: a disconnect, or a send blocked for ``timeout`` seconds (a client
    that stopped reading), closes ``events`` — whose ``finally`` cancels the engine work."""

    def __init__(self, events: AsyncIterator[str], timeout: float) -> None:
        self.events, self.timeout = events, timeout
        self.status_code, self.background = 200, None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            streaming.cancel()

        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache")]})
            try:
                async for event in self.events:
                    # Checked on every event, not left to ``cancel()`` alone: a send to a
                    # closed connection returns at once, so the stream would run to the end.
                    if watching.done():
                        return
                    # One timer per send, not ``asyncio.wait_for`` (a task of its own for
                    # every event, on the loop the engine's thread shares the GIL with).
                    timer = loop.call_at(loop.time() + self.timeout, expire)
                    try:
                        await send({"type": "http.response.body", "body": event.encode(),
                                    "more_body": True})
                    finally:
                        timer.cancel()
                    # A turn for the disconnect watcher even when neither the events nor the
                    # send ever wait (a closed connection's send returns at once).
                    await asyncio.sleep(0)
            except asyncio.CancelledError:
                if expired:  # our timer's cancel, wherever it landed
                    raise asyncio.TimeoutError() from None
                raise
            await send({"type": "http.response.body", "body": b""})

        watching = asyncio.ensure_future(wait_disconnect(receive))
        streaming = asyncio.ensure_future(stream())
        try:
            await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
            if streaming.done() and isinstance(streaming.exception(), asyncio.TimeoutError):
                log.warning("handformer serve: a client read nothing for %g s; its stream was "
                            "dropped and its KV blocks freed", self.timeout)
        finally:
            for task in (streaming, watching):
                task.cancel()
            await asyncio.gather(streaming, watching, return_exceptions=True)
            await self.events.aclose()  # type: ignore[attr-defined]


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class DroppedStreamFilter(logging.Filter):
    """uvicorn reports a stream dropped for a client that stopped reading as an ERROR ("ASGI
    callable returned without completing response"); the app logged why already."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "returned without completing response" not in record.getMessage()
