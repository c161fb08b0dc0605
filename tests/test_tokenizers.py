"""CharTokenizer: special ids, exact round-trips, unknown characters, persistence."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from handformer.tokenizers import SPECIAL_TOKENS, CharTokenizer, load_tokenizer

HYPOTHESIS = settings(max_examples=200, deadline=None)

TRICKY_TEXTS = [
    "hello world",
    "héllo wörld, ça va? Ünïcödé",
    "日本語のテキスト、中文字符，한국어",
    "emoji 🎉🐍 and a family 👩\u200d👩\u200d👧 (ZWJ sequence)",
    "combining e\u0301 vs precomposed é",
    "control \x00\x01\t\r\n and DEL \x7f",
    "astral 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0010ffff",
    "<pad><unk><bos><eos> look like specials but are plain text",
]


def naive_encode(tok: CharTokenizer, text: str) -> list[int]:
    """The tutorial's per-character dict lookup, with unknowns mapped to ``<unk>``."""
    return [tok.stoi.get(c, tok.unk_id) for c in text]


# -- special tokens -----------------------------------------------------------------------
def test_special_token_ids() -> None:
    tok = CharTokenizer.from_text("abc")
    assert SPECIAL_TOKENS == ("<pad>", "<unk>", "<bos>", "<eos>")
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    assert tok.itos[:4] == list(SPECIAL_TOKENS)
    assert tok.vocab_size == 4 + 3


def test_vocabulary_is_sorted_distinct_characters() -> None:
    tok = CharTokenizer.from_text("banana bread")
    assert tok.chars == sorted(set("banana bread"))
    assert tok.stoi == {c: i + 4 for i, c in enumerate(tok.chars)}
    assert all(i >= 4 for i in tok.encode("banana"))


def test_from_text_rejects_empty_text() -> None:
    with pytest.raises(ValueError, match="empty"):
        CharTokenizer.from_text("")


@pytest.mark.parametrize(
    ("chars", "needle"),
    [(["a", "b", "a"], "repeated"), (["a", "bc"], "single characters")],
)
def test_constructor_rejects_bad_vocabularies(chars: list[str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        CharTokenizer(chars)


# -- round trips --------------------------------------------------------------------------
@HYPOTHESIS
@given(text=st.text(), extra=st.text())
def test_round_trip_is_exact(text: str, extra: str) -> None:
    tok = CharTokenizer.from_text(text + extra or "a")
    ids = tok.encode(text, unknown="error")
    assert len(ids) == len(text)  # one id per code point, never a merged/split one
    assert tok.unk_id not in ids
    assert tok.decode(ids) == text


@HYPOTHESIS
@given(text=st.text(), vocab_text=st.text(min_size=1))
def test_encode_array_matches_naive_lookup(text: str, vocab_text: str) -> None:
    tok = CharTokenizer.from_text(vocab_text)
    arr = tok.encode_array(text)
    assert arr.dtype == np.int64
    assert arr.tolist() == naive_encode(tok, text)


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_round_trip_tricky_texts(text: str) -> None:
    tok = CharTokenizer.from_text(text)
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, add_bos=True, add_eos=True)) == text


def test_decode_accepts_lists_numpy_and_tensors() -> None:
    tok = CharTokenizer.from_text("xyz")
    ids = tok.encode("zyx")
    expected = "zyx"
    assert tok.decode(ids) == expected
    assert tok.decode(np.array(ids)) == expected
    assert tok.decode(torch.tensor(ids)) == expected
    assert tok.decode([]) == ""


# -- unknown characters -------------------------------------------------------------------
def test_unknown_characters_replaced_by_unk() -> None:
    tok = CharTokenizer.from_text("abc")
    # "z" lies inside the code-point table, "€" and "🙂" beyond it: both paths must give <unk>.
    assert tok.encode("azb€🙂") == [tok.stoi["a"], 1, tok.stoi["b"], 1, 1]
    assert tok.encode("azb", unknown="replace") == tok.encode("azb")


