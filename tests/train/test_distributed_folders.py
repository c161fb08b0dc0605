"""Under torchrun only rank 0 checks, claims and locks the run folder; a refusal there ends
every rank at once (no rank left waiting in a collective) and changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.train.helpers import toy_text

pytestmark = pytest.mark.slow  # one torchrun launch, ~10 s


def test_a_foreign_out_folder_ends_every_rank_without_a_hang(tmp_path: Path) -> None:
    (tmp_path / "text.txt").write_text(toy_text(1500), encoding="utf-8")
    out = tmp_path / "theirs"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "model.ckpt").write_bytes(b"another tool's")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HANDFORMER_DIST_TIMEOUT_S": "60"}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "handformer", "train", "--data", "text.txt", "--out", str(out), "--preset",
         "tiny", "--max-steps", "4", "--no-progress", "--no-plot"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert time.monotonic() - started < 120  # well under the collective timeout's reach
    assert "handformer did not write it" in proc.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints"]  # no marker, no lock
