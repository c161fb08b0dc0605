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

Each row also states its share of the FLOP floor: model FLOPs per step (``bench.flops``) ÷
median step time ÷ the matmul FLOP/s measured on this CPU, at these threads, in the dtype the
recipe trains in, right after the race — a share of *measured* matmul throughput (the
practical floor), not of the datasheet peak. Times move between CPUs; this share moves less.
The JSON's ``"machine"`` (and the line above the table) names the CPU, ISA level and threads.

    python benchmarks/time_to_loss.py --data tinyshakespeare.txt          # 1.88, the two presets
    python benchmarks/time_to_loss.py --data tinyshakespeare.txt --ablation   # the speedrun log
    python benchmarks/time_to_loss.py --quick                             # tiny; CI runs this
    handformer bench --only time_to_loss                                  # same, through the runner

``--ablation`` races the reference against a *ladder*: starting from ``shakespeare-fast``, one
lever is added per row (``LADDER``); a lever marked kept stays in every row below it, one
marked dropped is measured and then left out. The last rung (the final recipe) runs once per
``--seeds``. Every row trains in the same race, alternating chunk by chunk with all the
others and with the one reference run, so each ratio is against that reference; each row
also prints the command that races it alone against the reference.

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

from handformer.bench.flops import matmul_peaks, model_flops_per_token, peak_line
from handformer.config import get_preset
from handformer.data import Batch, LMWindows, train_val_split
from handformer.data.corpora import builtin_text, read_text_file
from handformer.jobs.lm import build_configs, seed_everything
from handformer.loss import lm_loss
from handformer.machine import describe_machine, machine_line
from handformer.models.decoder_lm import DecoderLM
from handformer.tokenizers import CharTokenizer
from handformer.train.trainer import Trainer

__all__ = ["LADDER", "Lever", "Recipe", "Runner", "add_flop_share", "evaluate", "json_arg",
           "ladder_recipes", "main", "race"]

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
    """A preset with overrides. ``eval_from`` skips the evaluations before that step (they
    cost time on a busy machine and cannot be the first one at the target when the loss at
    ``eval_from`` is still above it — the summary flags a recipe for which it was not)."""

    label: str
    preset: str
    model: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    eval_from: int = 0


@dataclass(frozen=True)
class Lever:
    """One rung of the ablation ladder: overrides on top of the rungs kept above it."""

    label: str
    model: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    kept: bool = True


# The speedrun log's ladder, from shakespeare-fast. Kept/dropped follows probes run before the
# race (see README; from the batch warm-up on: probes evaluated every 5-10 steps, the final
# recipe on seeds 1337, 1, 2); the race re-measures every rung against one reference. The log
# was measured from shakespeare-fast's earlier LayerNorm + GELU block; both presets have since
# taken Llama's / Qwen3's block, where Muon wants the lower rate of the last rung.
LADDER: tuple[Lever, ...] = (
    Lever("Muon 0.02 (match_rms_adamw) on the blocks' matrices, AdamW 3e-3 elsewhere, 400 steps",
          train=dict(optimizer="muon", muon_lr=0.02, max_steps=400)),
    Lever("+ QK-norm", model=dict(qk_norm=True)),
    Lever("+ cosine over 300 steps instead of 400", train=dict(max_steps=300)),
    Lever("+ zero-initialised output projections", model=dict(zero_init_out=True), kept=False),
    Lever("+ RMSNorm instead of LayerNorm", model=dict(norm_type="rmsnorm"), kept=False),
    Lever("+ untied head", model=dict(tie_weights=False), kept=False),
    Lever("+ ReLU²", model=dict(activation="relu2"), kept=False),
    Lever("+ SwiGLU (d_ff 424)", model=dict(activation="swiglu"), kept=False),
    Lever("+ logit soft-cap 15", model=dict(logit_softcap=15.0), kept=False),
    Lever("+ warm-up–stable–decay (last 50 %)", train=dict(schedule="wsd", decay_fraction=0.5),
          kept=False),
    Lever("+ sequence warm-up 16→64 over 100 steps", train=dict(seq_warmup_steps=100),
          kept=False),
    Lever("+ batch 8 (500 steps)", train=dict(batch_size=8, max_steps=500), kept=False),
    Lever("+ AdamW lr 6e-3", train=dict(lr=6e-3), kept=False),
    Lever("+ batch warm-up 8→16 over 100 steps",
          train=dict(batch_warmup_steps=100, batch_warmup_start=8), kept=False),
    Lever("+ Muon momentum 0.9 instead of 0.95", train=dict(muon_momentum=0.9)),
    Lever("+ lr warm-up 25 steps instead of 50", train=dict(warmup_steps=25)),
    Lever("+ the attention kernel chosen by precision (manual in bf16: bf16 SDPA's CPU "
          "backward is slow)", model=dict(attention="auto")),
    Lever("+ Muon lr 0.01 (with Llama's block and QK-norm: Qwen3's)", train=dict(muon_lr=0.01)),
)


