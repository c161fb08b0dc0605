"""``handformer doctor`` from the command line: presets, config files, run folders, JSON,
pictures, and clear one-line errors (exit code 1) when the subject cannot be built."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from handformer.cli.doctor import register
from handformer.config import ModelConfig
from handformer.doctor import CHECK_NAMES
from handformer.loss import lm_loss
from handformer.models.decoder_lm import DecoderLM
from handformer.runs import save_run
from handformer.tokenizers import CharTokenizer
from tests.doctor.test_doctor import TEXT


def doctor(argv: Sequence[str]) -> int:
    """Parse like the real ``handformer`` entry point does, then call the handler."""
    parser = argparse.ArgumentParser(prog="handformer")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["doctor", *argv])
    return args.handler(args)


def test_preset_prints_the_report_in_tutorial_order(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor(["--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "subject: preset 'tiny' (fresh) on the built-in text" in out
    titles = ["1. forward pass and shapes", "2. masks and attention", "3. loss and targets",
              "4. gradients", "5. learning", "6. paths agree"]
    positions = [out.index(t) for t in titles]
    assert positions == sorted(positions)
    assert "FAIL" not in out.split("summary:")[0]
    assert "summary: " in out and " 0 FAIL" in out


def test_json_report_and_pictures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from matplotlib.image import imread

    pics = tmp_path / "pics"
    assert doctor(["--preset", "tiny", "--json", "--pictures", str(pics)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True
    assert [c["name"] for c in data["checks"]] == [name for _, name in CHECK_NAMES]
    assert data["subject"]["config"]["d_model"] == 32
    written = sorted(Path(p).name for p in data["pictures"])
    assert written == ["attention_blocks_0_self_attn.png", "attention_blocks_1_self_attn.png",
                       "masks.png"]
    for name in written:
        image = imread(pics / name)  # (H, W, 4): a real, non-blank PNG
        assert image.ndim == 3 and float(image.std()) > 0.01


def test_config_file_flat_or_run_style(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    flat = tmp_path / "model.json"
    flat.write_text(json.dumps({"d_model": 16, "n_heads": 2, "n_layers": 1, "max_len": 16}))
    threads = torch.get_num_threads()
    assert doctor(["--config", str(flat), "--json", "--threads", str(threads + 1)]) == 0
    assert torch.get_num_threads() == threads  # the handler put the caller's setting back
    subject = json.loads(capsys.readouterr().out)["subject"]
    assert subject["config"]["d_model"] == 16 and subject["batch"] == [4, 16]
    assert subject["config"]["vocab_size"] == CharTokenizer.from_text(
        __import__("handformer.data.corpora", fromlist=["builtin_text"]).builtin_text()).vocab_size
    nested = tmp_path / "config.json"
    nested.write_text(json.dumps({"model": {"vocab_size": 200, "d_model": 16, "n_heads": 2,
                                            "n_layers": 1, "max_len": 16},
                                  "train": {"lr": 0.002, "block_size": 8}}))
    assert doctor(["--config", str(nested), "--json"]) == 0
    subject = json.loads(capsys.readouterr().out)["subject"]
    assert subject["lr"] == 0.002 and subject["batch"] == [4, 8] and subject["vocab_size"] == 200


def test_trained_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    tok = CharTokenizer.from_text(TEXT)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_layers=1, max_len=16)
    model = DecoderLM(cfg)
    ids = torch.as_tensor(tok.encode_array(TEXT))
    windows = torch.stack([ids[i: i + 17] for i in range(0, 320, 20)])  # (16, 17)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(40):
        opt.zero_grad()
        lm_loss(model(windows[:, :-1]), windows[:, 1:]).backward()
        opt.step()
    run_dir = save_run(tmp_path / "run", model, tok)
    assert doctor(["--run", str(run_dir), "--data", str(text_file), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["subject"]["initial"] is False
    first = next(c for c in data["checks"] if c["name"] == "first loss")
    assert first["status"] == "PASS" and "better than uniform" in first["evidence"]


@pytest.mark.parametrize("argv, message", [
    (["--run", "does/not/exist"], "run folder not found"),
    (["--preset", "tiny", "--data", "missing.txt"], "text file not found"),
    (["--config", "missing.json"], "config file not found"),
])
def test_bad_subjects_exit_1_with_a_clear_message(argv: list[str], message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor(argv) == 1  # a missing file is refused at run time, not a usage error
    err = capsys.readouterr().err
    assert err.startswith("handformer doctor: error: ") and message in err


def test_config_with_too_small_vocab_is_refused(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "small.json"
    path.write_text(json.dumps({"vocab_size": 10, "d_model": 16, "n_heads": 2}))
    assert doctor(["--config", str(path)]) == 1
    assert "vocab_size=10 is smaller than" in capsys.readouterr().err


def test_preset_and_run_are_mutually_exclusive() -> None:
    with pytest.raises(SystemExit):
        doctor(["--preset", "tiny", "--run", "x"])
