"""Generated ids → the text a client may see now, and whether a stop string ended it.

The whole generated text is decoded again after each token (a byte-level BPE token can be
half a character: decoding tokens one by one would show U+FFFD where the pair of them makes a
character). What is released lags behind what is decoded by two things: the tail that could
still become a stop string (``generate.text.held_back``, the rule ``generate_text`` streams
by) and a trailing U+FFFD (a character whose remaining bytes are still to come). A stop
string, once found, cuts the text before it and ends the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from handformer.generate.text import held_back

__all__ = ["TextStream"]


class TextStream:
    """``push(token)`` → (new text to release, whether a stop string was found);
    ``flush()`` releases what was held back once the request ends for another reason."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""
        self.released = 0

    def _release(self, upto: int) -> str:
        piece = self.text[self.released:upto] if upto > self.released else ""
        self.released = max(self.released, upto)
        return piece

    def push(self, token: int) -> tuple[str, bool]:
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids)
        hits = [self.text.find(s, max(0, self.released - len(s))) for s in self.stop]
        hits = [h for h in hits if h >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return self._release(len(self.text)), True
        upto = len(self.text) - held_back(self.text, self.stop)
        while upto > self.released and self.text[upto - 1] == "\ufffd":
            upto -= 1
        return self._release(upto), False

    def flush(self) -> str:
        return self._release(len(self.text))
