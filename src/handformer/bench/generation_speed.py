"""Generation speed at batch 1, greedy: handformer with and without the KV cache against
Hugging Face ``GPT2LMHeadModel`` (same shape, random weights, ``use_cache=True``).

Also measures the bound no implementation in that dtype can beat at batch 1: every weight
must be streamed from memory once per token, so the time of the model's matrix–vector
products alone (nothing else) is a floor on the time per token. Two versions: the model's
own matvecs one by one (what any layer-by-layer implementation must at least do) and one
matvec over all the weights stacked into a single matrix (pure streaming, no per-call cost).

Contenders run alternately in one process (median of ``--repeats`` after a warm-up), so
machine noise hits them alike, on ``--threads`` intra-op threads (default 1: at batch 1 the
ops are too small to split, and on a shared machine waiting OpenMP threads make small ops
many times slower). Prints a table and writes JSON.

    python benchmarks/generation_speed.py            # full: 4L/128d × 256 tokens, 6L/384d × 512
    python benchmarks/generation_speed.py --quick    # seconds; used in CI so it never rots
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from handformer.config import ModelConfig
from handformer.generate import generate
from handformer.models.decoder_lm import DecoderLM

VOCAB = 96
PROMPT = 16

CASES = {
    "4L-128d": dict(n_layers=4, n_heads=4, d_model=128, new_tokens=256),
    "6L-384d": dict(n_layers=6, n_heads=6, d_model=384, new_tokens=512),
}
QUICK_CASES = {"2L-64d": dict(n_layers=2, n_heads=4, d_model=64, new_tokens=24)}


def build_handformer(case: dict, max_len: int, dtype: torch.dtype) -> DecoderLM:
    cfg = ModelConfig(vocab_size=VOCAB, d_model=case["d_model"], n_heads=case["n_heads"],
                      n_layers=case["n_layers"], max_len=max_len, positional="learned",
                      attention="sdpa", activation="gelu")
    return DecoderLM(cfg).to(dtype).eval()


def build_hf(case: dict, max_len: int, dtype: torch.dtype):
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=max_len, n_embd=case["d_model"],
                     n_layer=case["n_layers"], n_head=case["n_heads"],
                     activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    return GPT2LMHeadModel(cfg).to(dtype).eval()


def matvec_floor(model: DecoderLM, reps: int) -> float:
    """Seconds per token spent in matrix–vector products alone: every Linear weight of the
    model (and the vocabulary head) multiplied by one vector."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = [torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights]
    times = []
    with torch.inference_mode():
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(20):
                for w, x in zip(weights, xs, strict=True):
                    torch.nn.functional.linear(x, w)
            times.append((time.perf_counter() - t0) / 20)
    return statistics.median(times)


