"""Wall-clock time to a target validation loss: two training recipes, one text, side by side.

Each recipe is a preset (``handformer.config.PRESETS``, with optional overrides) trained by
handformer's own ``Trainer`` — the same step ``handformer train`` runs — on the same
character tokenisation and the same train/validation split. Every ``--eval-every`` steps
both models are evaluated in fp32 on the *same* fixed validation windows (by default the
reference preset's: 200 × 12 evenly spaced windows of 64 characters), and the benchmark
records the first evaluation at which each reaches ``--target``.

The clock is the **training** wall-clock: the sum of the trainer's per-step times (batch,
forward, backward, clipping, AdamW). Evaluation is *excluded* (it differs only in how
often one chooses to look). The recipes alternate in chunks of ``--chunk`` steps while both
are still training, so load from other processes on a shared machine hits both alike; the
torch thread count is fixed and reported.

Once the faster recipe has stopped, the other trains alone, and a shared machine's load can
change meanwhile. So a second figure is reported beside the clock: the *paired estimate*,
steps to the target × the recipe's median step time over the rounds in which both were
still training (the same conditions for both).

    python benchmarks/time_to_loss.py --data tinyshakespeare.txt          # 1.88, the two presets
    python benchmarks/time_to_loss.py --quick                             # tiny; CI runs this
    handformer bench --only time_to_loss                                  # same, through the runner

Without ``--data`` the built-in text (Python's documentation) is used.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from handformer.config import get_preset
from handformer.data import Batch, LMWindows, train_val_split
from handformer.data.corpora import builtin_text, read_text_file
from handformer.jobs.lm import build_configs, seed_everything
from handformer.loss import lm_loss
from handformer.models.decoder_lm import DecoderLM
from handformer.tokenizers import CharTokenizer
from handformer.train.trainer import Trainer

__all__ = ["Recipe", "evaluate", "main", "race"]

REFERENCE, FAST = "shakespeare-char", "shakespeare-fast"
# The quick (CI) mode shrinks both recipes to a few seconds; it checks that the code runs,
# nothing about the result. Its target is one both recipes pass with room to spare at the
# first evaluation (the reference reaches ~4.30 at step 10 on the built-in text, from ~4.60),
# so the run always exercises the reached/ratio path.
QUICK_MODEL = dict(d_model=32, n_heads=4, n_layers=1)
QUICK_TRAIN = dict(max_steps=30, batch_size=4, warmup_steps=5)
QUICK_TARGET = 4.4


@dataclass
class Recipe:
    label: str
    preset: str
    model: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[Batch]) -> float:
    """Token-weighted mean validation loss in fp32, eval mode."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        n = batch.num_tokens
        total += float(lm_loss(model(batch.ids), batch.targets)) * n
        count += n
    model.train(was_training)
    return total / max(count, 1)


class _Runner:
    """One recipe: its trainer, its clock and its validation curve."""

    def __init__(self, recipe: Recipe, train_ids: torch.Tensor, vocab_size: int) -> None:
        self.recipe = recipe
        model_cfg, train_cfg = build_configs(
            recipe.preset, vocab_size, recipe.model,
            {**recipe.train, "device": "cpu", "loss_curve": False})
        self.model_cfg, self.train_cfg = model_cfg, train_cfg
        seed_everything(train_cfg.seed)
        self.model = DecoderLM(model_cfg)
        windows = LMWindows(train_ids, train_cfg.block_size, name="training split")
        self.trainer = Trainer(
            self.model, train_cfg, progress=False,
            train_batch=lambda g: windows.random_batch(train_cfg.batch_size, g))
        self.train_seconds = 0.0
        self.step_ms: list[float] = []
        self.paired_ms: list[float] = []  # steps taken while every recipe was training
        self.curve: list[dict[str, float]] = []
        self.reached: dict[str, float] | None = None

    @property
    def done(self) -> bool:
        return self.reached is not None or self.trainer.step >= self.train_cfg.max_steps

    def advance(self, steps: int, paired: bool) -> None:
        result = self.trainer.fit(stop_at=self.trainer.step + steps)
        self.step_ms += result.step_ms
        if paired:
            self.paired_ms += result.step_ms
        self.train_seconds += sum(result.step_ms) / 1000.0

    def evaluate(self, val: list[Batch], target: float) -> None:
        loss = evaluate(self.model, val)
        point = {"step": self.trainer.step, "train_seconds": self.train_seconds,
                 "val_loss": loss}
        self.curve.append(point)
        if self.reached is None and loss <= target:
            self.reached = point

    def summary(self) -> dict[str, Any]:
        tcfg = self.train_cfg
        paired = statistics.median(self.paired_ms) if self.paired_ms else math.nan
        return {
            "label": self.recipe.label, "preset": self.recipe.preset,
            "model_overrides": self.recipe.model, "train_overrides": self.recipe.train,
            "model": self.model_cfg.to_dict(), "train": tcfg.to_dict(),
            "parameters": self.model.num_parameters(),
            "tokens_per_step": tcfg.batch_size * tcfg.block_size * tcfg.grad_accum_steps,
            "median_step_ms": statistics.median(self.step_ms) if self.step_ms else math.nan,
            "paired_median_step_ms": paired,
            "paired_seconds_to_target": (None if self.reached is None
                                         else self.reached["step"] * paired / 1000.0),
            "steps_run": self.trainer.step,
            "reached": self.reached,
            "best_val_loss": min((p["val_loss"] for p in self.curve), default=math.nan),
            "curve": self.curve,
        }


