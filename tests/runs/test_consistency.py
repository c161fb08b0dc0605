"""runs.consistency: a run folder's files must belong together, checked at every load.

Each case is a folder one file of which came from elsewhere (or was edited); each must be
refused by ``load_run`` — the one loader of generate, explore, convert, doctor, classify and
seq2seq — with a ``RunFolderError`` naming the file, the config field and both numbers,
before a model is allocated.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from handformer.config import ClassifierConfig, ModelConfig, Seq2SeqConfig
from handformer.data.classification import LabelVocab
from handformer.models.decoder_lm import DecoderLM
from handformer.models.encoder import EncoderClassifier
from handformer.models.seq2seq import EncoderDecoder
from handformer.runs import RunFolderError, load_run, save_run
from handformer.runs.consistency import build_skeleton, config_fields, vocab_fields
from handformer.tokenizers import CharTokenizer

TOK = CharTokenizer.from_text("abcdefgh ")  # 4 specials + 9 characters = 13 ids
BIGGER = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ")  # 31 ids
SHAPE = dict(vocab_size=TOK.vocab_size, d_model=16, n_heads=2, n_layers=1, max_len=12)
KINDS = ["lm", "classifier", "seq2seq"]


def saved(kind: str, run_dir: Path, **shape: object) -> Path:
    torch.manual_seed(0)
    cfg = ModelConfig(**{**SHAPE, **shape})
    labels = None
    if kind == "lm":
        model: torch.nn.Module = DecoderLM(cfg)
    elif kind == "classifier":
        model, labels = EncoderClassifier(ClassifierConfig(cfg, 3)), LabelVocab(["a", "b", "c"])
    else:
        model = EncoderDecoder(Seq2SeqConfig(cfg, cfg))
    save_run(run_dir, model, TOK, labels=labels)
    return run_dir


def edit_config(run_dir: Path, change: Callable[[dict], None]) -> None:
    path = run_dir / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


def refused(run_dir: Path, *needles: str) -> str:
    with pytest.raises(RunFolderError) as info:
        load_run(run_dir)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} missing from: {message}"
    return message


@pytest.mark.parametrize("kind", KINDS)
def test_a_tokenizer_larger_than_the_vocabulary_is_refused_with_both_numbers(
        kind: str, tmp_path: Path) -> None:
    run = saved(kind, tmp_path / "run")
    BIGGER.save(run / "tokenizer.json")
    field = {"lm": "vocab_size", "classifier": "encoder.vocab_size",
             "seq2seq": "encoder.vocab_size"}[kind]
    refused(run, str(run / "tokenizer.json"), "31 tokens", str(run / "config.json"),
            f"{field}=13")


@pytest.mark.parametrize("kind", KINDS)
def test_a_character_tokenizer_smaller_than_the_vocabulary_is_refused_with_both_numbers(
        kind: str, tmp_path: Path) -> None:
    """A character tokenizer's size is exact by construction: fewer ids than the embedding
    means another run's tokenizer, and sampled ids past it would decode to nothing."""
    run = saved(kind, tmp_path / "run", vocab_size=20)
    field = {"lm": "vocab_size", "classifier": "encoder.vocab_size",
             "seq2seq": "encoder.vocab_size"}[kind]
    refused(run, str(run / "tokenizer.json"), "13 tokens", str(run / "config.json"),
            f"{field}=20", "character tokenizer")


def test_a_hugging_face_tokenizer_smaller_than_a_padded_vocabulary_is_fine(
        tmp_path: Path) -> None:
    """Published models pad their vocabulary past the tokenizer (Qwen3: 151669 tokens,
    vocab_size 151936): every id the tokenizer makes still has an embedding."""
    from handformer.tokenizers import BPETokenizer

    bpe = BPETokenizer.train("abcdefgh " * 50, vocab_size=270)
    torch.manual_seed(0)
    run = tmp_path / "run"
    save_run(run, DecoderLM(ModelConfig(**{**SHAPE, "vocab_size": bpe.vocab_size + 16})), bpe)
    assert load_run(run).tokenizer.vocab_size == bpe.vocab_size


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8])
@pytest.mark.parametrize("kind", KINDS)
def test_integer_tensors_are_never_cast_into_float_weights(kind: str, dtype: torch.dtype,
                                                            tmp_path: Path) -> None:
    run = saved(kind, tmp_path / "run")
    tensors = load_file(run / "model.safetensors")
    name = sorted(n for n in tensors if n.endswith("ffn.fc_in.weight"))[0]
    tensors[name] = (tensors[name] * 100).to(dtype)
    save_file(tensors, run / "model.safetensors")
    refused(run, str(run / "model.safetensors"), repr(name), "floating-point weight")


