"""The classification job, wired end to end: labelled texts → EncoderClassifier → run folder.

``handformer classify train`` and ``classify predict`` are thin shells around
``train_classifier`` and ``load_classifier_run`` + ``predict_texts``. Evaluation reports
accuracy, macro-F1 (the mean of per-class F1, so a rare class counts as much as a common
one) and a confusion matrix (rows: true class, columns: predicted), also drawn as a PNG.

    RUN_DIR/
      model.safetensors   weights only
      config.json         {"classifier": ClassifierConfig, "train": TrainConfig, "data": …}
      tokenizer.json      the character vocabulary
      labels.json         the label vocabulary, class id order
      metrics.jsonl       one JSON line per logged step and per evaluation
      summary.json        final validation scores, baselines, time
      confusion.png       the final confusion matrix (when matplotlib is installed)

Shape legend: ``B`` batch, ``T`` sequence, ``K`` classes, ``N`` examples.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from handformer.config import CLASSIFY_PRESET, ClassifierConfig, ModelConfig, TrainConfig
from handformer.data import Batch
from handformer.data.classification import (
    ClassificationBatches,
    DatasetError,
    DataWarning,
    LabelVocab,
    encode_texts,
    read_examples,
)
from handformer.data.tasks import BRACKETS_CHANCE, brackets_examples
from handformer.loss import classification_loss
from handformer.models.budget import Estimate, check_fits, check_training
from handformer.models.decoder_lm import DecoderLM
from handformer.models.encoder import EncoderClassifier
from handformer.nn.lora import LoRAConfig, apply_lora, trainable_parameters
from handformer.runs import (
    CLASSIFIER_FOLDER,
    Run,
    check_destination,
    folder_path,
    load_run,
    save_run,
    writing_folder,
)
from handformer.runs.base import BASE_KEY, LORA_KEY, base_record, copy_base_weights
from handformer.runs.files import METRICS, SUMMARY, write_json
from handformer.runs.guard import CONFUSION
from handformer.tokenizers import CharTokenizer, Tokenizer
from handformer.train.callbacks import MetricsWriter
from handformer.train.trainer import Trainer, TrainResult, pick_device

__all__ = [
    "ClassifierRun",
    "ClassifyData",
    "LoadedClassifier",
    "Prediction",
    "builtin_brackets_data",
    "confusion_matrix",
    "encode_for",
    "evaluate_classifier",
    "file_data",
    "finetune_classifier",
    "load_classifier_run",
    "plot_confusion",
    "predict_texts",
    "scores_from_confusion",
    "train_classifier",
]

CONFUSION_PNG = CONFUSION

# -- data -------------------------------------------------------------------------------
@dataclass
class ClassifyData:
    """Texts and labels to train and validate on, and where they came from."""

    train_texts: list[str]
    train_labels: list[str]
    val_texts: list[str]
    val_labels: list[str]
    source: str
    chance: float | None = None  # the stated chance level, when the task defines one


def builtin_brackets_data(
    *, seq_len: int = 64, n_train: int = 20_000, n_val: int = 1_000, seed: int = 0
) -> ClassifyData:
    """The built-in task (``tasks.brackets_examples``): strings of even length in
    [seq_len/2, seq_len]; the validation strings never occur in the training set."""
    lo = max(6, seq_len // 2)
    # Each string lives as text and as int64 ids (plus a list of Python ints while encoding).
    check_fits(Estimate("the built-in task's texts", {
        f"{n_train + n_val:,} strings of up to {seq_len:,} characters":
            (n_train + n_val) * seq_len * 24}, hint="use a smaller --seq-len"))
    val_texts, val_labels = brackets_examples(n_val, min_len=lo, max_len=seq_len,
                                              seed=seed + 1)
    train_texts, train_labels = brackets_examples(n_train, min_len=lo, max_len=seq_len,
                                                  seed=seed, exclude=set(val_texts))
    return ClassifyData(train_texts, train_labels, val_texts, val_labels,
                        source=f"built-in balanced-brackets task, lengths {lo}..{seq_len}",
                        chance=BRACKETS_CHANCE)


def file_data(
    path: str | Path, *, val_path: str | Path | None = None, text_col: str = "text",
    label_col: str = "label", val_fraction: float = 0.1, seed: int = 0,
) -> ClassifyData:
    """Read a labelled file; hold out ``val_fraction`` of it (seeded) unless ``val_path``."""
    texts, labels = read_examples(path, text_col=text_col, label_col=label_col)
    assert labels is not None
    LabelVocab.from_labels(labels, source=str(path))  # one class only: fail before splitting
    if val_path is not None:
        val_texts, val_labels = read_examples(val_path, text_col=text_col, label_col=label_col)
        assert val_labels is not None
        return ClassifyData(texts, labels, val_texts, val_labels, source=str(path))
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1); got {val_fraction}")
    n_val = max(1, round(len(texts) * val_fraction))
    if len(texts) - n_val < 2:
        raise DatasetError(f"{path} has {len(texts)} usable rows: too few to hold out "
                           f"{n_val} for validation and still train; add rows or pass --val")
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist()
    val, train = order[:n_val], order[n_val:]
    return ClassifyData([texts[i] for i in train], [labels[i] for i in train],
                        [texts[i] for i in val], [labels[i] for i in val], source=str(path))


# -- metrics ----------------------------------------------------------------------------
def confusion_matrix(y_true: Tensor, y_pred: Tensor, num_classes: int) -> Tensor:
    """(N,), (N,) class ids → (K, K) counts; row = true class, column = predicted."""
    flat = y_true.long() * num_classes + y_pred.long()  # (N,)
    counts = torch.bincount(flat, minlength=num_classes * num_classes)  # (K·K,)
    return counts.view(num_classes, num_classes)  # (K, K)


def scores_from_confusion(cm: Tensor) -> dict[str, float]:
    """Accuracy and macro-F1. A class absent from both truth and predictions is left out
    of the macro average (its F1 is undefined); one predicted but never true scores 0."""
    cm = cm.double()
    tp = cm.diag()  # (K,)
    predicted, actual = cm.sum(dim=0), cm.sum(dim=1)  # (K,), (K,)
    present = (predicted + actual) > 0
    f1 = 2 * tp / (predicted + actual).clamp(min=1)  # (K,) = 2PR/(P+R) in counts
    total = float(cm.sum())
    return {"accuracy": float(tp.sum()) / max(total, 1.0),
            "macro_f1": float(f1[present].mean()) if bool(present.any()) else 0.0}


@torch.no_grad()
def _logits_and_targets(model: EncoderClassifier, batches: Sequence[Batch]
                        ) -> tuple[Tensor, Tensor]:
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    logits, targets = [], []
    for batch in batches:
        batch = batch.to(device)
        logits.append(model(batch.ids, batch.padding_mask).float().cpu())  # (B, K)
        targets.append(batch.targets.cpu())  # (B,)
    model.train(was_training)
    return torch.cat(logits), torch.cat(targets)  # (N, K), (N,)


def evaluate_classifier(model: EncoderClassifier, batches: Sequence[Batch]) -> dict[str, Any]:
    """Accuracy, macro-F1 and the confusion matrix (as nested lists) over ``batches``."""
    logits, targets = _logits_and_targets(model, batches)
    cm = confusion_matrix(targets, logits.argmax(dim=-1), model.config.num_classes)
    return {**scores_from_confusion(cm), "confusion": cm.tolist(), "n": len(targets)}


def plot_confusion(cm: Sequence[Sequence[int]], labels: Sequence[str], path: Path, *,
                   title: str = "") -> Path | None:
    """Draw the confusion matrix as a PNG; ``None`` (with a warning) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed: confusion.png not written "
                      "(the matrix is in summary.json)", stacklevel=2)
        return None
    k = len(labels)
    fig, ax = plt.subplots(figsize=(max(5.0, 3.0 + 0.6 * k), max(4.5, 2.5 + 0.6 * k)))
    image = ax.imshow(cm, cmap="Blues")
    top = max((max(row) for row in cm), default=0)
    for i in range(k):
        for j in range(k):
            ax.text(j, i, str(cm[i][j]), ha="center", va="center",
                    color="white" if cm[i][j] > top / 2 else "black")
    ax.set_xticks(range(k), labels, rotation=45, ha="right")
    ax.set_yticks(range(k), labels)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# -- training ---------------------------------------------------------------------------
