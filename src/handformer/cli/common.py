"""What several commands share: argument types, the encoder jobs' training options, and the
wrapper that runs a handler with ``--threads`` torch threads and prints its warnings as
plain lines."""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["DROPOUT", "FRACTION", "NON_NEGATIVE", "POSITIVE", "PROBABILITY", "SEED_RANGE",
           "Handler", "UsageError", "add_overwrite_option", "add_threads_option",
           "add_training_options", "check_output_file", "check_recipe", "device_name",
           "finite_float", "folder_arg", "non_negative_int", "positive_int", "reporting",
           "seed_int", "text_arg", "training_overrides"]


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


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0, or a usage error naming what was given."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0; got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0; got {text}")
    return value


# torch's generators take seeds in [-2**63, 2**64 - 1]; outside it torch.manual_seed fails
# deep inside the run with "Overflow when unpacking long long", naming nothing.
SEED_RANGE = (-(2**63), 2**64 - 1)


def seed_int(text: str) -> int:
    """argparse type: a random seed torch can take, or a usage error naming the range."""
    lo, hi = SEED_RANGE
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed; got {text!r}") from None
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(f"expected a seed in [{lo}, {hi}]; got {text}")
    return value


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number; got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535]; got {value}")
    return value


def device_name(text: str) -> str:
    """argparse type: ``auto`` or a device torch can name (``cpu``, ``cuda``, ``cuda:1``,
    ``mps``). A typo is a usage error here; a bare ``torch.device`` failure surfaced later,
    while loading weights, as if the weights file were at fault. Whether the device exists on
    this machine is checked where it is used (a runtime error)."""
    if text == "auto":
        return text
    import torch

    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"expected auto, cpu, cuda[:N] or mps; got {text!r}") from None
    return text


def finite_float(low: float | None = None, high: float | None = None, *,
                 low_open: bool = False, high_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number within the bounds (``low_open`` / ``high_open``
    exclude them), else a usage error (exit 2) naming the option and the value given.

    ``float()`` alone accepts ``nan``, ``inf`` and ``1e999``: NaN compares False with every
    bound, so it slipped past every later range check (``--temperature nan`` sampled from
    NaN, ``--lr inf`` trained a step and then failed writing JSON)."""
    lo = "" if low is None else f"{'>' if low_open else '>='} {low:g}"
    hi = "" if high is None else f"{'<' if high_open else '<='} {high:g}"
    wanted = "a finite number" + (f" {lo}" if lo else "") + (" and" if lo and hi else "") + \
        (f" {hi}" if hi else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}; got {text!r}") from None
        if (not math.isfinite(value)
                or (low is not None and (value <= low if low_open else value < low))
                or (high is not None and (value >= high if high_open else value > high))):
            raise argparse.ArgumentTypeError(f"expected {wanted}; got {text!r}")
        return value

    parse.__name__ = "finite number"  # argparse's fallback message: "invalid finite number"
    return parse


# The ranges float options share (argparse types; each refuses nan and inf by name).
POSITIVE = finite_float(0.0, low_open=True)  # learning rates, penalties
NON_NEGATIVE = finite_float(0.0)  # temperature (0 = greedy)
FRACTION = finite_float(0.0, 1.0, low_open=True, high_open=True)  # a validation share
PROBABILITY = finite_float(0.0, 1.0, low_open=True)  # top-p
DROPOUT = finite_float(0.0, 1.0, high_open=True)


def folder_arg(text: str) -> Path:
    """argparse type for a folder path: an empty or blank string is a usage error naming the
    option (``Path("")`` would quietly mean the current folder, and a command would write —
    or clean — there)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a folder path; got an empty path {text!r} "
                                         "(use '.' to mean the current folder)")
    return Path(text)


def text_arg(text: str) -> str:
    """argparse type for text given on the command line: bytes that are not UTF-8 (Python
    carries them as lone surrogates) are a usage error naming them, not a failure deep in a
    tokenizer ("TextInputSequence must be str")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raw = text.encode("utf-8", "surrogateescape")
        raise argparse.ArgumentTypeError(
            f"expected UTF-8 text; got bytes that are not ({raw[:40]!r}"
            f"{'…' if len(raw) > 40 else ''})") from None
    return text


def add_overwrite_option(p: argparse.ArgumentParser, what: str) -> None:
    """``--overwrite``: write into ``what`` even if it is not a new or empty folder or one
    this command wrote before (``handformer.runs.writing_folder``)."""
    p.add_argument("--overwrite", action="store_true",
                   help=f"write into {what} even if it holds files handformer did not write, "
                        "another kind of output or an unfinished run; only files handformer "
                        "wrote are ever removed")


def check_output_file(path: Path, option: str, *, overwrite: bool,
                      ours: Callable[[Path], bool] | None = None) -> None:
    """Refuse (``ValueError``, a runtime refusal) to replace an existing file a command did
    not write: ``ours(path)`` says when it did; ``overwrite`` allows it anyway. A folder
    where the file should go is refused too."""
    if path.is_dir():
        raise ValueError(f"{option} {path} is a folder; give the path of a file to write")
    if path.exists() and not overwrite and not (ours is not None and ours(path)):
        raise ValueError(f"{option} {path} exists and handformer did not write it; give a "
                         "new file, or pass --overwrite to replace it")


def add_training_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-steps", type=positive_int, default=None)
    p.add_argument("--batch-size", type=positive_int, default=None)
    p.add_argument("--lr", type=POSITIVE, default=None, help="learning rate (> 0)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="linear warm-up steps (0 = none)")
    p.add_argument("--seed", type=seed_int, default=None)
    p.add_argument("--device", type=device_name, default="auto",
                   help="auto (default), cpu, cuda, mps")
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
    """``fn`` run with ``--threads`` torch threads (restored afterwards; a command without
    the option keeps torch's count) and its warnings printed as
    ``handformer COMMAND: warning: …``."""

    def run(args: argparse.Namespace) -> int:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(getattr(args, "threads", threads))
        try:
            with _reported_warnings(f"handformer {command}"):
                return fn(args)
        finally:
            torch.set_num_threads(threads)

    return run


