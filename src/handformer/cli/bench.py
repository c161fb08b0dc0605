"""``handformer bench``: the benchmarks side by side (``handformer.bench``), as a table, a
merged JSON and a chart. ``--out-dir`` is claimed and locked as ``BENCH_FOLDER`` before the
first benchmark runs; ``--json`` elsewhere must be new or a merged result bench wrote,
unless ``--overwrite``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from handformer.bench.runner import (
    BENCH_FOLDER,
    BENCHMARKS,
    CHART,
    MERGED,
    draw_chart,
    is_bench_json,
    run_benchmarks,
)
from handformer.cli.common import add_overwrite_option, folder_arg
from handformer.runs import RunFolderError, writing_folder

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add ``bench`` to ``handformer``'s sub-parsers."""
    bench = sub.add_parser("bench", help="run the benchmarks side by side; table, JSON, PNG")
    bench.add_argument("--quick", action="store_true", help="tiny sizes, a few repeats")
    bench.add_argument("--only", action="append", choices=BENCHMARKS,
                       help="run only these (repeatable; default: all)")
    bench.add_argument("--out-dir", type=folder_arg, default=Path("benchmarks/results"),
                       help="results folder: new, empty, or one bench wrote "
                            "(default: benchmarks/results)")
    bench.add_argument("--data", type=Path, default=None,
                       help="text for time_to_loss (default: the built-in text)")
    bench.add_argument("--json", type=folder_arg, default=None,
                       help="merged JSON (default: OUT_DIR/bench.json)")
    add_overwrite_option(bench, "--out-dir (and over --json)")
    bench.set_defaults(handler=_run)


def _check_json_target(path: Path, overwrite: bool) -> None:
    """A --json file elsewhere is replaced only if bench wrote it (or --overwrite)."""
    if path.is_dir():
        raise RunFolderError(f"--json {path} is a folder; give the path of a file to write")
    if path.exists() and not overwrite and not is_bench_json(path):
        raise RunFolderError(f"--json {path} exists and is not a result `handformer bench` "
                             "wrote; give a new file, or pass --overwrite to replace it")


def _run(args: argparse.Namespace) -> int:
    from handformer.atomic import atomic_write_text

    names = tuple(args.only or BENCHMARKS)
    if args.json is not None:
        _check_json_target(args.json, args.overwrite)
    with writing_folder(args.out_dir, BENCH_FOLDER, overwrite=args.overwrite) as out_dir:
        merged = run_benchmarks(names, out_dir, args.quick, args.data)
        json_path = args.json or out_dir / MERGED
        if args.json is not None:
            _check_json_target(json_path, args.overwrite)  # again: the run took a while
        atomic_write_text(json_path, json.dumps(merged, indent=2))
        chart = out_dir / CHART
        draw_chart(merged, chart)
    print(f"\nwrote {json_path} and {chart}")
    return 0