def streaming_floor(model: DecoderLM, reps: int) -> float:
    """Seconds per token to stream every Linear weight once, as one matvec over all of them
    stacked into a single (Σ out, C) matrix — the memory-bandwidth bound without the
    per-call cost of many small products. Layers whose input width is not C are stacked
    transposed, so every weight is read exactly once."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    c = model.config.d_model
    stacked = torch.cat([w if w.shape[1] == c else w.t() for w in weights]).contiguous()
    x = torch.randn(1, c, dtype=stacked.dtype)
    times = []
    with torch.inference_mode():
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(20):
                torch.nn.functional.linear(x, stacked)
            times.append((time.perf_counter() - t0) / 20)
    return statistics.median(times)


def time_runs(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():  # alternate, so drift hits every contender alike
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def run_case(name: str, case: dict, repeats: int, dtype: torch.dtype) -> list[dict]:
    torch.manual_seed(0)
    new = case["new_tokens"]
    max_len = PROMPT + new
    ours = build_handformer(case, max_len, dtype)
    hf = build_hf(case, max_len, dtype)
    prompt = torch.randint(1, VOCAB, (1, PROMPT))

    fns: dict[str, Callable[[], None]] = {
        "handformer (cache)": lambda: generate(ours, prompt, new, temperature=0),
        "handformer (no cache)": lambda: generate(ours, prompt, new, temperature=0,
                                                  use_cache=False),
    }
    if hf is not None:
        def run_hf() -> None:
            with torch.inference_mode():
                out = hf.generate(prompt, attention_mask=torch.ones_like(prompt),
                                  max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  use_cache=True, pad_token_id=0)
            assert out.shape[1] == PROMPT + new
        fns["HF GPT2LMHeadModel (cache)"] = run_hf
    times = time_runs(fns, repeats)
    floor = matvec_floor(ours, max(5, repeats))
    stream = streaming_floor(ours, max(5, repeats))
    weight_mb = sum(m.weight.numel() * m.weight.element_size() for m in ours.modules()
                    if isinstance(m, torch.nn.Linear)) / 1e6
    rows = []
    for contender, ts in times.items():
        med = statistics.median(ts)
        rows.append({"case": name, "dtype": str(dtype).removeprefix("torch."),
                     "contender": contender, "new_tokens": new,
                     "median_s": med, "min_s": min(ts), "max_s": max(ts),
                     "tokens_per_s": new / med, "ms_per_token": 1000 * med / new,
                     "floor_ms_per_token": 1000 * floor,
                     "fraction_of_floor": floor / (med / new), "weight_mb": weight_mb})
    for label, secs in (("weight-streaming floor (matvecs only)", floor),
                        ("  one matvec over all weights stacked", stream)):
        rows.append({"case": name, "dtype": str(dtype).removeprefix("torch."),
                     "contender": label, "new_tokens": new,
                     "median_s": secs * new, "min_s": secs * new, "max_s": secs * new,
                     "tokens_per_s": 1 / secs, "ms_per_token": 1000 * secs,
                     "floor_ms_per_token": 1000 * floor, "fraction_of_floor": floor / secs,
                     "weight_mb": weight_mb})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="float32")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for every contender (default 1)")
    parser.add_argument("--cases", nargs="+", default=None,
                        help=f"subset of the cases to run: {', '.join(CASES)}")
    parser.add_argument("--out", type=Path,
                        default=Path("benchmarks/results/generation_speed.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = QUICK_CASES if args.quick else CASES
    if args.cases:
        unknown = sorted(set(args.cases) - set(cases))
        if unknown:
            parser.error(f"unknown case(s) {unknown}; expected some of {list(cases)}")
        cases = {name: cases[name] for name in args.cases}
    repeats = args.repeats or (2 if args.quick else 5)
    dtypes = {"float32": [torch.float32], "bfloat16": [torch.bfloat16],
              "both": [torch.float32, torch.bfloat16]}[args.dtype]
    rows = [row for dtype in dtypes for name, case in cases.items()
            for row in run_case(name, case, repeats, dtype)]

    header = (f"{'case':<9} {'dtype':<9} {'contender':<40} {'tok/s':>9} {'ms/tok':>8} "
              f"{'min–max s':>15} {'% of floor':>10}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"median of {repeats} alternating repeats after a warm-up")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['case']:<9} {r['dtype']:<9} {r['contender']:<40} {r['tokens_per_s']:>9.0f} "
              f"{r['ms_per_token']:>8.3f} {r['min_s']:>7.3f}–{r['max_s']:<7.3f} "
              f"{100 * r['fraction_of_floor']:>9.0f}%")
    print()
    for name in cases:
        for dtype in dtypes:
            d = str(dtype).removeprefix("torch.")
            by = {r["contender"]: r for r in rows if r["case"] == name and r["dtype"] == d}
            cache = by["handformer (cache)"]["median_s"]
            ratio = by["handformer (no cache)"]["median_s"] / cache
            line = f"{name} {d}: cache vs no cache {ratio:.1f}x"
            hf = by.get("HF GPT2LMHeadModel (cache)")
            if hf is not None:
                line += f", handformer vs HF {hf['median_s'] / cache:.2f}x"
            print(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"repeats": repeats, "threads": torch.get_num_threads(),
                                    "rows": rows}, indent=2))
    print(f"\nwrote {args.out}")

    return 0


if __name__ == "__main__":
    raise SystemExit(main())