def ladder_recipes(ladder: tuple[Lever, ...] | list[Lever], base: str = FAST,
                   seeds: tuple[int, ...] = ()) -> list[Recipe]:
    """One recipe per rung (its overrides on top of every kept rung above it), then the final
    recipe (every kept rung) once per seed in ``seeds``."""
    model: dict[str, Any] = {}
    train: dict[str, Any] = {}
    recipes = []
    for i, lever in enumerate(ladder, 1):
        recipes.append(Recipe(f"L{i} {lever.label}", base, {**model, **lever.model},
                              {**train, **lever.train}))
        if lever.kept:
            model, train = {**model, **lever.model}, {**train, **lever.train}
    for seed in seeds:
        recipes.append(Recipe(f"final, seed {seed}", base, dict(model),
                              {**train, "seed": seed}))
    return recipes


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


class Runner:
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
            "precision": self.trainer.precision.name,
            "model_flops_per_token": model_flops_per_token(self.model, tcfg.block_size),
            "tokens_per_step": tcfg.batch_size * tcfg.block_size * tcfg.grad_accum_steps,
            "median_step_ms": statistics.median(self.step_ms) if self.step_ms else math.nan,
            "paired_median_step_ms": paired,
            "paired_seconds_to_target": (None if self.reached is None
                                         else self.reached["step"] * paired / 1000.0),
            "steps_run": self.trainer.step,
            "reached": self.reached,
            "eval_from": self.recipe.eval_from,
            # Reached at the first evaluation after the skipped ones: it may have been earlier.
            "reached_at_first_eval": (self.reached is not None and self.recipe.eval_from > 0
                                      and self.reached is self.curve[1]),
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
    runners = [Runner(r, train_ids, tok.vocab_size) for r in recipes]
    for r in runners:
        r.curve.append({"step": 0, "train_seconds": 0.0, "val_loss": evaluate(r.model, val)})
    while not all(r.done for r in runners):
        paired = not any(r.done for r in runners)
        for r in runners:
            if r.done:
                continue
            r.advance(chunk, paired)
            step = r.trainer.step
            if (step % eval_every or step < r.recipe.eval_from) \
                    and step < r.train_cfg.max_steps:
                continue
            r.evaluate(val, target)
            if verbose:
                p = r.curve[-1]
                print(f"  {r.recipe.label:<18} step {p['step']:>5}  train {p['train_seconds']:7.1f}"
                      f" s  val {p['val_loss']:.4f}", flush=True)
    return [r.summary() for r in runners]


