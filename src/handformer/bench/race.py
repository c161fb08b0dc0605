"""Race whole training commands against the real nanoGPT, timed as a user times them.

Each contender is one command a user types — the whole process, start-up, data preparation,
every evaluation and the checkpoint writes included — run in a fresh temporary folder. The
contenders run one after the other in alternating order (``repeats`` rounds), so a slow
minute on a shared machine hits them all alike, and the table shows medians. A process's
evaluation lines (``step N: … val loss X``, which nanoGPT and ``handformer train`` both
print) are timestamped as they arrive, so the figure is the wall clock from launch to the
first validation loss at or under the target — not a training-time-only harness.

nanoGPT is the user's own checkout (``--nanogpt DIR``): it is copied into the temporary
folder with the text to train on as its ``input.txt`` (so its ``prepare.py`` reads it rather
than downloading), prepared, and trained with its README's CPU recipe.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from handformer.machine import describe_machine, machine_line

__all__ = ["NANOGPT_CPU_RECIPE", "Contender", "Timing", "main", "parse_val_loss", "race"]

# nanoGPT README's "I only have a CPU" command, verbatim after the script name.
NANOGPT_CPU_RECIPE = [
    "config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
    "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
    "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
_VAL_LINE = re.compile(r"^step\s+(\d+):.*?val loss\s+([0-9.]+|nan|inf)", re.IGNORECASE)


def parse_val_loss(line: str) -> tuple[int, float] | None:
    """``(step, val_loss)`` from an evaluation line of nanoGPT or ``handformer train``."""
    match = _VAL_LINE.match(line.strip())
    return (int(match.group(1)), float(match.group(2))) if match else None


@dataclass
class Contender:
    """A named command; ``target`` is the validation loss its wall clock is timed to;
    ``data`` says which text it trains on (for the table); ``nanogpt`` marks the peer."""

    name: str
    argv: list[str]
    target: float
    data: str
    nanogpt: bool = False


@dataclass
class Timing:
    """One run of one contender: its evaluations as ``(seconds, step, val_loss)``."""

    name: str
    wall: float
    code: int
    evals: list[tuple[float, int, float]] = field(default_factory=list)

    def to_target(self, target: float) -> tuple[float, int, float] | None:
        """The first evaluation at or under ``target`` (its time, step and loss)."""
        return next((e for e in self.evals if e[2] <= target), None)


def _run(contender: Contender, cwd: Path) -> Timing:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(contender.argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    timing = Timing(contender.name, 0.0, 0)
    assert proc.stdout is not None
    tail: list[str] = []
    for line in proc.stdout:
        parsed = parse_val_loss(line)
        if parsed:
            timing.evals.append((time.perf_counter() - start, *parsed))
        tail = [*tail, line][-20:]
    timing.code = proc.wait()
    timing.wall = time.perf_counter() - start
    if timing.code:
        sys.stderr.write(f"{contender.name} exited with {timing.code}; its last lines:\n"
                         + "".join(tail))
    return timing


def _prepare_nanogpt(checkout: Path, data: Path, work: Path) -> Path:
    """A copy of the user's nanoGPT checkout with ``data`` prepared as shakespeare_char."""
    if not (checkout / "train.py").is_file() or not (
            checkout / "data" / "shakespeare_char" / "prepare.py").is_file():
        raise SystemExit(f"--nanogpt {checkout}: expected a nanoGPT checkout (train.py and "
                         "data/shakespeare_char/prepare.py); got neither")
    copy = work / "nanoGPT"
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git", "out-*"))
    folder = copy / "data" / "shakespeare_char"
    shutil.copyfile(data, folder / "input.txt")
    subprocess.run([sys.executable, "prepare.py"], cwd=folder, check=True,
                   stdout=subprocess.DEVNULL)
    return copy


def race(contenders: list[Contender], repeats: int, work: Path,
         setup: dict[str, Path]) -> list[Timing]:
    """Every contender ``repeats`` times, alternating, each in its own fresh folder."""
    timings: list[Timing] = []
    for round_ in range(repeats):
        order = contenders if round_ % 2 == 0 else contenders[::-1]
        for contender in order:
            cwd = setup.get(contender.name) or Path(tempfile.mkdtemp(dir=work))
            timing = _run(contender, cwd)
            hit = timing.to_target(contender.target)
            print(f"  round {round_ + 1} {contender.name}: wall {timing.wall:.1f} s, "
                  + (f"val {hit[2]:.4f} <= {contender.target} at {hit[0]:.1f} s (step {hit[1]})"
                     if hit else f"never reached {contender.target}"), flush=True)
            timings.append(timing)
            if cwd.name.startswith("tmp"):
                shutil.rmtree(cwd, ignore_errors=True)
    return timings


