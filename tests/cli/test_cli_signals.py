"""Ctrl-C and SIGTERM with real processes: `handformer train` stops with exit code 130 / 143
and one line on stderr naming the newest committed checkpoint and the command that resumes
it; an interrupt inside the checkpoint writer leaves the previous checkpoints whole (and no
half-written folder behind), and the run resumes from what the line named.

The live tests start `python -m handformer train`, wait for its second evaluation line and
send the signal, as a user's Ctrl-C or a scheduler's `kill` would; the writer tests send it
from inside a chosen phase of the checkpoint writer (tests/reference/crash_launcher.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from handformer.cli import main
from handformer.train.checkpoint import PHASES, list_checkpoints, verify_checkpoint
from tests.train.helpers import toy_text

CRASH_LAUNCHER = Path(__file__).parents[1] / "reference" / "crash_launcher.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
ARGS = ["--preset", "tiny", "--log-interval", "1", "--eval-interval", "5",
        "--checkpoint-interval", "5", "--keep-last", "2", "--no-progress", "--no-plot",
        "--device", "cpu"]
WORDS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(toy_text(1500), encoding="utf-8")
    return path


def expected_line(sig: int, out: Path) -> str:
    newest = list_checkpoints(out / "checkpoints")[-1]
    return (f"handformer train: {WORDS[sig]}; the newest committed checkpoint is {newest.path} "
            f"(step {newest.step}); continue with `handformer train --resume {out}`")


def assert_checkpoints_whole(out: Path) -> list[int]:
    found = list_checkpoints(out / "checkpoints")
    for info in found:
        verify_checkpoint(info.path)  # every file against its commit marker
    return [c.step for c in found]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_training_names_the_checkpoint_to_resume(
        corpus: Path, tmp_path: Path, sig: int, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "handformer", "train", "--data", str(corpus), "--out", str(out),
         "--max-steps", "100000", *ARGS],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    watchdog = threading.Timer(240, proc.kill)  # a hung child fails the test, not the suite
    watchdog.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # "step     10: train loss …": checkpoint 5 is committed
            if line.startswith("step") and int(line.split()[1].rstrip(":")) >= 10:
                break
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err
    assert err.splitlines() == [expected_line(sig, out)]
    steps = assert_checkpoints_whole(out)
    assert steps[0] >= 5

    # The line's command works: the run continues from the checkpoint it named.
    assert main(["train", "--resume", str(out), "--max-steps", str(steps[-1] + 2),
                 "--no-progress"]) == 0
    assert f"resumed from step {steps[-1]}" in capsys.readouterr().out


@pytest.mark.slow  # ~5 s a process
@pytest.mark.parametrize("sig, phase", [(signal.SIGINT, p) for p in PHASES]
                         + [(signal.SIGTERM, "files_written")],
                         ids=[f"SIGINT-{p}" for p in PHASES] + ["SIGTERM-files_written"])
def test_a_signal_inside_the_checkpoint_writer_keeps_the_previous_ones(
        corpus: Path, tmp_path: Path, sig: int, phase: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    name = "INT" if sig == signal.SIGINT else "TERM"
    proc = subprocess.run(
        [sys.executable, str(CRASH_LAUNCHER), "--signal-at", f"{name}:{phase}@15", "train",
         "--data", str(corpus), "--out", str(out), "--max-steps", "20", *ARGS],
        capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 128 + sig, proc.stderr
    committed = phase == "committed"  # signalled after the rename: step 15 is complete
    assert assert_checkpoints_whole(out) == ([5, 10, 15] if committed else [5, 10])
    # Unlike a kill -9, an interrupt lets the writer remove its temporary folder.
    assert not [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert proc.stderr.splitlines() == [expected_line(sig, out)]

    assert main(["train", "--resume", str(out), "--no-progress"]) == 0
    assert f"resumed from step {15 if committed else 10}" in capsys.readouterr().out
    assert assert_checkpoints_whole(out)[-1] == 20


def test_an_interrupt_before_any_checkpoint_says_there_is_nothing_to_resume(
        corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(CRASH_LAUNCHER), "--signal-at", "INT:step@2", "train",
         "--data", str(corpus), "--out", str(out), "--max-steps", "20", *ARGS],
        capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.splitlines() == [
        "handformer train: interrupted; no checkpoint was committed yet: nothing to resume, "
        "start the run again"]
