"""The main job, wired end to end: text → tokenizer → windows → DecoderLM → Trainer → run.

    RUN_DIR/
      model.safetensors, config.json, tokenizer.json   the final model (``generate`` loads it)
      metrics.jsonl, summary.json, loss_curve.png      what happened
      checkpoints/step-…/                              resumable checkpoints (see checkpoint.py)
      tensorboard/                                     with --tensorboard

The CLI's ``handformer train`` is a thin shell around ``train_lm`` and
``resume_lm``. Both hold the run folder's lock (``handformer.runs``) from before the first
write to the end, on rank 0 only under torchrun; ``train_lm`` writes only into a new or empty
folder or a run folder of its own (``runs.guard``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from handformer.config import ModelConfig, TrainConfig, get_preset
from handformer.data import LMWindows, train_val_split
from handformer.data.corpora import builtin_text, read_text_file
from handformer.generate import generate
from handformer.models.budget import TEXT_BYTES_PER_CHAR, check_training
from handformer.models.decoder_lm import DecoderLM
from handformer.nn.lora import LoRAConfig, apply_lora, trainable_parameters
from handformer.runs import (
    LM_FOLDER,
    FolderLock,
    RunFolderError,
    check_destination,
    folder_path,
    load_run,
    save_run,
    writing_folder,
)
from handformer.runs.base import (
    BASE_KEY,
    LORA_KEY,
    base_record,
    check_base,
    lora_from_config,
)
from handformer.runs.consistency import build_skeleton, check_tokenizer_fits, check_weights_fit
from handformer.runs.files import METRICS, SUMMARY, TOKENIZER, WEIGHTS
from handformer.runs.guard import CHECKPOINTS, LOSS_CURVE, TENSORBOARD, check_in_place
from handformer.tokenizers import BPETokenizer, CharTokenizer, Tokenizer, tokenizer_from_dict
from handformer.train.callbacks import (
    LossCurvePlot,
    MetricsWriter,
    TensorBoardLogger,
    require_tensorboard,
)
from handformer.train.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    CheckpointManager,
    list_checkpoints,
    read_checkpoint_json,
    verify_checkpoint,
)
from handformer.train.distributed import DistContext, init_distributed
from handformer.train.trainer import Trainer, TrainResult, pick_device

__all__ = ["BUILTIN_SOURCE", "DraftTarget", "LMRun", "build_configs", "check_text_fits",
           "draft_target", "finetune_lm", "resume_lm", "train_lm"]

BUILTIN_SOURCE = "builtin:pydoc_data.topics"


@dataclass
class LMRun:
    run_dir: Path
    model: DecoderLM
    tokenizer: Tokenizer
    model_config: ModelConfig
    train_config: TrainConfig
    result: TrainResult
    unigram_loss: float
    sample: str
    resumed_from: int | None = None
    dist: DistContext = dataclasses.field(default_factory=DistContext)


def build_train_config(preset: str,
                       train_overrides: dict[str, Any] | None = None) -> TrainConfig:
    """The preset's training recipe with ``train_overrides`` applied."""
    return TrainConfig.from_dict({**get_preset(preset).train, **(train_overrides or {})})


def build_configs(
    preset: str, vocab_size: int, model_overrides: dict[str, Any] | None = None,
    train_overrides: dict[str, Any] | None = None,
) -> tuple[ModelConfig, TrainConfig]:
    p = get_preset(preset)
    train_cfg = build_train_config(preset, train_overrides)
    model_kwargs = {**p.model, **(model_overrides or {})}
    model_kwargs.setdefault("max_len", train_cfg.block_size)
    model_cfg = ModelConfig.from_dict({**model_kwargs, "vocab_size": vocab_size})
    if train_cfg.block_size > model_cfg.max_len:
        raise ValueError(f"training window block_size={train_cfg.block_size} exceeds the model's "
                         f"max_len={model_cfg.max_len}")
    return model_cfg, train_cfg


