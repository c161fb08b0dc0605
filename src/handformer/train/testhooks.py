"""Test-only crash points, so tests can SIGKILL a real training process at a chosen moment.

Set ``HANDFORMER_TEST_KILL_AT=<point>@<step>`` in a subprocess's environment, e.g.
``step@12`` (after step 12 is complete, its checkpoint included) or ``ckpt:weights@10``
(inside the checkpoint writer for step 10, after the weights are written). The variable is
read once at import; when it is unset, each crash point is a single ``is None`` test.
Points: ``step``, ``ckpt:begin``, ``ckpt:weights``, ``ckpt:state``, ``ckpt:marker``,
``ckpt:renamed``.
"""

from __future__ import annotations

import os
import signal

__all__ = ["ENV_VAR", "RAISE_ENV_VAR", "crash_point", "raise_point"]

ENV_VAR = "HANDFORMER_TEST_KILL_AT"
_SPEC: str | None = os.environ.get(ENV_VAR) or None


def crash_point(point: str, step: int) -> None:
    """Kill this process with SIGKILL (no cleanup, no ``finally``) if the test asked for it."""
    if _SPEC is not None and f"{point}@{step}" == _SPEC:
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))


RAISE_ENV_VAR = "HANDFORMER_TEST_RAISE_AT"
_RAISE_SPEC: str | None = os.environ.get(RAISE_ENV_VAR) or None


def raise_point(rank: int, step: int) -> None:
    """Raise in one rank of a distributed test job: ``HANDFORMER_TEST_RAISE_AT=1@3`` makes
    rank 1 fail after step 3 while the other ranks carry on into their next collective."""
    if _RAISE_SPEC is not None and f"{rank}@{step}" == _RAISE_SPEC:
        raise RuntimeError(f"test hook {RAISE_ENV_VAR}={_RAISE_SPEC}: rank {rank} fails at "
                           f"step {step}")
