"""Training-step throughput, side by side: handformer's attention paths (and torch.compile)
against Hugging Face ``GPT2LMHeadModel`` with the same shape and random weights.

One step = forward + next-token loss + backward + AdamW step, on the same random batch.
Contenders alternate within one process (median of ``--repeats`` rounds after a warm-up),
so load on the machine hits them alike. Also measured in the same run:

* the fp32 (and bf16) matmul peak of this machine, from large square matmuls;
* the *matmul bound* of a step: the time of the step's own matrix multiplies (forward and
  backward, same shapes) run alone — what a step would cost with zero overhead;
* MFU: achieved FLOP/s ((6·N + 12·L·C·T) per token, N = matmul parameters) / fp32 peak.

    python benchmarks/train_throughput.py                  # small and medium configurations
    python benchmarks/train_throughput.py --quick          # tiny; CI runs this so it never rots
    python benchmarks/train_throughput.py --bf16 --compile # add bf16 autocast and compile rows
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from handformer.config import ModelConfig
from handformer.loss import lm_loss
from handformer.models.decoder_lm import DecoderLM

VOCAB = 65
CONFIGS = {
    "small": dict(n_layers=4, n_heads=4, d_model=128, window=64, batch=12),
    "medium": dict(n_layers=6, n_heads=6, d_model=384, window=256, batch=8),
}
QUICK = {"tiny": dict(n_layers=2, n_heads=2, d_model=32, window=16, batch=4)}


def matmul_peak(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of an n×n×n matmul: the best this machine does for dense math."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / min(times)


def step_matmul_shapes(cfg: dict) -> list[tuple[int, int, int]]:
    """(m, k, n) of every matmul in one training step (forward and backward)."""
    c, layers, t, b = cfg["d_model"], cfg["n_layers"], cfg["window"], cfg["batch"]
    tokens, heads = b * t, cfg["n_heads"]
    linears = [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)] * layers + [(c, VOCAB)]
    shapes = []
    for k_in, n_out in linears:
        shapes += [(tokens, k_in, n_out), (tokens, n_out, k_in), (k_in, tokens, n_out)]
    d = c // heads
    for _ in range(layers * b * heads):  # per (batch, head): scores and weights·v, fwd + bwd
        shapes += [(t, d, t), (t, t, d)] * 3
    return shapes


def matmul_bound(cfg: dict, dtype: torch.dtype, reps: int = 3) -> float:
    """Seconds that the step's matmuls alone take here (same shapes, nothing else)."""
    mats = [(torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype))
            for m, k, n in step_matmul_shapes(cfg)]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for a, b in mats:
            a @ b
        times.append(time.perf_counter() - t0)
    return min(times)


def flops_per_step(cfg: dict) -> float:
    c, layers, t = cfg["d_model"], cfg["n_layers"], cfg["window"]
    n_matmul = layers * 12 * c * c + c * VOCAB
    return cfg["batch"] * t * (6 * n_matmul + 12 * layers * c * t)


def build_handformer(cfg: dict, attention: str) -> torch.nn.Module:
    mc = ModelConfig(vocab_size=VOCAB, d_model=cfg["d_model"], n_heads=cfg["n_heads"],
                     n_layers=cfg["n_layers"], max_len=cfg["window"], attention=attention,
                     positional="learned", dropout=0.0)
    return DecoderLM(mc)


