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
from handformer.cli.common import add_overwrite_option, check_output_file, folder_arg
from handformer.runs import writing_folder

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
    bench.add_argument("--ablation", action="store_true",
                       help="time_to_loss races the speedrun ladder: one lever per row against "
                            "one reference run, the final recipe on three seeds")
    bench.add_argument("--json", type=folder_arg, default=None,
                       help="merged JSON (default: OUT_DIR/bench.json)")
    add_overwrite_option(bench, "--out-dir (and over --json)")
    bench.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from handformer.atomic import atomic_write_text

    names = tuple(args.only or BENCHMARKS)
    if args.json is not None:  # replaced only if bench wrote it (or --overwrite)
        check_output_file(args.json, "--json", overwrite=args.overwrite, ours=is_bench_json)
    with writing_folder(args.out_dir, BENCH_FOLDER, overwrite=args.overwrite) as out_dir:
        merged = run_benchmarks(names, out_dir, args.quick, args.data, args.ablation)
        json_path = args.json or out_dir / MERGED
        if args.json is not None:  # again: the benchmarks took a while
            check_output_file(json_path, "--json", overwrite=args.overwrite, ours=is_bench_json)
        atomic_write_text(json_path, json.dumps(merged, indent=2))
        chart = out_dir / CHART
        draw_chart(merged, chart)
    print(f"\nwrote {json_path} and {chart}")
    return 0