def check_budget(model_cfg: ModelConfig, train_cfg: TrainConfig, text_chars: int) -> None:
    """Refuse (``MemoryBudgetError``) a run whose model, optimizer, micro-batch, validation
    batches and tokenized text cannot fit in memory — before any of them is allocated."""
    b, t = train_cfg.batch_size, train_cfg.block_size
    host = {"the text's token ids": text_chars * TEXT_BYTES_PER_CHAR,
            "validation batches": train_cfg.eval_batches * b * (t + 1) * 2 * 8}
    check_training(model_cfg, b, t, pick_device(train_cfg.device), host_extra=host,
                   hint="use a smaller --batch-size, or a smaller model (--preset tiny, or a "
                        "config with a smaller d_model / n_layers)")


def unigram_loss(train_ids: torch.Tensor, val_ids: torch.Tensor, vocab_size: int) -> float:
    """Validation cross-entropy of the best context-free model (train-set frequencies)."""
    counts = torch.bincount(train_ids, minlength=vocab_size).double() + 1.0  # add-one
    logp = (counts / counts.sum()).log()
    return float(-logp[val_ids].mean())


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# -- where the text came from (so --resume can find it again, and knows it is unchanged) ---
def _fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


def data_record(text: str, source: str | None) -> dict[str, Any]:
    return {"source": source, "sha256": _fingerprint(text), "characters": len(text)}


def load_recorded_text(record: dict[str, Any] | None, run_dir: Path) -> str:
    """Read the training text again and check that it is the text the run started on."""
    source = (record or {}).get("source")
    if not source:
        raise ValueError(f"{run_dir} was trained on text passed in from Python, not a file; "
                         "pass the same text again: resume_lm(run_dir, text=...)")
    text = builtin_text() if source == BUILTIN_SOURCE else read_text_file(source)
    assert record is not None
    if _fingerprint(text) != record.get("sha256"):
        what = "the built-in text (another Python version?)" if source == BUILTIN_SOURCE \
            else source
        raise ValueError(f"{what} changed since the run in {run_dir} started (sha256 "
                         f"{record.get('sha256')} then, {_fingerprint(text)} now); resuming "
                         "on different text would not continue the same run")
    return text


# -- run folders ----------------------------------------------------------------------------
T = TypeVar("T")


def on_rank0_first(dist: DistContext, step: Callable[[], T]) -> T | None:
    """``step()`` on rank 0 only (checking, claiming or locking the run folder); a refusal
    there is raised on every rank, so no rank waits in a collective for one that left.
    Returns ``step()``'s value on rank 0, None elsewhere."""
    result, error = None, None
    if dist.is_main:
        try:
            result = step()
        except (ValueError, OSError) as err:
            error = err
    refused = dist.broadcast_object(None if error is None else str(error))
    if error is not None:
        raise error
    if refused is not None:
        raise RunFolderError(f"rank 0 refused: {refused}")
    return result


def _checkpoint_files(model_cfg: ModelConfig, train_cfg: TrainConfig,
                      tokenizer: Tokenizer, data: dict[str, Any],
                      start: dict[str, Any] | None = None) -> dict[str, str]:
    """config.json and tokenizer.json as in the run root, so ``generate --run`` works on any
    checkpoint folder too; ``start`` is the base (and LoRA recipe) a fine-tuned run records,
    which ``resume_lm`` rebuilds it from. A checkpoint holds every weight, base included."""
    config = {"model": model_cfg.to_dict(), "train": train_cfg.to_dict(), "data": data,
              **({} if start is None else {"start": start})}
    return {"config.json": json.dumps(config, indent=2, sort_keys=True),
            "tokenizer.json": json.dumps(tokenizer.to_dict())}


def distributed_context(train_cfg: TrainConfig) -> DistContext:
    """Join torchrun's process group when launched by it; a single process otherwise."""
    return init_distributed(pick_device(train_cfg.device))


