"""Where text comes from: the built-in default corpus and the user's own files.

The default corpus is Python's own documentation (``pydoc_data.topics``), which ships with
every CPython, so ``handformer train`` works offline on a fresh machine with no download.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CorpusError", "builtin_text", "read_text_file"]


class CorpusError(ValueError):
    """Bad input text: missing, empty, undecodable or too short."""


def builtin_text() -> str:
    """CPython's documentation topics joined in sorted key order (~465 K characters)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def _line_col(data: bytes, offset: int) -> tuple[int, int]:
    """1-based line and character column (as an editor shows them) of a byte offset."""
    line_start = data.rfind(b"\n", 0, offset) + 1
    line = data.count(b"\n", 0, offset) + 1
    col = len(data[line_start:offset].decode("utf-8", errors="replace")) + 1
    return line, col


def read_text_file(path: str | Path) -> str:
    """Read a UTF-8 text file, with errors that say what is wrong and where."""
    path = Path(path)
    if not path.exists():
        raise CorpusError(f"text file not found: {path}")
    if path.is_dir():
        raise CorpusError(f"{path} is a directory; expected a UTF-8 text file")
    data = path.read_bytes()
    if not data:
        raise CorpusError(f"{path} is empty; expected UTF-8 text to train on")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line, col = _line_col(data, err.start)
        bad = data[err.start : err.start + 4]
        raise CorpusError(
            f"{path} is not valid UTF-8: byte {err.start} (line {line}, column {col}) "
            f"starts {bad!r} ({err.reason}). Re-save the file as UTF-8."
        ) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    if not text.strip():
        raise CorpusError(f"{path} holds only whitespace; expected text to train on")
    return text
