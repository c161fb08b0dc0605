"""``handformer experiment``: measurements that answer a question — ``length`` trains one
model per positional type and evaluates it at 1×, 2× and 4× its training length
(``handformer.bench.length_study``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from handformer.bench.length_study import (
    LengthStudySettings,
    run_length_study,
    to_markdown,
)
from handformer.cli.common import add_overwrite_option, folder_arg, positive_int
from handformer.nn.positional import POSITIONAL_KINDS

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add ``experiment`` to ``handformer``'s sub-parsers."""
    exp = sub.add_parser("experiment", help="measurements that answer a question")
    which = exp.add_subparsers(dest="experiment", required=True)
    length = which.add_parser(
        "length", help="train at one length with each positional type, evaluate at 1×/2×/4×")
    length.add_argument("--out", type=folder_arg, default=Path("runs/length-study"),
                        help="results folder: new, empty, or one the study wrote "
                             "(default: runs/length-study)")
    add_overwrite_option(length, "--out")
    length.add_argument("--quick", action="store_true",
                        help="smaller model and fewer steps: a few minutes on 2 CPU cores")
    length.add_argument("--train-len", type=positive_int, default=None)
    length.add_argument("--steps", type=positive_int, default=None)
    length.add_argument("--positional", action="append", choices=POSITIONAL_KINDS,
                        help="only these positional types (repeatable; default: all)")
    length.set_defaults(handler=_run_length_cli)


def _run_length_cli(args: Any) -> int:
    settings = LengthStudySettings.quick() if args.quick else LengthStudySettings()
    if args.train_len is not None:
        settings.train_len = args.train_len
    if args.steps is not None:
        settings.steps = args.steps
    results = run_length_study(args.out, settings,
                               positionals=tuple(args.positional or POSITIONAL_KINDS),
                               overwrite=args.overwrite)
    print()
    print(to_markdown(results))
    print(f"wrote {args.out}/length_study.{{md,json,png}}")
    return 0