def _run(text: str, tokenizer: Tokenizer, model: DecoderLM, model_cfg: ModelConfig,
         train_cfg: TrainConfig, out_dir: Path, data: dict[str, Any], *,
         resume: CheckpointInfo | None, progress: bool, sample_prompt: str,
         sample_tokens: int, dist: DistContext, start: dict[str, Any] | None = None) -> LMRun:
    ids = tokenizer.encode_array(text)
    train_ids, val_ids = train_val_split(ids, train_cfg.val_fraction)
    train_windows = LMWindows(train_ids, train_cfg.block_size, name="training split")
    val_windows = LMWindows(val_ids, train_cfg.block_size, name="validation split")
    val_batches = val_windows.fixed_batches(train_cfg.eval_batches, train_cfg.batch_size)

    # Every rank holds the manager (they must agree on when to save: under FSDP saving is a
    # collective), but only rank 0 writes through it.
    manager = CheckpointManager(out_dir / CHECKPOINTS, keep_last=train_cfg.keep_last,
                                files=_checkpoint_files(model_cfg, train_cfg, tokenizer, data,
                                                        start))
    trainer = Trainer(
        model,
        train_cfg,
        train_batch=lambda g: train_windows.random_batch(train_cfg.batch_size, g),
        val_batches=val_batches,
        progress=progress,
        checkpoints=manager,
        chars_per_token=len(text) / max(len(ids), 1),  # 1 for characters, more for BPE
        dist=dist,
    )
    if resume is not None:
        trainer.resume(resume.path)
    resume_step = None if resume is None else resume.step
    callbacks: list[Any] = [MetricsWriter(out_dir / METRICS, resume_step=resume_step)]
    if train_cfg.loss_curve:
        callbacks.append(LossCurvePlot(out_dir / METRICS, out_dir / LOSS_CURVE,
                                       title=f"{out_dir.name}: loss per token"))
    if train_cfg.tensorboard:
        callbacks.append(TensorBoardLogger(out_dir / TENSORBOARD, resume_step=resume_step))
    trainer.callbacks = callbacks if dist.is_main else []

    result = trainer.fit()
    final_model = trainer.parallel.full_model()  # gathered under FSDP (every rank calls it)
    if not dist.is_main:
        dist.barrier()  # wait for rank 0's run folder, then leave writing and sampling to it
        return LMRun(out_dir, model, tokenizer, model_cfg, train_cfg, result, float("nan"),
                     "", resume_step, dist)
    model = final_model  # type: ignore[assignment]
    baseline = unigram_loss(train_ids, val_ids, tokenizer.vocab_size)
    best = result.best_step
    summary = {
        "final_val_loss": result.final_val_loss,
        "best_val_loss": result.best_val_loss,
        "best_step": best,
        "best_checkpoint": None if best is None else f"{CHECKPOINTS}/step-{best:08d}",
        "unigram_val_loss": baseline,
        "ln_vocab": math.log(tokenizer.vocab_size),
        "steps": result.steps,
        "resumed_from_step": resume_step,
        "stopped_early": result.stopped_early,
        "reached_target": result.reached_target,
        "nonfinite_steps": result.nonfinite_steps,
        "precision": trainer.precision.name,
        "precision_why": trainer.precision.why or f"--precision {train_cfg.precision}",
        "compile": train_cfg.compile,
        "seconds": result.seconds,
        "total_seconds": trainer.elapsed_seconds,
        "median_step_ms": result.median_step_ms,
        "parameters": model.num_parameters(),
        "trainable_parameters": trainable_parameters(model),
        "optimizer": train_cfg.optimizer,
        # Which parameter went to which optimizer (Muon: the blocks' matrices; AdamW: the rest).
        "optimizer_split": trainer.parameter_split,
    }
    save_run(out_dir, model, tokenizer, train_cfg,
             extra={"summary": summary, "data": data, **(start or {})})
    (out_dir / SUMMARY).write_text(json.dumps(summary, indent=2), encoding="utf-8")

    prompt = torch.tensor([tokenizer.encode(sample_prompt)], dtype=torch.long)
    sample_ids = generate(model, prompt, sample_tokens, temperature=0.8, top_k=None,
                          seed=train_cfg.seed)
    sample = tokenizer.decode(sample_ids[0].tolist())
    dist.barrier()
    return LMRun(out_dir, model, tokenizer, model_cfg, train_cfg, result, baseline, sample,
                 resume_step, dist)