def json_arg(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object; got {text!r}")
    return value


def _seeds_arg(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seeds like 1,2,3; got {text!r}") from None


def _command(data: str, threads: int, recipe: Recipe, target: float) -> str:
    """The command that races this recipe alone against the reference."""
    parts = ["python benchmarks/time_to_loss.py", f"--data {data}", f"--threads {threads}",
             f"--target {target}", f"--fast {recipe.preset}"]
    if recipe.model:
        parts.append(f"--fast-model '{json.dumps(recipe.model, sort_keys=True)}'")
    if recipe.train:
        parts.append(f"--fast-train '{json.dumps(recipe.train, sort_keys=True)}'")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None,
                        help="UTF-8 text (default: the built-in text)")
    parser.add_argument("--target", type=float, default=None,
                        help=f"validation loss to reach (default 1.88; --quick: {QUICK_TARGET})")
    parser.add_argument("--reference", default=REFERENCE, help="reference preset")
    parser.add_argument("--fast", default=FAST, help="contender preset")
    parser.add_argument("--fast-model", type=json_arg, default={}, metavar="JSON",
                        help="ModelConfig overrides for the contender, e.g. '{\"qk_norm\": true}'")
    parser.add_argument("--fast-train", type=json_arg, default={}, metavar="JSON",
                        help="TrainConfig overrides for the contender, e.g. "
                             "'{\"optimizer\": \"muon\"}'")
    parser.add_argument("--ablation", action="store_true",
                        help="race the reference against every rung of LADDER (from --fast) "
                             "and the final recipe once per --seeds")
    parser.add_argument("--seeds", type=_seeds_arg, default=None,
                        help="seeds of the final recipe with --ablation (default 1337,1,2); "
                             "without --ablation: race the contender once per seed (default: "
                             "once, with its preset's seed)")
    parser.add_argument("--reference-max-steps", type=int, default=3000,
                        help="the reference's step budget (its cosine schedule spans it)")
    parser.add_argument("--eval-from", type=int, default=0, metavar="STEP",
                        help="contenders: no evaluation before STEP (default 0)")
    parser.add_argument("--reference-eval-from", type=int, default=0, metavar="STEP",
                        help="the reference: no evaluation before STEP (default 0)")
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
    if args.ablation:
        contenders = ladder_recipes(LADDER, args.fast, args.seeds or (1337, 1, 2))
    else:
        fast_model, fast_train = {**model_o, **args.fast_model}, {**fast_train, **args.fast_train}
        contenders = ([Recipe("fast", args.fast, fast_model, fast_train)] if not args.seeds else
                      [Recipe(f"final, seed {seed}", args.fast, dict(fast_model),
                              {**fast_train, "seed": seed}) for seed in args.seeds])
    if args.ablation and args.quick:  # the same shrinking as the plain quick race
        for r in contenders:
            r.model, r.train = {**r.model, **model_o}, {**r.train, **fast_train}
            if "batch_warmup_start" in r.train:  # a warm-up starts within the shrunk batch
                r.train["batch_warmup_start"] = min(r.train["batch_warmup_start"],
                                                    fast_train["batch_size"])
    for r in contenders:
        r.eval_from = args.eval_from
    recipes = [Recipe("reference", args.reference, dict(model_o), ref_train,
                      eval_from=args.reference_eval_from), *contenders]
    eval_block = get_preset(args.reference).train.get("block_size", 64)
    threads = torch.get_num_threads()
    source = "built-in text" if args.data is None else str(args.data)
    machine = describe_machine()
    print(machine_line(machine))
    print(f"target val loss {target} on {source} ({len(text):,} chars); "
          f"{eval_windows} validation windows of {eval_block}, fp32, every {eval_every} steps; "
          f"{threads} torch thread(s); clock = training steps only (evaluation excluded)")
    t0 = time.perf_counter()
    rows = race(text, recipes, target=target, eval_every=eval_every, chunk=args.chunk,
                eval_windows=eval_windows, eval_block=eval_block)
    wall = time.perf_counter() - t0
    dtypes = {torch.bfloat16 if r["precision"] == "bf16" else torch.float32 for r in rows}
    peaks = matmul_peaks(tuple(sorted(dtypes, key=str)), 512 if args.quick else 2048)
    print(peak_line(peaks))
    for row in rows:
        add_flop_share(row, peaks)
    ref = rows[0]
    for row, recipe in zip(rows[1:], contenders, strict=True):
        row["command"] = _command(args.data or "<built-in>", threads, recipe, target)
        both = ref["reached"] and row["reached"]
        row["ratio"] = (row["reached"]["train_seconds"] / ref["reached"]["train_seconds"]
                        if both else None)
        row["paired_ratio"] = (row["paired_seconds_to_target"] / ref["paired_seconds_to_target"]
                               if both else None)
    _print_table(rows)
    ratio, paired_ratio = rows[1]["ratio"], rows[1]["paired_ratio"]
    if ratio is not None:
        print(f"{rows[1]['label']} / reference training time to {target}: {ratio:.2f} on the "
              f"clock, {paired_ratio:.2f} as the paired estimate")
    else:
        print(f"a recipe did not reach {target}: no ratio")
    seeds = _seed_summary(rows) if args.ablation or args.seeds else None
    if seeds:
        print(f"final recipe over {seeds['n']} seeds: paired ratio mean {seeds['paired_mean']:.3f}"
              f" (min {seeds['paired_min']:.3f}, max {seeds['paired_max']:.3f}); clock mean "
              f"{seeds['clock_mean']:.3f} (min {seeds['clock_min']:.3f}, max "
              f"{seeds['clock_max']:.3f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": machine, "peaks_flops": peaks, "target": target, "data": source,
        "characters": len(text), "threads": threads,
        "eval_every": eval_every, "eval_windows": eval_windows, "eval_block": eval_block,
        "quick": args.quick, "ratio": ratio, "ablation": args.ablation, "final_seeds": seeds,
        "paired_ratio": paired_ratio, "chunk": args.chunk, "wall_seconds": wall,
        "rows": rows}, indent=2))
    print(f"\nwrote {args.out}")
    return 0


