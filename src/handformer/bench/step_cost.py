"""Training time to a known step, measured side by side: the second half of a speedrun ratio.

``time_to_loss`` finds *at which step* each recipe first reaches the target; those steps are
exact. Its clock is not: on a shared machine a recipe that trains in busy minutes looks
slow. This benchmark times only the steps, in a quiet spell, the recipes alternating
``--chunk`` steps at a time with one thread each, so load hits them alike:

    cost(recipe, N) = Σ over its chunks up to step N of (median step ms in the chunk × steps)

(a chunk's median drops the odd step a neighbour stole). A recipe whose steps change cost as
it trains (a sequence or batch warm-up) is timed along its own schedule, so the sum is what
its first N steps really cost. The reference's steps all cost the same, so it trains
``--reference-timed`` steps and its cost to step M is M × its median. The ratio is
``cost(contender, N) / cost(reference, M)`` for each contender step N given; it is repeated
``--rounds`` times with fresh models and the median ratio reported.

Each recipe's median step is also stated as a share of the FLOP floor (``bench.flops``):
model FLOPs per step ÷ step time ÷ the matmul FLOP/s measured here, at these threads, in the
recipe's dtype — a share of *measured* matmul throughput (the practical floor), not of the
datasheet peak. The JSON's ``"machine"`` names the CPU, ISA level and threads.

    python benchmarks/step_cost.py --data tinyshakespeare.txt --threads 1 \\
        --reference-steps 2010 --fast speedrun --fast-steps 235,240,245
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from handformer.bench.flops import matmul_peaks, model_flops_per_token, peak_line
from handformer.bench.time_to_loss import REFERENCE, Recipe, Runner, json_arg
from handformer.data import train_val_split
from handformer.data.corpora import builtin_text, read_text_file
from handformer.machine import describe_machine, machine_line
from handformer.tokenizers import CharTokenizer

__all__ = ["flop_shares", "main", "step_costs"]


def _steps_arg(text: str) -> tuple[int, ...]:
    try:
        steps = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected steps like 255,260; got {text!r}") from None
    if not steps or min(steps) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive steps; got {text!r}")
    return steps


def step_costs(text: str, reference: Recipe, fast: Recipe, *, fast_steps: int,
               reference_timed: int, chunk: int) -> dict[str, Any]:
    """One round: both recipes from fresh models, alternating ``chunk`` steps; the
    contender trains ``fast_steps`` steps (its cumulative cost at every step is returned),
    the reference ``reference_timed`` steps (its median step ms)."""
    if chunk <= 0:
        raise ValueError(f"chunk must be a positive number of steps; got {chunk}")
    tok = CharTokenizer.from_text(text)
    train_ids, _ = train_val_split(tok.encode_array(text), 0.1)
    ref = Runner(reference, train_ids, tok.vocab_size)
    con = Runner(fast, train_ids, tok.vocab_size)
    ref_ms: list[float] = []
    cumulative: list[float] = [0.0]  # the contender's cost (ms) of its first n steps
    while con.trainer.step < fast_steps or ref.trainer.step < reference_timed:
        if con.trainer.step < fast_steps:
            n = min(chunk, fast_steps - con.trainer.step)
            ms = con.trainer.fit(stop_at=con.trainer.step + n).step_ms
            median = statistics.median(ms)
            cumulative += [cumulative[-1] + median * (i + 1) for i in range(len(ms))]
        if ref.trainer.step < reference_timed:
            n = min(chunk, reference_timed - ref.trainer.step)
            ms = ref.trainer.fit(stop_at=ref.trainer.step + n).step_ms
            ref_ms.append(statistics.median(ms))
    flops = {f"{name}_flops_per_step": model_flops_per_token(r.model, r.train_cfg.block_size)
             * r.train_cfg.batch_size * r.train_cfg.block_size * r.train_cfg.grad_accum_steps
             for name, r in (("reference", ref), ("fast", con))}
    return {**flops, "reference_precision": ref.trainer.precision.name,
            "fast_precision": con.trainer.precision.name,
            "reference_step_ms": statistics.median(ref_ms),
            "fast_median_chunk_ms": statistics.median(
                (b - a) for a, b in itertools.pairwise(cumulative)),
            "fast_cumulative_ms": cumulative}


def flop_shares(rounds: list[dict[str, Any]], peak_n: int = 2048) -> dict[str, Any]:
    """Each recipe's median step (over the rounds) as achieved model FLOP/s and as a share of
    the matmul FLOP/s measured now in the dtype it trains in."""
    dtype = {k: "bfloat16" if rounds[0][f"{k}_precision"] == "bf16" else "float32"
             for k in ("reference", "fast")}
    peaks = matmul_peaks(tuple(getattr(torch, d) for d in sorted(set(dtype.values()))), peak_n)
    step_s = {"reference": statistics.median(r["reference_step_ms"] for r in rounds) / 1000,
              "fast": statistics.median(r["fast_median_chunk_ms"] for r in rounds) / 1000}
    achieved = {k: rounds[0][f"{k}_flops_per_step"] / step_s[k] for k in dtype}
    return {"peaks_flops": peaks, "achieved_flops": achieved,
            "share_of_peak": {k: achieved[k] / peaks[dtype[k]] for k in dtype}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None,
                        help="UTF-8 text (default: the built-in text)")
    parser.add_argument("--reference", default=REFERENCE, help="reference preset")
    parser.add_argument("--reference-steps", type=int, required=True,
                        help="steps the reference needs to the target (from time_to_loss)")
    parser.add_argument("--reference-max-steps", type=int, default=3000,
                        help="the reference's step budget, as in time_to_loss")
    parser.add_argument("--reference-timed", type=int, default=0,
                        help="reference steps actually timed (default: the contender's most)")
    parser.add_argument("--fast", required=True, help="contender preset")
    parser.add_argument("--fast-model", type=json_arg, default={}, metavar="JSON")
    parser.add_argument("--fast-train", type=json_arg, default={}, metavar="JSON")
    parser.add_argument("--fast-steps", type=_steps_arg, required=True,
                        help="steps the contender needs to the target, one per seed: 255,260")
    parser.add_argument("--chunk", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--peak-n", type=int, default=2048,
                        help="side of the square matmul that measures the FLOP floor")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/step_cost.json"))
    args = parser.parse_args(argv)
    if min(args.reference_steps, args.rounds, args.chunk, args.peak_n) <= 0 or (
            args.reference_timed < 0 or (args.threads is not None and args.threads <= 0)):
        parser.error("--reference-steps, --rounds, --chunk, --peak-n and --threads must be "
                     "positive (--reference-timed >= 0)")
    if args.data is not None and not args.data.is_file():
        parser.error(f"--data {args.data}: no such file")
    if args.threads:
        torch.set_num_threads(args.threads)
    text = builtin_text() if args.data is None else read_text_file(args.data)
    most = max(args.fast_steps)
    reference = Recipe("reference", args.reference, {},
                       {"max_steps": max(args.reference_max_steps, args.reference_timed)})
    fast = Recipe("fast", args.fast, args.fast_model, args.fast_train)
    machine = describe_machine()
    print(machine_line(machine))
    rounds = []
    for i in range(args.rounds):
        r = step_costs(text, reference, fast, fast_steps=most, chunk=args.chunk,
                       reference_timed=args.reference_timed or most)
        ref_cost = r["reference_step_ms"] * args.reference_steps
        ratios = [r["fast_cumulative_ms"][n] / ref_cost for n in args.fast_steps]
        rounds.append({**r, "ratios": ratios})
        print(f"round {i + 1}: reference {r['reference_step_ms']:.1f} ms/step, contender "
              f"{r['fast_median_chunk_ms']:.1f} ms/step (median); ratios "
              + " ".join(f"{x:.4f}" for x in ratios), flush=True)
    per_steps = [statistics.median(r["ratios"][j] for r in rounds)
                 for j in range(len(args.fast_steps))]
    print(f"median over {args.rounds} rounds, {torch.get_num_threads()} thread(s): "
          + ", ".join(f"{n} steps → {x:.4f}" for n, x in zip(args.fast_steps, per_steps,
                                                             strict=True))
          + f"; mean {statistics.mean(per_steps):.4f}")
    shares = flop_shares(rounds, args.peak_n)
    print(peak_line(shares["peaks_flops"]) + "; median step as a share of it: "
          + ", ".join(f"{k} {100 * v:.1f} %" for k, v in shares["share_of_peak"].items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": machine, **shares, "reference": args.reference,
        "reference_steps": args.reference_steps,
        "fast": args.fast, "fast_model": args.fast_model, "fast_train": args.fast_train,
        "fast_steps": list(args.fast_steps), "chunk": args.chunk,
        "threads": torch.get_num_threads(), "ratios": per_steps,
        "mean_ratio": statistics.mean(per_steps),
        "rounds": [{k: v for k, v in r.items() if k != "fast_cumulative_ms"} for r in rounds]},
        indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