def train_lm(
    text: str,
    *,
    out_dir: str | Path,
    preset: str = "default",
    model_overrides: dict[str, Any] | None = None,
    train_overrides: dict[str, Any] | None = None,
    progress: bool = True,
    sample_prompt: str = "\n",
    sample_tokens: int = 200,
    data_source: str | None = None,
    overwrite: bool = False,
    tokenizer: str | Tokenizer = "char",
    vocab_size: int = 1000,
) -> LMRun:
    """Train a fresh LM on characters (``tokenizer="char"``) or on a byte-level BPE learned
    from the same text (``"bpe"``, ``vocab_size`` tokens), or with a given ``Tokenizer``
    (another run's: a draft for speculative decoding must share its target's tokens).
    ``data_source`` (a file path or ``BUILTIN_SOURCE``) is recorded so that ``resume_lm``
    can read the same text again."""
    if isinstance(tokenizer, str) and tokenizer not in ("char", "bpe"):
        raise ValueError(f"tokenizer must be 'char', 'bpe' or a Tokenizer; got {tokenizer!r}")
    # The process group comes first (a BPE is learned on rank 0 and sent to the others); it
    # needs only the training recipe's device, not the model, whose vocabulary is unknown yet.
    dist = distributed_context(build_train_config(preset, train_overrides))
    out_dir = folder_path(out_dir)
    # Refuse a folder that is not ours before the (possibly long) BPE training; nothing is
    # written until the configs are known to build.
    on_rank0_first(dist, lambda: check_destination(out_dir, LM_FOLDER, overwrite=overwrite))
    if not isinstance(tokenizer, str):
        tokenizer_obj: Tokenizer = tokenizer
    elif tokenizer == "char":
        tokenizer_obj = CharTokenizer.from_text(text)
    else:
        # Learned once, on rank 0; every other rank receives the very same merges.
        learned = BPETokenizer.train(text, vocab_size=vocab_size) if dist.is_main else None
        tokenizer_obj = tokenizer_from_dict(dist.broadcast_object(
            learned.to_dict() if learned is not None else None))
    model_cfg, train_cfg = build_configs(preset, tokenizer_obj.vocab_size, model_overrides,
                                         train_overrides)
    if train_cfg.tensorboard:
        require_tensorboard()  # fail before anything is written or trained
    check_budget(model_cfg, train_cfg, len(text))  # before anything is claimed or built
    with ExitStack() as held:
        # Claimed (an earlier run of ours cleared, a foreign folder refused) and locked
        # until the run folder is complete.
        on_rank0_first(dist, lambda: held.enter_context(
            writing_folder(out_dir, LM_FOLDER, overwrite=overwrite)))
        seed_everything(train_cfg.seed)
        model = DecoderLM(model_cfg)
        return _run(text, tokenizer_obj, model, model_cfg, train_cfg, out_dir,
                    data_record(text, data_source), resume=None, progress=progress,
                    sample_prompt=sample_prompt, sample_tokens=sample_tokens, dist=dist)


@dataclass
class DraftTarget:
    """What a draft model must share with the run it drafts for (``draft_target``)."""

    run_dir: Path
    tokenizer: Tokenizer
    max_len: int
    text: str
    data_source: str | None


def draft_target(run_dir: str | Path, data: Path | None = None) -> DraftTarget:
    """Read what a draft for the LM run in ``run_dir`` needs: its tokenizer (the draft's
    tokens must be the target's, id for id), its window and its training text (``data``
    instead, if given). ``RunFolderError`` for a folder that is not an LM run;
    ``ValueError`` if the recorded text cannot be read again or changed."""
    run = load_run(run_dir, kind="lm")
    if data is not None:
        text, source = read_text_file(data), str(data.resolve())
    else:
        record = run.config.get("data")
        text = load_recorded_text(record, run.run_dir)
        source = (record or {}).get("source")
    return DraftTarget(run.run_dir, run.tokenizer, run.model.config.max_len,  # type: ignore[union-attr]
                       text, source)


def _check_covers(tokenizer: Tokenizer, text: str, path: Path) -> None:
    """A character tokenizer is learned from the whole training text, so every character of
    that text is in it; one that is not means ``path`` is another run's tokenizer, and
    resuming would train on ``<unk>``."""
    if not isinstance(tokenizer, CharTokenizer):
        return  # byte-level BPE reads any text
    unknown = sorted(set(text) - set(tokenizer.stoi))
    if unknown:
        shown = "".join(unknown[:20])
        raise CheckpointError(f"{path} lacks {len(unknown)} character(s) of the training text "
                              f"({shown!r}): it is not the tokenizer this run was trained "
                              "with, and resuming would train on <unk>")


