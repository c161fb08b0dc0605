"""Greedy decoding at batch 1: handformer's ``generate`` (KV cache) beside onnxruntime running
the same model exported by ``handformer convert --to onnx`` — the cached graph (past →
present, ``handformer.interop.onnx_decode``) and, in full mode, the plain one (the whole
window again every token).

Same weights (random, the ``generation`` benchmark's shapes), same prompt, one thread each
(torch and onnxruntime), contenders alternated in one process, median of ``--repeats``
after a warm-up. Each row also says whether its tokens equal handformer's. Without
onnxruntime (the ``onnx`` extra) it says so, writes a JSON that records the skip, and
exits 0.

    python benchmarks/onnx_decode.py            # 4L/128d × 256 tokens
    python benchmarks/onnx_decode.py --quick    # seconds; CI runs it so it never rots
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from handformer.config import ModelConfig
from handformer.generate import generate
from handformer.machine import describe_machine, machine_line
from handformer.models.decoder_lm import DecoderLM
from handformer.tokenizers import CharTokenizer

PROMPT = 16
CASES = {"4L-128d": dict(n_layers=4, n_heads=4, d_model=128, new_tokens=256)}
QUICK_CASES = {"2L-64d": dict(n_layers=2, n_heads=4, d_model=64, new_tokens=24)}
# 92 characters + 4 special tokens = the generation benchmark's 96-token vocabulary.
CHARS = [chr(c) for c in range(33, 125)]


def _missing() -> list[str]:
    return [m for m in ("onnx", "onnxruntime", "onnxscript")
            if importlib.util.find_spec(m) is None]


def _time(fn: Callable[[], np.ndarray]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_case(name: str, case: dict, repeats: int, quick: bool, threads: int) -> list[dict]:
    from handformer.interop.onnx_decode import OnnxLM
    from handformer.interop.onnx_export import export_onnx
    from handformer.runs import save_run

    new = case["new_tokens"]
    tok = CharTokenizer(CHARS)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=case["d_model"],
                      n_heads=case["n_heads"], n_layers=case["n_layers"],
                      max_len=PROMPT + new, positional="learned", attention="sdpa",
                      activation="gelu")
    torch.manual_seed(0)
    model = DecoderLM(cfg).eval()
    prompt = torch.randint(4, cfg.vocab_size, (1, PROMPT))  # (1, T)
    with tempfile.TemporaryDirectory() as tmp:
        save_run(Path(tmp) / "run", model, tok)
        sessions = {"onnxruntime (cache)": OnnxLM(
            export_onnx(Path(tmp) / "run", Path(tmp) / "cached.onnx", with_cache=True),
            threads=threads)}
        if not quick:
            sessions["onnxruntime (no cache)"] = OnnxLM(
                export_onnx(Path(tmp) / "run", Path(tmp) / "plain.onnx"), threads=threads)
    contenders: dict[str, Callable[[], np.ndarray]] = {
        "handformer (cache)": lambda: generate(model, prompt, new, temperature=0).numpy()}
    for label, lm in sessions.items():
        contenders[label] = lambda lm=lm: lm.greedy(prompt.numpy(), new)
    reference = contenders["handformer (cache)"]()
    same = {label: bool(np.array_equal(fn(), reference)) for label, fn in contenders.items()}
    times: dict[str, list[float]] = {label: [] for label in contenders}
    for _ in range(repeats):  # alternate, so machine noise hits every contender alike
        for label, fn in contenders.items():
            times[label].append(_time(fn))
    rows = []
    for label, ts in times.items():
        secs = statistics.median(ts) / new
        rows.append({"case": name, "contender": label, "new_tokens": new,
                     "median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts),
                     "tokens_per_s": 1 / secs, "ms_per_token": 1000 * secs,
                     "same_tokens_as_handformer": same[label]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch and onnxruntime intra-op threads (default 1)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/onnx_decode.json"))
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    missing = _missing()
    if missing:
        reason = (f"skipped: {', '.join(missing)} not installed (pip install "
                  "'handformer[onnx]', or the README's test command)")
        print(reason)
        args.out.write_text(json.dumps({"machine": describe_machine(), "skipped": reason,
                                        "rows": []}, indent=2))
        return 0
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (2 if args.quick else 5)
    cases = QUICK_CASES if args.quick else CASES
    rows = [row for name, case in cases.items()
            for row in run_case(name, case, repeats, args.quick, args.threads)]
    machine = describe_machine()
    print(machine_line(machine))
    print(f"torch {torch.__version__}, {args.threads} thread(s) each, median of {repeats} "
          "alternating repeats after a warm-up, batch 1, greedy")
    header = f"{'case':<9} {'contender':<24} {'tok/s':>9} {'ms/tok':>8} {'min–max s':>15}  same"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['case']:<9} {r['contender']:<24} {r['tokens_per_s']:>9.0f} "
              f"{r['ms_per_token']:>8.3f} {r['min_s']:>7.3f}–{r['max_s']:<7.3f}  "
              f"{'yes' if r['same_tokens_as_handformer'] else 'NO'}")
    for name in cases:
        by = {r["contender"]: r for r in rows if r["case"] == name}
        base = by["handformer (cache)"]["median_s"]
        print(f"{name}: onnxruntime (cache) vs handformer (cache) "
              f"{base / by['onnxruntime (cache)']['median_s']:.2f}x speed")
    args.out.write_text(json.dumps({"machine": machine, "repeats": repeats,
                                    "threads": args.threads,
                                    "rows": rows}, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
