"""The exit-code contract (handformer.cli.errors), in process: which failure is which code,
and that each is exactly one line on stderr, never a traceback. Sizes nobody can allocate
are refused from arithmetic, before anything is written (the real signals are in
test_cli_signals.py)."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from handformer.cli import build_parser, main
from handformer.cli.common import UsageError
from handformer.cli.errors import one_line
from handformer.models.budget import MemoryBudgetError

Raiser = Callable[[], None]


def run_with(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
             body: Raiser) -> tuple[int, str]:
    """``handformer convert --to hf a b`` whose handler runs ``body``: (code, stderr)."""
    def handler(args: object) -> int:
        body()
        return 0

    monkeypatch.setattr("handformer.cli.convert._run", handler)
    code = main(["convert", "--to", "hf", "a", "b"])
    return code, capsys.readouterr().err


def _raise(err: BaseException) -> Raiser:
    def body() -> None:
        raise err
    return body


ALLOCATOR = ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough "
             "memory: you tried to allocate 400000000000 bytes.\nException raised from "
             "alloc_cpu at /pytorch/c10/core/impl/alloc_cpu.cpp:117 (most recent call first):\n"
             "frame #0: c10::Error::Error(...) + 0x90 (0x7f in libc10.so)")


@pytest.mark.parametrize("err, code, line", [
    (UsageError("--a needs --b"), 2, "error: --a needs --b (see handformer convert --help)"),
    (ValueError("bad file"), 1, "error: bad file"),
    (FileNotFoundError(2, "No such file or directory", "x.txt"), 1,
     "error: [Errno 2] No such file or directory: 'x.txt'"),
    (RuntimeError(ALLOCATOR), 1, "error: torch could not allocate 373 GiB (DefaultCPUAllocator: "
     "not enough memory: you tried to allocate 400000000000 bytes.); make the model, the "
     "batch or the request smaller"),
    (MemoryError(), 1, "error: ran out of memory (MemoryError); make the model, the batch or "
     "the request smaller"),
    (MemoryBudgetError("not enough memory: x needs about 1 TiB"), 1,
     "error: not enough memory: x needs about 1 TiB"),
    (RuntimeError("first line\n\n  second line\nTraceback (most recent call last):\n  f()"), 1,
     "error: first line second line"),
    (ImportError("pip install 'handformer[tensorboard]'"), 1,
     "error: pip install 'handformer[tensorboard]'"),
    (KeyError("k"), 1, "error: unexpected KeyError: 'k' (a bug in handformer; set "
     "HANDFORMER_TRACEBACK=1 to see where it happened)"),
    (KeyboardInterrupt(), 130, "interrupted"),
])
def test_each_failure_is_one_line_and_its_exit_code(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        err: BaseException, code: int, line: str) -> None:
    got, stderr = run_with(monkeypatch, capsys, _raise(err))
    assert got == code
    assert stderr.splitlines() == [f"handformer convert: {line}"]


def test_torch_out_of_memory_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                                 "total capacity of 139 GiB")
    code, stderr = run_with(monkeypatch, capsys, _raise(oom))
    assert code == 1 and len(stderr.splitlines()) == 1
    assert stderr.startswith("handformer convert: error: ran out of memory (CUDA out of memory.")


def test_a_real_allocator_failure_becomes_one_line(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The final guard: an allocation that still fails (here one no machine has) is a line."""
    import torch

    code, stderr = run_with(monkeypatch, capsys, lambda: torch.empty(1 << 62, dtype=torch.uint8))
    assert code == 1 and len(stderr.splitlines()) == 1 and "Traceback" not in stderr
    assert stderr.startswith("handformer convert: error: ")


