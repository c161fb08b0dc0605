"""Text typed into the page → token ids the model can take, plus notices about what changed.

Rules (the page shows every notice):

* an empty text is refused (``InputError``): there is nothing to attend over;
* characters outside a character vocabulary become ``<unk>`` — the model sees exactly that,
  so the view shows it too, and a notice lists the characters;
* a text longer than ``limit`` tokens (the model's window) is cropped, with a notice saying
  how many tokens were dropped: a language model keeps the *last* ``limit`` (as
  ``generate`` crops its context), a classifier the *first* (as its training data was
  cut). Cropping keeps the view useful where refusing would leave a blank page.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from handformer.explore.payload import InputError

__all__ = ["EncodedText", "encode_text", "token_text"]


@dataclass
class EncodedText:
    ids: list[int]
    tokens: list[str]  # what each id stands for, as the vocabulary names it
    notices: list[str] = field(default_factory=list)


def token_text(tokenizer: Any, token_id: int) -> str:
    """The vocabulary's name for one id (``<pad>``, ``a``, ``Ġthe`` …). An id past the
    tokenizer (a published model's padded vocabulary: embeddings no token maps to) is shown
    as ``<id N>``, never an error."""
    if not 0 <= token_id < tokenizer.vocab_size:
        return f"<id {token_id}>"
    itos = getattr(tokenizer, "itos", None)
    if itos is not None:
        return str(itos[token_id])
    backend = getattr(tokenizer, "backend", None)
    if backend is not None:
        name = backend.id_to_token(token_id)
        if name is not None:
            return str(name)
    return str(tokenizer.decode([token_id], skip_special=False))


def _unknown_notice(tokenizer: Any, text: str, ids: list[int], what: str) -> str | None:
    unk = getattr(tokenizer, "unk_id", None)
    if unk is None or unk not in ids:
        return None
    stoi = getattr(tokenizer, "stoi", None)
    count = ids.count(unk)
    if stoi is not None:
        chars = sorted({c for c in text if c not in stoi})
        shown = ", ".join(repr(c) for c in chars[:12]) + (" …" if len(chars) > 12 else "")
        return (f"{count} character(s) of {what} are not in the model's vocabulary and "
                f"became <unk>: {shown}")
    return f"{count} token(s) of {what} became <unk>"


def encode_text(tokenizer: Any, text: str, *, limit: int, what: str = "the prompt",
                add_bos: bool = False, keep: str = "last") -> EncodedText:
    """Encode ``text`` to at most ``limit`` ids, keeping its ``"last"`` or ``"first"``
    tokens (``add_bos`` prepends ``<bos>``, always kept). ``InputError`` for an empty text."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1; got {limit}")
    if keep not in ("last", "first"):
        raise ValueError(f"keep must be 'last' or 'first'; got {keep!r}")
    if not text:
        raise InputError(f"{what} is empty: type at least one character")
    ids = [int(i) for i in tokenizer.encode(text)]
    if not ids:
        raise InputError(f"{what} {text!r:.80} encodes to no tokens at all")
    notices = []
    unknown = _unknown_notice(tokenizer, text, ids, what)
    if unknown:
        notices.append(unknown)
    bos = getattr(tokenizer, "bos_id", None) if add_bos else None
    room = limit - (1 if bos is not None else 0)
    if room < 1:
        raise ValueError(f"limit={limit} leaves no room for {what} after <bos>")
    if len(ids) > room:
        dropped = len(ids) - room
        notices.append(f"{what} has {len(ids)} tokens but only {room} fit in the model's "
                       f"window: showing the {keep} {room} (the "
                       f"{'first' if keep == 'last' else 'last'} {dropped} were dropped)")
        ids = ids[-room:] if keep == "last" else ids[:room]
    if bos is not None:
        ids = [int(bos), *ids]
    return EncodedText(ids, [token_text(tokenizer, i) for i in ids], notices)
