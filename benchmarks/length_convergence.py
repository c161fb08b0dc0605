"""The tutorial's length problem: does a classifier still train at sequence length 512?

What it measures
    The built-in balanced-brackets task (``handformer.data.tasks``; chance 50 %, and every
    order-blind shortcut also scores 50 %) trained with ``handformer classify train``'s
    recipe at two lengths — strings of [L/2, L] characters, L = 128 and 512 — and one
    contrast run, each from the same seed:

    * ``pre-norm + warm-up``   the default recipe (pre-norm blocks, 50 warm-up steps,
                               cosine decay), at L = 128 and at L = 512;
    * ``post-norm, no warm-up`` the original paper's block order started at the full
                               learning rate, at L = 512 (``--contrast-lengths`` adds more).

    Every ``--eval-interval`` steps each run is scored on the same held-out strings
    (never in its training set): validation accuracy and loss. The curves go to
    ``benchmarks/results/length_convergence.{json,png}``; the table printed at the end
    gives each run's final accuracy, the first step at which it reached 90 %, its time, and
    its *peak loss*: the highest 20-step mean training loss after step 50. Guessing 50/50
    costs ln 2 = 0.693. Read a peak above it next to the held-out accuracy: on the plateau at
    chance it is noise, and later cross-entropy charges a few confident mistakes in a batch
    so heavily that the mean can pass ln 2 while accuracy is far above chance.

Why
    The tutorial's author found that a model which trained at 128 tokens would not train at
    512. Longer sequences make each step's gradient a sum over more positions, and a
    post-norm stack started at the full learning rate has no un-normalised residual path to
    keep early updates tame (Xiong et al., 2020). Pre-norm with a short linear warm-up is
    handformer's default; this script shows what it buys, one seed at a time (rerun with
    ``--seed`` to see the spread).

Usage
    python benchmarks/length_convergence.py              # ~12 min on one core (3 runs)
    python benchmarks/length_convergence.py --quick      # lengths 32/64, seconds
    python benchmarks/length_convergence.py --steps 600 --seed 1
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from handformer.config import CLASSIFY_PRESET
from handformer.jobs.classify import builtin_brackets_data, train_classifier
from handformer.machine import describe_machine, machine_line

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Setting:
    label: str
    seq_len: int
    norm: str
    warmup_steps: int


def settings(lengths: list[int], contrast_lengths: list[int]) -> list[Setting]:
    warmup = int(CLASSIFY_PRESET.train["warmup_steps"])
    runs = [Setting(f"L={n} pre-norm + warm-up", n, "pre", warmup) for n in lengths]
    runs += [Setting(f"L={n} post-norm, no warm-up", n, "post", 0) for n in contrast_lengths]
    return runs


def first_step_at(history: list[dict[str, Any]], threshold: float) -> int | None:
    return next((h["step"] for h in history if h["val_accuracy"] >= threshold), None)


def run_one(s: Setting, args: argparse.Namespace) -> dict[str, Any]:
    data = builtin_brackets_data(seq_len=s.seq_len, n_train=args.steps * args.batch_size,
                                 n_val=args.n_val, seed=args.seed)
    run = train_classifier(
        data, out_dir=None, max_len=s.seq_len + 1,
        model_overrides={"norm": s.norm},
        train_overrides={"max_steps": args.steps, "batch_size": args.batch_size,
                         "warmup_steps": s.warmup_steps, "eval_interval": args.eval_interval,
                         "log_interval": args.eval_interval, "seed": 1337 + args.seed,
                         "device": "cpu"},
        progress=False,
    )
    history = [{"step": h["step"], "val_accuracy": h["val_accuracy"],
                "val_loss": h["val_loss"]} for h in run.history]
    losses = run.result.train_losses
    return {**asdict(s), "history": history, "train_losses": losses,
            "final_val_accuracy": run.summary["val_accuracy"],
            "first_step_at_90": first_step_at(history, 0.9),
            "peak_loss_after_50": max(smooth(losses, 20)[50:], default=None),
            "seconds": run.summary["seconds"], "median_step_ms": run.result.median_step_ms}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(results: list[dict[str, Any]], path: Path, chance: float) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (the curves are in the JSON)")
        return None
    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        style = "-" if r["norm"] == "pre" else "--"
        steps = [h["step"] for h in r["history"]]
        acc_ax.plot(steps, [h["val_accuracy"] for h in r["history"]], style, marker=".",
                    label=r["label"])
        loss_ax.plot(range(1, len(r["train_losses"]) + 1), smooth(r["train_losses"], 20),
                     style, label=r["label"])
    acc_ax.axhline(chance, color="grey", lw=0.8, ls=":", label=f"chance {chance:.0%}")
    acc_ax.set(xlabel="step", ylabel="validation accuracy", ylim=(0.4, 1.0),
               title="held-out accuracy, balanced brackets")
    loss_ax.axhline(0.6931, color="grey", lw=0.8, ls=":", label="ln 2 (50/50 guess)")
    loss_ax.set(xlabel="step", ylabel="training loss (20-step mean)", title="training loss")
    acc_ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--contrast-lengths", type=int, nargs="*", default=[512])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--eval-interval", type=int, default=25)
    parser.add_argument("--n-val", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: faster for these small models on a "
                             "shared machine)")
    parser.add_argument("--quick", action="store_true",
                        help="lengths 32 and 64, 60 steps: a smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.contrast_lengths = [32], [64]
        args.steps, args.eval_interval, args.n_val = 60, 20, 64
    torch.set_num_threads(args.threads)
    machine = describe_machine()
    print(machine_line(machine))

    results = []
    for s in settings(args.lengths, args.contrast_lengths):
        print(f"training {s.label} ({args.steps} steps, batch {args.batch_size}) …", flush=True)
        r = run_one(s, args)
        print(f"  final accuracy {r['final_val_accuracy']:.3f}, 90 % at step "
              f"{r['first_step_at_90']}, peak loss {_fmt(r['peak_loss_after_50'])}, "
              f"{r['seconds']:.0f}s", flush=True)
        results.append(r)

    chance = 0.5
    report = {
        "benchmark": "length_convergence",
        "task": "balanced brackets, lengths [L/2, L], chance 50 %",
        "recipe": {k: CLASSIFY_PRESET.train[k] for k in ("lr", "min_lr", "warmup_steps")},
        "settings": vars(args) | {"out": str(args.out)},
        "runs": results,
        "machine": {**machine, "python": sys.version.split()[0],
                    "platform": platform.platform()},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "length_convergence.json").write_text(json.dumps(report, indent=2),
                                                      encoding="utf-8")
    png = plot(results, args.out / "length_convergence.png", chance)

    print(f"\n{'run':<32} {'final acc':>9} {'90 % at':>8} {'peak loss':>9} {'time':>7}")
    for r in results:
        at = "never" if r["first_step_at_90"] is None else str(r["first_step_at_90"])
        print(f"{r['label']:<32} {r['final_val_accuracy']:>9.3f} {at:>8} "
              f"{_fmt(r['peak_loss_after_50']):>9} {r['seconds']:>6.0f}s")
    print("(peak loss: highest 20-step mean training loss after step 50; ln 2 = 0.693 is "
          "the loss of a 50/50 guess; read it next to the held-out accuracy)")
    print(f"\nJSON: {args.out / 'length_convergence.json'}" + (f"\nPNG:  {png}" if png else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