def resume_lm(
    run_dir: str | Path,
    *,
    max_steps: int | None = None,
    text: str | None = None,
    progress: bool = True,
    sample_prompt: str = "\n",
    sample_tokens: int = 200,
    strategy: str | None = None,
) -> LMRun:
    """Continue a run from its newest committed checkpoint, exactly: configs, tokenizer and
    data come from the run folder; ``max_steps`` may extend the run. Under torchrun the
    checkpoint may come from any number of processes (``strategy`` picks ddp or fsdp)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"run folder not found: {run_dir}")
    check_in_place(run_dir, LM_FOLDER)  # no link carries the continued run's writes elsewhere
    found = list_checkpoints(run_dir / CHECKPOINTS)
    if not found:
        raise CheckpointError(f"{run_dir / CHECKPOINTS}: no committed checkpoint to resume from")
    info = verify_checkpoint(found[-1].path)
    config_file = info.path / "config.json"
    config = read_checkpoint_json(info.path, "config.json", verify=False)
    try:
        model_cfg = ModelConfig.from_dict(config["model"])
        train_cfg = TrainConfig.from_dict(config["train"])
        tokenizer = tokenizer_from_dict(
            read_checkpoint_json(info.path, "tokenizer.json", verify=False))
    except (KeyError, TypeError, ValueError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"{config_file} or tokenizer.json: cannot rebuild the run "
                              f"({type(err).__name__}: {err})") from None
    start = config.get("start")
    lora = _start_lora(start, run_dir)

    def build() -> DecoderLM:
        model = DecoderLM(model_cfg)
        return model if lora is None else apply_lora(model, lora)  # type: ignore[return-value]

    # The files must belong together before anything is allocated or trained.
    check_weights_fit(build_skeleton(build), info.path / WEIGHTS, config_file,
                      error=CheckpointError)
    check_tokenizer_fits(tokenizer, model_cfg, info.path / TOKENIZER, config_file,
                         error=CheckpointError)
    if max_steps is not None:
        train_cfg = dataclasses.replace(train_cfg, max_steps=max_steps)
    if strategy is not None:
        train_cfg = dataclasses.replace(train_cfg, strategy=strategy)
    if info.step >= train_cfg.max_steps:
        raise ValueError(f"{run_dir} already reached step {info.step} of max_steps="
                         f"{train_cfg.max_steps}; pass --max-steps N with N > {info.step} to "
                         "train further")
    if train_cfg.tensorboard:
        require_tensorboard()
    data = config.get("data") or {}
    if text is None:
        text = load_recorded_text(data, run_dir)
    elif _fingerprint(text) != data.get("sha256"):
        raise ValueError(f"the text given differs from the one {run_dir} was trained on")
    _check_covers(tokenizer, text, info.path / TOKENIZER)
    check_budget(model_cfg, train_cfg, len(text))
    dist = distributed_context(train_cfg)
    with ExitStack() as held:
        # Locked (not claimed: the run continues in place) until the run folder is complete.
        on_rank0_first(dist, lambda: held.enter_context(
            FolderLock(run_dir, command="handformer train --resume")))
        model = build()
        return _run(text, tokenizer, model, model_cfg, train_cfg, run_dir, data, resume=info,
                    progress=progress, sample_prompt=sample_prompt,
                    sample_tokens=sample_tokens, dist=dist, start=start)


def _start_lora(start: Any, run_dir: Path) -> LoRAConfig | None:
    """The LoRA recipe of a fine-tuned run being resumed (None for a plain one), after its
    base is checked unchanged: the run's final folder stores adapters for that base."""
    if start is None:
        return None
    check_base(start.get(BASE_KEY), run_dir / "config.json")
    if LORA_KEY not in start:
        return None
    lora, _ = lora_from_config(start, run_dir / "config.json")
    return lora


