"""THE run folder: one ``save_run`` and one ``load_run`` for every kind of model.

    RUN_DIR/
      model.safetensors   weights (tensors only)
      config.json         {KIND_KEY: the model's config, "train": TrainConfig, ...}
      tokenizer.json      the tokenizer
      labels.json         the label vocabulary (classifier runs only)
      metrics.jsonl, summary.json, …   what the job that trained it wrote

What a folder holds is said by the one key of ``config.json`` that names its model's config:
``"model"`` (a ``DecoderLM``, written by ``handformer train``), ``"classifier"`` (an
``EncoderClassifier``, ``handformer classify train``) or ``"seq2seq"`` (an
``EncoderDecoder``, ``handformer seq2seq train``) or ``"encoder"`` (a bare pretrained
``Encoder`` such as MiniLM, ``handformer convert --from hf``). ``load_run`` reads that key,
rebuilds the model from its config and loads the weights strictly; nothing is unpickled.

A language model quantized to int8 (``models.quantize``; ``handformer convert --quantize
int8``) is saved like any other: ``model.safetensors`` then holds each quantized layer's int8
``qweight`` and float ``scale`` in place of its ``weight``, and ``config.json`` records which
layers under ``"quantization"``. ``load_run`` rebuilds that layout before loading, so the
stored int8 weights load as they are, without quantizing again.

A run fine-tuned with LoRA (``runs.base``) records its base and LoRA recipe in
``config.json`` and stores only its adapters (and a new head) in ``model.safetensors``;
``load_run`` rebuilds it from the base, whose weights must be unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torch import nn

from handformer.config import ClassifierConfig, ModelConfig, Seq2SeqConfig, TrainConfig
from handformer.data.classification import DatasetError, LabelVocab
from handformer.models.decoder_lm import DecoderLM
from handformer.models.encoder import Encoder, EncoderClassifier
from handformer.models.quantize import (
    QUANTIZATION_KEY,
    QuantizationError,
    apply_int8_layout,
    quantization_info,
)
from handformer.models.seq2seq import EncoderDecoder
from handformer.nn.init import skip_init
from handformer.nn.lora import apply_lora, lora_layers, lora_state_dict
from handformer.runs.base import (
    BASE_KEY,
    LORA_KEY,
    check_base,
    copy_base_weights,
    load_adapter,
    lora_from_config,
)
from handformer.runs.consistency import build_skeleton, check_tokenizer_fits, check_weights_fit
from handformer.runs.files import (
    CONFIG,
    LABELS,
    TOKENIZER,
    WEIGHTS,
    RunFolderError,
    check_run_dir,
    load_weights,
    read_json,
    save_weights,
    write_json,
)
from handformer.tokenizers import HFTokenizer, Tokenizer, load_tokenizer

__all__ = ["RUN_KINDS", "Run", "RunKind", "load_run", "run_kind", "save_run"]

RunKind = Literal["lm", "classifier", "seq2seq", "encoder"]
SPECIAL_TOKENS_KEY = "special_tokens"  # config.json: bos/eos/pad ids a tokenizer cannot name

# kind → (the config.json key holding the model's config, the command that writes it)
RUN_KINDS: dict[str, tuple[str, str]] = {
    "lm": ("model", "handformer train"),
    "classifier": ("classifier", "handformer classify train"),
    "seq2seq": ("seq2seq", "handformer seq2seq train"),
    # A bare pretrained encoder (BERT, MiniLM): the base a classifier fine-tunes from.
    "encoder": ("encoder", "handformer convert --from hf"),
}


@dataclass
class Run:
    """A loaded run folder. ``model`` is in eval mode on the requested device; ``labels`` is
    set for classifier runs only; ``config`` is the whole ``config.json``."""

    run_dir: Path
    kind: RunKind
    model: nn.Module
    tokenizer: Tokenizer
    config: dict[str, Any]
    labels: LabelVocab | None = None


def _kind_of_model(model: nn.Module) -> RunKind:
    if isinstance(model, DecoderLM):
        return "lm"
    if isinstance(model, EncoderClassifier):
        return "classifier"
    if isinstance(model, EncoderDecoder):
        return "seq2seq"
    if isinstance(model, Encoder):
        return "encoder"
    raise TypeError(f"save_run takes a DecoderLM, EncoderClassifier, EncoderDecoder or Encoder; "
                    f"got {type(model).__name__}")


def save_run(
    run_dir: str | Path,
    model: nn.Module,
    tokenizer: Tokenizer,
    train_config: TrainConfig | None = None,
    *,
    labels: LabelVocab | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write weights, ``config.json`` (the model's config under its kind's key, the training
    recipe and ``extra``), the tokenizer and, for a classifier, ``labels``. Each file is
    replaced atomically. A model with LoRA adapters needs ``extra`` to hold its ``base`` and
    ``lora`` records, and only the adapters (and ``lora["trainable"]``) are written."""
    kind = _kind_of_model(model)
    if (kind == "classifier") != (labels is not None):
        raise ValueError("labels are saved with (and only with) a classifier run")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    key = RUN_KINDS[kind][0]
    config = {key: model.config.to_dict(),  # type: ignore[operator]
              "train": None if train_config is None else train_config.to_dict(),
              **(extra or {})}
    config.pop(QUANTIZATION_KEY, None)  # what the model holds is recorded, nothing else
    config.pop(SPECIAL_TOKENS_KEY, None)
    if getattr(tokenizer, "special_ids", None):  # ids a published model's config stated
        config[SPECIAL_TOKENS_KEY] = dict(tokenizer.special_ids)  # type: ignore[union-attr]
    quantized = quantization_info(model)
    if quantized is not None:
        config[QUANTIZATION_KEY] = quantized
    only = None
    if lora_layers(model):
        if not isinstance(config.get(LORA_KEY), dict) or BASE_KEY not in config:
            raise ValueError("a model with LoRA adapters is saved with extra={'base': ..., "
                             "'lora': ...} (runs.base): its folder stores only the adapters")
        only = lora_state_dict(model, trainable=config[LORA_KEY].get("trainable", []))
    save_weights(model, run_dir / WEIGHTS, only=only)
    write_json(run_dir / CONFIG, config)
    tokenizer.save(run_dir / TOKENIZER)
    if labels is not None:
        labels.save(run_dir / LABELS)
    return run_dir


