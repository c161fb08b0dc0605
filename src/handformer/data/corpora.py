"""Where text comes from: the built-in default corpus and the user's own files.

The default corpus is Python's own documentation (``pydoc_data.topics``), which ships with
every CPython, so ``handformer train`` works offline on a fresh machine with no download.
"""

from __future__ import annotations

import stat
from pathlib import Path

__all__ = ["MAX_TEXT_BYTES", "CorpusError", "builtin_text", "read_text_file"]

# The largest text file read whole (``read_text_file``'s default ``max_bytes``): the text,
# its code points and its int64 token ids all live in memory at once, ~16 bytes a character.
MAX_TEXT_BYTES = 2 << 30


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


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _format_size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def read_text_file(path: str | Path, *, max_bytes: int | None = MAX_TEXT_BYTES) -> str:
    """Read a UTF-8 text file, with errors that say what is wrong and where.

    Only a regular file is read: a device or a pipe (``/dev/zero``, ``/dev/stdin``) may never
    end. A file over ``max_bytes`` (default ``MAX_TEXT_BYTES``, 2 GiB; ``None``: no limit)
    is refused before it is read, and reading stops there should the file grow meanwhile.
    """
    path = Path(path)
    if not path.exists():
        raise CorpusError(f"text file not found: {path}")
    if path.is_dir():
        raise CorpusError(f"{path} is a directory; expected a UTF-8 text file")
    mode = path.stat().st_mode
    if not stat.S_ISREG(mode):
        raise CorpusError(f"{path} is {_kind(mode)}, which may never end; expected a regular "
                          "UTF-8 text file")
    size = path.stat().st_size
    if max_bytes is not None and size > max_bytes:
        raise CorpusError(f"{path} is {_format_size(size)}; texts are read whole into memory "
                          f"(with their token ids, ~16 bytes a character) and the limit is "
                          f"{_format_size(max_bytes)}: use a part of the file")
    with open(path, "rb") as fh:
        data = fh.read() if max_bytes is None else fh.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise CorpusError(f"{path} grew past the limit of {_format_size(max_bytes)} while "
                          "being read; use a part of the file")
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
