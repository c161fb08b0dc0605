"""Every float a command line takes is finite and in range, or a usage error (exit 2) naming
the option and the value — before anything is loaded, trained or written.

``float()`` accepts ``nan``, ``inf`` and ``1e999``; NaN compares False with every bound, so
before these types ``--temperature nan`` sampled from NaN and ``--lr inf`` trained a step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from handformer.cli import main
from handformer.cli.common import finite_float, non_negative_int

# (argv before the bad option, option, bad value) — the folders need not exist: the option
# is refused while parsing, first.
BAD: list[tuple[list[str], str, str]] = [
    (["generate", "--run", "nowhere"], "--temperature", "nan"),
    (["generate", "--run", "nowhere"], "--temperature", "inf"),
    (["generate", "--run", "nowhere"], "--temperature", "-0.5"),
    (["generate", "--run", "nowhere"], "--repetition-penalty", "nan"),
    (["generate", "--run", "nowhere"], "--repetition-penalty", "0"),
    (["generate", "--run", "nowhere"], "--top-p", "nan"),
    (["generate", "--run", "nowhere"], "--top-p", "1.5"),
    (["generate", "--run", "nowhere"], "--top-k", "0"),
    (["generate", "--run", "nowhere"], "--max-new-tokens", "-1"),
    (["train", "--out", "nowhere"], "--lr", "inf"),
    (["train", "--out", "nowhere"], "--lr", "nan"),
    (["train", "--out", "nowhere"], "--lr", "0"),
    (["train", "--out", "nowhere"], "--dropout", "1"),
    (["train", "--out", "nowhere"], "--dropout", "nan"),
    (["classify", "train", "--out", "nowhere"], "--lr", "1e999"),
    (["classify", "train", "--out", "nowhere"], "--val-fraction", "nan"),
    (["classify", "train", "--out", "nowhere"], "--val-fraction", "1"),
    (["seq2seq", "train", "--out", "nowhere"], "--lr", "-inf"),
    (["doctor"], "--lr", "nan"),
]


@pytest.mark.parametrize(("argv", "option", "value"), BAD,
                         ids=[f"{a[0]}{o}={v}" for a, o, v in BAD])
def test_a_bad_number_is_a_usage_error_naming_the_option_and_value(
        argv: list[str], option: str, value: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main([*argv, f"{option}={value}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err and value in err, err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing was written


@pytest.mark.parametrize(("kind", "good", "bad"), [
    (finite_float(), ["0", "-3.5", "1e30"], ["nan", "inf", "-inf", "1e999", "x", ""]),
    (finite_float(0.0, low_open=True), ["1e-12", "3"], ["0", "-1"]),
    (finite_float(0.0, 1.0, high_open=True), ["0", "0.999"], ["1", "-0.0001"]),
    (finite_float(0.0, 1.0, low_open=True), ["1", "0.5"], ["0", "1.0001"]),
])
def test_finite_float_types(kind: object, good: list[str], bad: list[str]) -> None:
    for text in good:
        assert kind(text) == float(text)  # type: ignore[operator]
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match="expected a finite number"):
            kind(text)  # type: ignore[operator]


def test_non_negative_int() -> None:
    assert non_negative_int("0") == 0
    for text in ("-1", "1.5", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="integer >= 0"):
            non_negative_int(text)
