"""Training-step throughput, side by side: handformer's attention paths (and torch.compile)
against Hugging Face ``GPT2LMHeadModel`` with the same shape and random weights.

One step = forward + next-token loss + backward + AdamW step, on the same random batch.
Contenders alternate within one process (median of ``--repeats`` rounds after a warm-up),
so load on the machine hits them alike. Also measured in the same run:

* the fp32 (and bf16) matmul peak of this machine, from large square matmuls;
* the *matmul bound* of a step: the time of the step's own matrix multiplies (forward and
  backward, same shapes) run alone — what a step would cost with zero overhead;
* MFU: achieved FLOP/s ((6·N + 12·L·C·T) per token, N = matmul parameters) / the *measured*
  matmul peak in the row's dtype (``bench.flops``): a share of the practical floor on this
  CPU, not of a datasheet peak, so it can be compared across CPUs where a time cannot.

The peaks and the bound are timed *in the same rounds* as the steps (one n×n matmul per
dtype, and the step's matmuls, alternated with the contenders), so a busy machine slows them
alike and the ratios (bound/step, MFU) stay meaningful; a peak is the median of those rounds.
The JSON's ``"machine"`` (and the line above the table) names the CPU, ISA level and threads.

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

from handformer.bench.flops import make_matmul, matmul_peaks, model_flops_per_token, peak_line
from handformer.config import ModelConfig
from handformer.loss import lm_loss
from handformer.machine import describe_machine, machine_line
from handformer.models.decoder_lm import DecoderLM

VOCAB = 65
CONFIGS = {
    "small": dict(n_layers=4, n_heads=4, d_model=128, window=64, batch=12),
    "medium": dict(n_layers=6, n_heads=6, d_model=384, window=256, batch=8),
}
BOUND = "matmuls alone (the bound)"
PEAK = "n×n matmul (the peak)"
PEAK_BF16 = "n×n bf16 matmul (the bf16 peak)"
QUICK = {"tiny": dict(n_layers=2, n_heads=2, d_model=32, window=16, batch=4)}


def step_matmul_shapes(cfg: dict) -> list[tuple[int, int, int, int]]:
    """(batch, m, k, n) of every matmul in one training step (forward and backward).

    Linear layers are 2-D (batch 1); attention's scores and weights·v are batched over
    (B·H), as the model runs them."""
    c, layers, t, b = cfg["d_model"], cfg["n_layers"], cfg["window"], cfg["batch"]
    tokens, heads = b * t, cfg["n_heads"]
    linears = [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)] * layers + [(c, VOCAB)]
    shapes = []
    for k_in, n_out in linears:  # forward, input gradient, weight gradient
        shapes += [(1, tokens, k_in, n_out), (1, tokens, n_out, k_in), (1, k_in, tokens, n_out)]
    d = c // heads
    for _ in range(layers):  # scores (T,D,T) and weights·v (T,T,D): forward 1 + backward 2 each
        shapes += [(b * heads, t, d, t), (b * heads, t, t, d)] * 3
    return shapes


def make_matmul_bound(cfg: dict, dtype: torch.dtype) -> Callable[[], None]:
    """A callable that runs the step's matmuls alone (same shapes, nothing else): what a
    step would cost with zero overhead. It is timed in the same rounds as the contenders."""
    mats = [(torch.randn(bb, m, k, dtype=dtype).squeeze(0),
             torch.randn(bb, k, n, dtype=dtype).squeeze(0))
            for bb, m, k, n in step_matmul_shapes(cfg)]

    def run() -> None:
        for a, b in mats:
            a @ b

    return run


def flops_per_step(cfg: dict) -> float:
    """Model FLOPs of one training step (``bench.flops.model_flops_per_token``)."""
    model = build_handformer(cfg, "sdpa")
    return cfg["batch"] * cfg["window"] * model_flops_per_token(model, cfg["window"])


def build_handformer(cfg: dict, attention: str, vocab: int = VOCAB) -> torch.nn.Module:
    mc = ModelConfig(vocab_size=vocab, d_model=cfg["d_model"], n_heads=cfg["n_heads"],
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
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                    bos_token_id=0, eos_token_id=0)  # GPT-2's 50256 is outside this vocab
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


def loss_curves(cfg: dict, steps: int, every: int, text: str) -> dict:
    """fp32 and bf16-autocast training of the same model (same initial weights, same
    batches of real text, lr 1e-3 after a 20-step warm-up), one step of each in turn: the
    two loss curves, and their step times in the same rounds."""
    from handformer.data import LMWindows
    from handformer.tokenizers import CharTokenizer

    tok = CharTokenizer.from_text(text)
    windows = LMWindows(torch.as_tensor(tok.encode_array(text)), cfg["window"])
    gen = torch.Generator().manual_seed(0)
    batches = [windows.random_batch(cfg["batch"], gen) for _ in range(steps)]
    runs = {}
    for label, bf16 in (("fp32", False), ("bf16", True)):
        torch.manual_seed(0)
        model = build_handformer(cfg, "sdpa", tok.vocab_size)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        runs[label] = (model, opt, bf16)
    losses: dict[str, list[float]] = {k: [] for k in runs}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i, batch in enumerate(batches):
        for label, (model, opt, bf16) in runs.items():
            for group in opt.param_groups:
                group["lr"] = 1e-3 * min(1.0, (i + 1) / 20)
            t0 = time.perf_counter()
            ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if bf16
                   else contextlib.nullcontext())
            with ctx:
                loss = lm_loss(model(batch.ids), batch.targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            times[label].append(time.perf_counter() - t0)
            losses[label].append(float(loss.detach()))
    # The mean loss over each block of ``every`` steps (one batch's loss is noisy).
    blocks = [(i + every, {k: statistics.fmean(v[i:i + every]) for k, v in losses.items()})
              for i in range(0, steps, every)]
    fp32_ms, bf16_ms = (1000 * statistics.median(times[k][2:] or times[k]) for k in runs)
    return {"steps": steps, "every": every, "vocab": tok.vocab_size,
            "losses": losses, "blocks": [{"step": s, **m} for s, m in blocks],
            "median_ms": {"fp32": fp32_ms, "bf16": bf16_ms}, "speedup": fp32_ms / bf16_ms}


def run_config(name: str, cfg: dict, repeats: int, bf16: bool, compile_: bool,
               peak_n: int) -> list[dict]:
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
    timed: dict[str, Callable[[], object]] = {**contenders,
                                              BOUND: make_matmul_bound(cfg, torch.float32),
                                              PEAK: make_matmul(torch.float32, peak_n)}
    if bf16:
        timed[PEAK_BF16] = make_matmul(torch.bfloat16, peak_n)
    for step in timed.values():  # warm-up (and compile)
        for _ in range(2):
            step()
    times: dict[str, list[float]] = {k: [] for k in timed}
    for _ in range(repeats):
        for label, step in timed.items():
            t0 = time.perf_counter()
            step()
            times[label].append(time.perf_counter() - t0)
    bound = statistics.median(times.pop(BOUND))
    peak = 2 * peak_n**3 / statistics.median(times.pop(PEAK))
    peak_bf16 = 2 * peak_n**3 / statistics.median(times.pop(PEAK_BF16)) if bf16 else None
    tokens = cfg["batch"] * cfg["window"]
    flops = flops_per_step(cfg)
    rows = []
    for label, ts in times.items():
        med = statistics.median(ts)
        in_bf16 = "bf16" in label
        row_peak = peak_bf16 if in_bf16 else peak
        rows.append({"config": name, "contender": label, "median_ms": 1000 * med,
                     "min_ms": 1000 * min(ts), "max_ms": 1000 * max(ts),
                     "tokens_per_s": tokens / med, "matmul_bound_ms": 1000 * bound,
                     "bound_over_step": bound / med, "achieved_flops": flops / med,
                     "peak_fp32_flops": peak, "peak_dtype": "bfloat16" if in_bf16 else "float32",
                     "mfu": flops / med / row_peak})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--bf16", action="store_true", help="add bf16 autocast rows")
    parser.add_argument("--compile", action="store_true", help="add a torch.compile row")
    parser.add_argument("--configs", nargs="*", default=None, choices=sorted(CONFIGS))
    parser.add_argument("--loss-curve", type=int, default=0, metavar="STEPS",
                        help="also train the medium configuration (quick: tiny) STEPS steps in "
                             "fp32 and in bf16 autocast side by side on the built-in text and "
                             "compare the loss curves")
    parser.add_argument("--out", type=Path,
                        default=Path("benchmarks/results/train_throughput.json"))
    args = parser.parse_args(argv)
    configs = QUICK if args.quick else {k: CONFIGS[k] for k in (args.configs or CONFIGS)}
    repeats = args.repeats or (2 if args.quick else 15)
    peak_n = 512 if args.quick else 2048
    machine = describe_machine()
    peaks = matmul_peaks((torch.float32, torch.bfloat16) if args.bf16 else (torch.float32,),
                         peak_n)
    print(machine_line(machine))
    print(f"before the rounds, {peak_line(peaks)}")
    rows = [r for name, cfg in configs.items()
            for r in run_config(name, cfg, repeats, args.bf16, args.compile, peak_n)]
    header = (f"{'config':<7} {'contender':<36} {'median ms':>9} {'min–max ms':>15} "
              f"{'tok/s':>8} {'bound/step':>10} {'MFU':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['config']:<7} {r['contender']:<36} {r['median_ms']:>9.1f} "
              f"{r['min_ms']:>7.1f}–{r['max_ms']:<7.1f} {r['tokens_per_s']:>8.0f} "
              f"{100 * r['bound_over_step']:>9.0f}% {100 * r['mfu']:>5.0f}%")
    bounds = [f"{r['config']} {r['matmul_bound_ms']:.1f} ms" for r in rows
              if r["contender"] == "handformer sdpa"]
    print("matmul bound of a step (its matmuls alone): " + ", ".join(bounds))
    in_rounds = [f"{r['config']} {r['peak_fp32_flops'] / 1e9:.0f}" for r in rows
                 if r["contender"] == "handformer sdpa"]
    print(f"fp32 peak in the rounds ({peak_n}³ matmul, median), GFLOP/s: "
          + ", ".join(in_rounds))
    print("MFU = achieved model FLOP/s ÷ the measured matmul peak in the row's dtype (the "
          "practical floor on this CPU, not the datasheet peak)")
    for name in configs:
        by = {r["contender"]: r["median_ms"] for r in rows if r["config"] == name}
        if "HF GPT2LMHeadModel" in by:
            print(f"{name}: handformer sdpa vs HF GPT-2: "
                  f"{by['HF GPT2LMHeadModel'] / by['handformer sdpa']:.2f}x")
        if "handformer sdpa (bf16 autocast)" in by:
            print(f"{name}: bf16 autocast vs fp32: "
                  f"{by['handformer sdpa'] / by['handformer sdpa (bf16 autocast)']:.2f}x")
    curves = None
    if args.loss_curve:
        from handformer.data.corpora import builtin_text

        name = "tiny" if args.quick else "medium"
        every = max(1, args.loss_curve // 10)
        curves = {"config": name, **loss_curves({**QUICK, **CONFIGS}[name], args.loss_curve,
                                                 every, builtin_text())}
        print(f"\n{name}: fp32 vs bf16 autocast training, same weights and batches (built-in "
              f"text, {curves['vocab']} characters); mean loss per {every} steps")
        print(f"{'steps':>9} {'fp32':>8} {'bf16':>8} {'diff':>8}")
        for b in curves["blocks"]:
            print(f"{b['step'] - every + 1:>4}–{b['step']:<4} {b['fp32']:>8.4f} {b['bf16']:>8.4f} "
                  f"{b['bf16'] - b['fp32']:>+8.4f}")
        print(f"step time in these rounds: fp32 {curves['median_ms']['fp32']:.0f} ms, bf16 "
              f"{curves['median_ms']['bf16']:.0f} ms ({curves['speedup']:.2f}x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "peaks_flops": peaks,
                                    "repeats": repeats, "rows": rows,
                                    "threads": torch.get_num_threads(),
                                    "loss_curves": curves}, indent=2))
    print(f"\nwrote {args.out}")

    return 0


if __name__ == "__main__":
    raise SystemExit(main())
