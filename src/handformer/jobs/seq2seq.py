"""The seq2seq job: a built-in task → EncoderDecoder (teacher forcing) → run folder.

Pairs become batches in ``handformer.data.seq2seq`` (source + ``<eos>``; ``<bos>`` + target
as the decoder's input; target + ``<eos>`` as what it must predict). The training stream
draws fresh pairs every step and never the held-out sources, so the reported
exact match (the whole decoded output equal to the answer) is on unseen inputs.

    RUN_DIR/  model.safetensors  config.json {"seq2seq", "train", "task", "summary"}
              tokenizer.json  metrics.jsonl  summary.json

Shape legend: ``B`` batch, ``S`` source length, ``T`` target length, ``V`` vocabulary.
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
from torch import Tensor, nn

from handformer.config import SEQ2SEQ_PRESET, ModelConfig, Seq2SeqConfig, TrainConfig
from handformer.data import Batch
from handformer.data.classification import DataWarning
from handformer.data.padding import pad_sequences
from handformer.data.seq2seq import Seq2SeqBatch, collate_pairs, encode_sources
from handformer.data.tasks import SEQ2SEQ_ALPHABET, SEQ2SEQ_TASKS, seq2seq_pairs
from handformer.loss import lm_loss
from handformer.models.budget import check_training
from handformer.models.seq2seq import EncoderDecoder, greedy_decode
from handformer.runs import (
    SEQ2SEQ_FOLDER,
    check_destination,
    folder_path,
    load_run,
    save_run,
    writing_folder,
)
from handformer.runs.files import METRICS, SUMMARY, write_json
from handformer.tokenizers import CharTokenizer
from handformer.train.callbacks import MetricsWriter
from handformer.train.trainer import Trainer, TrainResult, pick_device

__all__ = [
    "LoadedSeq2Seq",
    "Seq2SeqRun",
    "exact_match",
    "load_seq2seq_run",
    "seq2seq_forward",
    "train_seq2seq",
    "translate",
]


def seq2seq_forward(model: nn.Module, batch: Batch) -> Tensor:
    """The Trainer's ``forward_fn``: teacher-forced logits (B, T, V)."""
    assert isinstance(batch, Seq2SeqBatch)
    return model(batch.src, batch.ids, batch.src_mask, batch.padding_mask)


def _fit_sources(src: list[list[int]], window: int, eos_id: int,
                 warn: bool) -> list[list[int]]:
    """Sources cut to the encoder's window (their first characters, still ending in
    ``<eos>``); with ``warn``, one ``DataWarning`` counts them. Past its window an encoder
    with learned positions fails and the others read positions they never trained on."""
    long = [len(ids) for ids in src if len(ids) > window]
    if long and warn:
        warnings.warn(f"{len(long)} of {len(src)} source(s) are longer than the encoder's "
                      f"window (max_len={window} tokens, <eos> included) and were cut to "
                      f"their first {window - 1} characters; the longest has {max(long)} "
                      "tokens", DataWarning, stacklevel=3)
    return [ids if len(ids) <= window else [*ids[: window - 1], eos_id] for ids in src]


@torch.no_grad()
def translate(model: EncoderDecoder, tokenizer: CharTokenizer, sources: Sequence[str], *,
              max_new_tokens: int | None = None, batch_size: int = 256,
              warn: bool = True) -> list[str]:
    """Greedy outputs for ``sources`` (decoding stops at ``<eos>``).

    Sources longer than the encoder's window are cut to it; outputs are at most the
    decoder's window (or ``max_new_tokens``) long. With ``warn`` (default) each cut is
    one ``DataWarning`` with the lengths: sources cut, and outputs that filled the window
    without an ``<eos>`` (so may be cut short). Evaluation during training passes False.
    """
    device = next(model.parameters()).device
    limit = max_new_tokens or model.config.decoder.max_len
    outputs: list[str] = []
    unfinished = 0
    for start in range(0, len(sources), batch_size):
        src = _fit_sources(encode_sources(sources[start : start + batch_size], tokenizer),
                           model.config.encoder.max_len, tokenizer.eos_id, warn)
        src_ids, src_mask = pad_sequences(src, tokenizer.pad_id)  # (B, S), (B, S)
        out = greedy_decode(model, src_ids.to(device), src_mask.to(device),
                            bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
                            max_new_tokens=limit, pad_id=tokenizer.pad_id)  # (B, N)
        for row in out.tolist():
            cut = row.index(tokenizer.eos_id) if tokenizer.eos_id in row else len(row)
            unfinished += cut == limit
            outputs.append(tokenizer.decode(row[:cut]))
    if unfinished and warn:
        warnings.warn(f"{unfinished} of {len(sources)} output(s) filled the decoder's window "
                      f"({limit} tokens) without <eos> and may be cut short", DataWarning,
                      stacklevel=3)
    return outputs


def exact_match(model: EncoderDecoder, tokenizer: CharTokenizer,
                pairs: Sequence[tuple[str, str]]) -> float:
    """Share of pairs whose greedy output equals the target exactly (no warnings: an
    untrained model runs to the window all the time)."""
    predicted = translate(model, tokenizer, [s for s, _ in pairs], warn=False)
    return sum(p == t for p, (_, t) in zip(predicted, pairs, strict=True)) / max(len(pairs), 1)


