"""A run's tokenizer as files every Hugging Face tool reads, and back.

``transformers`` has no class for handformer's character vocabulary, so a converted folder
carries it as a ``tokenizers`` library ``tokenizer.json`` that says the same thing:

* a ``WordLevel`` model over the same ids (``<pad>`` 0, ``<unk>`` 1, ``<bos>`` 2, ``<eos>`` 3,
  then the characters in order), with ``<unk>`` as its unknown token;
* a pre-tokenizer that cuts the text into single characters (``Split`` on the empty
  pattern), so a word never becomes one token;
* a decoder that writes ``<unk>`` as U+FFFD and joins the pieces with nothing between them
  (the default would join them with spaces);
* ``<pad>``, ``<bos>`` and ``<eos>`` as special tokens, and ``split_special_tokens`` in
  ``tokenizer_config.json``: a text that spells "<eos>" is five characters, as in
  ``CharTokenizer``. ``<unk>`` is not declared special, so decoding with
  ``skip_special_tokens=True`` keeps it visible as U+FFFD — ``CharTokenizer.decode`` does too.

A BPE run's tokenizer (or one imported from a Hub folder) already is a ``tokenizers`` file
and is written as it is, its special tokens named by their own strings (Llama 3's
``<|begin_of_text|>``, …; a vocabulary without a pad token gets none). Both get
``tokenizer_config.json``, ``special_tokens_map.json`` and ``generation_config.json``
(bos/eos/pad ids, greedy decoding), which is what ``AutoTokenizer`` and
``pipeline("text-generation")`` look for.

Reading a folder back, ``read_folder_tokenizer`` recognises the character form above and
returns a ``CharTokenizer`` again; any other ``tokenizer.json`` becomes an ``HFTokenizer``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from handformer.atomic import atomic_write_text
from handformer.interop.errors import ConversionError
from handformer.interop.files import read_config
from handformer.tokenizers import (
    SPECIAL_TOKENS,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)

__all__ = ["TOKENIZER_FILES", "char_to_hf", "hf_to_char", "read_folder_tokenizer",
           "write_folder_tokenizer"]

PAD, UNK, BOS, EOS = SPECIAL_TOKENS
# What ``write_folder_tokenizer`` writes into a converted folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
# The files of a tokenizer that ``transformers`` can only build in Python ("slow").
_SLOW_FILES = ("vocab.json", "merges.txt", "vocab.txt", "spiece.model", "tokenizer.model")


def char_to_hf(tok: CharTokenizer) -> Any:
    """A ``CharTokenizer`` → a ``tokenizers.Tokenizer`` with the same ids (see the module
    docstring)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    vocab = {token: i for i, token in enumerate(tok.itos)}
    backend = Backend(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one piece per character
    backend.decoder = decoders.Sequence([decoders.Replace(UNK, "\ufffd"), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in (PAD, BOS, EOS)])
    return backend


def hf_to_char(data: dict[str, Any]) -> CharTokenizer | None:
    """The ``CharTokenizer`` a ``tokenizer.json`` dict written by ``char_to_hf`` describes,
    or ``None`` when it is some other tokenizer."""
    model, pre = data.get("model") or {}, data.get("pre_tokenizer") or {}
    if model.get("type") != "WordLevel" or model.get("unk_token") != UNK:
        return None
    if pre.get("type") != "Split" or pre.get("pattern") != {"String": ""}:
        return None
    vocab = model.get("vocab") or {}
    itos = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in itos] != list(range(len(itos))):
        return None
    if tuple(itos[: len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
        return None
    chars = itos[len(SPECIAL_TOKENS):]
    if any(len(c) != 1 for c in chars):
        return None
    return CharTokenizer(chars)


def _special_tokens(tok: Tokenizer) -> dict[str, str]:
    """``bos_token`` / ``eos_token`` / ``pad_token`` → their strings, for those ``tok`` has."""
    if isinstance(tok, CharTokenizer):
        return {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    found = {"bos_token": tok.bos_id, "eos_token": tok.eos_id,
             "pad_token": tok.pad_token_id}
    return {role: tok.backend.id_to_token(idx) for role, idx in found.items()
            if idx is not None}


def _side_files(tok: Tokenizer, max_len: int,
                chat_template: str | None) -> dict[str, dict[str, Any]]:
    """``tokenizer_config.json``, ``special_tokens_map.json``, ``generation_config.json``."""
    special = _special_tokens(tok)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", **special,
        # Decoding must give back exactly the characters: no space clean-up.
        "clean_up_tokenization_spaces": False, "model_max_length": max_len,
        "add_bos_token": False, "add_eos_token": False,
    }
    if isinstance(tok, CharTokenizer):
        config["split_special_tokens"] = True  # "<eos>" in a text is five characters
    if chat_template is not None:
        config["chat_template"] = chat_template
    generation = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id,
                  "pad_token_id": tok.pad_id if "pad_token" in special else None,
                  "do_sample": False,
                  "max_length": max_len}  # a learned-position model reads no further
    return {"tokenizer_config.json": config, "special_tokens_map.json": special,
            "generation_config.json": generation}


def write_folder_tokenizer(folder: Path, tok: Tokenizer, max_len: int, *,
                           chat_template: str | None = None) -> None:
    """Write ``TOKENIZER_FILES`` for ``tok`` into ``folder`` (each file atomically)."""
    if isinstance(tok, CharTokenizer):
        backend_json = char_to_hf(tok).to_str(pretty=False)
    elif isinstance(tok, HFTokenizer):
        if tok.eos_id is None:
            raise ConversionError("this run's tokenizer names no end-of-text token; a "
                                  "transformers pipeline needs one to stop")
        backend_json = tok.backend.to_str(pretty=False)
    else:
        raise ConversionError(f"cannot write a {type(tok).__name__} as a Hugging Face "
                              "tokenizer")
    atomic_write_text(folder / "tokenizer.json", backend_json)
    for name, content in _side_files(tok, max_len, chat_template).items():
        atomic_write_text(folder / name, json.dumps(content, indent=2, ensure_ascii=False))


def read_folder_tokenizer(folder: Path) -> Tokenizer:
    """The tokenizer of a Hugging Face folder: ``tokenizer.json`` (handformer's character
    form comes back as a ``CharTokenizer``) or, from folders converted before there was one,
    ``handformer_tokenizer.json``. ``ConversionError`` naming the file otherwise."""
    path, legacy = folder / "tokenizer.json", folder / "handformer_tokenizer.json"
    if not path.is_file():
        if legacy.is_file():
            return _load(legacy)
        slow = [n for n in _SLOW_FILES if (folder / n).is_file()]
        hint = (f"it has only a Python-only tokenizer's files ({', '.join(slow)}); write a "
                "tokenizer.json with AutoTokenizer.from_pretrained(FOLDER).save_pretrained("
                "FOLDER) (a fast tokenizer)" if slow else
                "save one with tokenizer.save_pretrained(...) from a fast tokenizer")
        raise ConversionError(f"{folder} has no tokenizer.json; a run folder needs one: {hint}")
    char = hf_to_char(read_config(path, "the tokenizer"))
    return char if char is not None else _load(path)


def _load(path: Path) -> Tokenizer:
    try:
        return load_tokenizer(path)
    except (ValueError, UnicodeDecodeError) as err:  # JSON errors are ValueErrors
        message = str(err) if str(path) in str(err) else f"{path}: {err}"
        raise ConversionError(message) from None
