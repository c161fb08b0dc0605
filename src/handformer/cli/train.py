"""``handformer train``: the language-model job (``handformer.jobs.lm``) from the command
line — a fresh run on the built-in text or a file, or ``--resume`` of an unfinished one."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from handformer.cli.common import (
    DROPOUT,
    POSITIVE,
    UsageError,
    add_overwrite_option,
    device_name,
    folder_arg,
    positive_int,
    seed_int,
)
from handformer.cli.finetune import add_lora_options, lora_config

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add ``train`` to ``handformer``'s sub-parsers."""
    from handformer.config import OPTIMIZERS, PRECISIONS, PRESETS, STRATEGIES
    from handformer.interop.families import FAMILIES
    from handformer.nn.attention import ATTENTION_KINDS
    from handformer.nn.positional import POSITIONAL_KINDS

    train = sub.add_parser(
        "train", help="train a language model on characters or BPE (or --resume one)",
        description="Train a language model (characters or a byte-level BPE) and write a run "
        "folder; --resume RUN_DIR continues a run exactly from its newest checkpoint.")
    train.add_argument("--data", type=Path, default=None,
                       help="UTF-8 text file (default: Python's built-in documentation text)")
    train.add_argument("--out", type=folder_arg, default=None,
                       help="run folder to write: new, empty, or a run folder of `train` "
                       "(default: runs/default)")
    train.add_argument("--preset", default=None, choices=sorted(PRESETS),
                       help="model + training recipe (default: default)")
    train.add_argument("--resume", type=folder_arg, default=None, metavar="RUN_DIR",
                       help="continue RUN_DIR from its newest checkpoint; the recipe, "
                       "tokenizer and data come from the run folder (only --max-steps and "
                       "--no-progress may be given)")
    train.add_argument("--draft-for", type=folder_arg, default=None, metavar="RUN_DIR",
                       help="train a draft for speculative decoding (`generate --draft`): "
                       "RUN_DIR's tokenizer, window and training text (unless --data), and "
                       "the preset 'draft' unless --preset says otherwise")
    train.add_argument("--from", dest="from_", type=folder_arg, default=None, metavar="RUN",
                       help="continue the language model of RUN (a run of `train`, or a "
                       "Hugging Face folder imported with `convert --from hf`) on --data, "
                       "with its own tokenizer; every weight, or only --lora adapters")
    add_lora_options(train, "q,v")
    add_overwrite_option(train, "--out")
    train.add_argument("--tokenizer", choices=("char", "bpe"), default=None,
                       help="characters (default) or a byte-level BPE learned on the text")
    train.add_argument("--vocab-size", type=positive_int, default=None,
                       help="BPE vocabulary size (default 1000; with --tokenizer bpe)")
    train.add_argument("--max-steps", type=positive_int, default=None)
    train.add_argument("--batch-size", type=positive_int, default=None,
                       help="micro-batch size (windows per forward pass)")
    train.add_argument("--grad-accum", type=positive_int, default=None, metavar="N",
                       help="accumulate N micro-batches per optimizer step")
    train.add_argument("--lr", type=POSITIVE, default=None, help="learning rate (> 0)")
    train.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                       help="adamw, or muon: torch's Muon for the blocks' weight matrices and "
                            "AdamW (at --lr) for the rest; the split is in summary.json")
    train.add_argument("--seed", type=seed_int, default=None)
    train.add_argument("--dropout", type=DROPOUT, default=None, help="in [0, 1)")
    train.add_argument("--device", type=device_name, default=None,
                       help="auto (default), cpu, cuda, mps")
    train.add_argument("--precision", choices=PRECISIONS, default=None,
                       help="fp32 (default); bf16 autocast (cpu, cuda); fp16 + GradScaler "
                       "(cuda); auto: bf16 where the CPU/GPU multiplies it natively, else fp32 "
                       "(summary.json says which and why)")
    train.add_argument("--strategy", choices=STRATEGIES, default=None,
                       help="under torchrun: ddp (default; every rank holds the whole model) "
                       "or fsdp (weights, gradients and optimizer state sharded over ranks)")
    train.add_argument("--compile", action="store_true", default=None,
                       help="compile the model with torch.compile")
    train.add_argument("--attention", choices=ATTENTION_KINDS, default=None)
    train.add_argument("--positional", choices=POSITIONAL_KINDS, default=None)
    train.add_argument("--family", choices=FAMILIES, default=None,
                       help="give the preset's model the architecture of a Hugging Face "
                            "family (gpt2, llama, qwen3), so `convert --to hf` writes that "
                            "family's folder")
    train.add_argument("--log-interval", type=positive_int, default=None)
    train.add_argument("--eval-interval", type=positive_int, default=None)
    train.add_argument("--checkpoint-interval", type=positive_int, default=None,
                       help="steps between checkpoints (default: at every evaluation)")
    train.add_argument("--keep-last", type=positive_int, default=None,
                       help="checkpoints to keep besides the best (default 3)")
    train.add_argument("--patience", type=positive_int, default=None,
                       help="stop after this many evaluations without a better val loss")
    train.add_argument("--until-val-loss", type=POSITIVE, default=None, metavar="LOSS",
                       help="stop at the first evaluation whose val loss is <= LOSS (the "
                       "time to a loss, as a speedrun measures it)")
    train.add_argument("--max-nonfinite", type=positive_int, default=None,
                       help="stop after this many steps with a NaN/Inf loss or gradient")
    train.add_argument("--tensorboard", action="store_true", default=None,
                       help="also log to RUN_DIR/tensorboard (needs handformer[tensorboard])")
    train.add_argument("--no-plot", action="store_true",
                       help="do not draw loss_curve.png")
    train.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    train.set_defaults(handler=_cmd_train)


