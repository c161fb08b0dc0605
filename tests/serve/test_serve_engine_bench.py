"""benchmarks/serve_engine.py runs at a tiny size: the engine alone for 1 and C clients and
beside a thread holding the GIL, every token counted (a check that it works, not a figure)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_engine.py"


def _module(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("serve_engine", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "serve_engine", module)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_the_engine_benchmark_runs_at_a_tiny_size(tmp_path, monkeypatch) -> None:
    out = tmp_path / "serve_engine.json"
    module = _module(monkeypatch)
    assert module.main(["--quick", "--gil-noise", "0.05:100", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {row["scenario"]: row for row in report["rows"]}
    assert set(rows) == {"1 client", "4 clients", "4 clients + GIL noise 0.05:100"}
    from handformer.config import get_preset

    jobs = module._jobs(8, 0, get_preset("tiny").model["max_len"], quick=True)
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["full_decode_step_ms"] > 0
    # One client decodes a token a step after each prompt; a crowd needs fewer steps.
    assert rows["1 client"]["steps"] >= sum(j.max_tokens for j in jobs)
    assert rows["4 clients"]["steps"] < rows["1 client"]["steps"]
    assert report["machine"]["cpu"] and report["machine"]["threads"] == 1


@pytest.mark.parametrize("noise", ["0.05", "1.5:100", "0.05:-3", "a:b"])
def test_a_bad_gil_noise_is_one_line(noise, monkeypatch, capsys) -> None:
    module = _module(monkeypatch)
    with pytest.raises(SystemExit):
        module.main(["--quick", "--gil-noise", noise, "--out", "/dev/null"])
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "SHARE:BURST_US" in lines[0]