def finetune_lm(
    base_dir: str | Path,
    text: str,
    *,
    out_dir: str | Path,
    lora: LoRAConfig | None = None,
    preset: str = "default",
    train_overrides: dict[str, Any] | None = None,
    progress: bool = True,
    sample_prompt: str = "\n",
    sample_tokens: int = 200,
    data_source: str | None = None,
    overwrite: bool = False,
) -> LMRun:
    """Continue the language model of the run ``base_dir`` on ``text``, with its own
    tokenizer: every weight (``lora=None``) or only LoRA adapters, which are then all the new
    run folder stores. The training recipe is ``preset``'s with ``train_overrides`` (its
    window cut to the model's; with LoRA the optimizer is AdamW unless the overrides say).
    The new run records the base (path, weights hash)."""
    base_dir = Path(base_dir)
    out = folder_path(out_dir)
    if out.exists() and base_dir.exists() and out.resolve() == base_dir.resolve():
        raise ValueError(f"--out {out} is the base run itself; give the fine-tuned run its own "
                         "folder (the base must stay as it is)")
    check_destination(out, LM_FOLDER, overwrite=overwrite)
    config_path = base_dir / "config.json"
    if config_path.is_file() and '"model_type"' in config_path.read_text(encoding="utf-8"):
        raise RunFolderError(f"{base_dir} is a Hugging Face folder; import it first (handformer "
                             f"convert --from hf {base_dir} DIR) and continue DIR")
    base = load_run(base_dir, kind="lm")
    if LORA_KEY in base.config:
        raise ValueError(f"{base_dir} is itself a LoRA run; merge it first (handformer convert "
                         f"--merge-lora {base_dir} DST) and start from DST")
    if "quantization" in base.config:
        raise ValueError(f"{base_dir} holds int8 weights; fine-tune the float run it was "
                         f"quantized from ({base.config.get('quantized_from', 'its source')})")
    tokenizer = base.tokenizer
    check_text_fits(tokenizer, text, data_source or "the text")
    model: DecoderLM = base.model  # type: ignore[assignment]
    model_cfg = model.config
    overrides = dict(train_overrides or {})
    if lora is not None:  # LoRA's factors train with AdamW, as PEFT's do, unless told otherwise
        overrides.setdefault("optimizer", "adamw")
    train_cfg = build_train_config(preset, {"block_size": min(
        build_train_config(preset).block_size, model_cfg.max_len), **overrides})
    if train_cfg.block_size > model_cfg.max_len:
        raise ValueError(f"block_size={train_cfg.block_size} exceeds the base model's "
                         f"max_len={model_cfg.max_len}")
    if train_cfg.tensorboard:
        require_tensorboard()
    check_budget(model_cfg, train_cfg, len(text))
    start: dict[str, Any] = {BASE_KEY: base_record(base_dir, "lm")}
    if lora is not None:
        build_skeleton(lambda: apply_lora(DecoderLM(model_cfg), lora))  # refused before writing
        start[LORA_KEY] = {**lora.to_dict(), "trainable": []}
    dist = distributed_context(train_cfg)
    with ExitStack() as held:
        on_rank0_first(dist, lambda: held.enter_context(
            writing_folder(out, LM_FOLDER, overwrite=overwrite)))
        seed_everything(train_cfg.seed)
        if lora is not None:  # after the seed: the adapters' A is drawn like a fresh run's weights
            apply_lora(model, lora)
        return _run(text, tokenizer, model, model_cfg, train_cfg, out,
                    data_record(text, data_source), resume=None, progress=progress,
                    sample_prompt=sample_prompt, sample_tokens=sample_tokens, dist=dist,
                    start=start)


def check_text_fits(tokenizer: Tokenizer, text: str, source: str) -> None:
    """Refuse text with characters a character tokenizer lacks, naming them: mapped to
    ``<unk>`` they would be trained on as one meaningless token."""
    if not isinstance(tokenizer, CharTokenizer):
        return  # byte-level BPE and Hugging Face tokenizers read any text
    unknown = sorted(set(text) - set(tokenizer.stoi))
    if unknown:
        raise ValueError(f"{source} has {len(unknown)} character(s) the base's tokenizer lacks "
                         f"({''.join(unknown[:20])!r}); a character tokenizer is fixed with "
                         "its model, so give text made of its characters")
