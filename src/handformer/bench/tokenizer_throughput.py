"""Character-tokenizer throughput: vectorised encoding vs the tutorial's per-character loop.

What it measures
    Wall-clock time to turn 1,000,000 characters of text (the built-in corpus repeated and
    truncated, or ``--data FILE``) into token ids, for three contenders:

    * ``naive``          ``[stoi[c] for c in text]`` — the baseline most tutorials show: one
                         Python-level dict lookup per character, producing a list.
    * ``encode_array``   ``CharTokenizer.encode_array`` — text → UTF-32 code points in one C
                         call, then a numpy lookup table; produces an int64 array.
    * ``encode``         ``CharTokenizer.encode`` — ``encode_array`` plus ``.tolist()``, i.e.
                         the same output type as the naive baseline.
    * ``bpe encode_array`` a byte-level BPE (Hugging Face ``tokenizers``, vocabulary 1000):
                         fewer, longer tokens, so a different output — timed, not compared.

Why
    Encoding happens once per corpus, so it is rarely the bottleneck — but the tokenizer's
    docstring claims a vectorised speed-up, and a claim should come with a measurement that
    anyone can rerun. Each contender runs once as a warm-up, then ``repeats`` times with the
    contenders alternated round-robin so that machine noise (other jobs, frequency scaling)
    hits all of them alike. We report the median (robust to outliers), the min–max spread,
    throughput in MB/s (10^6 characters per second) and the speed-up over ``naive``.
    All contenders are checked to produce identical ids before timing.

Usage
    python benchmarks/tokenizer_throughput.py            # 1 MB, 7 repeats
    python benchmarks/tokenizer_throughput.py --quick    # 100 KB, 3 repeats
    python benchmarks/tokenizer_throughput.py --data my_corpus.txt
    handformer bench --only tokenizer

Results are printed as a table and written to ``benchmarks/results/tokenizer_throughput.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from handformer.data.corpora import builtin_text, read_text_file
from handformer.machine import describe_machine, machine_line
from handformer.tokenizers import BPETokenizer, CharTokenizer

RESULTS = Path("benchmarks/results/tokenizer_throughput.json")


def build_text(n_chars: int, data: Path | None) -> tuple[str, str]:
    """The benchmark text (source repeated and truncated to ``n_chars``) and its source name."""
    source = builtin_text() if data is None else read_text_file(data)
    name = "built-in Python documentation text" if data is None else str(data)
    reps = -(-n_chars // len(source))  # ceil division
    return (source * reps)[:n_chars], name


def contenders(tok: CharTokenizer) -> dict[str, Callable[[str], Any]]:
    """Name → encode function. ``naive`` first: it is the reference for the ratios."""
    stoi = tok.stoi

    def naive(text: str) -> list[int]:
        return [stoi[c] for c in text]

    return {"naive": naive, "encode_array": tok.encode_array, "encode": tok.encode}


def time_contenders(funcs: dict[str, Callable[[str], Any]], text: str,
                    repeats: int) -> dict[str, list[float]]:
    """One warm-up call each, then ``repeats`` rounds alternating the contenders."""
    for fn in funcs.values():
        fn(text)
    times: dict[str, list[float]] = {name: [] for name in funcs}
    for _ in range(repeats):
        for name, fn in funcs.items():
            t0 = time.perf_counter()
            fn(text)
            times[name].append(time.perf_counter() - t0)
    return times


def summarise(times: dict[str, list[float]], n_chars: int) -> list[dict[str, Any]]:
    """Median, min, max (ms), throughput (MB/s, 10^6 chars/s) and speed-up over naive."""
    naive_median = statistics.median(times["naive"])
    rows = []
    for name, ts in times.items():
        median = statistics.median(ts)
        rows.append({
            "name": name,
            "median_ms": median * 1e3,
            "min_ms": min(ts) * 1e3,
            "max_ms": max(ts) * 1e3,
            "mb_per_s": n_chars / median / 1e6,
            "speedup_vs_naive": naive_median / median,
            "times_ms": [t * 1e3 for t in ts],
        })
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    header = (f"{'contender':<16} {'median ms':>10} {'min–max ms':>17} {'MB/s':>9} "
              f"{'vs naive':>9}")
    lines = [header, "-" * len(header)]
    for r in rows:
        spread = f"{r['min_ms']:.2f}–{r['max_ms']:.2f}"
        lines.append(f"{r['name']:<16} {r['median_ms']:>10.2f} {spread:>17} "
                     f"{r['mb_per_s']:>9.1f} {r['speedup_vs_naive']:>8.1f}x")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=None,
                        help="UTF-8 text file (default: the built-in corpus)")
    parser.add_argument("--quick", action="store_true", help="100 KB and 3 repeats")
    parser.add_argument("--chars", type=int, default=None, help="override the text length")
    parser.add_argument("--repeats", type=int, default=None, help="override the repeat count")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON results path")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    n_chars = args.chars or (100_000 if args.quick else 1_000_000)
    repeats = args.repeats or (3 if args.quick else 7)
    text, source = build_text(n_chars, args.data)
    tok = CharTokenizer.from_text(text)
    funcs = contenders(tok)

    reference = funcs["naive"](text)
    for name, fn in funcs.items():
        if np.asarray(fn(text)).tolist() != reference:
            print(f"error: {name} disagrees with the naive encoding", file=sys.stderr)
            return 1

    # Byte-level BPE (vocabulary 1000, learned on the first 200 K characters) makes other
    # tokens, so it is timed but not compared id for id.
    bpe = BPETokenizer.train(text[:200_000], vocab_size=1000)
    funcs["bpe encode_array"] = bpe.encode_array

    times = time_contenders(funcs, text, repeats)
    rows = summarise(times, len(text))
    machine = describe_machine()
    print(machine_line(machine))
    print(f"tokenizer throughput: {len(text):,} chars from {source}, vocab {tok.vocab_size}, "
          f"{repeats} repeats after a warm-up (alternating)")
    print(format_table(rows))

    result = {
        "benchmark": "tokenizer_throughput",
        "machine": machine,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "source": source,
        "n_chars": len(text),
        "vocab_size": tok.vocab_size,
        "repeats": repeats,
        "quick": args.quick,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
