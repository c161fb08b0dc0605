"""Crash safety with real processes: SIGKILL a `handformer train` at a chosen step or inside
the checkpoint writer, then `--resume` must continue exactly (same losses, bit-identical
weights) and the previous checkpoint must always load.

Each process runs one intra-op thread so the runs are deterministic and fast; a killed
process is started through tests/reference/crash_launcher.py, which installs the kill point
(a trainer callback or the checkpoint writer's phase hook) and runs the normal CLI.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from handformer.cli import main
from handformer.config import ModelConfig
from handformer.models.decoder_lm import DecoderLM
from handformer.train.checkpoint import (
    PHASES,
    list_checkpoints,
    load_weights,
    read_checkpoint_json,
    read_trainer_state,
)
from tests.train.helpers import toy_text

pytestmark = pytest.mark.slow  # ~30 s: eight short processes

CRASH_LAUNCHER = Path(__file__).parents[1] / "reference" / "crash_launcher.py"

ARGS = ["--preset", "tiny", "--max-steps", "20", "--dropout", "0.1", "--log-interval", "1",
        "--eval-interval", "10", "--checkpoint-interval", "5", "--keep-last", "2",
        "--no-progress", "--no-plot", "--device", "cpu"]


def run_train(args: list[str], kill_at: str | None = None) -> subprocess.CompletedProcess:
    """``handformer train ARGS`` in a new process; ``kill_at="POINT@STEP"`` SIGKILLs it there
    (see tests/reference/crash_launcher.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    launch = ["-m", "handformer"] if kill_at is None else \
        [str(CRASH_LAUNCHER), "--kill-at", kill_at]
    return subprocess.run([sys.executable, *launch, "train", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def history(run: Path) -> list[tuple[Any, ...]]:
    """Every train loss and eval loss in metrics.jsonl, by step."""
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out.append((r["kind"], r["step"], r.get("loss"), r.get("val_loss")))
    return out


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(toy_text(1500), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def straight(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: 20 steps in one process, never interrupted."""
    out = tmp_path_factory.mktemp("straight") / "run"
    proc = run_train(["--data", str(corpus), "--out", str(out), *ARGS])
    assert proc.returncode == 0, proc.stderr
    return out


def test_sigkill_at_step_then_resume_is_exact(corpus: Path, straight: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    proc = run_train(["--data", str(corpus), "--out", str(out), *ARGS], kill_at="step@12")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert [c.step for c in list_checkpoints(out / "checkpoints")] == [5, 10]
    assert history(out)[-1][:2] == ("train", 12)  # steps 11, 12 were logged, then lost

    # A fresh run into the same folder must not wipe the unfinished one.
    code = main(["train", "--data", str(corpus), "--out", str(out), *ARGS])
    err = capsys.readouterr().err
    assert code == 1 and "unfinished run" in err and f"--resume {out}" in err  # run state
    assert main(["train", "--resume", str(out), "--lr", "0.1"]) == 2  # a usage error
    assert "--lr" in capsys.readouterr().err
    assert [c.step for c in list_checkpoints(out / "checkpoints")] == [5, 10]  # untouched

    proc = run_train(["--resume", str(out), "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    assert "resumed from step 10" in proc.stdout
    assert history(out) == history(straight)  # the metrics file continued, not restarted
    assert_same_weights(out, straight)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 10 and summary["steps"] == 20


@pytest.mark.parametrize("phase", PHASES)  # every phase the checkpoint writer reports
def test_sigkill_during_checkpoint_write_keeps_previous(
        corpus: Path, straight: Path, tmp_path: Path, phase: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    proc = run_train(["--data", str(corpus), "--out", str(out), *ARGS], kill_at=f"{phase}@15")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    root = out / "checkpoints"
    steps = [c.step for c in list_checkpoints(root)]
    committed = phase == "committed"  # killed after the rename: step 15 is complete
    assert steps == ([5, 10, 15] if committed else [5, 10])
    assert any(p.name.startswith(".tmp-") for p in root.iterdir()) == (not committed)
    for step in steps[1:]:  # the newest ones load completely, without the run's code state
        path = root / f"step-{step:08d}"
        model = DecoderLM(ModelConfig.from_dict(read_checkpoint_json(path, "config.json")["model"]))
        load_weights(model, path)
        assert read_trainer_state(path).meta["step"] == step

    assert main(["train", "--resume", str(out), "--no-progress"]) == 0  # in-process: faster
    assert f"resumed from step {steps[-1]}" in capsys.readouterr().out
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())  # stale ones removed
    assert history(out) == history(straight)
    assert_same_weights(out, straight)


def test_resume_extends_a_finished_run_and_checks_the_data(corpus: Path, straight: Path,
                                                           tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    assert main(["train", "--resume", str(out)]) == 1
    assert "already reached step 20" in capsys.readouterr().err
    assert main(["train", "--resume", str(out), "--max-steps", "24", "--no-progress"]) == 0
    steps = [s for kind, s, *_ in history(out) if kind == "train"]
    assert steps == list(range(1, 25))
    assert json.loads((out / "config.json").read_text())["train"]["max_steps"] == 24

    corpus.write_text(corpus.read_text() + "changed", encoding="utf-8")
    try:
        assert main(["train", "--resume", str(out), "--max-steps", "30"]) == 1
        assert "changed since the run" in capsys.readouterr().err
    finally:
        corpus.write_text(corpus.read_text()[: -len("changed")], encoding="utf-8")
