"""``EventStream`` stops at a client's disconnect however the event loop orders the last
send and the disconnect — even when every send completes at once (what a closed
connection's send does under uvicorn, so the streaming task never waits on its own)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

pytest.importorskip("starlette")

from handformer.serve.asgi import EventStream

ENDLESS = 5_000


def _stream_until_disconnect(send_yields: int, receive_yields: int,
                             event_yields: int) -> tuple[int, bool]:
    """Stream up to ``ENDLESS`` events to a client that leaves during its fifth send; each
    ``*_yields`` is how many loop turns that step takes. Returns (events made, closed)."""
    produced, closed = [0], [False]
    sent, gone = [0], asyncio.Event()

    async def events():
        try:
            for _ in range(ENDLESS):
                produced[0] += 1
                for _ in range(event_yields):
                    await asyncio.sleep(0)
                yield "data: x\n\n"
        finally:
            closed[0] = True  # where the app cancels the engine work

    async def send(message: dict) -> None:
        for _ in range(send_yields):
            await asyncio.sleep(0)
        sent[0] += 1
        if sent[0] == 5:
            gone.set()

    async def receive() -> dict:
        await gone.wait()
        for _ in range(receive_yields):
            await asyncio.sleep(0)
        return {"type": "http.disconnect"}

    asyncio.run(EventStream(events(), timeout=5.0)({}, receive, send))
    return produced[0], closed[0]


@pytest.mark.parametrize("yields", list(itertools.product(range(3), range(4), range(3))))
def test_the_stream_ends_at_the_disconnect_and_closes_its_events(yields) -> None:
    produced, closed = _stream_until_disconnect(*yields)
    assert closed
    assert produced < 20, f"the stream ran on for {produced} events after the client left"


def test_a_send_blocked_past_the_timeout_drops_the_stream_and_closes_its_events(
        caplog) -> None:
    closed, made = [False], [0]

    async def events():
        try:
            while True:
                made[0] += 1
                yield "data: x\n\n"
        finally:
            closed[0] = True

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()  # a client that reads nothing: the send never ends

    async def receive() -> dict:
        await asyncio.Event().wait()  # and never hangs up
        return {"type": "http.disconnect"}

    async def run() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await EventStream(events(), timeout=0.05)({}, receive, send)
        return loop.time() - start

    with caplog.at_level("WARNING", logger="handformer.serve"):
        elapsed = asyncio.run(run())
    assert closed[0] and made[0] == 1
    assert 0.05 <= elapsed < 5
    assert "read nothing for 0.05 s" in caplog.text
