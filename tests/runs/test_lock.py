"""handformer.runs.lock: one writer per folder; a refused writer changes nothing; a holder
killed with SIGKILL never blocks the next one (the kernel drops a flock with its process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from handformer.runs import FolderBusyError, FolderLock, RunFolderError
from handformer.runs.lock import LOCK_FILE

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")

HOLDER = """
import sys, time
from handformer.runs import FolderLock
lock = FolderLock(sys.argv[1], command="test holder").acquire()
print("held", flush=True)
time.sleep(300)
"""


def start_holder(folder: Path) -> subprocess.Popen[str]:
    """A separate process that takes ``folder``'s lock and sleeps holding it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)],
                            stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_the_lock_file_names_its_holder_and_is_released(tmp_path: Path) -> None:
    with FolderLock(tmp_path, command="handformer train") as lock:
        assert lock.held
        info = json.loads((tmp_path / LOCK_FILE).read_text())
        assert info["pid"] == os.getpid() and info["command"] == "handformer train"
    assert not lock.held
    with FolderLock(tmp_path):  # released: the next writer gets it
        pass


def test_a_second_writer_fails_at_once_naming_the_pid_and_changes_nothing(
        tmp_path: Path) -> None:
    with FolderLock(tmp_path, command="handformer train"):
        before = (tmp_path / LOCK_FILE).read_bytes()
        started = time.monotonic()
        with pytest.raises(FolderBusyError, match=rf"PID {os.getpid()}, `handformer train`"):
            FolderLock(tmp_path).acquire()
        assert time.monotonic() - started < 5  # refused, not waited for
        assert (tmp_path / LOCK_FILE).read_bytes() == before
    assert issubclass(FolderBusyError, RunFolderError) and issubclass(FolderBusyError, ValueError)


def test_another_process_holds_it_until_sigkill_then_it_is_taken_over(tmp_path: Path) -> None:
    holder = start_holder(tmp_path)
    try:
        with pytest.raises(FolderBusyError, match=rf"PID {holder.pid}, `test holder`"):
            FolderLock(tmp_path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert holder.returncode == -signal.SIGKILL
    # The file still names the dead holder, but the kernel released its lock.
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid
    with FolderLock(tmp_path, command="after the kill"):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_lock_file_with_no_details_yet_still_gives_a_message(tmp_path: Path) -> None:
    with FolderLock(tmp_path):
        (tmp_path / LOCK_FILE).write_text("")  # as between another holder's flock and write
        with pytest.raises(FolderBusyError, match="PID unknown"):
            FolderLock(tmp_path).acquire()
