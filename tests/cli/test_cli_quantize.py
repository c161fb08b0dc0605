"""``handformer generate --quantize int8`` and ``handformer convert --quantize int8``,
in-process through ``handformer.cli.main``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from handformer.cli import main
from handformer.config import ClassifierConfig
from handformer.data.classification import LabelVocab
from handformer.models.decoder_lm import DecoderLM
from handformer.models.encoder import EncoderClassifier
from handformer.runs import load_run, save_run
from handformer.tokenizers import CharTokenizer
from tests.conftest import TokenKernelSpy, tiny_config

TOK = CharTokenizer.from_text("abcdefgh \n")


def lm_run(path: Path) -> Path:
    save_run(path, DecoderLM(tiny_config(vocab_size=TOK.vocab_size, max_len=32)), TOK)
    return path


def generate(run: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["generate", "--run", str(run), "--prompt", "ab", "--max-new-tokens", "6",
                 "--temperature", "0", *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow  # compiles the fused int8 kernel: ~10-20 s on a busy 2-core machine
def test_quantize_at_load_and_a_converted_int8_run_generate_alike(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = lm_run(tmp_path / "run")
    code, on_the_fly, err = generate(run, capsys, "--quantize", "int8")
    assert code == 0, err
    assert on_the_fly.startswith("ab") and "int8: ready in" in err
    assert main(["convert", "--quantize", "int8", str(run), str(tmp_path / "int8")]) == 0
    assert "wrote int8 run folder" in capsys.readouterr().out
    # The converted folder is int8 already: no --quantize needed, the same tokens.
    code, converted, err = generate(tmp_path / "int8", capsys)
    assert code == 0, err
    assert converted == on_the_fly
    code, again, err = generate(tmp_path / "int8", capsys, "--quantize", "int8")
    assert code == 0 and again == on_the_fly, err


def test_generate_prints_each_piece_and_checks_the_int8_kernel_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``handformer generate`` streams by printing, which leaves the model alone: it says so
    (``stream_keeps_model``), so the token kernel is checked once, not at every token."""
    spy = TokenKernelSpy(monkeypatch)
    code, out, err = generate(lm_run(tmp_path / "run"), capsys, "--quantize", "int8")
    assert code == 0 and out.startswith("ab"), err
    assert spy.calls >= 2 and len(spy.checks) == 1


def test_the_int8_kernel_is_said_to_be_prepared_only_while_a_wait_is_felt(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel cached on disk is ready at once: the CLI says only that. A preparation that
    takes longer than ``PREPARING_AFTER_S`` is announced while it runs, before "ready"."""
    from handformer.cli import generate as cli_generate
    from handformer.models import quantize

    run = lm_run(tmp_path / "run")
    generate(run, capsys, "--quantize", "int8")  # builds or loads the kernel once
    code, _, err = generate(run, capsys, "--quantize", "int8")
    assert code == 0 and "int8: ready in" in err and "preparing" not in err, err
    real = quantize.warm_up_int8

    def slow(*args: object, **kwargs: object) -> tuple[float, str | None]:
        time.sleep(0.4)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(quantize, "warm_up_int8", slow)
    monkeypatch.setattr(cli_generate, "PREPARING_AFTER_S", 0.05)
    code, _, err = generate(run, capsys, "--quantize", "int8")
    assert code == 0, err
    assert 0 <= err.index("preparing the int8 kernel") < err.index("int8: ready in")


def test_int8_without_the_cache_compiles_no_kernel_per_length(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without the KV cache each step feeds the whole prefix, a new row count each time: the
    fused kernel (compiled once per row count) would compile again at every new length
    (12 tokens took minutes). The dequantizing kernel serves every length at once."""
    from handformer.nn import quantized

    run = lm_run(tmp_path / "run")
    shapes, seconds = quantized._FUSED.shapes(), quantized.compile_seconds()
    code, out, err = generate(run, capsys, "--quantize", "int8", "--no-cache",
                              "--max-new-tokens", "12")
    assert code == 0, err
    assert out.startswith("ab") and len(out.rstrip("\n")) >= 2
    assert "dequantizing kernel" in err and "preparing the int8 kernel" not in err
    assert quantized._FUSED.shapes() == shapes and quantized.compile_seconds() == seconds


@pytest.mark.parametrize("argv", [
    ["generate", "--run", "RUN", "--quantize", "int4"],
    ["convert", "--quantize", "int4", "RUN", "OUT"],
    ["convert", "--quantize", "int8", "--to", "hf", "RUN", "OUT"],
])
def test_unknown_schemes_and_two_directions_are_usage_errors(
        argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = lm_run(tmp_path / "run")
    argv = [str(run) if a == "RUN" else str(tmp_path / "out") if a == "OUT" else a
            for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'int4'" in err or "not allowed with argument" in err
    assert not (tmp_path / "out").exists()


def test_a_classifier_run_is_refused_by_name(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    model = EncoderClassifier(ClassifierConfig(tiny_config(vocab_size=TOK.vocab_size),
                                               num_classes=2))
    save_run(tmp_path / "cls", model, TOK, labels=LabelVocab(["x", "y"]))
    code, _, err = generate(tmp_path / "cls", capsys, "--quantize", "int8")
    assert code == 1 and "classifier run" in err
    assert main(["convert", "--quantize", "int8", str(tmp_path / "cls"),
                 str(tmp_path / "out")]) == 1
    assert "classifier run" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert not load_run(tmp_path / "cls").config.get("quantization")


def test_convert_quantize_into_someone_elses_folder_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The int8 copy goes through the same folder guard as every writer: another tool's
    non-empty folder is refused by name (exit 1) and left byte-identical."""
    run = lm_run(tmp_path / "run")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine", encoding="utf-8")
    capsys.readouterr()
    assert main(["convert", "--quantize", "int8", str(run), str(theirs)]) == 1
    err = capsys.readouterr().err
    assert "handformer did not write it" in err and "Traceback" not in err
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"]
    assert (theirs / "notes.txt").read_text(encoding="utf-8") == "mine"
