"""benchmarks/length_convergence.py runs end to end and writes its curves (tiny settings)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench.scripts import load_script


def test_length_convergence_writes_curves_for_every_run(tmp_path: Path) -> None:
    module = load_script("length_convergence")
    # The script sets its own thread count; tests/conftest.py puts the suite's back after.
    code = module.main(["--lengths", "16", "--contrast-lengths", "20", "--steps", "6",
                        "--eval-interval", "3", "--n-val", "16", "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "length_convergence.json").read_text())
    labels = [(r["seq_len"], r["norm"], r["warmup_steps"]) for r in report["runs"]]
    assert labels == [(16, "pre", 50), (20, "post", 0)]
    for run in report["runs"]:
        assert [h["step"] for h in run["history"]] == [3, 6]
        assert len(run["train_losses"]) == 6
        assert 0.0 <= run["final_val_accuracy"] <= 1.0
        assert run["peak_loss_after_50"] is None  # only 6 steps: no step after 50
    assert (tmp_path / "length_convergence.png").stat().st_size > 1000
