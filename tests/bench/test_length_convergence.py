"""benchmarks/length_convergence.py runs end to end and writes its curves (tiny settings)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "length_convergence.py"


def test_length_convergence_writes_curves_for_every_run(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("length_convergence", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
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