class ClassifierEvalLog:
    """Trainer callback: validation accuracy / macro-F1 at every evaluation, and every log
    and evaluation line appended to ``metrics.jsonl`` (when a path is given)."""

    def __init__(self, model: EncoderClassifier, batches: Sequence[Batch],
                 path: Path | None = None) -> None:
        self.model = model
        self.batches = list(batches)
        self.log = None if path is None else MetricsWriter(path)
        self.history: list[dict[str, Any]] = []
        self.train: list[dict[str, Any]] = []

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        self.train.append(dict(metrics))
        if self.log is not None:
            self.log.write("train", metrics)

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        report = evaluate_classifier(self.model, self.batches)
        entry = {**metrics, "step": step, "val_accuracy": report["accuracy"],
                 "val_macro_f1": report["macro_f1"]}
        self.history.append(entry)
        if self.log is not None:
            self.log.write("eval", entry)


@dataclass
class ClassifierRun:
    run_dir: Path | None
    model: EncoderClassifier
    tokenizer: CharTokenizer
    labels: LabelVocab
    config: ClassifierConfig
    train_config: TrainConfig
    result: TrainResult
    report: dict[str, Any]
    summary: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)


def train_classifier(
    data: ClassifyData,
    *,
    out_dir: str | Path | None,
    max_len: int,
    model_overrides: dict[str, Any] | None = None,
    train_overrides: dict[str, Any] | None = None,
    pooling: str = "cls",
    bucket: bool = True,
    progress: bool = True,
    overwrite: bool = False,
) -> ClassifierRun:
    """Train an ``EncoderClassifier`` on ``data``; write a run folder unless ``out_dir``
    is ``None``. Texts longer than ``max_len`` tokens (``<bos>`` included) are truncated.

    ``out_dir`` must be new, empty or a classifier run (replaced); anything else is refused
    with a ``RunFolderError`` before training unless ``overwrite`` (``runs.writing_folder``:
    even then only handformer's own files are removed). It is locked while the job writes."""
    run_dir = None if out_dir is None else folder_path(out_dir)
    if run_dir is not None:
        check_destination(run_dir, CLASSIFIER_FOLDER, overwrite=overwrite)
    tokenizer = CharTokenizer.from_text("".join(data.train_texts))
    labels = LabelVocab.from_labels(data.train_labels, source="the training data")
    train_ids = encode_texts(data.train_texts, tokenizer, max_len, source="training data")
    val_ids = encode_texts(data.val_texts, tokenizer, max_len, source="validation data")

    train_cfg = TrainConfig.from_dict({**CLASSIFY_PRESET.train, "block_size": max_len,
                                       **(train_overrides or {})})
    model_cfg = ModelConfig.from_dict({**CLASSIFY_PRESET.model, **(model_overrides or {}),
                                       "vocab_size": tokenizer.vocab_size, "max_len": max_len})
    config = ClassifierConfig(model_cfg, num_classes=len(labels), pooling=pooling)
    _check_fits(config, train_cfg, train_ids, val_ids)
    torch.manual_seed(train_cfg.seed)
    model = EncoderClassifier(config)
    return _fit(data, model, tokenizer, labels, train_ids, val_ids, train_cfg, run_dir,
                bucket=bucket, progress=progress, overwrite=overwrite, max_len=max_len)


