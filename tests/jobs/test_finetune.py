"""Starting from pretrained weights (``finetune_lm``, ``finetune_classifier``): a LoRA run
stores only its adapters and records its base; every loader rebuilds it from that base and
refuses a base whose weights changed; resuming one is exact; merging gives a plain run with
the same outputs; the frozen base never moves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from handformer.config import ModelConfig
from handformer.data.classification import DatasetError
from handformer.jobs.classify import (
    ClassifyData,
    LoadedClassifier,
    finetune_classifier,
    predict_texts,
)
from handformer.jobs.lm import finetune_lm, resume_lm, train_lm
from handformer.models.encoder import Encoder
from handformer.nn.lora import LoRAConfig, LoRAError
from handformer.runs import RunFolderError, load_run, save_run
from handformer.runs.base import weights_sha256
from handformer.runs.merged import write_merged_run
from handformer.tokenizers import CharTokenizer
from handformer.train.checkpoint import list_checkpoints
from tests.train.helpers import toy_text

TEXT = toy_text(400)
MORE = toy_text(300, seed=1)
STEPS = {"max_steps": 6, "eval_interval": 3, "checkpoint_interval": 3, "log_interval": 1,
         "batch_size": 4, "device": "cpu", "loss_curve": False}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("base")
    train_lm(TEXT, out_dir=root / "lm", preset="tiny", progress=False, sample_tokens=1,
             train_overrides={**STEPS, "max_steps": 2})
    return root / "lm"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(".handformer")}


def _finetune(base: Path, out: Path, **kw: Any) -> Any:
    return finetune_lm(base, MORE, out_dir=out, preset="tiny", progress=False,
                       sample_tokens=1, train_overrides=STEPS, **kw)


def test_a_lora_run_stores_only_adapters_and_loads_through_its_base(base: Path,
                                                                    tmp_path: Path) -> None:
    before = _snapshot(base)
    run = _finetune(base, tmp_path / "ft", lora=LoRAConfig(r=2, alpha=4, targets=("q", "v")))
    stored = load_file(tmp_path / "ft" / "model.safetensors")
    assert stored and all(".adapters." in k for k in stored)
    config = json.loads((tmp_path / "ft" / "config.json").read_text())
    assert config["base"]["sha256"] == weights_sha256(base)
    assert config["lora"]["r"] == 2 and config["lora"]["targets"] == ["q", "v"]
    assert _snapshot(base) == before  # the base was only read
    loaded = load_run(tmp_path / "ft", kind="lm")
    ids = torch.randint(0, run.tokenizer.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids), run.model.eval()(ids), rtol=0, atol=0)
        plain = load_run(base, kind="lm").model
        assert not torch.allclose(loaded.model(ids), plain(ids))  # the adapters trained
    frozen = {k: v for k, v in loaded.model.state_dict().items() if ".adapters." not in k}
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in frozen.items())
    assert run.model.num_parameters() > 0
    summary = json.loads((tmp_path / "ft" / "summary.json").read_text())
    assert summary["trainable_parameters"] == sum(v.numel() for v in stored.values())


def test_merged_run_stands_alone_with_the_same_outputs(base: Path, tmp_path: Path) -> None:
    _finetune(base, tmp_path / "ft", lora=LoRAConfig(r=2, targets=("all-linear",)))
    write_merged_run(tmp_path / "ft", tmp_path / "merged")
    copy = tmp_path / "moved-base"
    shutil.move(str(base), copy)  # the merged run needs no base
    try:
        merged = load_run(tmp_path / "merged", kind="lm")
        assert "lora" not in merged.config
        with pytest.raises(RunFolderError, match="is gone or is not a run folder"):
            load_run(tmp_path / "ft")
    finally:
        shutil.move(str(copy), base)
    lora = load_run(tmp_path / "ft", kind="lm")
    ids = torch.randint(0, lora.tokenizer.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(merged.model(ids), lora.model(ids), rtol=0, atol=1e-5)
    with pytest.raises(RunFolderError, match="no LoRA adapters to merge"):
        write_merged_run(tmp_path / "merged", tmp_path / "again")


def test_a_changed_base_is_refused_in_one_line_and_nothing_changes(base: Path,
                                                                 tmp_path: Path) -> None:
    copy = tmp_path / "base"
    shutil.copytree(base, copy)
    _finetune(copy, tmp_path / "ft", lora=LoRAConfig(r=2))
    weights = load_file(copy / "model.safetensors")
    weights["final_norm.weight"] = weights["final_norm.weight"] + 1.0
    from safetensors.torch import save_file

    save_file(weights, str(copy / "model.safetensors"))
    before = _snapshot(tmp_path / "ft")
    with pytest.raises(RunFolderError, match="changed since the run started") as err:
        load_run(tmp_path / "ft")
    assert "\n" not in str(err.value)
    with pytest.raises(RunFolderError, match="changed since the run started"):
        resume_lm(tmp_path / "ft", max_steps=8, progress=False, sample_tokens=1)
    assert _snapshot(tmp_path / "ft") == before


def test_resuming_a_lora_run_is_exact(base: Path, tmp_path: Path) -> None:
    lora = LoRAConfig(r=2, dropout=0.1, targets=("q", "v", "up"))
    _finetune(base, tmp_path / "straight", lora=lora)
    shutil.copytree(tmp_path / "straight", tmp_path / "cut")
    newest = list_checkpoints(tmp_path / "cut" / "checkpoints")[-1]
    assert newest.step == 6
    shutil.rmtree(newest.path)  # as if the run had died after its step-3 checkpoint
    (tmp_path / "cut" / "checkpoints" / "best.json").unlink(missing_ok=True)
    resumed = resume_lm(tmp_path / "cut", text=MORE, progress=False, sample_tokens=1)
    assert resumed.resumed_from == 3
    a = load_file(tmp_path / "straight" / "model.safetensors")
    b = load_file(tmp_path / "cut" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_full_fine_tuning_records_its_base_and_stores_every_weight(base: Path,
                                                                 tmp_path: Path) -> None:
    _finetune(base, tmp_path / "full")
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    assert config["base"]["path"] == str(base.resolve()) and "lora" not in config
    stored = load_file(tmp_path / "full" / "model.safetensors")
    assert "final_norm.weight" in stored and not any(".adapters." in k for k in stored)


@pytest.mark.parametrize(("kwargs", "error", "pattern"), [
    ({"lora": LoRAConfig(r=0)}, LoRAError, "positive integer; got 0"),
    ({"lora": LoRAConfig(r=10_000)}, LoRAError, "exceeds target 'q'"),
    ({"lora": LoRAConfig(r=2, targets=("gate",))}, LoRAError, r"match no layer.*it has q"),
])
def test_bad_lora_requests_write_nothing(base: Path, tmp_path: Path, kwargs: dict[str, Any],
                                         error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        _finetune(base, tmp_path / "ft", **kwargs)
    assert not (tmp_path / "ft").exists()


def test_text_with_characters_the_tokenizer_lacks_is_refused_by_name(base: Path,
                                                                     tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"2 character\(s\) the base's tokenizer lacks \('QZ'\)"):
        finetune_lm(base, MORE + "QZ", out_dir=tmp_path / "ft", preset="tiny", progress=False)
    assert not (tmp_path / "ft").exists()
    with pytest.raises(ValueError, match="is the base run itself"):
        finetune_lm(base, MORE, out_dir=base, preset="tiny", progress=False)


# -- classifiers -------------------------------------------------------------------------
def _data(labels: tuple[str, ...] = ("cat", "dog")) -> ClassifyData:
    texts = [f"the {w} sees a {w}" for w in ("cat", "dog") for _ in range(12)]
    tags = [labels[0] if "cat" in t else labels[-1] for t in texts]
    return ClassifyData(texts[::2], tags[::2], texts[1::2], tags[1::2], source="toy rows")


@pytest.fixture(scope="module")
def encoder_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny pretrained-style encoder run (the kind ``convert --from hf`` writes for BERT)."""
    folder = tmp_path_factory.mktemp("enc") / "encoder"
    tokenizer = CharTokenizer.from_text(TEXT)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_heads=4, n_layers=2,
                      max_len=32, norm="post", positional="learned")
    save_run(folder, Encoder(cfg), tokenizer)
    return folder


