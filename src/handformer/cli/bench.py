"""``handformer bench``: the benchmarks side by side (``handformer.bench``), as a table, a
merged JSON and a chart."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from handformer.bench.runner import BENCHMARKS, draw_chart, run_benchmarks

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add ``bench`` to ``handformer``'s sub-parsers."""
    bench = sub.add_parser("bench", help="run the benchmarks side by side; table, JSON, PNG")
    bench.add_argument("--quick", action="store_true", help="tiny sizes, a few repeats")
    bench.add_argument("--only", action="append", choices=BENCHMARKS,
                       help="run only these (repeatable; default: all)")
    bench.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    bench.add_argument("--data", type=Path, default=None,
                       help="text for time_to_loss (default: the built-in text)")
    bench.add_argument("--json", type=Path, default=None,
                       help="merged JSON (default: OUT_DIR/bench.json)")
    bench.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    names = tuple(args.only or BENCHMARKS)
    merged = run_benchmarks(names, args.out_dir, args.quick, args.data)
    json_path = args.json or args.out_dir / "bench.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(merged, indent=2), encoding="utf-8")
    chart = args.out_dir / "bench.png"
    draw_chart(merged, chart)
    print(f"\nwrote {json_path} and {chart}")
    return 0