def _check_fits(config: ClassifierConfig, train_cfg: TrainConfig, train_ids: list[list[int]],
                val_ids: list[list[int]]) -> None:
    # Batches are padded to their longest text, so the longest text (not max_len) sizes them.
    longest = max((len(ids) for ids in (*train_ids, *val_ids)), default=1)
    check_training(config, train_cfg.batch_size, longest, pick_device(train_cfg.device),
                   hint="use a smaller --batch-size or --max-len, or a smaller model "
                        "(--d-model, --n-layers)")


def _fit(data: ClassifyData, model: EncoderClassifier, tokenizer: Tokenizer, labels: LabelVocab,
         train_ids: list[list[int]], val_ids: list[list[int]], train_cfg: TrainConfig,
         run_dir: Path | None, *, bucket: bool, progress: bool, overwrite: bool, max_len: int,
         start: dict[str, Any] | None = None) -> ClassifierRun:
    """Train ``model`` (all of it, or what LoRA left trainable), evaluate it and write the
    run folder; ``start`` is what a fine-tuned run records of its base (``runs.base``)."""
    train_y = labels.encode(data.train_labels, source="the training data")
    val_y = labels.encode(data.val_labels, source="the validation data")
    train_batches = ClassificationBatches(train_ids, train_y, train_cfg.batch_size,
                                          bucket=bucket, pad_id=tokenizer.pad_id)
    val_batches = ClassificationBatches(val_ids, val_y, train_cfg.batch_size, bucket=True,
                                        pad_id=tokenizer.pad_id).fixed_batches()
    with ExitStack() as held:
        if run_dir is not None:  # claimed and locked until the run folder is complete
            held.enter_context(writing_folder(run_dir, CLASSIFIER_FOLDER, overwrite=overwrite))
        evaluator = ClassifierEvalLog(model, val_batches,
                                      None if run_dir is None else run_dir / METRICS)
        trainer = Trainer(model, train_cfg, train_batch=train_batches, val_batches=val_batches,
                          loss_fn=classification_loss, callbacks=[evaluator], progress=progress)
        start_time = time.perf_counter()
        result = trainer.fit()
        report = evaluate_classifier(model, val_batches)
        counts = torch.bincount(torch.tensor(val_y), minlength=len(labels))
        summary = {
            "source": data.source,
            "labels": labels.labels,
            "num_train": len(train_ids),
            "num_val": len(val_ids),
            "val_accuracy": report["accuracy"],
            "val_macro_f1": report["macro_f1"],
            "confusion": report["confusion"],
            "chance": data.chance if data.chance is not None else 1.0 / len(labels),
            "majority_baseline": float(counts.max()) / max(len(val_y), 1),
            "seconds": time.perf_counter() - start_time,
            "median_step_ms": result.median_step_ms,
            "parameters": model.num_parameters(),
            "trainable_parameters": trainable_parameters(model),
            "max_len": max_len,
        }
        if run_dir is not None:
            save_run(run_dir, model, tokenizer, train_cfg, labels=labels,
                     extra={"summary": summary, **(start or {})})
            write_json(run_dir / SUMMARY, summary)
            plot_confusion(report["confusion"], labels.labels, run_dir / CONFUSION_PNG,
                           title=f"validation ({len(val_y)} examples)\naccuracy "
                                 f"{report['accuracy']:.3f}, macro-F1 {report['macro_f1']:.3f}")
        return ClassifierRun(run_dir, model, tokenizer, labels, model.config, train_cfg,  # type: ignore[arg-type]
                             result, report, summary, evaluator.history)


