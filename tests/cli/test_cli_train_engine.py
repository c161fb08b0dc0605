"""`handformer train` with the engine's options, in-process: the run folder gains checkpoints,
a loss curve and a summary of the best step; failures end with clear messages and exit codes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from handformer.cli import main
from handformer.train.checkpoint import list_checkpoints
from tests.train.helpers import toy_text

TINY = ["--preset", "tiny", "--no-progress", "--device", "cpu"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(toy_text(1500), encoding="utf-8")
    return path


def test_bf16_accumulated_run_writes_checkpoints_curve_and_summary(
        corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    code = main(["train", "--data", str(corpus), "--out", str(out), *TINY, "--max-steps", "24",
                 "--precision", "bf16", "--grad-accum", "2", "--eval-interval", "6",
                 "--keep-last", "1", "--patience", "5"])
    assert code == 0, capsys.readouterr().err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["train"]["precision"] == "bf16" and cfg["train"]["grad_accum_steps"] == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 24 and summary["best_val_loss"] <= summary["final_val_loss"]
    best = summary["best_checkpoint"]
    steps = [c.step for c in list_checkpoints(out / "checkpoints")]
    assert steps[-1] == 24 and len(steps) <= 2 and best.endswith(f"{summary['best_step']:08d}")
    assert (out / best / "model.safetensors").is_file()
    assert (out / "loss_curve.png").read_bytes().startswith(b"\x89PNG")
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in line]
    assert [e["step"] for e in evals] == [6, 12, 18, 24]
    assert all(e["val_bits_per_char"] == pytest.approx(e["val_bits_per_token"]) for e in evals)
    # A checkpoint folder is a run folder too: generate can sample from it.
    capsys.readouterr()
    assert main(["generate", "--run", str(out / best), "--prompt", "the", "--seed", "0",
                 "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("the")


def test_muon_run_records_the_parameter_split_and_resumes(
        corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "muon"
    assert main(["train", "--data", str(corpus), "--out", str(out), *TINY, "--max-steps", "8",
                 "--eval-interval", "4", "--optimizer", "muon", "--no-plot"]) == 0, \
        capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["train"]["optimizer"] == "muon"
    split = json.loads((out / "summary.json").read_text())["optimizer_split"]
    assert "blocks.0.self_attn.in_proj.weight" in split["muon"]
    assert "embed.token.weight" in split["adamw"] and "final_norm.weight" in split["adamw"]
    assert main(["train", "--resume", str(out), "--max-steps", "12", "--no-progress"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 12


def test_diverging_run_stops_with_exit_code_3(corpus: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    code = main(["train", "--data", str(corpus), "--out", str(out), *TINY, "--max-steps", "30",
                 "--lr", "1e30", "--max-nonfinite", "3", "--checkpoint-interval", "1"])
    err = capsys.readouterr().err
    assert code == 3
    assert "3 steps had a non-finite loss" in err and "step-00000001" in err
    assert [c.step for c in list_checkpoints(out / "checkpoints")] == [1]


def test_tensorboard_without_the_package_fails_before_training(
        corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    out = tmp_path / "run"
    code = main(["train", "--data", str(corpus), "--out", str(out), *TINY, "--tensorboard"])
    assert code == 1  # a missing package: refused at run time
    assert "pip install 'handformer[tensorboard]'" in capsys.readouterr().err
    assert not out.exists()


def test_resume_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--resume", str(tmp_path / "nowhere")]) == 1
    assert "run folder not found" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["train", "--resume", str(tmp_path / "empty")]) == 1
    assert "no committed checkpoint" in capsys.readouterr().err


def test_until_val_loss_stops_at_the_first_evaluation_under_it_and_says_so(
        corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Any val loss is under 100: the run ends at its first evaluation (step 4 of 40), the
    summary says it reached the target and the recipe keeps it."""
    out = tmp_path / "target"
    assert main(["train", "--data", str(corpus), "--out", str(out), *TINY, "--max-steps", "40",
                 "--eval-interval", "4", "--until-val-loss", "100", "--no-plot"]) == 0, \
        capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["reached_target"] is True
    assert "reached the target at step 4" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["train"]["target_val_loss"] == 100.0
