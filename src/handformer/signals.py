"""Signal handlers for a stretch of code: installed on the way in, the previous ones put back
on the way out. Only the main thread may install them; elsewhere nothing changes."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

__all__ = ["handled"]

Handler = Callable[[int, FrameType | None], Any]


@contextmanager
def handled(handler: Handler, *signals: int) -> Iterator[dict[int, Any]]:
    """While inside, ``handler`` handles ``signals``; yields the previous handlers (signal →
    handler; empty outside the main thread), which ``handler`` may put back itself sooner."""
    if threading.current_thread() is not threading.main_thread():
        yield {}
        return
    previous = {number: signal.signal(number, handler) for number in signals}
    try:
        yield previous
    finally:
        for number, old in previous.items():
            signal.signal(number, old)