# -- starting from a pretrained model ----------------------------------------------------
def encode_for(tokenizer: Tokenizer, texts: Sequence[str], max_len: int, *,
               source: str) -> list[list[int]]:
    """Texts as a pretrained model's tokenizer writes them: a Hugging Face tokenizer with its
    own template (BERT's [CLS] … [SEP]), handformer's character tokenizer with ``<bos>``;
    characters a character tokenizer lacks are refused by name (never mapped to ``<unk>``)."""
    if isinstance(tokenizer, CharTokenizer):
        unknown = sorted(set("".join(texts)) - set(tokenizer.stoi))
        if unknown:
            raise DatasetError(f"{source} has {len(unknown)} character(s) the base's tokenizer "
                               f"lacks ({''.join(unknown[:20])!r}); a character tokenizer is "
                               "fixed with its model: give texts made of its characters")
        return encode_texts(texts, tokenizer, max_len, source=source)
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2; got {max_len}")
    encoded = [tokenizer.encode(t, add_special_tokens=True) for t in texts]  # type: ignore[call-arg]
    long = [len(ids) for ids in encoded if len(ids) > max_len]
    if long:
        warnings.warn(f"{source}: {len(long)} of {len(encoded)} texts are longer than "
                      f"max_len={max_len} tokens and were truncated; the longest has "
                      f"{max(long)} tokens", DataWarning, stacklevel=2)
    return [ids[:max_len] for ids in encoded]


