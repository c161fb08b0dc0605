"""The ``handformer`` command line: ``build_parser`` gathers every command's sub-parser (one
module per command in this package, each with a ``register(subparsers)``) and ``main``
dispatches to the handler the command set, under one contract (``handformer.cli.errors``):
exit 0 on success, 1 for anything refused or failed while running, 2 for a wrong command line,
130 after Ctrl-C and 143 after SIGTERM — each failure as one line on stderr, never a
traceback."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence

from handformer.cli.errors import EXPECTED, Interrupted, Terminated, UsageParser

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
        serve,
        train,
    )
    from handformer.cli.examples import add_examples

    parser = UsageParser(  # every sub-parser inherits its one-line usage errors
        prog="handformer", description="A Transformer written by hand: train, sample, inspect.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (train, generate, classify, seq2seq, doctor, explore, embed, convert,
                    experiment, bench, serve):
        command.register(sub)
    add_examples(parser)  # an "examples:" section in every command's --help
    parser.epilog = (parser.epilog or "") + "\n\n" + EXIT_CODES_HELP
    return parser


EXIT_CODES_HELP = """exit codes:
  0    success
  1    refused or failed while running (files, folders, run state, sizes, memory)
  2    the command line is wrong (an unknown option, a value out of range, a contradiction)
  3    train only: stopped after too many non-finite steps (the last good checkpoint is kept)
  130  interrupted (Ctrl-C);  143  terminated (SIGTERM)"""


def main(argv: Sequence[str] | None = None) -> int:
    from handformer.train.distributed import launched_by_torchrun

    if launched_by_torchrun():
        # torchrun's summary then shows the failing rank's traceback, not just its exit code.
        from torch.distributed.elastic.multiprocessing.errors import record

        from handformer.train.distributed import exit_worker

        # A worker ends here, without the interpreter's teardown (exit_worker says why).
        exit_worker(record(_main)(argv))
    return _main(argv)


def _command_path(args: argparse.Namespace) -> str:
    """``"train"``, ``"classify train"``: the words that name the command, as in its help."""
    words = [args.command, getattr(args, "action", None), getattr(args, "experiment", None)]
    return " ".join(w for w in words if isinstance(w, str))


def _main(argv: Sequence[str] | None = None) -> int:
    from handformer.cli.errors import report, show_tracebacks, sigterm_raises, silence_stdout
    from handformer.train.distributed import launched_by_torchrun

    try:
        parser = build_parser()
        args, unknown = parser.parse_known_args(argv)  # argparse's errors: one line, exit 2
    except KeyboardInterrupt as err:  # Ctrl-C while the commands' modules load
        return report("", err)
    handler, command = args.handler, _command_path(args)
    if unknown:  # refused by the command they were given to, pointing at its own --help
        from handformer.cli.examples import iter_commands

        owner = dict(iter_commands(parser)).get(command, parser)
        owner.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command != "train" and launched_by_torchrun():
        # N copies of a single-process command would race to write the same files.
        print(f"handformer {command}: error: only `handformer train` runs under torchrun "
              f"(WORLD_SIZE={os.environ.get('WORLD_SIZE')}); run `handformer {command}` "
              "as one process", file=sys.stderr)
        return 2
    # Under torchrun, SIGTERM is torchrun's way to stop the other ranks when one fails: a
    # rank blocked in a collective must die at once, not wait to raise an exception.
    guard = contextlib.nullcontext() if launched_by_torchrun() else sigterm_raises()
    try:
        with guard:
            return handler(args)
    except BrokenPipeError:
        return silence_stdout()  # `handformer generate | head`: the reader left, no error
    except (KeyboardInterrupt, Interrupted, Terminated) as err:
        return report(command, err)
    except Exception as err:
        if not isinstance(err, EXPECTED) and (show_tracebacks() or launched_by_torchrun()):
            raise  # a bug: its traceback (torchrun's error summary records it too)
        return report(command, err)


if __name__ == "__main__":
    raise SystemExit(main())
