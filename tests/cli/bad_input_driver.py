"""Runs many ``handformer`` command lines, each in a forked child of one warm interpreter:
the isolation of a subprocess per case (own cwd, own stdout/stderr files, own exit code, a
kill on timeout, a memory ceiling) without paying torch's import for every case.

    python tests/cli/bad_input_driver.py SPEC.json RESULTS.json

SPEC.json is a list of ``{"id", "argv", "cwd", "stdout", "stderr", "stdin", "timeout"}``;
RESULTS.json maps each id to ``{"code", "signal", "timed_out", "seconds"}``. A child does
what ``python -m handformer ARGV`` does: ``SystemExit`` gives the exit code, an exception
that escapes ``main`` is printed as a traceback with exit code 1.

Each child gets an address-space limit (what this interpreter already maps + a few GiB), so
a case that asks for 10¹² tokens fails inside torch's allocator on this machine instead of
pushing the machine into swap or the OOM killer; and a file-size limit, so a runaway writer
stops. Up to ``--jobs`` children run at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import sys
import time
import traceback
from typing import Any

HEADROOM_BYTES = 3 << 30  # address space a child may add to what the parent maps
MAX_FILE_BYTES = 256 << 20  # a child's largest file (stdout included)


def _warm() -> Any:
    """Import what the commands import, once, before any fork."""
    import importlib

    for name in ("torch", "handformer.data.corpora", "handformer.explore.server",
                 "handformer.generate", "handformer.interop.bert",
                 "handformer.interop.hf_folder", "handformer.jobs.classify",
                 "handformer.jobs.lm", "handformer.jobs.seq2seq", "handformer.runs"):
        importlib.import_module(name)
    from handformer.cli.main import build_parser, main

    build_parser()  # imports every command module
    return main


def _mapped_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(spec: dict[str, Any], main: Any, limit: int) -> None:
    """Never returns: becomes the case, then ``os._exit`` with its exit code."""
    code = 1
    try:
        os.chdir(spec["cwd"])
        for fd, path, flags in ((0, spec.get("stdin") or os.devnull, os.O_RDONLY),
                                (1, spec["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, spec["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sys.argv = ["handformer", *spec["argv"]]
        try:
            result = main(spec["argv"])
            code = 0 if result is None else int(result)
        except SystemExit as stop:  # as the interpreter turns SystemExit into an exit code
            if stop.code is None:
                code = 0
            elif isinstance(stop.code, int):
                code = stop.code
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except BaseException:  # as the interpreter reports an uncaught exception
            traceback.print_exc()
            code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):  # nothing left to report it to
                stream.flush()
        os._exit(code & 0xFF)


def run_all(specs: list[dict[str, Any]], jobs: int) -> dict[str, dict[str, Any]]:
    main = _warm()
    limit = _mapped_bytes() + HEADROOM_BYTES
    results: dict[str, dict[str, Any]] = {}
    pending = list(specs)
    running: dict[int, tuple[dict[str, Any], float]] = {}
    while pending or running:
        while pending and len(running) < jobs:
            spec = pending.pop(0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(spec, main, limit)
            running[pid] = (spec, time.monotonic())
        time.sleep(0.02)
        for pid, (spec, started) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            elapsed = time.monotonic() - started
            if done == 0 and elapsed > spec["timeout"]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                results[spec["id"]] = {"code": None, "signal": None, "timed_out": True,
                                       "seconds": round(elapsed, 2)}
                del running[pid]
            elif done:
                code = os.waitstatus_to_exitcode(status)
                results[spec["id"]] = {"code": code if code >= 0 else None,
                                       "signal": -code if code < 0 else None,
                                       "timed_out": False, "seconds": round(elapsed, 2)}
                del running[pid]
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("results")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    with open(args.spec, encoding="utf-8") as fh:
        specs = json.load(fh)
    results = run_all(specs, args.jobs)
    with open(args.results, "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
