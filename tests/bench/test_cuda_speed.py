"""The GPU benchmark where there is no GPU: it says so in one line, measures nothing and
exits 0 (its figures on a GPU are tested in tests/test_cuda.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from handformer.bench.cuda_speed import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: tests/test_cuda.py runs it")
def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cuda.json"
    assert main(["--quick", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [
        "cuda_speed: no CUDA GPU visible here (torch.cuda.is_available() is False); "
        "nothing measured"]
    assert not out.exists()


@pytest.mark.parametrize("repeats", ["0", "-3"])
def test_repeats_below_one_is_a_usage_error(repeats: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--repeats", repeats, "--out", str(tmp_path / "cuda.json")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"--repeats must be at least 1; got {repeats}")
    assert "Traceback" not in "\n".join(err)
    assert not (tmp_path / "cuda.json").exists()
