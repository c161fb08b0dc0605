"""``handformer.signals.handled``: handlers for a stretch of code, put back afterwards."""

from __future__ import annotations

import signal
import threading
from typing import Any

import pytest

from handformer.signals import handled


def _ignore(signum: int, frame: Any) -> None:
    pass


def test_handlers_are_installed_inside_and_the_previous_ones_come_back() -> None:
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)
    with handled(_ignore, signal.SIGUSR1, signal.SIGUSR2) as previous:
        assert signal.getsignal(signal.SIGUSR1) is _ignore
        assert signal.getsignal(signal.SIGUSR2) is _ignore
        assert previous == {signal.SIGUSR1: before[0], signal.SIGUSR2: before[1]}
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)) == before


def test_the_previous_handlers_come_back_when_the_body_raises() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(RuntimeError, match="body"), handled(_ignore, signal.SIGUSR1):
        raise RuntimeError("body")
    assert signal.getsignal(signal.SIGUSR1) == before


def test_outside_the_main_thread_nothing_changes() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    seen: dict[str, Any] = {}

    def body() -> None:
        with handled(_ignore, signal.SIGUSR1) as previous:
            seen["previous"] = previous
            seen["inside"] = signal.getsignal(signal.SIGUSR1)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == {"previous": {}, "inside": before}