def _summarise(contenders: list[Contender], timings: list[Timing]) -> list[dict[str, object]]:
    rows = []
    for c in contenders:
        mine = [t for t in timings if t.name == c.name]
        hits = [t.to_target(c.target) for t in mine]
        reached = [h for h in hits if h is not None]
        rows.append({
            "name": c.name, "data": c.data, "target": c.target,
            "command": " ".join(c.argv), "runs": len(mine),
            "reached": len(reached), "failed": sum(t.code != 0 for t in mine),
            "median_wall_to_target_s": statistics.median(h[0] for h in reached)
            if len(reached) == len(mine) else None,
            "median_step_at_target": statistics.median(h[1] for h in reached)
            if reached else None,
            "median_val_at_target": statistics.median(h[2] for h in reached)
            if reached else None,
            "median_total_wall_s": statistics.median(t.wall for t in mine),
            "final_val": [t.evals[-1][2] if t.evals else None for t in mine],
            "walls_to_target_s": [h[0] if h else None for h in hits],
        })
    peer = next((r for r, c in zip(rows, contenders, strict=True) if c.nanogpt), None)
    base = None
    if peer is not None:
        # nanoGPT's CPU recipe is published as reaching 1.88, and ends a hair above it
        # (1.8857): where it never reaches the target, its wall to its own last evaluation
        # is the reference — what a user of it waits for.
        base = peer["median_wall_to_target_s"]
        if base is None:
            mine = [t for t in timings if t.name == peer["name"] and t.evals]
            if mine:
                base = statistics.median(t.evals[-1][0] for t in mine)
                peer["median_wall_to_last_eval_s"] = base
    for row in rows:
        wall = row["median_wall_to_target_s"]
        if row is peer and wall is None:
            wall = base
        row["vs_nanogpt"] = wall / base if isinstance(wall, float) and base else None
    return rows


def _print_table(rows: list[dict[str, object]], machine: str) -> None:
    print(f"\nwhole commands, medians · {machine}")
    print(f"{'contender':<22}{'data':<18}{'target':>7}{'reached':>9}{'to target':>11}"
          f"{'step':>7}{'val':>8}{'total':>9}{'× nanoGPT':>11}")
    for r in rows:
        wall, ratio = r["median_wall_to_target_s"], r["vs_nanogpt"]
        if wall is None and "median_wall_to_last_eval_s" in r:
            wall = r["median_wall_to_last_eval_s"]  # the peer, to its own final loss
        print(f"{r['name']:<22}{r['data']:<18}{r['target']:>7}{r['reached']:>5}/{r['runs']:<3}"
              f"{f'{wall:.1f} s' if wall is not None else '—':>11}"
              f"{r['median_step_at_target'] or '—':>7}{_val(r):>8}"
              f"{r['median_total_wall_s']:>7.1f} s"
              f"{f'{ratio:.2f}×' if ratio is not None else '—':>11}")


def _val(row: dict[str, object]) -> str:
    """The loss at the target, or (never reached) the median final loss, marked '>'."""
    if row["median_val_at_target"] is not None:
        return f"{row['median_val_at_target']:.4f}"
    finals = [v for v in row["final_val"] if v is not None]  # type: ignore[union-attr]
    return f">{statistics.median(finals):.4f}" if finals else "—"


def _default_contenders(args: argparse.Namespace, nanogpt_python: list[str]) -> list[Contender]:
    hf = [sys.executable, "-m", "handformer", "train"]
    shakes = ["--data", str(args.data.resolve())]
    return [
        Contender("nanoGPT (CPU recipe)", [*nanogpt_python, "train.py", *NANOGPT_CPU_RECIPE],
                  args.target, "tinyshakespeare", nanogpt=True),
        Contender("speedrun", [*hf, *shakes, "--preset", "speedrun", "--until-val-loss",
                               str(args.target)], args.target, "tinyshakespeare"),
        Contender("shakespeare-char", [*hf, *shakes, "--preset", "shakespeare-char"],
                  args.target, "tinyshakespeare"),
        Contender("default", [*hf], args.default_target, "built-in text"),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, required=True,
                        help="a checkout of karpathy/nanoGPT (it is copied, never changed)")
    parser.add_argument("--data", type=Path, default=Path("../shared/data/tinyshakespeare.txt"),
                        help="tinyshakespeare's input.txt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target", type=float, default=1.88,
                        help="the val loss on tinyshakespeare (nanoGPT's published 1.88)")
    parser.add_argument("--default-target", type=float, default=1.26,
                        help="the val loss `handformer train` is timed to on the built-in text")
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME",
                        help="race only these contenders (by name, as in the table)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/race_nanogpt.json"))
    args = parser.parse_args(argv)
    if not args.data.is_file():
        parser.error(f"--data {args.data}: no such file (tinyshakespeare's input.txt)")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1; got {args.repeats}")
    machine = describe_machine()
    with tempfile.TemporaryDirectory(prefix="race-") as tmp:
        work = Path(tmp)
        contenders = _default_contenders(args, [sys.executable])
        if args.only:
            known = [c.name for c in contenders]
            unknown = [n for n in args.only if n not in known]
            if unknown:
                parser.error(f"--only {unknown}: not a contender; choose from {known}")
            contenders = [c for c in contenders if c.name in args.only]
        setup: dict[str, Path] = {}
        for c in contenders:
            if c.nanogpt:
                setup[c.name] = _prepare_nanogpt(args.nanogpt.resolve(), args.data.resolve(),
                                                 work)
        print(f"racing {len(contenders)} commands × {args.repeats} · {machine_line(machine)}")
        timings = race(contenders, args.repeats, work, setup)
    rows = _summarise(contenders, timings)
    _print_table(rows, machine_line(machine))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "repeats": args.repeats,
                                    "results": rows}, indent=2), encoding="utf-8")
    print(f"\nwrote {args.out}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1
