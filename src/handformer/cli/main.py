"""The ``handformer`` command line: ``build_parser`` gathers every command's sub-parser (one
module per command in this package, each with a ``register(subparsers)``) and ``main``
dispatches to the handler the command set, with one error contract: a ``ValueError`` or
``OSError`` becomes one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The whole parser: every command, each with an examples section in its --help."""
    from handformer.cli import (
        bench,
        classify,
        convert,
        doctor,
        embed,
        experiment,
        explore,
        generate,
        seq2seq,
        train,
    )
    from handformer.cli.examples import add_examples

    parser = argparse.ArgumentParser(
        prog="handformer", description="A Transformer written by hand: train, sample, inspect.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (train, generate, classify, seq2seq, doctor, explore, embed, convert,
                    experiment, bench):
        command.register(sub)
    return add_examples(parser)  # an "examples:" section in every command's --help


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
    handler = args.handler
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