def test_sigterm_raises_runs_finally_blocks_and_exits_143(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    cleaned = []

    def body() -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises long before this ends
        finally:
            cleaned.append(True)

    before = signal.getsignal(signal.SIGTERM)
    code, stderr = run_with(monkeypatch, capsys, body)
    assert code == 143 and cleaned == [True]
    assert stderr.splitlines() == ["handformer convert: terminated"]
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is put back


def test_tracebacks_on_request_for_bugs_only(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HANDFORMER_TRACEBACK", "1")
    with pytest.raises(KeyError):
        run_with(monkeypatch, capsys, _raise(KeyError("k")))
    code, _ = run_with(monkeypatch, capsys, _raise(ValueError("refused")))
    assert code == 1  # a refusal is still a message


def test_a_closed_stdout_is_not_an_error(monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, stderr = run_with(monkeypatch, capsys, _raise(BrokenPipeError(32, "Broken pipe")))
    assert code == 141 and stderr == ""


def test_one_line_keeps_what_comes_before_a_stack_trace() -> None:
    assert one_line("a\n  b \n\nframe #0: x\nc") == "a b"
    assert one_line("[enforce fail at x.cpp:1] data. out") == "out"


def test_help_lists_the_exit_codes() -> None:
    text = build_parser().format_help()
    assert "exit codes:" in text and "130" in text and "143" in text


# -- usage errors (2) versus run-time refusals (1) through the real commands -----------------
@pytest.fixture(scope="module")
def lm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from handformer.models.decoder_lm import DecoderLM
    from handformer.runs import save_run
    from handformer.tokenizers import CharTokenizer
    from tests.conftest import tiny_config

    tok = CharTokenizer.from_text("abcdef \n")
    return save_run(tmp_path_factory.mktemp("lm") / "run",
                    DecoderLM(tiny_config(vocab_size=tok.vocab_size)), tok)


USAGE = [
    [],  # no command at all
    ["train", "--lr", "x"],  # argparse's type error
    ["train", "--bogus", "1"],  # an option the command does not have
    ["doctor", "--no-such-option"],
    ["seq2seq", "train", "--nope"],
    ["convert", "--to", "xx", "a", "b"],  # not one of the choices
    ["bench", "--quick", "--out-dir", ""],
    ["experiment", "length", "--steps", "0"],
    ["train", "--resume", "RUN", "--lr", "0.1"],
    ["train", "--vocab-size", "300"],
    ["train", "--dropout", "2"],
    ["train", "--lr", "-1"],
    ["train", "--max-steps", "10", "--eval-interval", "0"],  # argparse's own
    ["generate", "--run", "RUN", "--temperature", "-1"],
    ["generate", "--run", "RUN", "--top-p", "2"],
    ["generate", "--run", "RUN", "--max-new-tokens", "-1"],
    ["generate", "--run", "RUN", "--prompt", ""],
    ["classify", "train", "--val", "v.csv"],
    ["classify", "train", "--d-model", "30"],  # 4 heads do not divide 30
    ["classify", "predict", "--run", "RUN", "--text", "x", "--confusion", "cm.png"],
    ["seq2seq", "train", "--min-len", "5", "--max-len", "3"],
    ["explore", "--run", "RUN", "--host", "0.0.0.0"],
]


@pytest.mark.parametrize("argv", USAGE, ids=[" ".join(a) for a in USAGE])
def test_command_line_mistakes_exit_2(argv: list[str], lm_run: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # nothing may be written, but if it were: not in the repo
    argv = [str(lm_run) if a == "RUN" else a for a in argv]
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == 2, err
    # One line, no usage block before it, naming the command and pointing at its --help.
    command = " ".join(["handformer", *itertools.takewhile(lambda a: not a.startswith("-"),
                                                           argv)])
    (line,) = err.splitlines()
    assert line.startswith(f"{command}: error: "), line
    assert line.endswith(f" (see {command} --help)"), line
    assert list(tmp_path.iterdir()) == []


def _config(path: Path, **fields: int) -> str:
    path.write_text(json.dumps({"d_model": 128, "n_heads": 4, **fields}))
    return str(path)


def test_sizes_nobody_can_allocate_are_refused_fast(lm_run: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cases = [
        (["generate", "--run", str(lm_run), "--max-new-tokens", str(10**12)],
         "generating this many tokens needs about"),
        (["train", "--preset", "tiny", "--batch-size", str(10**8), "--out", "lm"],
         "activations of a 100000000 × 32 micro-batch"),
        (["seq2seq", "train", "--max-len", str(10**6), "--out", "s2s"],
         "use a smaller --max-len"),
        (["classify", "train", "--batch-size", str(10**8), "--out", "cls"],
         "use a smaller --batch-size"),
        (["classify", "train", "--seq-len", str(10**6), "--out", "cls"],
         "the built-in task's texts needs about"),
        (["doctor", "--config", _config(tmp_path / "wide.json", d_model=1 << 16)],
         "building this DecoderLM needs about"),
        (["doctor", "--config", _config(tmp_path / "deep.json", d_model=1024, n_layers=4096)],
         "building this DecoderLM needs about"),
        (["doctor", "--config", _config(tmp_path / "absurd.json", n_layers=10**6)],
         "n_layers=1000000 is beyond the sane limit"),  # config.MODEL_LIMITS
        (["train", "--data", "/dev/zero", "--out", "z"], "/dev/zero is a character device"),
    ]
    for argv, message in cases:
        start = time.perf_counter()
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 1, (argv, err)
        *warnings, last = err.splitlines()
        assert all(": warning: " in w for w in warnings) and message in last, (argv, err)
        assert time.perf_counter() - start < 20, argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["absurd.json", "deep.json",
                                                          "wide.json"]


@pytest.mark.parametrize("readme", ["README.md", "README.zh.md"])
def test_the_readmes_usage_error_is_what_the_command_prints(
        readme: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = (Path(__file__).resolve().parents[2] / readme).read_text(encoding="utf-8")
    shown = re.search(r"^`?(handformer train: error: argument --lr: [^`\n]*)`?", text, re.M)
    assert shown, f"{readme} shows no usage error of `handformer train --lr x`"
    with pytest.raises(SystemExit) as stop:
        main(["train", "--lr", "x"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines() == [shown.group(1)]
