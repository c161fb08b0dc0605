"""handformer.data.corpora: the built-in text and user files read with clear errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from handformer.data.corpora import CorpusError, builtin_text, read_text_file


# =========================================================================================
# corpora.py
# =========================================================================================
def test_builtin_text_size_and_determinism() -> None:
    text = builtin_text()
    assert 400_000 < len(text) < 600_000
    assert builtin_text() == text
    assert text.strip()


def _write(content: bytes) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        path = tmp / "corpus.txt"
        path.write_bytes(content)
        return path

    return make


def _directory(tmp: Path) -> Path:
    path = tmp / "a_folder"
    path.mkdir()
    return path


# (id, make the path, substrings the message must contain besides the path)
READ_ERRORS: list[tuple[str, Callable[[Path], Path], list[str]]] = [
    ("missing", lambda tmp: tmp / "does_not_exist.txt", ["not found"]),
    ("directory", _directory, ["directory"]),
    ("empty", _write(b""), ["empty"]),
    ("whitespace-only", _write(b"  \n\t\r\n  "), ["whitespace"]),
    ("bom-then-whitespace", _write(b"\xef\xbb\xbf \n"), ["whitespace"]),
    ("invalid-utf8", _write(b"hello\nab\xffcd\n"),
     ["not valid UTF-8", "byte 8", "line 2", "column 3"]),
    ("column-counts-characters", _write("é日x".encode() + b"\xff"),
     ["byte 6", "line 1", "column 4"]),
    ("truncated-utf8", _write(b"ok\n\xe6\x97"), ["not valid UTF-8", "byte 3", "line 2",
                                                  "column 1"]),
]


@pytest.mark.parametrize(("make_path", "needles"), [(m, n) for _, m, n in READ_ERRORS],
                         ids=[i for i, _, _ in READ_ERRORS])
def test_read_text_file_errors(tmp_path: Path, make_path: Callable[[Path], Path],
                               needles: list[str]) -> None:
    path = make_path(tmp_path)
    with pytest.raises(CorpusError) as info:
        read_text_file(path)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert str(path) in message
    for needle in needles:
        assert needle in message


def test_read_text_file_strips_bom_and_reads_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffhéllo 日本 🎉\n".encode())
    assert read_text_file(path) == "héllo 日本 🎉\n"
    assert read_text_file(str(path)) == "héllo 日本 🎉\n"


