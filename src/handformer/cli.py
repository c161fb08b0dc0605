"""Command line: ``handformer train`` and ``handformer generate``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from handformer.config import PRESETS

    parser = argparse.ArgumentParser(
        prog="handformer", description="A Transformer written by hand: train, sample, inspect.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a character-level language model")
    train.add_argument("--data", type=Path, default=None,
                       help="UTF-8 text file (default: Python's built-in documentation text)")
    train.add_argument("--out", type=Path, default=Path("runs/default"),
                       help="run folder to write (default: runs/default)")
    train.add_argument("--preset", default="default", choices=sorted(PRESETS),
                       help="model + training recipe (default: default)")
    train.add_argument("--max-steps", type=_positive_int, default=None)
    train.add_argument("--batch-size", type=_positive_int, default=None)
    train.add_argument("--lr", type=float, default=None)
    train.add_argument("--seed", type=int, default=None)
    train.add_argument("--device", default=None, help="auto (default), cpu, cuda, mps")
    train.add_argument("--attention", choices=("manual", "sdpa"), default=None)
    train.add_argument("--positional", choices=("sinusoidal", "learned"), default=None)
    train.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    gen = sub.add_parser("generate", help="sample text from a trained run folder")
    gen.add_argument("--run", type=Path, required=True, help="run folder written by train")
    gen.add_argument("--prompt", default="\n")
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default="cpu")
    return parser


def _cmd_train(args: argparse.Namespace) -> int:
    from handformer.corpora import builtin_text, read_text_file
    from handformer.train.lm_run import train_char_lm

    text = builtin_text() if args.data is None else read_text_file(args.data)
    source = "built-in Python documentation text" if args.data is None else str(args.data)
    train_overrides = {k: v for k, v in {
        "max_steps": args.max_steps, "batch_size": args.batch_size, "lr": args.lr,
        "seed": args.seed, "device": args.device}.items() if v is not None}
    if args.max_steps is not None:
        # Keep the recipe's shape on shorter runs: warm-up and evaluation fit inside them.
        train_overrides.setdefault("eval_interval", max(1, min(250, args.max_steps // 4)))
    model_overrides = {k: v for k, v in {
        "attention": args.attention, "positional": args.positional}.items() if v is not None}
    print(f"training on {source} ({len(text):,} characters), preset {args.preset!r}",
          flush=True)
    run = train_char_lm(text, out_dir=args.out, preset=args.preset,
                        model_overrides=model_overrides, train_overrides=train_overrides,
                        progress=not args.no_progress)
    r = run.result
    print(f"\nparameters: {run.model.num_parameters():,}   steps: {r.steps}   "
          f"time: {r.seconds:.1f}s   median step: {r.median_step_ms:.1f} ms")
    print(f"validation loss: {r.final_val_loss:.4f} nats/token "
          f"(unigram baseline {run.unigram_loss:.4f})")
    print(f"run folder: {run.run_dir}")
    print("\n--- sample ---")
    print(run.sample)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from handformer.generate import generate
    from handformer.train.run_folder import load_run

    model, tokenizer, _ = load_run(args.run, device=args.device)
    if not args.prompt:
        raise ValueError("--prompt is empty; give at least one character")
    prompt = torch.tensor([tokenizer.encode(args.prompt)], dtype=torch.long)
    out = generate(model, prompt, args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, seed=args.seed)
    print(tokenizer.decode(out[0].tolist()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"train": _cmd_train, "generate": _cmd_generate}
    try:
        return handlers[args.command](args)
    except (ValueError, OSError) as err:
        print(f"handformer {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
