"""``python -m handformer`` with crash points, for the kill/resume tests.

    python tests/reference/crash_launcher.py [--kill-at POINT@STEP] [--raise-at RANK@STEP] \\
        [--signal-at INT|TERM:POINT@STEP] \\
        train --data corpus.txt ...

``--kill-at step@12``             SIGKILL (no cleanup, no ``finally``) once step 12 is complete,
                                  its evaluation and checkpoint included
``--kill-at weights_written@15``  SIGKILL inside the checkpoint writer for step 15, at that
                                  phase (any of ``handformer.train.checkpoint.PHASES``)
``--raise-at 1@5``                rank 1 of a torchrun job raises ``RuntimeError`` once step 5
                                  is complete, while the other ranks carry on into the next
                                  collective
``--signal-at INT:files_written@15``  send this process SIGINT (``TERM``: SIGTERM) at that
                                  point, as a Ctrl-C or a ``kill`` would: the handlers run,
                                  ``finally`` blocks too (unlike ``--kill-at``)

The points go in through the trainer's public extension points only: a callback whose
``on_step_end`` runs on every rank (``every_rank = True``) and the checkpoint manager's
``on_phase`` hook. The CLI has no option to add callbacks, so the launcher wraps
``Trainer.fit`` to install them into every trainer that trains in this process, then runs
``python -m handformer`` in-process with the remaining arguments. Run it as a script (a file
path), so that torchrun can launch it like any other training script.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
from typing import Any

from handformer.train.checkpoint import PHASES
from handformer.train.trainer import Trainer

STEP_END = "step"
KILL_POINTS = (STEP_END, *PHASES)


def _point(text: str, first: str) -> tuple[str, int]:
    """``"name@12"`` → ``("name", 12)``."""
    name, sep, step = text.rpartition("@")
    if not sep or not name or not step.isdigit():
        raise argparse.ArgumentTypeError(f"expected {first}@STEP; got {text!r}")
    return name, int(step)


def kill_point(text: str) -> tuple[str, int]:
    name, step = _point(text, "POINT")
    if name not in KILL_POINTS:
        raise argparse.ArgumentTypeError(f"unknown kill point {name!r}; expected one of "
                                         f"{', '.join(KILL_POINTS)}")
    return name, step


SIGNALS = {"INT": signal.SIGINT, "TERM": signal.SIGTERM}


def signal_point(text: str) -> tuple[int, str, int]:
    """``"INT:weights_written@15"`` → ``(SIGINT, "weights_written", 15)``."""
    sig, sep, point = text.partition(":")
    if not sep or sig not in SIGNALS:
        raise argparse.ArgumentTypeError(f"expected INT:POINT@STEP or TERM:POINT@STEP; got "
                                         f"{text!r}")
    name, step = kill_point(point)
    return SIGNALS[sig], name, step


def raise_point(text: str) -> tuple[int, int]:
    rank, step = _point(text, "RANK")
    if not rank.isdigit():
        raise argparse.ArgumentTypeError(f"expected RANK@STEP with an integer rank; got {text!r}")
    return int(rank), step


def _sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class CrashPoints:
    """The trainer callback and checkpoint hook of one process (one rank)."""

    every_rank = True  # the raise point fires on a rank other than 0

    def __init__(self, rank: int, kill_at: tuple[str, int] | None,
                 raise_at: tuple[int, int] | None,
                 signal_at: tuple[int, str, int] | None = None) -> None:
        self.rank = rank
        self.kill_at = kill_at
        self.raise_at = raise_at
        self.signal_at = signal_at

    def _signal(self, point: str, step: int) -> None:
        if self.signal_at is not None and self.signal_at[1:] == (point, step):
            os.kill(os.getpid(), self.signal_at[0])  # its handler runs at the next bytecode

    def on_phase(self, phase: str, step: int) -> None:  # CheckpointManager.on_phase
        if (phase, step) == self.kill_at:
            _sigkill()
        self._signal(phase, step)

    def on_step_end(self, step: int) -> None:
        if (STEP_END, step) == self.kill_at:
            _sigkill()
        self._signal(STEP_END, step)
        if (self.rank, step) == self.raise_at:
            raise RuntimeError(f"crash launcher --raise-at {self.rank}@{step}: rank {self.rank} "
                               f"fails at step {step}")


def install(kill_at: tuple[str, int] | None, raise_at: tuple[int, int] | None,
            signal_at: tuple[int, str, int] | None = None) -> None:
    """Make every ``Trainer.fit`` in this process run with the crash points."""
    fit = Trainer.fit

    def fit_with_crash_points(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        points = CrashPoints(self.dist.rank, kill_at, raise_at, signal_at)
        self.callbacks.append(points)
        if self.checkpoints is not None:
            self.checkpoints.on_phase = points.on_phase
        return fit(self, *args, **kwargs)

    Trainer.fit = fit_with_crash_points  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kill-at", type=kill_point, metavar="POINT@STEP")
    parser.add_argument("--raise-at", type=raise_point, metavar="RANK@STEP")
    parser.add_argument("--signal-at", type=signal_point, metavar="INT|TERM:POINT@STEP")
    parser.add_argument("handformer_args", nargs=argparse.REMAINDER,
                        help="the arguments of `python -m handformer`")
    args = parser.parse_args(argv)
    install(args.kill_at, args.raise_at, args.signal_at)
    sys.argv = ["handformer", *args.handformer_args]
    runpy.run_module("handformer", run_name="__main__", alter_sys=True)  # raises SystemExit


if __name__ == "__main__":
    main()
