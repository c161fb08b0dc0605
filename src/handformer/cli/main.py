"""The ``handformer`` command line.

``train`` lives here; every other subcommand registers itself from the module that owns it
(``add_*_subcommand``) and names its handler with ``set_defaults(handler=...)``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from handformer.config import PRECISIONS, PRESETS, STRATEGIES
    from handformer.nn.attention import ATTENTION_KINDS
    from handformer.nn.positional import POSITIONAL_KINDS

    parser = argparse.ArgumentParser(
        prog="handformer", description="A Transformer written by hand: train, sample, inspect.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train", help="train a character-level language model (or --resume one)",
        description="Train a character LM and write a run folder; --resume RUN_DIR continues "
        "a run exactly from its newest checkpoint.")
    train.add_argument("--data", type=Path, default=None,
                       help="UTF-8 text file (default: Python's built-in documentation text)")
    train.add_argument("--out", type=Path, default=None,
                       help="run folder to write (default: runs/default)")
    train.add_argument("--preset", default=None, choices=sorted(PRESETS),
                       help="model + training recipe (default: default)")
    train.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                       help="continue RUN_DIR from its newest checkpoint; the recipe, "
                       "tokenizer and data come from the run folder (only --max-steps and "
                       "--no-progress may be given)")
    train.add_argument("--overwrite", action="store_true",
                       help="replace an unfinished run in --out instead of refusing")
    train.add_argument("--tokenizer", choices=("char", "bpe"), default=None,
                       help="characters (default) or a byte-level BPE learned on the text")
    train.add_argument("--vocab-size", type=_positive_int, default=None,
                       help="BPE vocabulary size (default 1000; with --tokenizer bpe)")
    train.add_argument("--max-steps", type=_positive_int, default=None)
    train.add_argument("--batch-size", type=_positive_int, default=None,
                       help="micro-batch size (windows per forward pass)")
    train.add_argument("--grad-accum", type=_positive_int, default=None, metavar="N",
                       help="accumulate N micro-batches per optimizer step")
    train.add_argument("--lr", type=float, default=None)
    train.add_argument("--seed", type=int, default=None)
    train.add_argument("--dropout", type=float, default=None)
    train.add_argument("--device", default=None, help="auto (default), cpu, cuda, mps")
    train.add_argument("--precision", choices=PRECISIONS, default=None,
                       help="fp32 (default); bf16 autocast (cpu, cuda); fp16 + GradScaler "
                       "(cuda)")
    train.add_argument("--strategy", choices=STRATEGIES, default=None,
                       help="under torchrun: ddp (default; every rank holds the whole model) "
                       "or fsdp (weights, gradients and optimizer state sharded over ranks)")
    train.add_argument("--compile", action="store_true", default=None,
                       help="compile the model with torch.compile")
    train.add_argument("--attention", choices=ATTENTION_KINDS, default=None)
    train.add_argument("--positional", choices=POSITIONAL_KINDS, default=None)
    train.add_argument("--log-interval", type=_positive_int, default=None)
    train.add_argument("--eval-interval", type=_positive_int, default=None)
    train.add_argument("--checkpoint-interval", type=_positive_int, default=None,
                       help="steps between checkpoints (default: at every evaluation)")
    train.add_argument("--keep-last", type=_positive_int, default=None,
                       help="checkpoints to keep besides the best (default 3)")
    train.add_argument("--patience", type=_positive_int, default=None,
                       help="stop after this many evaluations without a better val loss")
    train.add_argument("--max-nonfinite", type=_positive_int, default=None,
                       help="stop after this many steps with a NaN/Inf loss or gradient")
    train.add_argument("--tensorboard", action="store_true", default=None,
                       help="also log to RUN_DIR/tensorboard (needs handformer[tensorboard])")
    train.add_argument("--no-plot", action="store_true",
                       help="do not draw loss_curve.png")
    train.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    from handformer.bench.length_study import add_experiment_subcommand
    from handformer.bench.runner import add_bench_subcommand
    from handformer.cli.convert import add_convert_subcommand
    from handformer.cli.doctor import add_doctor_subcommand
    from handformer.cli.embed import add_embed_subcommand
    from handformer.cli.encoders import add_subcommands as add_encoder_subcommands
    from handformer.cli.explore import add_explore_subcommand
    from handformer.cli.generate import add_generate_subcommand

    add_generate_subcommand(sub)
    add_encoder_subcommands(sub)  # classify, seq2seq
    add_doctor_subcommand(sub)
    add_explore_subcommand(sub)
    add_embed_subcommand(sub)
    add_convert_subcommand(sub)
    add_experiment_subcommand(sub)
    add_bench_subcommand(sub)
    from handformer.cli.examples import add_examples

    return add_examples(parser)  # an "examples:" section in every command's --help


_RESUME_ALLOWED = {"resume", "max_steps", "no_progress", "strategy", "command"}


def _train_overrides(args: argparse.Namespace) -> dict[str, object]:
    given = {
        "max_steps": args.max_steps, "batch_size": args.batch_size, "lr": args.lr,
        "seed": args.seed, "device": args.device, "grad_accum_steps": args.grad_accum,
        "precision": args.precision, "compile": args.compile,
        "log_interval": args.log_interval, "eval_interval": args.eval_interval,
        "checkpoint_interval": args.checkpoint_interval, "keep_last": args.keep_last,
        "early_stopping_patience": args.patience, "max_nonfinite_steps": args.max_nonfinite,
        "tensorboard": args.tensorboard, "loss_curve": False if args.no_plot else None,
        "strategy": args.strategy,
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
    from handformer.train.distributed import shutdown_distributed

    run = None
    try:
        code, run = _train(args)
        return code
    finally:
        if run is not None:
            shutdown_distributed(run.dist)


def _train(args: argparse.Namespace) -> tuple[int, Any]:
    from handformer.data.corpora import builtin_text, read_text_file
    from handformer.jobs.lm import BUILTIN_SOURCE, resume_char_lm, train_char_lm
    from handformer.train.callbacks import MissingExtraError
    from handformer.train.trainer import NonFiniteError

    say = print if _is_main_process() else (lambda *a, **k: None)
    try:
        if args.resume is not None:
            extra = sorted(f"--{k.replace('_', '-')}" for k, v in vars(args).items()
                           if k not in _RESUME_ALLOWED and v not in (None, False))
            if extra:
                raise ValueError(f"--resume takes the recipe from the run folder; it accepts "
                                 f"only --max-steps, --strategy and --no-progress, got {extra}")
            say(f"resuming {args.resume}", flush=True)
            run = resume_char_lm(args.resume, max_steps=args.max_steps,
                                 progress=not args.no_progress, strategy=args.strategy)
            say(f"resumed from step {run.resumed_from}")
        else:
            text = builtin_text() if args.data is None else read_text_file(args.data)
            source = "built-in Python documentation text" if args.data is None else str(args.data)
            preset = args.preset or "default"
            model_overrides = {k: v for k, v in {
                "attention": args.attention, "positional": args.positional,
                "dropout": args.dropout}.items() if v is not None}
            if args.vocab_size is not None and args.tokenizer != "bpe":
                raise ValueError("--vocab-size applies to --tokenizer bpe only")
            say(f"training on {source} ({len(text):,} characters), preset {preset!r}",
                flush=True)
            run = train_char_lm(
                text, out_dir=args.out or Path("runs/default"), preset=preset,
                model_overrides=model_overrides, train_overrides=_train_overrides(args),
                progress=not args.no_progress, overwrite=args.overwrite,
                tokenizer=args.tokenizer or "char", vocab_size=args.vocab_size or 1000,
                data_source=BUILTIN_SOURCE if args.data is None else str(args.data.resolve()))
    except MissingExtraError as err:
        print(f"handformer train: error: {err}", file=sys.stderr)
        return 2, None
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
    print(f"run folder: {run.run_dir}")
    if run.dist.is_distributed:
        print(f"trained on {run.dist.world_size} processes ({run.train_config.strategy}), "
              f"global batch {run.train_config.batch_size} windows")
    print("\n--- sample ---")
    print(run.sample)
    return 0, run


def main(argv: Sequence[str] | None = None) -> int:
    from handformer.train.distributed import launched_by_torchrun

    if launched_by_torchrun():
        # torchrun's summary then shows the failing rank's traceback, not just its exit code.
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(_main)(argv)
    return _main(argv)


def _main(argv: Sequence[str] | None = None) -> int:
    from handformer.train.distributed import launched_by_torchrun

    args = build_parser().parse_args(argv)
    handler = _cmd_train if args.command == "train" else args.handler
    if args.command != "train" and launched_by_torchrun():
        # N copies of a single-process command would race to write the same files.
        print(f"handformer {args.command}: error: only `handformer train` runs under torchrun "
              f"(WORLD_SIZE={os.environ.get('WORLD_SIZE')}); run `handformer {args.command}` "
              "as one process", file=sys.stderr)
        return 2
    try:
        return handler(args)
    except (ValueError, OSError) as err:
        print(f"handformer {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
