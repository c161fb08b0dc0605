"""A run's tokenizer as Hugging Face files: ``AutoTokenizer`` gives handformer's ids for every
character, and the files read back into the same tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handformer.data.corpora import builtin_text
from handformer.interop.gpt2 import ConversionError
from handformer.interop.hf_tokenizer import (
    char_to_hf,
    hf_to_char,
    read_folder_tokenizer,
    write_folder_tokenizer,
)
from handformer.tokenizers import BPETokenizer, CharTokenizer

transformers = pytest.importorskip(
    "transformers", reason="the 'transformers' test extra is not installed "
    "(pip install -r requirements-dev.txt)")

# The built-in training text has newlines, spaces and non-ASCII (°, ß, –, “ …) but no tab:
# add one, and characters outside the Basic Multilingual Plane.
EXTRA = "\t\u00e9\u4e2d\U0001f600"
TEXT = builtin_text() + EXTRA


@pytest.fixture(scope="module")
def char_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[CharTokenizer, Path]:
    tok = CharTokenizer.from_text(TEXT)
    folder = tmp_path_factory.mktemp("char-tokenizer")
    write_folder_tokenizer(folder, tok, max_len=64)
    return tok, folder


def test_auto_tokenizer_round_trips_every_character_of_the_training_text(
        char_folder: tuple[CharTokenizer, Path]) -> None:
    tok, folder = char_folder
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    text = TEXT[:40_000] + "".join(tok.chars)  # a long stretch, then every character once
    ids = hf(text)["input_ids"]
    assert ids == tok.encode(text)  # the same ids, no BOS/EOS added
    assert hf.decode(ids, skip_special_tokens=True) == text
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (tok.bos_id, tok.eos_id,
                                                                   tok.pad_id)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([*"ab \n\t<>éso", "\u4e2d", "\U0001f600", "Ω", "<eos>", "<unk>"]),
                max_size=40).map("".join))
def test_unknown_characters_and_special_names_behave_as_in_char_tokenizer(text: str) -> None:
    """Ω is not in the vocabulary: ``<unk>`` on encoding, U+FFFD on decoding, in both; a text
    spelling "<eos>" or "<unk>" is those characters, not the special token."""
    tok = CharTokenizer.from_text("ab \n\t<>éso\u4e2d\U0001f600eunkEOS")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=char_to_hf(tok),
                                              split_special_tokens=True,
                                              clean_up_tokenization_spaces=False)
    ids = hf(text)["input_ids"]
    assert ids == tok.encode(text)
    assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids)


def test_the_files_read_back_as_the_same_char_tokenizer(
        char_folder: tuple[CharTokenizer, Path]) -> None:
    tok, folder = char_folder
    back = read_folder_tokenizer(folder)
    assert isinstance(back, CharTokenizer) and back.chars == tok.chars
    assert hf_to_char(json.loads(char_to_hf(tok).to_str())).chars == tok.chars
    config = json.loads((folder / "generation_config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"]) == (tok.eos_id, tok.pad_id)


def test_a_bpe_tokenizer_gives_the_same_ids_through_auto_tokenizer(tmp_path: Path) -> None:
    tok = BPETokenizer.train(builtin_text()[:20_000], vocab_size=300)
    write_folder_tokenizer(tmp_path, tok, max_len=64)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "def main():\n    return 'é' + \"x\"  # ü\t"
    assert hf(text)["input_ids"] == tok.encode(text)
    assert hf.decode(tok.encode(text)) == text
    assert isinstance(read_folder_tokenizer(tmp_path), BPETokenizer)


def test_another_tool_s_tokenizer_files_get_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(ConversionError, match=r"no tokenizer\.json.*vocab\.json, merges\.txt"):
        read_folder_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "vocab": {"a": 0}}')
    with pytest.raises(ConversionError, match=r"tokenizer\.json: unknown tokenizer format"):
        read_folder_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "Spiral"}}')
    with pytest.raises(ConversionError, match=r"tokenizer\.json: not a loadable Hugging Face"):
        read_folder_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{oops")
    with pytest.raises(ConversionError, match=r"tokenizer\.json: cannot read the tokenizer"):
        read_folder_tokenizer(tmp_path)
