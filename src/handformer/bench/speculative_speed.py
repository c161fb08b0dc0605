"""Speculative decoding against the target alone: batch 1, greedy, trained run folders.

For each pair (a target run and a draft run trained for it with ``handformer train
--draft-for``), the contenders decode the same prompts — snippets of the target's own
training text — one after another, alternating, median of ``--repeats`` after a warm-up:

* the target alone (``generate``, KV cache), and the draft alone (what a proposal costs);
* target + draft for each ``--speculate`` K (``speculative_generate``): tokens/s, the
  speed-up over the target alone, the acceptance rate, the tokens each target forward
  yields, and whether the output is token for token the target's own (it must be).

Why speculation pays or not is in two measured costs: ``ms/token`` of each model alone
(the draft's share of a target step) and the cost of one target forward over K + 1 new
tokens against one over a single token (``verify_ratio``: close to 1 where reading the
weights dominates, larger where per-call overhead or arithmetic does). The expected step
then costs ``K · draft + verify`` and yields ``(1 − α^(K+1)) / (1 − α)`` tokens.

``target_transforms`` (``--target-transform NAME=module:function``) adds, for each named
transform of the target model (e.g. int8 weights), the transformed target alone and with
the draft. Pairs: ``--pair NAME TARGET_RUN DRAFT_RUN`` (repeatable); with none, the runs
``runs/medium`` + ``runs/medium-draft`` and ``runs/default`` + ``runs/default-draft`` are
used where they exist (the commands that make them are printed otherwise). ``--quick``
uses tiny random models (a draft equal to the target and an unrelated one), in seconds.

    python -m handformer.bench.speculative_speed --pair 6L-384d runs/medium runs/medium-draft
    handformer bench --only speculative --quick
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from handformer.bench.generation_speed import time_alternating
from handformer.config import ModelConfig
from handformer.generate import SpeculationStats, generate, speculative_generate
from handformer.machine import describe_machine, machine_line
from handformer.models.decoder_lm import DecoderLM

__all__ = ["Pair", "main", "measure_pair", "verify_ratio"]

DEFAULT_PAIRS = (("6L-384d", "runs/medium", "runs/medium-draft"),
                 ("4L-128d (default)", "runs/default", "runs/default-draft"))
MAKE_PAIR = {
    "runs/medium": "handformer train --preset medium --out runs/medium",
    "runs/medium-draft": "handformer train --draft-for runs/medium --out runs/medium-draft",
    "runs/default": "handformer train --out runs/default",
    "runs/default-draft": "handformer train --draft-for runs/default --out "
                          "runs/default-draft",
}
Transform = Callable[[nn.Module], nn.Module]


class Pair:
    """A target and its draft, with the prompts to decode (lists of ids)."""

    def __init__(self, name: str, target: nn.Module, draft: nn.Module,
                 prompts: list[list[int]]) -> None:
        self.name, self.target, self.draft, self.prompts = name, target, draft, prompts


def verify_ratio(model: nn.Module, k: int, context: int = 32, reps: int = 60) -> float:
    """Time of one cached forward over ``k + 1`` new tokens / over 1 new token, after
    ``context`` cached tokens (medians, the two widths alternated): what checking K
    proposals costs in target steps."""
    vocab = model.config.vocab_size  # type: ignore[union-attr]
    context = min(context, model.config.max_len - k - 1)  # type: ignore[union-attr]
    prefix = torch.randint(0, vocab, (1, context))
    news = {width: torch.randint(0, vocab, (1, width)) for width in (1, k + 1)}
    times: dict[int, list[float]] = {width: [] for width in news}
    cache = model.make_cache(1)  # type: ignore[operator]
    with torch.inference_mode():
        model(prefix, cache=cache)
        for _ in range(reps):
            for width, new in news.items():
                cache.truncate(context)  # back to the prefix: the same work every time
                t0 = time.perf_counter()
                model(new, cache=cache, validate=False)
                times[width].append(time.perf_counter() - t0)
    return statistics.median(times[k + 1]) / statistics.median(times[1])


def measure_pair(pair: Pair, ks: list[int], new_tokens: int, repeats: int,
                 target_transforms: dict[str, Transform] | None = None) -> list[dict]:
    """Rows of the table for one pair (see the module docstring)."""
    targets: dict[str, nn.Module] = {"": pair.target}
    for label, transform in (target_transforms or {}).items():
        targets[f"{label} "] = transform(pair.target)
    prompts = [torch.tensor([p]) for p in pair.prompts]
    fns: dict[str, Callable[[], Any]] = {}
    stats: dict[str, SpeculationStats] = {}

    def alone(model: nn.Module) -> Callable[[], Any]:
        return lambda: [generate(model, p, new_tokens, temperature=0) for p in prompts]

    def speculative(model: nn.Module, k: int, name: str) -> Callable[[], Any]:
        def run() -> list[torch.Tensor]:
            stats[name] = SpeculationStats()  # the figures of the last round
            return [speculative_generate(model, pair.draft, p, new_tokens, speculate=k,
                                         temperature=0, stats=stats[name]) for p in prompts]
        return run

    for prefix, model in targets.items():
        fns[f"{prefix}target alone"] = alone(model)
        for k in ks:
            fns[f"{prefix}target + draft, K={k}"] = speculative(model, k,
                                                               f"{prefix}target + draft, K={k}")
    fns["draft alone"] = alone(pair.draft)
    times, outputs = time_alternating(fns, repeats)
    draft_s = statistics.median(times["draft alone"])
    total = new_tokens * len(prompts)
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        prefix = next((p for p in sorted(targets, key=len, reverse=True) if p and
                       name.startswith(p)), "")
        base = statistics.median(times[f"{prefix}target alone"]) if name != "draft alone" \
            else med
        row: dict[str, Any] = {
            "pair": pair.name, "contender": name, "new_tokens": new_tokens,
            "prompts": len(prompts), "median_s": med, "min_s": min(ts), "max_s": max(ts),
            "tokens_per_s": total / med, "ms_per_token": 1000 * med / total,
            "speedup_vs_target_alone": base / med,
            "draft_over_target_ms": draft_s / base if name != "draft alone" else None,
        }
        if name in stats:
            s = stats[name]
            reference = outputs[f"{prefix}target alone"]
            row.update(acceptance_rate=s.acceptance_rate,
                       tokens_per_target_call=s.tokens_per_target_call,
                       identical=all(torch.equal(a, b) for a, b in
                                     zip(outputs[name], reference, strict=True)))
        rows.append(row)
    for prefix, model in targets.items():  # each target's own cost of checking K proposals
        for k in ks:
            rows.append({"pair": pair.name,
                         "contender": f"{prefix}verify K={k} (1 target forward)",
                         "verify_ratio": verify_ratio(model, k)})
    return rows


def _load_pair(name: str, target_dir: str, draft_dir: str, n_prompts: int,
               prompt_chars: int) -> Pair:
    from handformer.generate import check_same_tokenizer
    from handformer.jobs.lm import load_recorded_text
    from handformer.runs import load_run

    target, draft = load_run(target_dir, kind="lm"), load_run(draft_dir, kind="lm")
    check_same_tokenizer(target.tokenizer, draft.tokenizer)
    text = load_recorded_text(target.config.get("data"), Path(target_dir))
    tail = text[int(0.9 * len(text)):]  # the validation split: text the models did not train on
    step = max(1, (len(tail) - prompt_chars) // n_prompts)
    prompts = [target.tokenizer.encode(tail[i * step : i * step + prompt_chars])
               for i in range(n_prompts)]
    return Pair(name, target.model, draft.model, prompts)


def _quick_pairs() -> list[Pair]:
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, n_heads=4, max_len=32, positional="learned", attention="sdpa")
    target = DecoderLM(ModelConfig(d_model=64, n_layers=2, **cfg)).eval()
    stranger = DecoderLM(ModelConfig(d_model=32, n_layers=1, tie_weights=False, **cfg)).eval()
    prompts = [torch.randint(0, 64, (8,)).tolist()]
    return [Pair("2L-64d, draft = itself", target, target, prompts),
            Pair("2L-64d, random 1L draft", target, stranger, prompts)]


def _transform(spec: str) -> tuple[str, Transform]:
    label, _, path = spec.partition("=")
    module, _, function = path.partition(":")
    if not (label and module and function):
        raise argparse.ArgumentTypeError(f"expected NAME=module:function; got {spec!r}")
    try:
        return label, getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as err:
        raise argparse.ArgumentTypeError(f"cannot load {path!r}: {err}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny random models, seconds")
    parser.add_argument("--pair", nargs=3, action="append", default=None,
                        metavar=("NAME", "TARGET_RUN", "DRAFT_RUN"))
    parser.add_argument("--speculate", type=int, nargs="+", default=None,
                        help="K values (default 2 4 6 8; quick: 3)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 512 (quick 24)")
    parser.add_argument("--prompts", type=int, default=4,
                        help="prompts from the validation text, 32 characters each")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (quick 1)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1)")
    parser.add_argument("--target-transform", type=_transform, action="append", default=[],
                        metavar="NAME=module:function",
                        help="also measure the target as transformed by this function")
    parser.add_argument("--out", type=Path,
                        default=Path("benchmarks/results/speculative_speed.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ks = args.speculate or ([3] if args.quick else [2, 4, 6, 8])
    new_tokens = args.new_tokens or (24 if args.quick else 512)
    repeats = args.repeats or (1 if args.quick else 3)
    skipped: list[str] = []
    if args.quick:
        pairs = _quick_pairs()
    else:
        wanted = [tuple(p) for p in args.pair] if args.pair else list(DEFAULT_PAIRS)
        pairs = []
        for name, target_dir, draft_dir in wanted:
            missing = [d for d in (target_dir, draft_dir) if not Path(d).is_dir()]
            if missing and not args.pair:
                how = "; ".join(MAKE_PAIR.get(d, d) for d in missing)
                skipped.append(f"{name}: no {', '.join(missing)} (make: {how})")
                continue
            try:
                if missing:
                    raise ValueError(f"run folder not found: {', '.join(missing)} (train a "
                                     "target with `handformer train --out TARGET_RUN` and its "
                                     "draft with `handformer train --draft-for TARGET_RUN "
                                     "--out DRAFT_RUN`)")
                pairs.append(_load_pair(name, target_dir, draft_dir, args.prompts, 32))
            except (ValueError, OSError) as err:  # one line, as handformer's commands say it
                print(f"speculative_speed: error: --pair {name!r}: {' '.join(str(err).split())}",
                      file=sys.stderr)
                return 1
    transforms = dict(args.target_transform)
    rows = [row for pair in pairs for row in measure_pair(pair, ks, new_tokens, repeats,
                                                          transforms)]
    _print_table(rows, repeats, skipped)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": describe_machine(), "rows": rows,
                                    "skipped": skipped, "speculate": ks,
                                    "threads": torch.get_num_threads(), "repeats": repeats,
                                    "torch": torch.__version__}, indent=2), encoding="utf-8")
    return 0


def _print_table(rows: list[dict], repeats: int, skipped: list[str]) -> None:
    print(machine_line())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), batch 1, greedy, "
          f"median of {repeats} alternating repeats after a warm-up")
    for line in skipped:
        print(f"skipped {line}")
    header = (f"{'pair':<24} {'contender':<34} {'tok/s':>8} {'ms/tok':>8} {'speed-up':>8} "
              f"{'accept':>7} {'tok/call':>8} {'same':>5}")
    print(header)
    print("-" * len(header))
    for r in rows:
        if "verify_ratio" in r:
            print(f"{r['pair']:<24} {r['contender']:<34} cost / 1-token forward: "
                  f"{r['verify_ratio']:.2f}")
            continue
        accept = f"{100 * r['acceptance_rate']:.0f}%" if "acceptance_rate" in r else ""
        per_call = f"{r['tokens_per_target_call']:.2f}" if "tokens_per_target_call" in r else ""
        same = ("yes" if r["identical"] else "NO") if "identical" in r else ""
        print(f"{r['pair']:<24} {r['contender']:<34} {r['tokens_per_s']:>8.0f} "
              f"{r['ms_per_token']:>8.3f} {r['speedup_vs_target_alone']:>7.2f}x "
              f"{accept:>7} {per_call:>8} {same:>5}")


if __name__ == "__main__":
    raise SystemExit(main())