class Seq2SeqEvalLog:
    """Trainer callback: held-out exact match at every evaluation; lines to metrics.jsonl."""

    def __init__(self, model: EncoderDecoder, tokenizer: CharTokenizer,
                 pairs: Sequence[tuple[str, str]], path: Path | None = None) -> None:
        self.model, self.tokenizer, self.pairs = model, tokenizer, list(pairs)
        self.log = None if path is None else MetricsWriter(path)
        self.history: list[dict[str, Any]] = []

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        if self.log is not None:
            self.log.write("train", metrics)

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        entry = {**metrics, "step": step,
                 "val_exact_match": exact_match(self.model, self.tokenizer, self.pairs)}
        self.history.append(entry)
        if self.log is not None:
            self.log.write("eval", entry)


@dataclass
class Seq2SeqRun:
    run_dir: Path | None
    model: EncoderDecoder
    tokenizer: CharTokenizer
    train_config: TrainConfig
    result: TrainResult
    summary: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)


def train_seq2seq(
    task: str,
    *,
    out_dir: str | Path | None,
    min_len: int | None = None,
    max_len: int | None = None,
    n_val: int = 500,
    model_overrides: dict[str, Any] | None = None,
    train_overrides: dict[str, Any] | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> Seq2SeqRun:
    """Train an ``EncoderDecoder`` on a built-in task; held-out exact match at the end.

    ``out_dir`` (None: write nothing) must be new, empty or a seq2seq run (replaced);
    anything else is refused with a ``RunFolderError`` before training unless ``overwrite``
    (``runs.writing_folder``: even then only handformer's own files are removed). It is
    locked while the job writes."""
    run_dir = None if out_dir is None else folder_path(out_dir)
    if run_dir is not None:
        check_destination(run_dir, SEQ2SEQ_FOLDER, overwrite=overwrite)
    if task not in SEQ2SEQ_TASKS:
        raise ValueError(f"unknown seq2seq task {task!r}; expected one of {sorted(SEQ2SEQ_TASKS)}")
    spec = SEQ2SEQ_TASKS[task]
    min_len = spec.default_min_len if min_len is None else min_len
    max_len = spec.default_max_len if max_len is None else max_len
    train_cfg = TrainConfig.from_dict({**SEQ2SEQ_PRESET.train, "block_size": max_len,
                                       **(train_overrides or {})})
    tokenizer = CharTokenizer(SEQ2SEQ_ALPHABET)
    src_len, tgt_len = spec.max_lengths(max_len)
    shape = {**SEQ2SEQ_PRESET.model, **(model_overrides or {}), "vocab_size": tokenizer.vocab_size}
    config = Seq2SeqConfig(encoder=ModelConfig.from_dict({**shape, "max_len": src_len + 1}),
                           decoder=ModelConfig.from_dict({**shape, "max_len": tgt_len + 1}))
    # Before the model and before any pairs are drawn (--max-len 10⁶ would take minutes).
    check_training(config, train_cfg.batch_size, tgt_len + 1, pick_device(train_cfg.device),
                   source_len=src_len + 1,
                   hint="use a smaller --max-len or --batch-size, or a smaller model "
                        "(--d-model, --n-layers)")
    torch.manual_seed(train_cfg.seed)
    model = EncoderDecoder(config)

    val_pairs = seq2seq_pairs(task, n_val, min_len=min_len, max_len=max_len,
                              seed=train_cfg.seed + 1)
    held_out = frozenset(s for s, _ in val_pairs)

    def train_batch(generator: torch.Generator) -> Seq2SeqBatch:
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        pairs = seq2seq_pairs(task, train_cfg.batch_size, min_len=min_len, max_len=max_len,
                              seed=seed, exclude=held_out)
        return collate_pairs(pairs, tokenizer)

    val_batches = [collate_pairs(val_pairs[i : i + 256], tokenizer)
                   for i in range(0, len(val_pairs), 256)]
    with ExitStack() as held:
        if run_dir is not None:  # claimed and locked until the run folder is complete
            held.enter_context(writing_folder(run_dir, SEQ2SEQ_FOLDER, overwrite=overwrite))
        evaluator = Seq2SeqEvalLog(model, tokenizer, val_pairs,
                                   None if run_dir is None else run_dir / METRICS)
        trainer = Trainer(model, train_cfg, train_batch=train_batch, val_batches=val_batches,
                          loss_fn=lm_loss, forward_fn=seq2seq_forward, callbacks=[evaluator],
                          progress=progress)
        start = time.perf_counter()
        result = trainer.fit()
        summary = {
            "task": task,
            "description": spec.description,
            "min_len": min_len,
            "max_len": max_len,
            "num_val": len(val_pairs),
            "val_exact_match": exact_match(model, tokenizer, val_pairs),
            "final_val_loss": result.final_val_loss,
            "seconds": time.perf_counter() - start,
            "median_step_ms": result.median_step_ms,
            "parameters": model.num_parameters(),
            "examples": [{"source": s, "target": t, "output": o} for (s, t), o in
                         zip(val_pairs[:5], translate(model, tokenizer,
                                                      [s for s, _ in val_pairs[:5]], warn=False),
                             strict=True)],
        }
        if run_dir is not None:
            save_run(run_dir, model, tokenizer, train_cfg,
                     extra={"task": {"name": task, "min_len": min_len, "max_len": max_len},
                                    "summary": summary})
            write_json(run_dir / SUMMARY, summary)
        return Seq2SeqRun(run_dir, model, tokenizer, train_cfg, result, summary, evaluator.history)


@dataclass
class LoadedSeq2Seq:
    model: EncoderDecoder
    tokenizer: CharTokenizer
    config: dict[str, Any]


def load_seq2seq_run(run_dir: str | Path, *, device: str = "cpu") -> LoadedSeq2Seq:
    """The encoder-decoder of a run folder written by ``handformer seq2seq train``."""
    run = load_run(run_dir, device=device, kind="seq2seq")
    return LoadedSeq2Seq(run.model, run.tokenizer, run.config)  # type: ignore[arg-type]
