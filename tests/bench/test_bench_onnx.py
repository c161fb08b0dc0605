"""The onnxruntime decoding benchmark in quick mode: it runs, its tokens equal handformer's,
and without the onnx extra it skips with a message instead of failing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from handformer.bench import onnx_decode


def test_quick_run_decodes_handformer_s_tokens(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime", reason="the 'onnx' test extra is not installed "
                        "(pip install -r requirements-dev.txt)")
    assert onnx_decode.main(["--quick", "--repeats", "1", "--out", str(tmp_path / "o.json")]) == 0
    data = json.loads((tmp_path / "o.json").read_text())
    assert data["machine"]["threads"] == data["threads"]
    rows = data["rows"]
    assert {r["contender"] for r in rows} == {"handformer (cache)", "onnxruntime (cache)"}
    assert all(r["same_tokens_as_handformer"] and r["tokens_per_s"] > 0 for r in rows)


def test_without_onnxruntime_it_skips_and_says_why(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(onnx_decode, "_missing", lambda: ["onnxruntime"])
    assert onnx_decode.main(["--quick", "--out", str(tmp_path / "o.json")]) == 0
    assert "skipped: onnxruntime not installed" in capsys.readouterr().out
    data = json.loads((tmp_path / "o.json").read_text())
    assert data["rows"] == [] and data["machine"]["cpu"]
