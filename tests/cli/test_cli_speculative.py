"""``handformer train --draft-for`` and ``handformer generate --draft --speculate``, in
process: a draft shares its target's tokenizer, window and text; speculative greedy output
equals plain greedy output; bad combinations exit with the documented codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from handformer.cli import main
from handformer.cli.generate import MAX_SPECULATE as CLI_MAX_SPECULATE
from handformer.generate import MAX_SPECULATE
from tests.cli.test_cli import tiny_corpus


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny target, a draft trained for it, and a run with another tokenizer."""
    tmp = tmp_path_factory.mktemp("speculative")
    data, other = tmp / "corpus.txt", tmp / "other.txt"
    data.write_text(tiny_corpus(), encoding="utf-8")
    other.write_text(tiny_corpus().upper(), encoding="utf-8")
    paths = {name: tmp / name for name in ("target", "draft", "foreign")}
    common = ["--no-progress", "--max-steps", "20", "--device", "cpu"]
    assert main(["train", "--preset", "tiny", "--data", str(data), "--out",
                 str(paths["target"]), *common]) == 0
    assert main(["train", "--draft-for", str(paths["target"]), "--out", str(paths["draft"]),
                 *common]) == 0
    assert main(["train", "--preset", "tiny", "--data", str(other), "--out",
                 str(paths["foreign"]), *common]) == 0
    return paths


def _exit_code(args: list[str]) -> int:
    """``main``'s exit code, also when argparse itself exits (a bad option value)."""
    try:
        return main(args)
    except SystemExit as stop:
        return int(stop.code or 0)


def _config(run: Path) -> dict:
    return json.loads((run / "config.json").read_text(encoding="utf-8"))


def test_a_draft_shares_the_targets_tokenizer_window_and_text(runs: dict[str, Path]) -> None:
    target, draft = _config(runs["target"]), _config(runs["draft"])
    assert (runs["draft"] / "tokenizer.json").read_bytes() == \
        (runs["target"] / "tokenizer.json").read_bytes()
    assert draft["model"]["max_len"] == target["model"]["max_len"] == 32
    assert draft["data"] == target["data"]
    assert draft["model"]["n_layers"] == 2 and draft["model"]["d_model"] == 128  # preset draft


def test_speculative_greedy_prints_what_plain_greedy_prints(
        runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    base = ["generate", "--run", str(runs["target"]), "--prompt", "the ", "--temperature", "0",
            "--max-new-tokens", "60"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--draft", str(runs["draft"]), "--speculate", "3"]) == 0
    fast = capsys.readouterr()
    assert fast.out == plain
    assert "drafted tokens accepted" in fast.err and "tokens per target forward" in fast.err


@pytest.mark.slow  # compiles the fused int8 kernel for two row counts
def test_an_int8_target_with_a_draft_prints_its_own_plain_greedy_text(
        runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    base = ["generate", "--run", str(runs["target"]), "--prompt", "the ", "--temperature", "0",
            "--max-new-tokens", "60", "--quantize", "int8"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--draft", str(runs["draft"]), "--speculate", "3"]) == 0
    fast = capsys.readouterr()
    assert fast.out == plain
    assert "int8: ready in" in fast.err and "drafted tokens accepted" in fast.err


@pytest.mark.parametrize("extra, code, words", [
    (["--speculate", "0"], 2, "positive integer"),
    (["--speculate", str(MAX_SPECULATE + 1)], 2, f"at most {MAX_SPECULATE}"),
    (["--no-cache"], 2, "drop --no-cache"),
    (["--repetition-penalty", "1.2"], 2, "--repetition-penalty"),
])
def test_bad_speculation_options_are_usage_errors(runs: dict[str, Path], extra: list[str],
                                                  code: int, words: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", "--run", str(runs["target"]), "--prompt", "a", "--draft",
            str(runs["draft"]), *extra]
    assert _exit_code(args) == code
    assert words in capsys.readouterr().err


def test_speculate_without_a_draft_and_tokenizer_with_draft_for_are_usage_errors(
        runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--run", str(runs["target"]), "--speculate", "2"]) == 2
    assert "--speculate needs --draft" in capsys.readouterr().err
    assert main(["train", "--draft-for", str(runs["target"]), "--tokenizer", "bpe",
                 "--out", str(tmp_path / "d")]) == 2
    assert "takes the tokenizer from RUN_DIR" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_a_missing_or_mismatched_draft_is_refused(runs: dict[str, Path], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    base = ["generate", "--run", str(runs["target"]), "--prompt", "a", "--draft"]
    assert main([*base, str(tmp_path / "nowhere")]) == 1
    assert "nowhere" in capsys.readouterr().err
    assert main([*base, str(runs["foreign"])]) == 1
    assert "must share its target's tokenizer" in capsys.readouterr().err


def test_the_cli_bound_is_the_librarys() -> None:
    assert CLI_MAX_SPECULATE == MAX_SPECULATE


@pytest.mark.parametrize("source", ["missing", "someone_elses"])
def test_draft_for_a_folder_that_is_no_run_is_refused(
        source: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--draft-for`` reads a run folder: a missing one or another tool's folder is refused
    in one line (exit 1) before anything is written, and the other folder is left as it was."""
    target = tmp_path / source
    if source == "someone_elses":
        target.mkdir()
        (target / "notes.txt").write_text("mine", encoding="utf-8")
    capsys.readouterr()
    code = main(["train", "--draft-for", str(target), "--out", str(tmp_path / "d"),
                 "--max-steps", "2", "--no-progress", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and "Traceback" not in err and str(target) in err
    assert not (tmp_path / "d").exists()
    if source == "someone_elses":
        assert [p.name for p in target.iterdir()] == ["notes.txt"]
        assert (target / "notes.txt").read_text(encoding="utf-8") == "mine"
