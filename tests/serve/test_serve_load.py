"""benchmarks/serve_load.py runs end to end at a tiny size: every request answered, none
mixed up, the peak of KV blocks within the pool (a check that it works, not a figure)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_load.py"


@pytest.mark.slow
def test_the_load_benchmark_runs_at_a_tiny_size(tmp_path, monkeypatch) -> None:
    spec = importlib.util.spec_from_file_location("serve_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "serve_load", module)  # its dataclasses look it up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    out = tmp_path / "serve_load.json"
    assert module.main(["--quick", "--no-static", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {row["scenario"]: row for row in report["rows"]}
    assert set(rows) == {"1 client", "4 clients"}
    for row in rows.values():
        assert row["errors"] == 0 and row["mixed_up"] == 0 and row["requests"] == 8
        assert row["tokens_per_s"] > 0 and row["ttft_p50_s"] is not None
    assert 0 < rows["4 clients"]["peak_kv_blocks"] <= report["kv_pool_blocks"]
    # Where it ran travels with the figures: CPU, ISA level, the server's threads, dtype.
    assert report["machine"]["cpu"] and report["machine"]["isa"]
    assert report["machine"]["threads"] == report["threads"] == 1
    assert report["dtype"] == "float32"
