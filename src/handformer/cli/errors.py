"""The exit-code contract of every ``handformer`` command, and the one line a user sees.

    0    success
    1    refused or failed while running: files, folders, run state, sizes, memory
         (ValueError, OSError, RuntimeError, MemoryError, torch's allocator errors, …)
    2    the command line itself is wrong (argparse's errors, ``UsageError``)
    3    ``handformer train`` stopped on non-finite losses (see the README)
    130  interrupted by Ctrl-C (SIGINT);  143  terminated by SIGTERM

A failure prints exactly one line on stderr, ``handformer COMMAND: error: MESSAGE`` (warning
lines may precede it), never a traceback: multi-line messages (torch appends C++ stack
frames to some) are cut to their meaningful lines and joined. A usage error (exit 2) ends
with a pointer to the command's help instead of argparse's usage block:
``handformer train: error: argument --lr: invalid float value: 'x' (see handformer train
--help)`` (``UsageParser``, the class of every handformer parser). An interrupt prints
``handformer COMMAND: interrupted``, followed on the same line by what the command knows
about where it stopped (``Interrupted.detail``; ``handformer train`` names the checkpoint to
resume from). Set ``HANDFORMER_TRACEBACK=1`` to let unexpected errors (bugs) raise as usual.

SIGTERM is turned into an exception, ``Terminated``, while a command runs
(``sigterm_raises``), so that ``finally`` blocks, atomic writes and the checkpoint writer's
clean-up run as they do for Ctrl-C, instead of the process vanishing mid-step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import NoReturn

from handformer.cli.common import UsageError

__all__ = [
    "EXIT_ERROR",
    "EXIT_USAGE",
    "EXPECTED",
    "Interrupted",
    "Terminated",
    "UsageParser",
    "exit_code",
    "message_of",
    "one_line",
    "report",
    "show_tracebacks",
    "signal_of",
    "sigterm_raises",
    "silence_stdout",
    "usage_line",
]

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
# What a command means to report as a failure; anything else is a bug (see ``message_of``).
EXPECTED: tuple[type[Exception], ...] = (ValueError, OSError, RuntimeError, MemoryError,
                                         ImportError)
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a reader that went away (SIGPIPE)


class Terminated(BaseException):
    """SIGTERM arrived. A ``BaseException`` like ``KeyboardInterrupt``: ``except Exception``
    blocks let it pass, ``finally`` blocks run."""

    signal_number = signal.SIGTERM


class Interrupted(BaseException):
    """A ``KeyboardInterrupt`` or ``Terminated`` on its way out, with ``detail``: what the
    command can tell about where it stopped (one sentence, no newline)."""

    def __init__(self, signal_number: int, detail: str = "") -> None:
        super().__init__(signal_number, detail)
        self.signal_number = signal_number
        self.detail = detail

    @classmethod
    def from_exception(cls, err: BaseException, detail: str = "") -> Interrupted:
        return cls(signal_of(err), detail)


def usage_line(prog: str, message: str) -> str:
    """The one line of a usage error: what is wrong and where the command's help is."""
    return f"{prog}: error: {one_line(message)} (see {prog} --help)"


class UsageParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line with a pointer to ``--help`` (exit 2),
    not argparse's usage block followed by the error. Sub-parsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        """Print ``usage_line`` for ``message`` on stderr and exit 2."""
        self.exit(EXIT_USAGE, usage_line(self.prog, message) + "\n")


def signal_of(err: BaseException) -> int:
    """The signal behind an interrupt exception (SIGINT for ``KeyboardInterrupt``)."""
    return int(getattr(err, "signal_number", signal.SIGINT))


_TRACE = re.compile(r"^(Exception raised from |frame #\d+|Traceback \(most recent call last\))")
_ENFORCE = re.compile(r"^\[enforce fail at [^\]]*\]\s*(data\.\s*)?")
_ALLOCATION = re.compile(r"tried to allocate (\d+) bytes")


def one_line(text: str) -> str:
    """``text`` as one line: the lines before any C++/Python stack trace, stripped and joined
    with spaces (torch's ``[enforce fail at …]`` prefix dropped)."""
    kept: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if _TRACE.match(line):
            break
        if line:
            kept.append(line)
    return _ENFORCE.sub("", " ".join(kept))


def _is_out_of_memory(err: BaseException) -> bool:
    import torch

    if isinstance(err, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("not enough memory" in text
                                              or "out of memory" in text.lower())


def message_of(err: BaseException) -> str:
    """The one-line message a user sees for ``err`` (without the ``handformer X:`` prefix)."""
    from handformer.models.budget import MemoryBudgetError, format_bytes

    text = one_line(str(err))
    if isinstance(err, MemoryBudgetError):
        return text  # our own refusal already says what, how much and what to change
    if _is_out_of_memory(err):
        size = _ALLOCATION.search(text)
        what = f"torch could not allocate {format_bytes(int(size.group(1)))}" if size \
            else "ran out of memory"
        return (f"{what} ({text or type(err).__name__}); make the model, the batch or the "
                "request smaller")
    if not text:
        return type(err).__name__
    if isinstance(err, EXPECTED):
        return text  # refusals and failures the code means to report (ImportError: extras)
    return (f"unexpected {type(err).__name__}: {text} (a bug in handformer; set "
            "HANDFORMER_TRACEBACK=1 to see where it happened)")


def exit_code(err: BaseException) -> int:
    """2 for a usage error, 128 + the signal for an interrupt, 1 for anything else."""
    if isinstance(err, UsageError):
        return EXIT_USAGE
    if isinstance(err, (KeyboardInterrupt, Terminated, Interrupted)):
        return 128 + signal_of(err)
    return EXIT_ERROR


def report(command: str, err: BaseException) -> int:
    """Print the one line for ``err`` on stderr and return its exit code (``command`` may
    be empty: before the command line is parsed)."""
    prefix = f"handformer {command}".rstrip()
    if isinstance(err, (KeyboardInterrupt, Terminated, Interrupted)):
        detail = getattr(err, "detail", "")
        word = "terminated" if signal_of(err) == signal.SIGTERM else "interrupted"
        line = f"{prefix}: {word}" + (f"; {detail}" if detail else "")
    elif exit_code(err) == EXIT_USAGE:
        line = usage_line(prefix, message_of(err))
    else:
        line = f"{prefix}: error: {message_of(err)}"
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()  # what the command printed comes before its last word
    print(line, file=sys.stderr, flush=True)
    return exit_code(err)


def show_tracebacks() -> bool:
    """``HANDFORMER_TRACEBACK=1``: let unexpected errors raise (for debugging handformer)."""
    return os.environ.get("HANDFORMER_TRACEBACK", "") not in ("", "0")


def silence_stdout() -> int:
    """The reader of stdout went away (``handformer generate | head``): not an error of the
    command. Point stdout at /dev/null so the interpreter's final flush stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
    return EXIT_BROKEN_PIPE


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """While inside, SIGTERM raises ``Terminated`` in the main thread (the previous handler
    is restored on the way out). Elsewhere than the main thread, signals cannot be handled
    and nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
