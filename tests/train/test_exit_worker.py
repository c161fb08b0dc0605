"""``exit_worker``: how a torchrun worker ends (``handformer.train.distributed``).

torch keeps the gloo group alive past ``destroy_process_group`` once DDP or FSDP used it, so a
worker leaves with ``os._exit`` instead of tearing the interpreter down beside its threads.
What ``os._exit`` alone would lose must still happen: the exit handlers run, buffered output
reaches the pipe, and the exit code is the command's.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import atexit, sys
    from handformer.train.distributed import exit_worker

    atexit.register(lambda: print("exit handler ran", flush=False))
    sys.stdout.write("buffered, no newline")  # a pipe: block-buffered until flushed
    sys.stderr.write("on stderr")
    exit_worker(int(sys.argv[1]))
    print("after exit_worker")  # never reached
""")


def _run(code: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(code)], capture_output=True,
                          text=True, timeout=120)


def test_exit_worker_keeps_the_code_runs_exit_handlers_and_flushes_output() -> None:
    for code in (0, 3):
        proc = _run(code)
        assert proc.returncode == code, proc.stderr
        assert proc.stdout == "buffered, no newlineexit handler ran\n"
        assert "on stderr" in proc.stderr
        assert "after exit_worker" not in proc.stdout


def test_exit_worker_skips_the_interpreter_teardown() -> None:
    """The point of it: no object is finalized after the exit handlers (a ``__del__`` at
    teardown would print)."""
    script = SCRIPT.replace("exit_worker(int(sys.argv[1]))", textwrap.dedent("""\
        class Finalized:
            def __del__(self):
                sys.stdout.write(" finalized")
        kept = Finalized()
        exit_worker(int(sys.argv[1]))"""))
    proc = subprocess.run([sys.executable, "-c", script, "0"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "finalized" not in proc.stdout
    plain = subprocess.run([sys.executable, "-c", script.replace(
        "exit_worker(int(sys.argv[1]))", "sys.exit(0)"), "0"], capture_output=True, text=True,
        timeout=120)
    assert "finalized" in plain.stdout  # the check can fail: a plain exit does finalize it
