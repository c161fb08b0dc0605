"""The speculative benchmark runs in --quick mode, and its rows say what they must: the
speculative output is the target's own, a draft equal to the target is always accepted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn

from handformer.bench.speculative_speed import _quick_pairs, main, measure_pair


def test_quick_run_writes_rows_with_identical_outputs(tmp_path: Path) -> None:
    out = tmp_path / "speculative.json"
    assert main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["machine"]["threads"] == data["threads"]
    rows = data["rows"]
    speculative = [r for r in rows if "acceptance_rate" in r]
    assert len(speculative) == 2 and all(r["identical"] for r in speculative)
    by_pair = {r["pair"]: r for r in speculative}
    assert by_pair["2L-64d, draft = itself"]["acceptance_rate"] == 1.0
    assert by_pair["2L-64d, random 1L draft"]["acceptance_rate"] < 0.5
    assert all(r["verify_ratio"] > 0 for r in rows if "verify_ratio" in r)


def test_a_target_transform_adds_its_own_rows() -> None:
    """What the int8 target will plug into: any function from model to model."""
    pair = _quick_pairs()[0]
    seen: list[nn.Module] = []

    def halve_nothing(model: nn.Module) -> nn.Module:
        seen.append(model)
        return model

    rows = measure_pair(pair, [2], 6, 1, {"same": halve_nothing})
    names = [r["contender"] for r in rows]
    assert seen == [pair.target]
    assert {"same target alone", "same target + draft, K=2", "target alone"} <= set(names)
    same = next(r for r in rows if r["contender"] == "same target + draft, K=2")
    assert same["identical"] and same["acceptance_rate"] == pytest.approx(1.0)


def test_a_pair_of_missing_or_foreign_folders_is_one_line_not_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's ``--pair NAME TARGET DRAFT`` with folders that are not there (or are not
    runs): one error line naming them, exit 1, nothing written."""
    out = tmp_path / "speculative.json"
    (tmp_path / "empty").mkdir()
    for target, draft, named in ((tmp_path / "gone", tmp_path / "gone-draft", "gone-draft"),
                                 (tmp_path / "empty", tmp_path / "empty", "empty")):
        assert main(["--pair", "x", str(target), str(draft), "--out", str(out)]) == 1
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("speculative_speed: error: --pair 'x'")
        assert named in lines[0]
    assert not out.exists()