@pytest.mark.parametrize("from_lm", [False, True])
def test_a_lora_classifier_stores_adapters_and_head_and_predicts_the_same_after_loading(
        base: Path, encoder_run: Path, tmp_path: Path, from_lm: bool) -> None:
    source = base if from_lm else encoder_run
    pretrained = load_run(source)
    run = finetune_classifier(_data(), pretrained.model, pretrained.tokenizer, base_dir=source,
                              base_kind=pretrained.kind, out_dir=tmp_path / "cls",
                              lora=LoRAConfig(r=2, targets=("attn",)), progress=False,
                              train_overrides={"max_steps": 3, "batch_size": 4,
                                               "device": "cpu"})
    assert run.model.config.causal is from_lm
    assert run.model.config.pooling == ("last" if from_lm else "mean")
    stored = load_file(tmp_path / "cls" / "model.safetensors")
    assert {k for k in stored if not k.startswith("head.")} == {
        k for k in stored if ".adapters." in k}
    assert {"head.weight", "head.bias"} <= stored.keys()
    loaded = LoadedClassifier.from_run(load_run(tmp_path / "cls", kind="classifier"))
    texts = ["the cat sees a dog", "a dog"]
    again = predict_texts(loaded, texts)
    run.model.eval()
    original = predict_texts(LoadedClassifier(run.model, run.tokenizer, run.labels, {}), texts)
    assert [(p.label, round(p.confidence, 6)) for p in again] == [
        (p.label, round(p.confidence, 6)) for p in original]


def test_a_classifier_needs_two_classes_and_known_characters(encoder_run: Path,
                                                             tmp_path: Path) -> None:
    pretrained = load_run(encoder_run)
    kw = dict(base_dir=encoder_run, base_kind="encoder", out_dir=tmp_path / "cls",
              progress=False)
    with pytest.raises(DatasetError, match="has one class only"):
        finetune_classifier(_data(("same",)), pretrained.model, pretrained.tokenizer, **kw)
    data = _data()
    data.train_texts[0] = "QQQ zebra"
    with pytest.raises(DatasetError, match="lacks"):
        finetune_classifier(data, pretrained.model, pretrained.tokenizer, **kw)
    assert not (tmp_path / "cls").exists()
