"""Tokenizers: text ↔ integer ids.

``CharTokenizer`` gives every distinct character its own id, after four special tokens
(``<pad>`` = 0, ``<unk>``, ``<bos>``, ``<eos>``). Encoding is vectorised: the text becomes an
array of Unicode code points (one C-level call) and a lookup table maps them to ids, instead
of a Python dict lookup per character.

``HFTokenizer`` wraps any Hugging Face ``tokenizer.json`` (a WordPiece vocabulary such as
MiniLM's, a GPT-2 BPE, …) behind the same interface; ``BPETokenizer.train`` learns a
byte-level BPE on a corpus with the ``tokenizers`` library. Both save the library's own
``tokenizer.json``, which ``transformers`` loads as it is.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from handformer.atomic import atomic_write_text

__all__ = ["SPECIAL_TOKENS", "BPETokenizer", "CharTokenizer", "HFTokenizer", "Tokenizer",
           "load_tokenizer", "tokenizer_from_dict"]

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, UNK, BOS, EOS)


def _code_points(text: str) -> np.ndarray:
    """str → (N,) uint32 code points, without a Python-level loop."""
    return np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype="<u4")


class CharTokenizer:
    """Character-level tokenizer with special tokens.

    Ids 0-3 are ``<pad>`` (``pad_id``), ``<unk>`` (``unk_id``), ``<bos>`` and ``<eos>``; the
    characters follow in sorted order (``CharTokenizer.from_text(text)`` builds the
    vocabulary from a text). ``encode(text)`` → list of ids, ``encode_array`` → (N,) int64
    array, ``decode(ids)`` → text; a batch for a model is ``torch.tensor([ids])`` of shape
    (B, T).

    ``unknown="replace"`` (the default) maps characters outside the vocabulary to ``<unk>``,
    which decodes as U+FFFD; ``unknown="error"`` raises ``ValueError`` naming them. The
    constructor raises ``ValueError`` for repeated or multi-character entries, ``decode`` for
    ids outside [0, vocab_size).
    """

    kind = "char"

    def __init__(self, chars: Iterable[str]) -> None:
        chars = list(chars)
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer vocabulary has repeated characters")
        bad = [c for c in chars if len(c) != 1]
        if bad:
            raise ValueError(f"CharTokenizer vocabulary entries must be single characters; "
                             f"got {bad[:5]}")
        self.chars: list[str] = chars
        self.itos: list[str] = [*SPECIAL_TOKENS, *chars]
        self.stoi: dict[str, int] = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(chars)}
        cps = _code_points("".join(chars)).astype(np.int64)  # (N_chars,)
        # One slot past the largest known code point holds <unk>: encode clamps every
        # larger code point onto it, so a lookup is a single `take`.
        table_size = (int(cps.max()) if len(cps) else 0) + 2
        self._table = np.full(table_size, self.unk_id, dtype=np.int64)  # code point → id
        self._table[cps] = np.arange(len(SPECIAL_TOKENS), len(self.itos), dtype=np.int64)
        self._decode_table = np.array(self.itos, dtype=object)

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """Vocabulary = the sorted set of characters in ``text``."""
        if not text:
            raise ValueError("cannot build a character vocabulary from empty text")
        cps = np.unique(_code_points(text))
        return cls(chr(int(c)) for c in cps)

    # -- properties ---------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids: the four special tokens plus the characters."""
        return len(self.itos)

    pad_id = 0
    unk_id = 1
    bos_id = 2
    eos_id = 3

    # -- encode / decode ----------------------------------------------------------------
    def encode_array(self, text: str, *, unknown: str = "replace") -> np.ndarray:
        """text → (N,) int64 ids, vectorised."""
        cps = _code_points(text)  # (N,) uint32
        ids = self._table.take(np.minimum(cps, len(self._table) - 1))  # (N,) int64
        if unknown == "error":
            missing = np.flatnonzero(ids == self.unk_id)
            if missing.size:
                chars = sorted({text[i] for i in missing[:1000].tolist()})
                raise ValueError(
                    f"{missing.size} character(s) are not in the vocabulary, e.g. {chars[:10]} "
                    f"(first at index {int(missing[0])})"
                )
        elif unknown != "replace":
            raise ValueError(f"unknown= must be 'replace' or 'error'; got {unknown!r}")
        return ids

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False,
               unknown: str = "replace") -> list[int]:
        """text → list of ids, optionally framed by ``<bos>`` / ``<eos>``; ``unknown`` as in
        ``encode_array``."""
        ids = self.encode_array(text, unknown=unknown).tolist()
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Sequence[int] | np.ndarray | Any, *, skip_special: bool = True) -> str:
        """ids → text. Special tokens are dropped (``skip_special``) or written as ``<name>``;
        ``<unk>`` becomes U+FFFD so the loss of information stays visible."""
        arr = np.asarray(ids.tolist() if hasattr(ids, "tolist") else ids, dtype=np.int64)
        if arr.ndim != 1:
            raise ValueError(f"decode expects a 1-D sequence of ids; got shape {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"ids must lie in [0, {self.vocab_size}); got min {arr.min()}, "
                             f"max {arr.max()}")
        n_special = len(SPECIAL_TOKENS)
        if skip_special:
            arr = arr[(arr >= n_special) | (arr == self.unk_id)]
        pieces = self._decode_table[arr]
        if skip_special:
            pieces[arr == self.unk_id] = "\ufffd"
        return "".join(pieces.tolist())

    # -- persistence --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON-able form saved as ``tokenizer.json`` in run folders."""
        return {"type": self.kind, "version": 1, "special_tokens": list(SPECIAL_TOKENS),
                "chars": self.chars}

    def save(self, path: str | Path) -> None:
        """Write ``to_dict()`` as JSON, atomically (a temporary file renamed into place)."""
        atomic_write_text(Path(path), json.dumps(self.to_dict()))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CharTokenizer:
        """Inverse of ``to_dict``; ``ValueError`` for another tokenizer type or different
        special tokens."""
        if data.get("type") != cls.kind:
            raise ValueError(f"not a character tokenizer: type={data.get('type')!r}")
        if list(data.get("special_tokens", [])) != list(SPECIAL_TOKENS):
            raise ValueError(f"special tokens {data.get('special_tokens')} differ from "
                             f"{list(SPECIAL_TOKENS)}")
        return cls(data["chars"])

    @classmethod
    def load(cls, path: str | Path) -> CharTokenizer:
        """Read a file written by ``save`` (errors as in ``from_dict``)."""
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` behind handformer's tokenizer interface.

    The special ids are found by name (``<pad>``, ``[CLS]``, ``<|endoftext|>``, …) unless
    ``special_ids`` states them (``{"bos": 128000, "eos": 128001}``): a published model
    says in its ``config.json`` which tokens begin and end a text, and no list of names
    covers every vocabulary (Llama 3's ``<|begin_of_text|>``, Qwen3's ``<|im_end|>``). A run
    folder records them beside the tokenizer (``special_tokens`` in ``config.json``).
    """

    kind = "hf"
    SPECIAL_ROLES: tuple[str, ...] = ("bos", "eos", "pad")
    _PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>")
    _UNK_NAMES = ("<unk>", "[UNK]")
    _BOS_NAMES = ("<bos>", "[CLS]", "<s>", "<|endoftext|>")
    _EOS_NAMES = ("<eos>", "[SEP]", "</s>", "<|endoftext|>")

    def __init__(self, tokenizer: Any, *, special_ids: dict[str, int] | None = None) -> None:
        # handformer pads and truncates batches itself (padding masks, max_len): switch off
        # any padding/truncation baked into the file (MiniLM's pads every text to 128).
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self.backend = tokenizer  # a tokenizers.Tokenizer
        self.special_ids: dict[str, int] = {}
        for role, idx in (special_ids or {}).items():
            if role not in self.SPECIAL_ROLES:
                raise ValueError(f"special_ids: unknown role {role!r}; expected one of "
                                 f"{self.SPECIAL_ROLES}")
            if not isinstance(idx, int) or isinstance(idx, bool) or not (
                    0 <= idx < self.vocab_size):
                raise ValueError(f"special_ids[{role!r}] = {idx!r} is not an id of this "
                                 f"tokenizer (0..{self.vocab_size - 1})")
            self.special_ids[role] = idx

    def _find(self, names: tuple[str, ...], role: str) -> int | None:
        if role in self.special_ids:
            return self.special_ids[role]
        for name in names:
            idx = self.backend.token_to_id(name)
            if idx is not None:
                return idx
        return None

    @property
    def vocab_size(self) -> int:
        """Number of ids, added special tokens included (the model's ``vocab_size``)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def pad_token_id(self) -> int | None:
        """The padding token's id (stated, or ``<pad>``/``[PAD]``), None when there is none."""
        return self._find(self._PAD_NAMES, "pad")

    @property
    def pad_id(self) -> int:
        """The padding token's id (``<pad>``/``[PAD]``), 0 when the vocabulary has none."""
        found = self.pad_token_id
        return 0 if found is None else found

    @property
    def unk_id(self) -> int | None:
        """``<unk>``/``[UNK]``'s id, or None (byte-level BPE never needs one)."""
        return self._find(self._UNK_NAMES, "unk")

    @property
    def bos_id(self) -> int | None:
        """The begin-of-sequence id (``<bos>``, ``[CLS]``, ``<s>``, ``<|endoftext|>``) or None."""
        return self._find(self._BOS_NAMES, "bos")

    @property
    def eos_id(self) -> int | None:
        """The end-of-sequence id (``<eos>``, ``[SEP]``, ``</s>``, ``<|endoftext|>``) or None."""
        return self._find(self._EOS_NAMES, "eos")

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False,
               add_special_tokens: bool = False) -> list[int]:
        """``add_special_tokens`` applies the file's own template (e.g. BERT's [CLS] … [SEP])."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = [self.bos_id] if add_bos and self.bos_id is not None else []
        eos = [self.eos_id] if add_eos and self.eos_id is not None else []
        return bos + ids + eos

    def encode_array(self, text: str) -> np.ndarray:
        """A whole corpus → int64 ids (N,), without special tokens."""
        # One call on the whole text: splitting it first (e.g. by lines) would change where
        # whitespace runs are cut, and so the tokens.
        return np.asarray(self.backend.encode(text, add_special_tokens=False).ids,
                          dtype=np.int64)

    def decode(self, ids: Sequence[int] | np.ndarray | Any, *, skip_special: bool = True) -> str:
        """ids → text; special tokens are left out unless ``skip_special=False``."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special)

    def to_dict(self) -> dict[str, Any]:
        """The library's own tokenizer.json content, as a dict."""
        return json.loads(self.backend.to_str(pretty=False))

    def save(self, path: str | Path) -> None:
        """Write the library's own ``tokenizer.json`` (atomically: whole or not at all)."""
        atomic_write_text(Path(path), self.backend.to_str(pretty=False))

    @classmethod
    def load(cls, path: str | Path) -> HFTokenizer:
        """Any ``tokenizers`` library ``tokenizer.json`` (GPT-2's, BERT's WordPiece, …)."""
        from tokenizers import Tokenizer as Backend

        return cls(Backend.from_file(str(path)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


class BPETokenizer(HFTokenizer):
    """Byte-level BPE: any text round-trips, no character is ever unknown."""

    kind = "bpe"

    @classmethod
    def train(cls, text: str | Iterable[str], vocab_size: int = 1000) -> BPETokenizer:
        """Learn merges on ``text`` until the vocabulary (256 bytes + merges + the four
        special tokens, ids 0–3) reaches ``vocab_size``."""
        from tokenizers import Tokenizer as Backend
        from tokenizers import decoders, models, pre_tokenizers, trainers

        if vocab_size < 260:
            raise ValueError(f"vocab_size must be >= 260 (4 special tokens + 256 bytes); "
                             f"got {vocab_size}")
        backend = Backend(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        lines = [text] if isinstance(text, str) else text
        backend.train_from_iterator(lines, trainer=trainer)
        return cls(backend)


Tokenizer = CharTokenizer | HFTokenizer


def tokenizer_from_dict(data: dict[str, Any], *, source: str = "tokenizer.json") -> Tokenizer:
    """Rebuild whichever tokenizer a ``tokenizer.json`` dict describes: handformer's
    character vocabulary, or any Hugging Face ``tokenizers`` file (BPE, WordPiece, …)."""
    if data.get("type") == "char":
        return CharTokenizer.from_dict(data)
    model = data.get("model")
    if isinstance(model, dict):
        from tokenizers import Tokenizer as Backend

        try:
            backend = Backend.from_str(json.dumps(data))
        except Exception as err:  # the library raises its own exception type
            raise ValueError(f"{source}: not a loadable Hugging Face tokenizer ({err})") from None
        return (BPETokenizer if model.get("type") == "BPE" else HFTokenizer)(backend)
    raise ValueError(f"{source}: unknown tokenizer format (type={data.get('type')!r}, no "
                     "'model' section); expected handformer's character tokenizer "
                     "(type='char') or a Hugging Face tokenizer.json")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load whichever tokenizer a ``tokenizer.json`` file describes."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return tokenizer_from_dict(data, source=str(path))