def run_kind(config: dict[str, Any], path: Path) -> RunKind:
    """Which kind of run a ``config.json`` describes (``path`` names it in the error)."""
    for kind, (key, _) in RUN_KINDS.items():
        if isinstance(config.get(key), dict):
            return kind  # type: ignore[return-value]
    keys = ", ".join(repr(key) for key, _ in RUN_KINDS.values())
    raise RunFolderError(f"{path} describes no handformer model: expected one of the keys "
                         f"{keys}; its top-level keys are {sorted(config)}")


def _build(kind: RunKind, model_config: dict[str, Any]) -> nn.Module:
    if kind == "lm":
        return DecoderLM(ModelConfig.from_dict(model_config))
    if kind == "classifier":
        return EncoderClassifier(ClassifierConfig.from_dict(model_config))
    if kind == "encoder":
        return Encoder(ModelConfig.from_dict(model_config))
    return EncoderDecoder(Seq2SeqConfig.from_dict(model_config))


def _quantized_layout(model: nn.Module, config: dict[str, Any], path: Path) -> None:
    """Give ``model`` the int8 layers ``config.json`` records, if any (in place)."""
    if QUANTIZATION_KEY not in config:
        return
    try:
        apply_int8_layout(model, config[QUANTIZATION_KEY])
    except QuantizationError as err:
        raise RunFolderError(f"{path}: {err}") from None


def _with_special_ids(tokenizer: Tokenizer, config: dict[str, Any], path: Path) -> Tokenizer:
    """The tokenizer with the special ids ``config.json`` records (``special_tokens``)."""
    special = config.get(SPECIAL_TOKENS_KEY)
    if special is None:
        return tokenizer
    if not isinstance(tokenizer, HFTokenizer) or not isinstance(special, dict):
        raise RunFolderError(f"{path}: {SPECIAL_TOKENS_KEY!r} must be an object of ids, for a "
                             f"Hugging Face tokenizer; got {special!r}")
    try:
        return type(tokenizer)(tokenizer.backend, special_ids=special)
    except ValueError as err:
        raise RunFolderError(f"{path}: {err}") from None


