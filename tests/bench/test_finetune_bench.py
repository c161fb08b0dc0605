"""The fine-tuning benchmark at a tiny size: handformer's LoRA and PEFT's start from the same
weights and train along the same path (same losses, same accuracy); the script writes its
table and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from handformer.bench.finetune import _tiny_folder, main, run_contender
from handformer.data.docstrings import docstring_rows

pytest.importorskip("peft", reason="the 'peft' test extra is not installed "
                    "(pip install -r requirements-dev.txt)")


def test_handformer_lora_and_peft_lora_train_alike(tmp_path: Path) -> None:
    folder = _tiny_folder(tmp_path / "bert", docstring_rows()[0])
    kw = dict(seed=0, steps=4, batch=8, r=2, targets=("q", "v"), max_len=32, device="cpu")
    ours = run_contender("handformer-lora", folder, **kw)
    theirs = run_contender("peft-lora", folder, **kw)
    assert ours["trainable"] == theirs["trainable"]
    assert ours["final_loss"] == pytest.approx(theirs["final_loss"], abs=1e-4)
    assert ours["accuracy"] == theirs["accuracy"]
    full = run_contender("handformer-full", folder, **kw)
    assert full["trainable"] > 10 * ours["trainable"]


def test_docstring_task_is_real_text_in_four_groups() -> None:
    texts, labels = docstring_rows()
    assert len(texts) > 400 and set(labels) == {"files", "network", "concurrency", "numbers"}
    assert len(set(texts)) == len(texts)
    assert docstring_rows(seed=1)[0] != texts and sorted(docstring_rows(seed=1)[0]) == sorted(texts)


@pytest.mark.slow
def test_the_script_writes_table_and_json(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "finetune.json"
    assert main(["--tiny", "--steps", "2", "--batch-size", "4", "--seeds", "0",
                 "--contenders", "handformer-lora,peft-lora", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["medians"]) == {"handformer-lora", "peft-lora"}
    assert "time_ratio" in report["handformer_vs_peft"]
    assert "| handformer-lora |" in capsys.readouterr().out