def test_half_precision_weights_still_load(tmp_path: Path) -> None:
    run = saved("lm", tmp_path / "run")
    tensors = {n: t.to(torch.bfloat16) for n, t in load_file(run / "model.safetensors").items()}
    save_file(tensors, run / "model.safetensors")
    assert next(load_run(run).model.parameters()).dtype == torch.float32


@pytest.mark.parametrize(("change", "needles"), [
    (lambda c: c["model"].update(vocab_size=40), ["embed.token.weight", "(13, 16)", "(40, 16)",
                                                  "vocab_size=40"]),
    (lambda c: c["model"].update(d_model=32, n_heads=2), ["shape", "d_model=32"]),
    (lambda c: c["model"].update(n_layers=2), ["missing", "blocks.1.", "n_layers",
                                               "1 layer(s)", "2 layer(s)"]),
    (lambda c: c["model"].update(tie_weights=False), ["lm_head.weight", "tie_weights"]),
    (lambda c: c["model"].update(positional="sinusoidal"), ["unexpected",
                                                            "embed.positions.table.weight"]),
], ids=["vocab_size", "d_model", "n_layers", "tie_weights", "positional"])
def test_a_config_that_does_not_describe_the_weights_is_refused_by_field(
        change: Callable[[dict], None], needles: list[str], tmp_path: Path) -> None:
    run = saved("lm", tmp_path / "run")
    edit_config(run, change)
    refused(run, str(run / "model.safetensors"), str(run / "config.json"), *needles)


def test_separately_stored_tied_weights_are_refused(tmp_path: Path) -> None:
    run = saved("lm", tmp_path / "run")
    tensors = load_file(run / "model.safetensors")
    tensors["lm_head.weight"] = torch.randn_like(tensors["embed.token.weight"])
    save_file(tensors, run / "model.safetensors")
    refused(run, "lm_head.weight", "tie_weights")


@pytest.mark.parametrize(("change", "needles"), [
    (lambda c: c["model"].update(tie_weights="false"), ["ModelConfig.tie_weights", "'false'"]),
    (lambda c: c["model"].update(vocab_size=10**12), ["vocab_size", "sane limit"]),
    (lambda c: c["model"].update(rope_base=float("nan")), ["ModelConfig.rope_base", "nan"]),
    (lambda c: c["model"].pop("vocab_size"), ["missing", "vocab_size"]),
], ids=["bool-as-string", "absurd-size", "nan", "missing-field"])
def test_config_values_are_typed_and_bounded_at_load(change: Callable[[dict], None],
                                                     needles: list[str],
                                                     tmp_path: Path) -> None:
    run = saved("lm", tmp_path / "run")
    edit_config(run, change)
    refused(run, str(run / "config.json"), *needles)


def test_a_mismatched_config_is_refused_before_the_model_is_allocated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config asking for a 10-billion-parameter model is compared with the (small) file on
    the meta device: refused at once, no real tensor built."""
    run = saved("lm", tmp_path / "run")
    edit_config(run, lambda c: c["model"].update(vocab_size=2**20, d_model=8192, n_heads=64,
                                                 n_layers=64))
    built: list[str] = []
    real_init = DecoderLM.__init__

    def spy(self: DecoderLM, config: ModelConfig) -> None:
        real_init(self, config)
        built.append(next(self.parameters()).device.type)

    monkeypatch.setattr(DecoderLM, "__init__", spy)
    refused(run, "n_layers", "64 layer(s)")
    assert built == ["meta"]


def test_config_fields_and_vocab_fields_name_nested_configs() -> None:
    s2s = Seq2SeqConfig(ModelConfig(**SHAPE), ModelConfig(**{**SHAPE, "vocab_size": 20}))
    assert vocab_fields(s2s) == {"encoder.vocab_size": 13, "decoder.vocab_size": 20}
    fields = config_fields(ClassifierConfig(ModelConfig(**SHAPE), 3))
    assert fields["num_classes"] == 3 and fields["encoder.d_model"] == 16
    assert "encoder.tie_weights" not in fields  # booleans are not sizes
    skeleton = build_skeleton(lambda: DecoderLM(ModelConfig(**SHAPE)))
    assert {p.device.type for p in skeleton.parameters()} == {"meta"}