@pytest.mark.parametrize("bad_char", ["z", "€", "🙂"])
def test_unknown_characters_error_names_the_char(bad_char: str) -> None:
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match="not in the vocabulary") as info:
        tok.encode(f"ab{bad_char}c", unknown="error")
    assert bad_char in str(info.value)
    assert "index 2" in str(info.value)


def test_unknown_mode_is_validated() -> None:
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match="unknown="):
        tok.encode("abc", unknown="ignore")


def test_decode_of_unk_shows_replacement_character() -> None:
    tok = CharTokenizer.from_text("abc")
    ids = tok.encode("aZc")
    assert tok.decode(ids) == "a\ufffdc"
    assert tok.decode(ids, skip_special=False) == "a<unk>c"


def test_decode_skip_special_false_shows_names() -> None:
    tok = CharTokenizer.from_text("hi")
    ids = tok.encode("hi", add_bos=True, add_eos=True)
    assert tok.decode(ids, skip_special=False) == "<bos>hi<eos>"
    assert tok.decode([0, 0, *ids], skip_special=False) == "<pad><pad><bos>hi<eos>"
    assert tok.decode([0, 0, *ids]) == "hi"  # pad, bos, eos dropped by default


@pytest.mark.parametrize(
    ("add_bos", "add_eos", "expected_prefix", "expected_suffix"),
    [(False, False, [], []), (True, False, [2], []), (False, True, [], [3]),
     (True, True, [2], [3])],
)
def test_add_bos_eos(add_bos: bool, add_eos: bool, expected_prefix: list[int],
                     expected_suffix: list[int]) -> None:
    tok = CharTokenizer.from_text("abc")
    body = tok.encode("cab")
    assert tok.encode("cab", add_bos=add_bos, add_eos=add_eos) == (
        expected_prefix + body + expected_suffix)
    assert tok.encode("", add_bos=add_bos, add_eos=add_eos) == expected_prefix + expected_suffix


@pytest.mark.parametrize(
    "ids", [[-1], [99], [[4, 5]]], ids=["negative", "too-large", "two-dimensional"])
def test_decode_rejects_bad_ids(ids: list) -> None:
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError):
        tok.decode(ids)


# -- persistence --------------------------------------------------------------------------
def test_save_load_round_trip(tmp_path: Path) -> None:
    text = " ".join(TRICKY_TEXTS)
    tok = CharTokenizer.from_text(text)
    path = tmp_path / "sub" / "tokenizer.json"
    tok.save(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["type"] == "char"
    assert data["special_tokens"] == list(SPECIAL_TOKENS)
    for loaded in (CharTokenizer.load(path), load_tokenizer(path)):
        assert loaded.itos == tok.itos
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.encode("unseen ∑ chars") == tok.encode("unseen ∑ chars")
        assert loaded.decode(tok.encode(text)) == text
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("loader", [CharTokenizer.load, load_tokenizer])
def test_load_wrong_type_raises(tmp_path: Path, loader) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"type": "bpe", "version": 1, "chars": ["a"],
                                "special_tokens": list(SPECIAL_TOKENS)}), encoding="utf-8")
    with pytest.raises(ValueError, match="bpe"):
        loader(path)


def test_load_wrong_special_tokens_raises(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"type": "char", "chars": ["a"],
                                "special_tokens": ["<pad>", "<bos>"]}), encoding="utf-8")
    with pytest.raises(ValueError, match="special tokens"):
        CharTokenizer.load(path)


# -- vectorised encoder vs the naive loop, at scale ---------------------------------------
def test_encode_array_matches_naive_on_large_random_text() -> None:
    rng = random.Random(1234)
    alphabet = list("abcdefghij ABC\n.,日本語🎉é") + [chr(0x10000 + i) for i in range(5)]
    vocab_text = "".join(alphabet[:-6])  # some characters stay out of the vocabulary
    tok = CharTokenizer.from_text(vocab_text)
    text = "".join(rng.choices(alphabet, k=200_000))
    arr = tok.encode_array(text)
    assert arr.shape == (len(text),)
    assert arr.tolist() == naive_encode(tok, text)
    assert (arr == tok.unk_id).any() and (arr != tok.unk_id).any()
