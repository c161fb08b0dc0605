"""handformer.runs: one save_run/load_run for every kind of run folder, one error class."""

from __future__ import annotations

import json
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
from handformer.runs.metrics import read_loss_curve
from handformer.tokenizers import CharTokenizer

TOK = CharTokenizer.from_text("abcdefgh ")
SHAPE = dict(vocab_size=TOK.vocab_size, d_model=16, n_heads=2, n_layers=1, max_len=12)


def make(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "lm":
        return DecoderLM(ModelConfig(**SHAPE))
    if kind == "classifier":
        return EncoderClassifier(ClassifierConfig(ModelConfig(**SHAPE), num_classes=3))
    return EncoderDecoder(Seq2SeqConfig(ModelConfig(**SHAPE), ModelConfig(**SHAPE)))


def saved(kind: str, run_dir: Path) -> torch.nn.Module:
    model = make(kind)
    labels = LabelVocab(["a", "b", "c"]) if kind == "classifier" else None
    save_run(run_dir, model, TOK, labels=labels, extra={"note": kind})
    return model


@pytest.mark.parametrize("kind", ["lm", "classifier", "seq2seq"])
def test_every_kind_round_trips_every_tensor(kind: str, tmp_path: Path) -> None:
    model = saved(kind, tmp_path / "run")
    run = load_run(tmp_path / "run")
    assert run.kind == kind and type(run.model) is type(model)
    assert not run.model.training
    assert run.config["note"] == kind
    assert run.tokenizer.to_dict() == TOK.to_dict()
    assert (run.labels is not None) == (kind == "classifier")
    want, got = model.state_dict(), run.model.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


@pytest.mark.parametrize(("kind", "wanted"), [("lm", "classifier"), ("classifier", "lm"),
                                              ("seq2seq", ("lm", "classifier"))])
def test_a_folder_of_another_kind_is_refused_by_name(kind: str, wanted: object,
                                                     tmp_path: Path) -> None:
    saved(kind, tmp_path / "run")
    with pytest.raises(RunFolderError, match=f"holds a {kind} run"):
        load_run(tmp_path / "run", kind=wanted)  # type: ignore[arg-type]


def test_missing_and_damaged_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(RunFolderError, match="not found"):
        load_run(tmp_path / "nowhere")
    saved("lm", tmp_path / "run")
    (tmp_path / "run" / "tokenizer.json").unlink()
    with pytest.raises(RunFolderError, match=r"missing \['tokenizer.json'\]"):
        load_run(tmp_path / "run")
    saved("lm", tmp_path / "run")
    (tmp_path / "run" / "config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(RunFolderError, match=r"config\.json: cannot read JSON"):
        load_run(tmp_path / "run")
    (tmp_path / "run" / "config.json").write_text('{"other": 1}', encoding="utf-8")
    with pytest.raises(RunFolderError, match="describes no handformer model"):
        load_run(tmp_path / "run")
    (tmp_path / "run" / "config.json").write_text('{"model": {"d_model": 16}}', "utf-8")
    with pytest.raises(RunFolderError, match="cannot rebuild the model"):
        load_run(tmp_path / "run")


def test_weights_must_fit_the_config_exactly(tmp_path: Path) -> None:
    saved("lm", tmp_path / "run")
    weights = tmp_path / "run" / "model.safetensors"
    tensors = load_file(weights)
    name = next(n for n in tensors if n.endswith("final_norm.weight"))
    del tensors[name]
    save_file(tensors, weights)
    with pytest.raises(RunFolderError, match="cannot load weights"):
        load_run(tmp_path / "run")


def test_classifier_labels_must_match_its_classes(tmp_path: Path) -> None:
    saved("classifier", tmp_path / "run")
    LabelVocab(["a", "b"]).save(tmp_path / "run" / "labels.json")
    with pytest.raises(RunFolderError, match="2 labels but the model has 3 classes"):
        load_run(tmp_path / "run")
    (tmp_path / "run" / "labels.json").unlink()
    with pytest.raises(RunFolderError, match=r"missing \['labels.json'\]"):
        load_run(tmp_path / "run")


def test_labels_go_with_classifiers_only(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="labels are saved with"):
        save_run(tmp_path / "run", make("lm"), TOK, labels=LabelVocab(["a", "b"]))
    with pytest.raises(TypeError, match="DecoderLM, EncoderClassifier, EncoderDecoder or Encoder"):
        save_run(tmp_path / "run", torch.nn.Linear(2, 2), TOK)


def test_loss_curve_skips_torn_and_foreign_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [{"kind": "train", "step": 1, "loss": 2.5}, {"kind": "eval", "step": 1,
             "val_loss": 2.4}, {"kind": "train", "step": 2, "loss": None}, ["x"]]
    path.write_text("\n".join(json.dumps(x) for x in lines) + '\n{"kind": "tr', "utf-8")
    curve = read_loss_curve(path)
    assert curve.train == [(1, 2.5)] and curve.val == [(1, 2.4)]
    assert curve.skipped_lines == 2


@pytest.mark.parametrize("positional", ["learned", "rope", "alibi"])
def test_loading_draws_no_random_start_and_keeps_computed_buffers_and_ties(
        positional: str, tmp_path: Path) -> None:
    """``load_run`` builds under ``skip_init``: the generator is untouched, yet the buffers
    computed from the config, the tied head and every output are those of the saved model."""
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(**SHAPE, positional=positional)).eval()
    save_run(tmp_path / "run", model, TOK)
    before = torch.get_rng_state()
    loaded = load_run(tmp_path / "run").model
    assert torch.equal(torch.get_rng_state(), before)
    want, got = dict(model.named_buffers()), dict(loaded.named_buffers())
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert loaded.lm_head.weight is loaded.embed.token.weight
    ids = torch.randint(0, TOK.vocab_size, (2, 7))  # (B, T)
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))
