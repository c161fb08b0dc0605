"""One writer per folder: an exclusive ``flock`` on ``FOLDER/.handformer.lock``.

Two ``handformer train --out X`` at once would interleave ``metrics.jsonl`` and save over
each other's checkpoints; the second must stop before it writes anything. The lock is the
kernel's (``fcntl.flock``), not the file's existence, so a holder killed with SIGKILL, a
power cut or an OOM kill leaves nothing that blocks the next writer: the kernel drops the
lock with the process. The file stays behind (removing it would let two processes lock two
different files of the same name); what is in it is only the holder's PID, host and command,
for the message the next writer prints.

On a platform without ``fcntl`` (Windows) there is no lock: ``FolderLock`` then only writes
the holder's details.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from handformer.runs.files import RunFolderError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_FILE", "FolderBusyError", "FolderLock", "check_not_busy"]

LOCK_FILE = ".handformer.lock"


class FolderBusyError(RunFolderError):
    """Another live process holds the folder's lock; the message names its PID."""


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _refuse_link(path: Path) -> None:
    """A lock file that is a symbolic link is refused: locking it would write our details
    into whatever it points at."""
    if path.is_symlink():
        raise RunFolderError(f"{path} is a symbolic link: handformer writes its lock only into "
                             "a plain file of its own; remove the link")


def _holder(fd: int) -> str:
    """The current holder's details, as written in the lock file, for a message."""
    try:
        raw = os.pread(fd, 4096, 0).decode("utf-8", errors="replace")
        info: dict[str, Any] = json.loads(raw)
        where = f" on {info['host']}" if info.get("host") != socket.gethostname() else ""
        return f"PID {info['pid']}{where}, `{info.get('command', 'handformer')}`"
    except (OSError, ValueError, TypeError, KeyError):
        return "PID unknown: the holder has not written its details yet"


def _busy_message(folder: Path, fd: int) -> str:
    return (f"{folder} is being written by another handformer process ({_holder(fd)}); wait "
            "for it to finish or stop it, or write somewhere else")


def check_not_busy(folder: str | Path) -> None:
    """Raise ``FolderBusyError`` if a live process holds ``folder``'s lock; otherwise do
    nothing. Creates no file: a refusal that checks this first leaves the folder as it was."""
    path = Path(folder) / LOCK_FILE
    if fcntl is None:
        return
    _refuse_link(path)
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return  # no lock file (or none readable): nobody holds one we could wait for
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderBusyError(_busy_message(path.parent, fd)) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class FolderLock:
    """Hold ``folder``'s lock while in the ``with`` block (or between ``acquire`` and
    ``release``). ``acquire`` fails at once, never waits: ``FolderBusyError`` names the
    holder. ``folder`` must exist; the lock file is created if missing."""

    def __init__(self, folder: str | Path, *, command: str = "handformer") -> None:
        self.path = Path(folder) / LOCK_FILE
        self.command = command
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """True between a successful ``acquire`` and ``release``."""
        return self._fd is not None

    def acquire(self) -> FolderLock:
        """Take the lock or raise ``FolderBusyError``; then write this process's details."""
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this FolderLock")
        # O_RDWR without O_TRUNC: a process that fails to lock must not erase the holder's PID.
        # O_NOFOLLOW: a link planted under the lock's name must not carry our write elsewhere.
        _refuse_link(self.path)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o644)
        except OSError:
            _refuse_link(self.path)  # a link that appeared since: ELOOP, named
            raise
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise FolderBusyError(_busy_message(self.path.parent, fd)) from None
            details = {"pid": os.getpid(), "host": socket.gethostname(),
                       "command": self.command,
                       "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(details).encode("utf-8"), 0)
        except BaseException:
            os.close(fd)  # closing the descriptor also drops a lock taken on it
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (the file stays: see the module docstring). Safe to call twice."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
