"""The ``handformer`` command line: one module per command, each registering its own
sub-parser; ``main`` dispatches."""

from handformer.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