def build_hf(cfg: dict) -> torch.nn.Module | None:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    hc = GPT2Config(vocab_size=VOCAB, n_positions=cfg["window"], n_embd=cfg["d_model"],
                    n_layer=cfg["n_layers"], n_head=cfg["n_heads"], activation_function="gelu",
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(hc)


def make_step(model: torch.nn.Module, forward: Callable, ids: torch.Tensor,
              bf16: bool) -> Callable[[], float]:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    inputs, targets = ids[:, :-1], ids[:, 1:]

    def step() -> float:
        ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if bf16
               else contextlib.nullcontext())
        with ctx:
            loss = lm_loss(forward(model, inputs), targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return 0.0

    return step


def run_config(name: str, cfg: dict, repeats: int, bf16: bool, compile_: bool,
               peaks: dict[str, float]) -> list[dict]:
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (cfg["batch"], cfg["window"] + 1))
    ours = lambda m, x: m(x)  # noqa: E731
    contenders: dict[str, Callable[[], float]] = {}
    for path in ("manual", "sdpa"):
        contenders[f"handformer {path}"] = make_step(build_handformer(cfg, path), ours, ids,
                                                     False)
    if compile_:
        compiled = torch.compile(build_handformer(cfg, "sdpa"))
        contenders["handformer sdpa + compile"] = make_step(compiled, ours, ids, False)
    hf = build_hf(cfg)
    if hf is not None:
        contenders["HF GPT2LMHeadModel"] = make_step(hf, lambda m, x: m(input_ids=x).logits,
                                                     ids, False)
    if bf16:
        contenders["handformer sdpa (bf16 autocast)"] = make_step(
            build_handformer(cfg, "sdpa"), ours, ids, True)
        if hf is not None:
            contenders["HF GPT2LMHeadModel (bf16 autocast)"] = make_step(
                build_hf(cfg), lambda m, x: m(input_ids=x).logits, ids, True)
    for step in contenders.values():  # warm-up (and compile)
        for _ in range(2):
            step()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(repeats):
        for label, step in contenders.items():
            t0 = time.perf_counter()
            step()
            times[label].append(time.perf_counter() - t0)
    bound = matmul_bound(cfg, torch.float32)
    tokens = cfg["batch"] * cfg["window"]
    flops = flops_per_step(cfg)
    rows = []
    for label, ts in times.items():
        med = statistics.median(ts)
        rows.append({"config": name, "contender": label, "median_ms": 1000 * med,
                     "min_ms": 1000 * min(ts), "max_ms": 1000 * max(ts),
                     "tokens_per_s": tokens / med, "matmul_bound_ms": 1000 * bound,
                     "bound_over_step": bound / med,
                     "mfu_fp32": flops / med / peaks["float32"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--bf16", action="store_true", help="add bf16 autocast rows")
    parser.add_argument("--compile", action="store_true", help="add a torch.compile row")
    parser.add_argument("--configs", nargs="*", default=None, choices=sorted(CONFIGS))
    parser.add_argument("--out", type=Path,
                        default=Path("benchmarks/results/train_throughput.json"))
    args = parser.parse_args(argv)
    configs = QUICK if args.quick else {k: CONFIGS[k] for k in (args.configs or CONFIGS)}
    repeats = args.repeats or (2 if args.quick else 15)
    peaks = {"float32": matmul_peak(torch.float32, 512 if args.quick else 2048)}
    if args.bf16:
        peaks["bfloat16"] = matmul_peak(torch.bfloat16, 512 if args.quick else 2048)
    print("matmul peak: " + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in peaks.items()))
    rows = [r for name, cfg in configs.items()
            for r in run_config(name, cfg, repeats, args.bf16, args.compile, peaks)]
    header = (f"{'config':<7} {'contender':<36} {'median ms':>9} {'min–max ms':>15} "
              f"{'tok/s':>8} {'bound/step':>10} {'MFU':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['config']:<7} {r['contender']:<36} {r['median_ms']:>9.1f} "
              f"{r['min_ms']:>7.1f}–{r['max_ms']:<7.1f} {r['tokens_per_s']:>8.0f} "
              f"{100 * r['bound_over_step']:>9.0f}% {100 * r['mfu_fp32']:>5.0f}%")
    bounds = [f"{r['config']} {r['matmul_bound_ms']:.1f} ms" for r in rows
              if r["contender"] == "handformer sdpa"]
    print("matmul bound of a step (its matmuls alone): " + ", ".join(bounds))
    for name in configs:
        by = {r["contender"]: r["median_ms"] for r in rows if r["config"] == name}
        if "HF GPT2LMHeadModel" in by:
            print(f"{name}: handformer sdpa vs HF GPT-2: "
                  f"{by['HF GPT2LMHeadModel'] / by['handformer sdpa']:.2f}x")
        if "handformer sdpa (bf16 autocast)" in by:
            print(f"{name}: bf16 autocast vs fp32: "
                  f"{by['handformer sdpa'] / by['handformer sdpa (bf16 autocast)']:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"peaks_flops": peaks, "repeats": repeats, "rows": rows},
                                   indent=2))
    print(f"\nwrote {args.out}")

    return 0


if __name__ == "__main__":
    raise SystemExit(main())
