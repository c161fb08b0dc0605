"""``handformer bench``: run every benchmark, merge their JSON, draw one chart.

The results folder is ``BENCH_FOLDER`` for ``handformer.runs.writing_folder``: the caller
claims it (a folder of another tool is refused) and holds its lock while the benchmarks
write into it; ``is_bench_json`` recognises a merged JSON written here before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from handformer.runs import FolderSpec

__all__ = ["BENCHMARKS", "BENCH_FOLDER", "draw_chart", "is_bench_json", "run_benchmarks"]

BENCHMARKS = ("tokenizer", "generation", "train", "attention", "time_to_loss", "onnx",
              "speculative")
_MODULES = {"tokenizer": "tokenizer_throughput", "generation": "generation_speed",
            "train": "train_throughput", "attention": "attention_memory",
            "time_to_loss": "time_to_loss", "onnx": "onnx_decode",
            "speculative": "speculative_speed"}
# Benchmarks that train on text take ``--data FILE`` (default: the built-in text).
_TAKES_DATA = ("time_to_loss",)
MERGED, CHART = "bench.json", "bench.png"
BENCH_FOLDER = FolderSpec("bench", "benchmark results", "handformer bench",
                          (MERGED, CHART, *(f"{m}.json" for m in _MODULES.values())))


def is_bench_json(path: Path) -> bool:
    """True if ``path`` holds a merged result ``handformer bench`` wrote: an object of
    ``"quick"`` and benchmark names only."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and "quick" in data and set(data) <= {"quick", *BENCHMARKS}


def run_benchmarks(names: tuple[str, ...], out_dir: Path, quick: bool,
                   data: Path | None = None, ablation: bool = False) -> dict[str, Any]:
    """Run ``names`` one after another, each writing its JSON into ``out_dir`` (which the
    caller has claimed as ``BENCH_FOLDER``); return their results merged. ``ablation``
    makes time_to_loss race the speedrun ladder (its ``--ablation``)."""
    import importlib

    out_dir.mkdir(parents=True, exist_ok=True)
    merged: dict[str, Any] = {"quick": quick}
    for name in names:
        module = importlib.import_module(f"handformer.bench.{_MODULES[name]}")
        path = out_dir / f"{_MODULES[name]}.json"
        argv = ["--out", str(path)] + (["--quick"] if quick else [])
        if data is not None and name in _TAKES_DATA:
            argv += ["--data", str(data)]
        if ablation and name == "time_to_loss":
            argv += ["--ablation"]
        print(f"\n=== {name} ===", flush=True)
        code = module.main(argv)
        if code:
            raise RuntimeError(f"benchmark {name!r} failed with exit code {code}")
        merged[name] = json.loads(path.read_text(encoding="utf-8"))
    return merged


def draw_chart(merged: dict[str, Any], path: Path) -> None:
    """One PNG, a panel per benchmark that ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from handformer.train.plots import save_figure

    panels = [n for n in BENCHMARKS if n in merged]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, name in zip(axes[0], panels, strict=True):
        data = merged[name]
        if name == "tokenizer":
            rows = data["results"]
            ax.barh([r["name"] for r in rows], [r["mb_per_s"] for r in rows])
            ax.set_xlabel("MB/s (higher is better)")
        elif name == "generation":
            rows = [r for r in data["rows"] if "floor" not in r["contender"]]
            ax.barh([f"{r['case']} {r.get('threads', 1)}T {r['contender']}" for r in rows],
                    [r["tokens_per_s"] for r in rows])
            ax.set_xlabel("tokens/s, batch 1 (higher is better)")
        elif name == "onnx":
            rows = data["rows"]
            ax.barh([f"{r['case']} {r['contender']}" for r in rows],
                    [r["tokens_per_s"] for r in rows])
            ax.set_xlabel("greedy tokens/s, batch 1 (higher is better)")
            if not rows:  # the onnx extra is not installed
                ax.text(0.5, 0.5, data.get("skipped", "skipped"), ha="center", va="center",
                        wrap=True, fontsize=8, transform=ax.transAxes)
        elif name == "speculative":
            rows = [r for r in data["rows"] if "tokens_per_s" in r]
            ax.barh([f"{r['pair']} {r['contender']}" for r in rows],
                    [r["tokens_per_s"] for r in rows])
            ax.set_xlabel("tokens/s, batch 1, greedy (higher is better)")
        elif name == "train":
            rows = data["rows"]
            ax.barh([f"{r['config']} {r['contender']}" for r in rows],
                    [r["tokens_per_s"] for r in rows])
            ax.set_xlabel("training tokens/s (higher is better)")
        elif name == "time_to_loss":
            for row in data["rows"]:
                pts = [(p["train_seconds"], p["val_loss"]) for p in row["curve"]]
                ax.plot(*zip(*pts, strict=True), marker=".", label=f"{row['label']} "
                        f"({row['preset']})")
            ax.axhline(data["target"], color="grey", linestyle="--", linewidth=1)
            ax.set_xlabel("training seconds (evaluation excluded)")
            ax.set_ylabel("validation loss")
            ax.legend(fontsize=7)
        else:
            for path_name in ("manual", "sdpa", "tiled"):
                pts = [(r["T"], r["peak_mib"]) for r in data["rows"]
                       if r["path"] == path_name and r["pass"] == "fwd+bwd" and "peak_mib" in r]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=path_name)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length T")
            ax.set_ylabel("peak MiB, forward + backward")
            ax.legend()
        ax.set_title(name)
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