def load_run(run_dir: str | Path, *, device: str = "cpu",
             kind: RunKind | tuple[RunKind, ...] | None = None) -> Run:
    """Rebuild the model a run folder describes and load its weights and tokenizer.

    ``kind`` states what the caller can use (``handformer generate`` needs ``"lm"``; the
    explorer takes ``("lm", "classifier")``): a folder of another kind is refused by name,
    before anything is built. Raises ``RunFolderError`` naming the file for a
    missing folder or file, unreadable JSON, a config that does not build, a tokenizer that
    does not load or has more tokens than the model's vocabulary, or weights that do not fit
    the config (names, shapes, float dtypes: checked from the file's header against a meta-
    device skeleton before the model is allocated; see ``runs.consistency``).
    """
    run_dir = check_run_dir(run_dir, (WEIGHTS, CONFIG, TOKENIZER))
    config = read_json(run_dir / CONFIG)
    found = run_kind(config, run_dir / CONFIG)
    wanted = (kind,) if isinstance(kind, str) else kind
    if wanted is not None and found not in wanted:
        needed = " or ".join(f"a {k} run (written by `{RUN_KINDS[k][1]}`)" for k in wanted)
        raise RunFolderError(f"{run_dir} holds a {found} run (written by "
                             f"`{RUN_KINDS[found][1]}`); this needs {needed}")
    key = RUN_KINDS[found][0]
    if LORA_KEY in config:
        return _load_lora_run(run_dir, found, config, device)
    # A checkpoint of a LoRA run holds every weight, adapters included: build it with them.
    start = config.get("start")
    lora = (lora_from_config(start, run_dir / CONFIG)[0]
            if isinstance(start, dict) and LORA_KEY in start else None)

    def build() -> nn.Module:
        model = _build(found, config[key])
        return model if lora is None else apply_lora(model, lora)

    try:  # on the meta device: nothing is allocated until config and files agree
        skeleton = build_skeleton(build)
    except (KeyError, TypeError, ValueError) as err:
        raise RunFolderError(f"{run_dir / CONFIG}: cannot rebuild the model from {key!r} "
                             f"({type(err).__name__}: {err})") from None
    _quantized_layout(skeleton, config, run_dir / CONFIG)
    try:
        tokenizer = load_tokenizer(run_dir / TOKENIZER)
    except (KeyError, TypeError, ValueError, OSError) as err:
        raise RunFolderError(f"{run_dir / TOKENIZER}: cannot read the tokenizer "
                             f"({type(err).__name__}: {err})") from None
    tokenizer = _with_special_ids(tokenizer, config, run_dir / CONFIG)
    # The weights against the config first: a config edited by hand is named by its field.
    check_weights_fit(skeleton, run_dir / WEIGHTS, run_dir / CONFIG)
    check_tokenizer_fits(tokenizer, skeleton.config, run_dir / TOKENIZER, run_dir / CONFIG)
    labels = None
    if found == "classifier":
        check_run_dir(run_dir, (LABELS,))
        try:
            labels = LabelVocab.load(run_dir / LABELS)
        except (DatasetError, ValueError, OSError) as err:
            raise RunFolderError(f"{run_dir / LABELS}: cannot read the labels ({err})") from None
        classes = skeleton.config.num_classes  # type: ignore[union-attr]
        if len(labels) != classes:
            raise RunFolderError(f"{run_dir}: labels.json has {len(labels)} labels but the "
                                 f"model has {classes} classes")
    with skip_init():  # every weight comes from the file, strictly: no random start to draw
        model = build()
    _quantized_layout(model, config, run_dir / CONFIG)
    load_weights(model, run_dir / WEIGHTS, device=device)
    return Run(run_dir, found, model.to(device).eval(), tokenizer, config, labels)


def _load_lora_run(run_dir: Path, kind: RunKind, config: dict[str, Any], device: str) -> Run:
    """A LoRA run: its base (unchanged since the run started, and no LoRA run itself), the
    new model filled from it, then the run's adapters."""
    where = run_dir / CONFIG
    base_dir = check_base(config.get(BASE_KEY), where)
    lora, trainable = lora_from_config(config, where)
    base = load_run(base_dir, device=device)
    if LORA_KEY in base.config:
        raise RunFolderError(f"{where}: its base {base_dir} is itself a LoRA run")
    if kind == "lm" and base.kind != "lm":
        raise RunFolderError(f"{where}: a language-model run's base must be one too; "
                             f"{base_dir} holds a {base.kind} run")
    key = RUN_KINDS[kind][0]
    try:
        model = base.model if kind == "lm" else _build(kind, config[key])
    except (KeyError, TypeError, ValueError) as err:
        raise RunFolderError(f"{where}: cannot rebuild the model from {key!r} "
                             f"({type(err).__name__}: {err})") from None
    if model is not base.model:
        copy_base_weights(model, base.model)
    model.to(device)
    load_adapter(model, lora, trainable, run_dir / WEIGHTS, device=device)
    check_run_dir(run_dir, (TOKENIZER,))
    try:
        tokenizer = load_tokenizer(run_dir / TOKENIZER)
    except (KeyError, TypeError, ValueError, OSError) as err:
        raise RunFolderError(f"{run_dir / TOKENIZER}: cannot read the tokenizer "
                             f"({type(err).__name__}: {err})") from None
    tokenizer = _with_special_ids(tokenizer, config, where)
    check_tokenizer_fits(tokenizer, model.config, run_dir / TOKENIZER, where)  # type: ignore[arg-type]
    labels = None
    if kind == "classifier":
        check_run_dir(run_dir, (LABELS,))
        try:
            labels = LabelVocab.load(run_dir / LABELS)
        except (DatasetError, ValueError, OSError) as err:
            raise RunFolderError(f"{run_dir / LABELS}: cannot read the labels ({err})") from None
        if len(labels) != model.config.num_classes:  # type: ignore[union-attr]
            raise RunFolderError(f"{run_dir}: labels.json has {len(labels)} labels but the "
                                 f"model has {model.config.num_classes} classes")  # type: ignore[union-attr]
    return Run(run_dir, kind, model.eval(), tokenizer, config, labels)
