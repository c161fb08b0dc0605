"""Attention time and peak memory against sequence length, for each attention path.

Every (path, T, pass) is measured in a fresh subprocess: peak resident memory
(``ru_maxrss``) is a process-wide high-water mark, so a clean process per point is the
honest way to read it on a CPU. Peak memory is reported as the growth of that mark during
the measured call, above what the inputs already hold.

    python benchmarks/attention_memory.py           # T = 256 … 4096, and 16384
    python benchmarks/attention_memory.py --quick   # tiny; used in CI so it never rots
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from handformer.machine import describe_machine, machine_line

PATHS = ("manual", "sdpa", "tiled")
B, H, D = 1, 4, 32
BUDGET_GIB = 12.0  # skip points whose score matrices alone would need more than this

CHILD = r"""
import json, resource, statistics, sys, time
import torch
from handformer.nn.attention import attention
path, t, mode, repeats = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
torch.manual_seed(0)
grad = mode == "fwd+bwd"
q, k, v = (torch.randn(BATCH, HEADS, t, HEAD_DIM, requires_grad=grad) for _ in range(3))
def run():
    out, _ = attention(q, k, v, kind=path, is_causal=True)
    if grad:
        out.sum().backward()
        q.grad = k.grad = v.grad = None
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
run()  # the first call sets the memory high-water mark and warms up
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
times = []
for _ in range(repeats):
    t0 = time.perf_counter(); run(); times.append(time.perf_counter() - t0)
print(json.dumps({"median_s": statistics.median(times), "min_s": min(times),
                  "max_s": max(times), "peak_mib": (after - before) / 1024}))
""".replace("BATCH", str(B)).replace("HEADS", str(H)).replace("HEAD_DIM", str(D))


def score_matrix_gib(t: int, mode: str) -> float:
    """Rough memory of the manual path: scores + weights (+ their grads in backward)."""
    copies = 4 if mode == "fwd+bwd" else 2
    return B * H * t * t * 4 * copies / 2**30


def measure(path: str, t: int, mode: str, repeats: int) -> dict:
    if path == "manual" and score_matrix_gib(t, mode) > BUDGET_GIB:
        return {"skipped": f"the (T, T) score matrices need ~{score_matrix_gib(t, mode):.0f} "
                           f"GiB (> {BUDGET_GIB:.0f} GiB budget on a 24 GiB machine)"}
    proc = subprocess.run([sys.executable, "-c", CHILD, path, str(t), mode, str(repeats)],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"skipped": f"failed: {proc.stderr.strip().splitlines()[-1][:200]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--lengths", type=int, nargs="*", default=None)
    parser.add_argument("--out", type=Path,
                        default=Path("benchmarks/results/attention_memory.json"))
    args = parser.parse_args(argv)
    lengths = args.lengths or ([64, 128] if args.quick else [256, 512, 1024, 2048, 4096, 16384])
    repeats = 1 if args.quick else 3
    rows = []
    machine = describe_machine()
    print(machine_line(machine))
    print(f"B={B} H={H} D={D}, causal, fp32; median of {repeats} (one process per point)")
    header = (f"{'T':>6} {'pass':<8} {'path':<7} {'median ms':>10} {'min–max ms':>19} "
              f"{'peak MiB':>9}")
    print(header)
    print("-" * len(header))
    for t in lengths:
        for mode in ("fwd", "fwd+bwd"):
            for path in PATHS:
                r = {"T": t, "pass": mode, "path": path, **measure(path, t, mode, repeats)}
                rows.append(r)
                if "skipped" in r:
                    print(f"{t:>6} {mode:<8} {path:<7} skipped: {r['skipped']}")
                else:
                    print(f"{t:>6} {mode:<8} {path:<7} {1000 * r['median_s']:>10.1f} "
                          f"{1000 * r['min_s']:>9.1f}–{1000 * r['max_s']:<9.1f} "
                          f"{r['peak_mib']:>9.0f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "B": B, "H": H, "D": D, "rows": rows},
                                   indent=2))
    print(f"\nwrote {args.out}")

    return 0


if __name__ == "__main__":
    raise SystemExit(main())