def finetune_classifier(
    data: ClassifyData,
    base_model: torch.nn.Module,
    tokenizer: Tokenizer,
    *,
    base_dir: str | Path,
    base_kind: str,
    out_dir: str | Path | None,
    max_len: int | None = None,
    lora: LoRAConfig | None = None,
    pooling: str | None = None,
    train_overrides: dict[str, Any] | None = None,
    bucket: bool = True,
    progress: bool = True,
    overwrite: bool = False,
) -> ClassifierRun:
    """A classifier whose trunk starts as ``base_model``'s — an encoder (MiniLM), another
    classifier's encoder, or a decoder LM's body run causally with last-token pooling — and a
    new head; every weight trains, or (``lora``) only the adapters and the head, which are
    then all the run folder stores besides the record of its base (``base_dir``)."""
    run_dir = None if out_dir is None else folder_path(out_dir)
    if run_dir is not None:
        base = Path(base_dir)
        if run_dir.exists() and base.exists() and run_dir.resolve() == base.resolve():
            raise ValueError(f"--out {run_dir} is the base itself; give the classifier its own "
                             "folder (the base must stay as it is)")
        check_destination(run_dir, CLASSIFIER_FOLDER, overwrite=overwrite)
    if lora is not None and (run_dir is not None and base_kind not in ("lm", "classifier",
                                                                       "encoder")):
        raise ValueError(f"--lora stores only the adapters and reloads {base_dir} at every "
                         "load, so the base must be a handformer run folder; convert it first "
                         f"(handformer convert --from hf {base_dir} DIR) and start from DIR")
    trunk = base_model.encoder if isinstance(base_model, EncoderClassifier) else base_model
    causal = isinstance(base_model, DecoderLM) or bool(getattr(trunk, "causal", False))
    pooling = pooling or ("last" if causal else "mean")
    trunk_cfg: ModelConfig = trunk.config  # type: ignore[assignment]
    max_len = min(max_len or 256, trunk_cfg.max_len)
    labels = LabelVocab.from_labels(data.train_labels, source="the training data")
    train_ids = encode_for(tokenizer, data.train_texts, max_len, source="training data")
    val_ids = encode_for(tokenizer, data.val_texts, max_len, source="validation data")
    train_cfg = TrainConfig.from_dict({**CLASSIFY_PRESET.train, "block_size": max_len,
                                       **(train_overrides or {})})
    config = ClassifierConfig(trunk_cfg, num_classes=len(labels), pooling=pooling,
                              causal=causal)
    _check_fits(config, train_cfg, train_ids, val_ids)
    torch.manual_seed(train_cfg.seed)
    model = EncoderClassifier(config)
    copy_base_weights(model, base_model)
    start: dict[str, Any] = {BASE_KEY: base_record(base_dir, base_kind)}
    if lora is not None:
        apply_lora(model, lora, trainable=("head",))
        start[LORA_KEY] = {**lora.to_dict(), "trainable": ["head"]}
    return _fit(data, model, tokenizer, labels, train_ids, val_ids, train_cfg, run_dir,
                bucket=bucket, progress=progress, overwrite=overwrite, max_len=max_len,
                start=start)


# -- the run folder ---------------------------------------------------------------------
@dataclass
class LoadedClassifier:
    """A classifier run folder, loaded (``handformer.runs.load_run`` of kind classifier)."""

    model: EncoderClassifier
    tokenizer: CharTokenizer
    labels: LabelVocab
    config: dict[str, Any]

    @classmethod
    def from_run(cls, run: Run) -> LoadedClassifier:
        assert run.kind == "classifier" and run.labels is not None
        return cls(run.model, run.tokenizer, run.labels, run.config)  # type: ignore[arg-type]

    @property
    def max_len(self) -> int:
        return self.model.config.encoder.max_len


def load_classifier_run(run_dir: str | Path, *, device: str = "cpu") -> LoadedClassifier:
    """The classifier of a run folder written by ``handformer classify train``."""
    return LoadedClassifier.from_run(load_run(run_dir, device=device, kind="classifier"))


@dataclass
class Prediction:
    label: str
    confidence: float  # softmax probability of the predicted class


def predict_texts(loaded: LoadedClassifier, texts: Sequence[str], *, batch_size: int = 64
                  ) -> list[Prediction]:
    """Classify raw texts (truncated to the model's ``max_len``, with a warning count)."""
    if not texts:
        raise DatasetError("nothing to classify: no texts given")
    empty = [i for i, t in enumerate(texts) if not t.strip()]
    if empty:
        raise DatasetError(f"text(s) {empty[:10]} are empty; give at least one character")
    ids = encode_texts(texts, loaded.tokenizer, loaded.max_len, source="input")
    batches = ClassificationBatches(ids, None, batch_size, bucket=False,
                                    pad_id=loaded.tokenizer.pad_id).fixed_batches()
    logits, _ = _logits_and_targets(loaded.model, batches)
    probs = torch.softmax(logits, dim=-1)  # (N, K)
    conf, pred = probs.max(dim=-1)  # (N,), (N,)
    return [Prediction(label, float(c))
            for label, c in zip(loaded.labels.decode(pred.tolist()), conf, strict=True)]