_RESUME_ALLOWED = {"resume", "max_steps", "no_progress", "strategy", "command", "handler"}


def _train_overrides(args: argparse.Namespace) -> dict[str, object]:
    given = {
        "max_steps": args.max_steps, "batch_size": args.batch_size, "lr": args.lr,
        "seed": args.seed, "device": args.device, "grad_accum_steps": args.grad_accum,
        "precision": args.precision, "compile": args.compile,
        "log_interval": args.log_interval, "eval_interval": args.eval_interval,
        "checkpoint_interval": args.checkpoint_interval, "keep_last": args.keep_last,
        "early_stopping_patience": args.patience, "max_nonfinite_steps": args.max_nonfinite,
        "target_val_loss": args.until_val_loss,
        "tensorboard": args.tensorboard, "loss_curve": False if args.no_plot else None,
        "strategy": args.strategy, "optimizer": args.optimizer,
    }
    overrides = {k: v for k, v in given.items() if v is not None}
    if args.max_steps is not None and args.eval_interval is None:
        # Keep the recipe's shape on shorter runs: warm-up and evaluation fit inside them.
        overrides["eval_interval"] = max(1, min(250, args.max_steps // 4))
    return overrides


def _is_main_process() -> bool:
    """Rank 0 of a torchrun job, or a plain process: the one that prints."""
    return os.environ.get("RANK", "0") == "0"


def _cmd_train(args: argparse.Namespace) -> int:
    import torch.distributed as torch_dist

    from handformer.cli.errors import Interrupted, Terminated

    started = time.time()
    try:
        code, _ = _train(args)
        if torch_dist.is_available() and torch_dist.is_initialized():
            # Every rank leaves the group together: a rank that tears its gloo group down
            # while another still runs (rank 0 printing its sample) can abort at exit.
            torch_dist.barrier()
        return code
    except (KeyboardInterrupt, Terminated) as err:
        run_dir = args.resume or args.out or Path("runs/default")
        since = None if args.resume is not None else started
        raise Interrupted.from_exception(err, _resume_hint(run_dir, since)) from None
    finally:
        # Leave torchrun's process group also when the job failed after joining it (rank 0
        # refused the run folder): a process that exits in it aborts in the backend's
        # destructor ("terminate called without an active exception").
        if torch_dist.is_available() and torch_dist.is_initialized():
            torch_dist.destroy_process_group()


def _resume_hint(run_dir: Path, since: float | None) -> str:
    """Where an interrupted run can continue from: the newest committed checkpoint (of this
    run: committed after ``since``, for a fresh one) and the command that resumes it."""
    from handformer.train.checkpoint import MARKER, list_checkpoints, read_checkpoint_json

    try:
        found = [c for c in list_checkpoints(run_dir / "checkpoints")
                 if since is None or (c.path / MARKER).stat().st_mtime >= since]
        finished = bool(found) and read_checkpoint_json(
            found[-1].path, "trainer_state.json", verify=False).get("finished") is True
    except (OSError, ValueError):
        found, finished = [], False
    if not found:
        return "no checkpoint was committed yet: nothing to resume, start the run again"
    newest = found[-1]
    if finished:
        return (f"training had finished: {newest.path} is the final checkpoint (step "
                f"{newest.step}); `handformer train --resume {run_dir} --max-steps N` "
                "trains further")
    return (f"the newest committed checkpoint is {newest.path} (step {newest.step}); "
            f"continue with `handformer train --resume {run_dir}`")


def _check_options(args: argparse.Namespace, preset: str) -> None:
    """Options that contradict each other, or values a config refuses, are usage errors:
    found here, before any text is read or anything is written."""
    from handformer.jobs.lm import build_configs

    if args.vocab_size is not None and args.tokenizer != "bpe":
        raise UsageError("--vocab-size applies to --tokenizer bpe only")
    try:  # the vocabulary is not known yet; any size checks the other fields
        build_configs(preset, 1, _model_overrides(args), _train_overrides(args))
    except ValueError as err:
        raise UsageError(str(err)) from None


def _train_draft(args: argparse.Namespace, say: Any) -> Any:
    """``--draft-for RUN_DIR``: a small model on the target run's text, with its tokenizer
    and window, so that ``generate --draft`` can check its proposals id for id."""
    from handformer.config import get_preset
    from handformer.jobs.lm import draft_target, train_lm

    if args.tokenizer is not None or args.vocab_size is not None:
        raise UsageError("--draft-for takes the tokenizer from RUN_DIR; drop --tokenizer and "
                         "--vocab-size")
    preset = args.preset or "draft"
    _check_options(args, preset)
    out = args.out or Path("runs/draft")
    if out.exists() and args.draft_for.exists() and out.resolve() == args.draft_for.resolve():
        raise UsageError(f"--out {out} is the run --draft-for reads: the draft would replace "
                         "its own target (--overwrite or not); give the draft its own folder")
    target = draft_target(args.draft_for, args.data)
    train_overrides = _train_overrides(args)
    block = train_overrides.get("block_size", get_preset(preset).train.get("block_size", 64))
    train_overrides["block_size"] = min(int(block), target.max_len)  # type: ignore[call-overload]
    say(f"training a draft for {target.run_dir} on {target.data_source or args.data} "
        f"({len(target.text):,} characters), preset {preset!r}, its tokenizer "
        f"({target.tokenizer.vocab_size} tokens) and window ({target.max_len})", flush=True)
    return train_lm(
        target.text, out_dir=out, preset=preset,
        model_overrides={**_model_overrides(args), "max_len": target.max_len},
        train_overrides=train_overrides, progress=not args.no_progress,
        overwrite=args.overwrite, tokenizer=target.tokenizer,
        data_source=target.data_source)


# What --from takes from the base run, so cannot be given.
_FROM_REFUSED = ("tokenizer", "vocab_size", "attention", "positional", "family", "dropout",
                 "draft_for")


def _train_from(args: argparse.Namespace, say: Any) -> Any:
    """``--from RUN``: the base run's model and tokenizer, trained further on ``--data``."""
    from handformer.data.corpora import read_text_file
    from handformer.jobs.lm import finetune_lm

    refused = [f"--{k.replace('_', '-')}" for k in _FROM_REFUSED if getattr(args, k)]
    if refused:
        raise UsageError(f"--from takes the model and tokenizer from RUN; drop {refused}")
    if args.data is None:
        raise UsageError("--from needs --data, the text to continue the model on")
    lora = lora_config(args, "q,v")
    preset = args.preset or "default"
    text = read_text_file(args.data)
    how = "full fine-tuning" if lora is None else f"LoRA r={lora.r} on {','.join(lora.targets)}"
    say(f"fine-tuning {args.from_} on {args.data} ({len(text):,} characters), {how}",
        flush=True)
    return finetune_lm(args.from_, text, out_dir=args.out or Path("runs/finetune"), lora=lora,
                       preset=preset, train_overrides=_train_overrides(args),
                       progress=not args.no_progress, overwrite=args.overwrite,
                       data_source=str(args.data.resolve()))


def _model_overrides(args: argparse.Namespace) -> dict[str, object]:
    from handformer.interop.families import FAMILY_ARCHITECTURE

    family = {} if args.family is None else FAMILY_ARCHITECTURE[args.family]
    if args.family is not None and args.positional not in (None, family["positional"]):
        raise UsageError(f"--family {args.family} needs positional={family['positional']!r}; "
                         f"got --positional {args.positional}")
    return {**family, **{k: v for k, v in {"attention": args.attention,
                                           "positional": args.positional,
                                           "dropout": args.dropout}.items() if v is not None}}


def _train(args: argparse.Namespace) -> tuple[int, Any]:
    from handformer.data.corpora import builtin_text, read_text_file
    from handformer.jobs.lm import BUILTIN_SOURCE, resume_lm, train_lm
    from handformer.train.trainer import NonFiniteError

    say = print if _is_main_process() else (lambda *a, **k: None)
    try:
        if args.resume is not None:
            extra = sorted(f"--{k.replace('_', '-')}" for k, v in vars(args).items()
                           if k not in _RESUME_ALLOWED and v not in (None, False))
            if extra:
                raise UsageError(f"--resume takes the recipe from the run folder; it accepts "
                                 f"only --max-steps, --strategy and --no-progress, got {extra}")
            say(f"resuming {args.resume}", flush=True)
            run = resume_lm(args.resume, max_steps=args.max_steps,
                                 progress=not args.no_progress, strategy=args.strategy)
            say(f"resumed from step {run.resumed_from}")
        elif args.from_ is not None:
            run = _train_from(args, say)
        elif args.draft_for is not None:
            run = _train_draft(args, say)
        else:
            lora_config(args, "q,v")  # LoRA options without --from are refused
            preset = args.preset or "default"
            _check_options(args, preset)
            text = builtin_text() if args.data is None else read_text_file(args.data)
            source = "built-in Python documentation text" if args.data is None else str(args.data)
            say(f"training on {source} ({len(text):,} characters), preset {preset!r}",
                flush=True)
            run = train_lm(
                text, out_dir=args.out or Path("runs/default"), preset=preset,
                model_overrides=_model_overrides(args), train_overrides=_train_overrides(args),
                progress=not args.no_progress, overwrite=args.overwrite,
                tokenizer=args.tokenizer or "char", vocab_size=args.vocab_size or 1000,
                data_source=BUILTIN_SOURCE if args.data is None else str(args.data.resolve()))
    except NonFiniteError as err:
        say(f"handformer train: error: {err}", file=sys.stderr)
        return 3, None
    if not run.dist.is_main:
        return 0, run
    r = run.result
    print(f"\nparameters: {run.model.num_parameters():,}   steps: {r.steps}   "
          f"time: {r.seconds:.1f}s   median step: {r.median_step_ms:.1f} ms")
    print(f"validation loss: {r.final_val_loss:.4f} nats/token "
          f"(unigram baseline {run.unigram_loss:.4f})")
    if r.best_step is not None:
        print(f"best validation loss: {r.best_val_loss:.4f} at step {r.best_step}")
    if r.nonfinite_steps:
        print(f"skipped steps (non-finite loss or gradient): {r.nonfinite_steps}")
    trained = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    if trained != run.model.num_parameters():  # LoRA: only the adapters trained
        print(f"trained {trained:,} of {run.model.num_parameters():,} parameters (LoRA)")
    print(f"run folder: {run.run_dir}")
    if run.dist.is_distributed:
        print(f"trained on {run.dist.world_size} processes ({run.train_config.strategy}), "
              f"global batch {run.train_config.batch_size} windows")
    print("\n--- sample ---")
    print(run.sample)
    return 0, run