def race(text: str, recipes: list[Recipe], *, target: float, eval_every: int,
         eval_windows: int, eval_block: int, val_fraction: float = 0.1, chunk: int = 0,
         verbose: bool = True) -> list[dict[str, Any]]:
    """Train the recipes alternately, ``chunk`` steps at a time (default: ``eval_every``),
    evaluating every ``eval_every`` steps, until each reaches ``target`` (or its
    ``max_steps``); return one summary per recipe."""
    chunk = chunk or eval_every
    if chunk <= 0 or eval_every % chunk:
        raise ValueError(f"chunk={chunk} must divide eval_every={eval_every}")
    tok = CharTokenizer.from_text(text)
    train_ids, val_ids = train_val_split(tok.encode_array(text), val_fraction)
    # The same windows for every recipe, grouped into large batches (evaluation speed only).
    per_batch = min(eval_windows, 240)
    val = LMWindows(val_ids, eval_block, name="validation split").fixed_batches(
        math.ceil(eval_windows / per_batch), per_batch)
    runners = [_Runner(r, train_ids, tok.vocab_size) for r in recipes]
    for r in runners:
        r.curve.append({"step": 0, "train_seconds": 0.0, "val_loss": evaluate(r.model, val)})
    while not all(r.done for r in runners):
        paired = not any(r.done for r in runners)
        for r in runners:
            if r.done:
                continue
            r.advance(chunk, paired)
            step = r.trainer.step
            if step % eval_every and step < r.train_cfg.max_steps:
                continue
            r.evaluate(val, target)
            if verbose:
                p = r.curve[-1]
                print(f"  {r.recipe.label:<18} step {p['step']:>5}  train {p['train_seconds']:7.1f}"
                      f" s  val {p['val_loss']:.4f}", flush=True)
    return [r.summary() for r in runners]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None,
                        help="UTF-8 text (default: the built-in text)")
    parser.add_argument("--target", type=float, default=None,
                        help=f"validation loss to reach (default 1.88; --quick: {QUICK_TARGET})")
    parser.add_argument("--reference", default=REFERENCE, help="reference preset")
    parser.add_argument("--fast", default=FAST, help="contender preset")
    parser.add_argument("--reference-max-steps", type=int, default=3000,
                        help="the reference's step budget (its cosine schedule spans it)")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--chunk", type=int, default=25,
                        help="steps of one recipe before the other's turn (divides --eval-every)")
    parser.add_argument("--eval-windows", type=int, default=2400,
                        help="fixed validation windows (the reference preset's 200 × 12)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's own choice)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny models and a few steps, to check that it runs (no claims)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/time_to_loss.json"))
    args = parser.parse_args(argv)
    target = args.target or (QUICK_TARGET if args.quick else 1.88)
    if args.threads:
        torch.set_num_threads(args.threads)
    text = builtin_text() if args.data is None else read_text_file(args.data)
    ref_train: dict[str, Any] = {"max_steps": args.reference_max_steps}
    model_o: dict[str, Any] = {}
    fast_train: dict[str, Any] = {}
    eval_windows, eval_every = args.eval_windows, args.eval_every
    if args.quick:
        text = text[:60_000]
        model_o, ref_train, fast_train = dict(QUICK_MODEL), dict(QUICK_TRAIN), dict(QUICK_TRAIN)
        eval_windows, eval_every = 48, 10
        args.chunk = 5
    recipes = [Recipe("reference", args.reference, dict(model_o), ref_train),
               Recipe("fast", args.fast, dict(model_o), fast_train)]
    eval_block = get_preset(args.reference).train.get("block_size", 64)
    threads = torch.get_num_threads()
    source = "built-in text" if args.data is None else str(args.data)
    print(f"target val loss {target} on {source} ({len(text):,} chars); "
          f"{eval_windows} validation windows of {eval_block}, fp32, every {eval_every} steps; "
          f"{threads} torch thread(s); clock = training steps only (evaluation excluded)")
    t0 = time.perf_counter()
    rows = race(text, recipes, target=target, eval_every=eval_every, chunk=args.chunk,
                eval_windows=eval_windows, eval_block=eval_block)
    wall = time.perf_counter() - t0
    header = (f"{'recipe':<10} {'preset':<18} {'params':>8} {'tok/step':>8} {'ms/step':>8} "
              f"{'paired ms':>9} {'steps':>6} {'train s':>8} {'paired s':>8} {'best val':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        hit = r["reached"]
        steps = f"{hit['step']:>6}" if hit else f"{'—':>6}"
        secs = f"{hit['train_seconds']:>8.1f}" if hit else f"{'not hit':>8}"
        est = r["paired_seconds_to_target"]
        est_s = f"{est:>8.1f}" if est is not None else f"{'—':>8}"
        print(f"{r['label']:<10} {r['preset']:<18} {r['parameters']:>8,} "
              f"{r['tokens_per_step']:>8} {r['median_step_ms']:>8.1f} "
              f"{r['paired_median_step_ms']:>9.1f} {steps} {secs} {est_s} "
              f"{r['best_val_loss']:>8.4f}")
    ref, fast = rows
    ratio = paired_ratio = None
    if ref["reached"] and fast["reached"]:
        ratio = fast["reached"]["train_seconds"] / ref["reached"]["train_seconds"]
        paired_ratio = fast["paired_seconds_to_target"] / ref["paired_seconds_to_target"]
        print(f"fast / reference training time to {target}: {ratio:.2f} on the clock, "
              f"{paired_ratio:.2f} as the paired estimate")
    else:
        print(f"a recipe did not reach {target}: no ratio")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "target": target, "data": source, "characters": len(text), "threads": threads,
        "eval_every": eval_every, "eval_windows": eval_windows, "eval_block": eval_block,
        "quick": args.quick, "ratio": ratio,
        "paired_ratio": paired_ratio, "chunk": args.chunk, "wall_seconds": wall,
        "rows": rows}, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
