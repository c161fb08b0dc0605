"""The FLOP floor of a training step: how much of this CPU's *measured* matmul throughput a
step achieves.

A step's model FLOPs — 6 per matmul weight per token (forward, input gradient, weight
gradient) plus attention's 12·L·C·T — over its time is the FLOP/s it achieved. Divided by what
one large square matmul reaches *here* (this CPU, these threads, this dtype: ``matmul_flops``)
it is a share that holds across CPUs where a ratio to a peer or a time does not. The divisor
is measured, not the datasheet peak: it is the practical floor, what the kernels really do on
this machine, so 100 % is a step with no overhead at all around its matmuls.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["make_matmul", "matmul_flops", "matmul_peaks", "model_flops_per_token", "peak_line"]


def make_matmul(dtype: torch.dtype, n: int) -> Callable[[], object]:
    """One n×n×n matmul (2·n³ FLOP), ready to time."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return lambda: a @ b


def matmul_flops(dtype: torch.dtype = torch.float32, n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of an n×n×n matmul at torch's current thread count: median of ``reps`` after a
    warm-up."""
    run = make_matmul(dtype, n)
    run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def matmul_peaks(dtypes: tuple[torch.dtype, ...], n: int = 2048) -> dict[str, float]:
    """``matmul_flops`` per dtype, keyed by its name (``"float32"``, ``"bfloat16"``)."""
    return {str(d).removeprefix("torch."): matmul_flops(d, n) for d in dtypes}


def model_flops_per_token(model: nn.Module, window: int) -> float:
    """Training FLOPs per token: 6 × the weights of every ``nn.Linear`` (a tied head is a
    matmul too, so it counts) + 12 · layers · d_model · window for attention's two products."""
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    cfg = getattr(model, "config", None)
    attention = 12 * cfg.n_layers * cfg.d_model * window if cfg is not None else 0
    return 6 * weights + attention


def peak_line(peaks: dict[str, float]) -> str:
    """``measured matmul peak: float32 X GFLOP/s, bfloat16 Y GFLOP/s``."""
    return "measured matmul peak: " + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s"
                                                for k, v in peaks.items())
