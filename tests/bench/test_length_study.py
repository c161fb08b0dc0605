"""The length study runs end to end and reports a learned table's limit as 'cannot run'."""

from __future__ import annotations

import json
from pathlib import Path

from handformer.bench.length_study import LengthStudySettings, run_length_study


def test_length_study_writes_table_json_and_plot(tmp_path: Path) -> None:
    settings = LengthStudySettings(train_len=16, steps=40, batch_size=8, d_model=32,
                                   n_layers=1, eval_tokens=2_000)
    results = run_length_study(tmp_path, settings, positionals=("learned", "alibi"),
                               progress=False)
    assert results["lengths"] == [16, 32, 64]
    learned, alibi = results["rows"]
    assert learned["val_loss"]["32"] is None and "max_len=16" in learned["cannot_run"]["32"]
    assert all(v is not None and v < 4.0 for v in alibi["val_loss"].values())
    table = (tmp_path / "length_study.md").read_text()
    assert "| learned |" in table and "cannot run" in table
    assert json.loads((tmp_path / "length_study.json").read_text())["lengths"] == [16, 32, 64]
    assert (tmp_path / "length_study.png").stat().st_size > 1000
