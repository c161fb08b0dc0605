"""What a checker hands back, and how a bug in the reader's code becomes one.

A checker never raises on the reader's mistake: an exception inside their code is caught and
reported with *their* file and line (the last frame of the traceback that is neither
handformer's nor torch's), so the message points where the fix goes.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from handformer.learn.mistakes import MISTAKES

__all__ = ["CheckResult", "ReaderError", "call_reader", "fail", "never_raises", "passed"]

T = TypeVar("T")

_LIBRARY_DIRS = (Path(__file__).resolve().parents[1], Path(torch.__file__).resolve().parent)


@dataclass(frozen=True)
class CheckResult:
    """``passed`` says whether the reader's code did what the contract asks; ``message`` says
    what was checked (PASS) or what is wrong and the likely cause (FAIL); ``mistake`` is the
    key of the classic mistake diagnosed (``MISTAKES``), or None."""

    checker: str
    passed: bool
    message: str
    mistake: str | None = None

    def __str__(self) -> str:
        return self.message

    def __bool__(self) -> bool:
        return self.passed


def passed(checker: str, what: str) -> CheckResult:
    return CheckResult(checker, True, f"PASS {checker}: {what}")


def fail(checker: str, what: str, mistake: str | None = None) -> CheckResult:
    """A FAIL naming what was observed and, when one of the table's mistakes explains it,
    that mistake and its fix."""
    text = f"FAIL {checker}: {what}"
    if mistake is not None:
        m = MISTAKES[mistake]
        text += f"\n  likely cause: {m.title} — {m.why}\n  fix: {m.fix}"
    return CheckResult(checker, False, text, mistake)


class ReaderError(Exception):
    """The reader's code raised; ``where`` is their line, ``result`` the FAIL to return."""

    def __init__(self, result: CheckResult) -> None:
        super().__init__(result.message)
        self.result = result


def _reader_frame(err: BaseException) -> traceback.FrameSummary | None:
    frames = traceback.extract_tb(err.__traceback__)
    for frame in reversed(frames):
        path = Path(frame.filename).resolve() if frame.filename[:1] != "<" else None
        if path is None or not any(path.is_relative_to(d) for d in _LIBRARY_DIRS):
            return frame
    return None  # raised before the reader's code ran (a call that does not fit its signature)


def _raised(checker: str, what: str, err: BaseException) -> CheckResult:
    frame = _reader_frame(err)
    where = "" if frame is None else (
        f" at {Path(frame.filename).name}:{frame.lineno} in {frame.name}"
        + (f": {frame.line.strip()}" if frame.line else ""))
    message = str(err).splitlines()[0] if str(err) else ""
    mistake = "view_contiguous" if "view size is not compatible" in message else None
    return fail(checker, f"{what} raised {type(err).__name__}{where}\n  {message}", mistake)


def call_reader(checker: str, what: str, fn: Callable[..., T], *args: object,
                **kwargs: object) -> T:
    """``fn(*args, **kwargs)``; if it raises, a ``ReaderError`` whose FAIL names the reader's
    line. ``view`` on a non-contiguous tensor is diagnosed as that classic mistake."""
    try:
        return fn(*args, **kwargs)
    except Exception as err:  # the reader's bug, reported rather than raised
        raise ReaderError(_raised(checker, what, err)) from None


def never_raises(check: Callable[..., CheckResult]) -> Callable[..., CheckResult]:
    """A checker returns a FAIL for whatever the reader's code does: what it hands back may
    still break the comparison itself (an object that is not a module, a tensor of another
    dtype, a backward pass that fails), and that is reported too, with the reader's line."""
    @functools.wraps(check)
    def wrapper(*args: object, **kwargs: object) -> CheckResult:
        try:
            return check(*args, **kwargs)
        except ReaderError as err:
            return err.result
        except Exception as err:  # what the reader's code handed back broke the check
            return _raised(check.__name__, "checking what your code returned", err)
    return wrapper