def add_flop_share(row: dict[str, Any], peaks: dict[str, float]) -> None:
    """Put a summary row's achieved model FLOP/s and its share of the measured matmul peak in
    the dtype it trained in (bf16 autocast runs its matmuls in bfloat16) into the row."""
    dtype = "bfloat16" if row["precision"] == "bf16" else "float32"
    achieved = (row["model_flops_per_token"] * row["tokens_per_step"]
                / (row["median_step_ms"] / 1000.0))
    row.update(achieved_flops=achieved, peak_dtype=dtype, share_of_peak=achieved / peaks[dtype])


def _seed_summary(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Mean and spread of the final recipe's ratios over its seeds (None if one missed)."""
    finals = [r for r in rows if r["label"].startswith("final, seed")]
    if not finals or any(r["ratio"] is None for r in finals):
        return None
    clock = [r["ratio"] for r in finals]
    paired = [r["paired_ratio"] for r in finals]
    return {"n": len(finals), "clock_mean": statistics.mean(clock), "clock_min": min(clock),
            "clock_max": max(clock), "paired_mean": statistics.mean(paired),
            "paired_min": min(paired), "paired_max": max(paired),
            "steps": [r["reached"]["step"] for r in finals]}


def _print_table(rows: list[dict[str, Any]]) -> None:
    header = (f"{'recipe':<44} {'params':>8} {'ms/step':>8} {'paired ms':>9} {'steps':>6} "
              f"{'train s':>8} {'paired s':>8} {'ratio':>6} {'paired':>6} {'best val':>8} "
              f"{'% peak':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        hit = r["reached"]
        early = "≤" if r["reached_at_first_eval"] else ""
        steps = f"{early}{hit['step']}".rjust(6) if hit else f"{'—':>6}"
        secs = f"{hit['train_seconds']:>8.1f}" if hit else f"{'not hit':>8}"
        est = r["paired_seconds_to_target"]
        est_s = f"{est:>8.1f}" if est is not None else f"{'—':>8}"
        ratio = r.get("ratio")
        paired = r.get("paired_ratio")
        print(f"{r['label'][:44]:<44} {r['parameters']:>8,} {r['median_step_ms']:>8.1f} "
              f"{r['paired_median_step_ms']:>9.1f} {steps} {secs} {est_s} "
              f"{'' if ratio is None else f'{ratio:.3f}':>6} "
              f"{'' if paired is None else f'{paired:.3f}':>6} {r['best_val_loss']:>8.4f} "
              f"{100 * r['share_of_peak']:>5.1f}%")
    print("% peak: achieved model FLOP/s ÷ the measured matmul FLOP/s in the recipe's dtype "
          "(the practical floor on this CPU)")


if __name__ == "__main__":
    raise SystemExit(main())
