"""What several commands share: argument types, the encoder jobs' training options, and the
wrapper that runs a handler with ``--threads`` torch threads and prints its warnings as
plain lines."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Handler", "UsageError", "add_threads_option", "add_training_options",
           "check_recipe", "positive_int", "reporting", "training_overrides"]


class UsageError(ValueError):
    """The command line itself is wrong (an option's value out of range, options that
    contradict each other): exit code 2, like argparse's own errors. Everything else a
    command refuses (files, folders, run state) is a runtime error: exit code 1."""


def positive_int(text: str) -> int:
    """argparse type: an integer > 0, or a usage error naming what was given."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text}")
    return value


def add_training_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-steps", type=positive_int, default=None)
    p.add_argument("--batch-size", type=positive_int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="linear warm-up steps (0 = none)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, mps")
    p.add_argument("--norm", choices=("pre", "post"), default=None,
                   help="block norm placement (default: pre)")
    p.add_argument("--d-model", type=positive_int, default=None)
    p.add_argument("--n-layers", type=positive_int, default=None)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_threads_option(p)


def add_threads_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch intra-op threads (default 1: these models are small, and on a "
                        "busy machine more threads make each step several times slower)")


def training_overrides(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model overrides, train overrides) from the options actually given."""
    train = {k: v for k, v in {
        "max_steps": args.max_steps, "batch_size": args.batch_size, "lr": args.lr,
        "warmup_steps": args.warmup_steps, "seed": args.seed, "device": args.device,
    }.items() if v is not None}
    if args.max_steps is not None:  # keep evaluations inside short runs
        train.setdefault("eval_interval", max(1, args.max_steps // 6))
        train.setdefault("log_interval", max(1, min(50, args.max_steps // 6)))
    model = {k: v for k, v in {"norm": args.norm, "d_model": args.d_model,
                                "n_layers": args.n_layers}.items() if v is not None}
    return model, train


def check_recipe(preset: Any, model_overrides: dict[str, Any],
                 train_overrides: dict[str, Any], *, max_len: int) -> None:
    """The encoder jobs' options checked the way their configs will check them, before any
    data is read: a value a config refuses (``--lr -1``, ``--d-model`` that ``n_heads`` does
    not divide) is a usage error. ``preset`` is a ``config.Preset``."""
    from handformer.config import ModelConfig, TrainConfig

    try:
        TrainConfig.from_dict({**preset.train, "block_size": max_len, **train_overrides})
        ModelConfig.from_dict({**preset.model, **model_overrides, "vocab_size": 1,
                               "max_len": max_len})
    except ValueError as err:
        raise UsageError(str(err)) from None


@contextmanager
def _reported_warnings(prefix: str) -> Iterator[None]:
    """Show warnings (truncation, skipped rows) as they happen, one plain line each."""

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        print(f"{prefix}: warning: {message}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = show
        yield


Handler = Callable[[argparse.Namespace], int]


def reporting(command: str, fn: Handler) -> Handler:
    """``fn`` run with ``--threads`` torch threads (restored afterwards) and its warnings
    printed as ``handformer COMMAND: warning: …``."""

    def run(args: argparse.Namespace) -> int:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(args.threads)
        try:
            with _reported_warnings(f"handformer {command}"):
                return fn(args)
        finally:
            torch.set_num_threads(threads)

    return run


