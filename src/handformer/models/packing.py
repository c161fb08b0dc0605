"""Which library multiplies a float32 decoder's weights on this CPU: BLAS, or oneDNN over
weights reordered once (``handformer.nn.packed``) — measured here, at start-up.

``choose_matmul(model, rows)`` times the model's own first layers (a slice of its weights
larger than a CPU's last-level cache, so the weights stream from memory as they do in a real
step) through both libraries, at 1 row of input — one user decoding — and at ``rows`` rows —
a crowd's step, up to ``nn.packed.ROWS_PER_CALL`` — best of a few passes each, and picks
oneDNN only when its two times together beat BLAS's by a clear margin; otherwise (a tie
within noise, a torch without oneDNN, another dtype or device) BLAS stays: it is what the
rest of handformer runs. A CPU where BLAS takes its best kernels keeps it; one where it does
not gets oneDNN's. The measurement is the decision, so it never comes from another machine's
profile.

``pack_linears(model)`` then replaces every float32 ``nn.Linear`` of the model by a
``PackedLinear``, in place, one layer at a time (the memory peak is one layer's copy). The
packed model is for inference only (see ``handformer.nn.packed``): it cannot be trained or
saved — ``handformer serve`` packs the model it loaded, and nothing else does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from handformer.nn.packed import ROWS_PER_CALL, PackedLinear, onednn_packing_available

__all__ = ["MATMUL_CHOICES", "MatmulChoice", "choose_matmul", "pack_linears", "packed_layers"]

Matmul = Literal["blas", "onednn"]
MATMUL_CHOICES: tuple[str, ...] = ("auto", "blas", "onednn")  # what `--matmul` accepts
_PROBE_BYTES = 64 << 20  # weights timed per pass: past any CPU's last-level cache today
_PROBE_PASSES = 5
_MARGIN = 0.9  # oneDNN must take at most this share of BLAS's time to be chosen


@dataclass(frozen=True)
class MatmulChoice:
    """The library picked, and why: the probe's seconds per pass over ``layers`` layers
    (``bytes`` of weights) at 1 row and at ``rows`` rows, per library — empty where no
    probe ran (``reason`` says why)."""

    matmul: Matmul
    reason: str
    rows: int = 1
    layers: int = 0
    bytes: int = 0
    seconds: dict[str, tuple[float, float]] | None = None

    def line(self) -> str:
        """One line for a log: the choice and the figures it came from."""
        if not self.seconds:
            return f"float32 matrix products: {self.matmul} ({self.reason})"
        figures = "; ".join(f"{name} {one * 1e3:.2f} / {many * 1e3:.2f} ms"
                            for name, (one, many) in self.seconds.items())
        return (f"float32 matrix products: {self.matmul} — measured over {self.layers} "
                f"layers ({self.bytes / 2**20:.0f} MiB of weights) at 1 / {self.rows} rows: "
                f"{figures}")


def _float_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(name, m) for name, m in model.named_modules()
            if type(m) is nn.Linear and m.weight.dtype == torch.float32
            and m.weight.device.type == "cpu"]


def packed_layers(model: nn.Module) -> list[str]:
    """Names of the model's ``PackedLinear`` layers, in module order."""
    return [name for name, m in model.named_modules() if isinstance(m, PackedLinear)]


def _best_pass(layers: list[nn.Module], inputs: dict[int, Tensor]) -> float:
    """The fastest of ``_PROBE_PASSES`` passes over ``layers`` (after one untimed pass)."""
    best = float("inf")
    for attempt in range(_PROBE_PASSES + 1):
        start = time.perf_counter()
        for layer in layers:
            layer(inputs[layer.in_features])  # type: ignore[index]
        if attempt:
            best = min(best, time.perf_counter() - start)
    return best


def choose_matmul(model: nn.Module, rows: int) -> MatmulChoice:
    """Measure BLAS and oneDNN on ``model``'s own float32 layers at 1 and ``rows`` rows of
    input and pick (see the module docstring). Takes a fraction of a second."""
    linears = _float_linears(model)
    if not linears:
        return MatmulChoice("blas", "the model has no float32 CPU linear layers")
    if not onednn_packing_available():
        return MatmulChoice("blas", "this torch build has no oneDNN")
    probe, size = [], 0
    for _, linear in linears:
        probe.append(linear)
        size += linear.weight.numel() * 4
        if size >= _PROBE_BYTES:
            break
    rows = max(1, min(rows, ROWS_PER_CALL))  # taller inputs run in pieces this tall
    seconds: dict[str, tuple[float, float]] = {}
    with torch.inference_mode():
        packed = [PackedLinear.from_linear(linear) for linear in probe]
        generator = torch.Generator().manual_seed(0)
        widths = {linear.in_features for linear in probe}
        for name, layers in (("blas", probe), ("onednn", packed)):
            times = []
            for m in (1, rows):
                inputs = {k: torch.randn(m, k, generator=generator) for k in widths}
                times.append(_best_pass(layers, inputs))  # type: ignore[arg-type]
            seconds[name] = (times[0], times[1])
        del packed
    blas, onednn = sum(seconds["blas"]), sum(seconds["onednn"])
    pick: Matmul = "onednn" if onednn <= _MARGIN * blas else "blas"
    return MatmulChoice(pick, "measured", rows, len(probe), size, seconds)


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace, in place, every float32 CPU ``nn.Linear`` of ``model`` by a ``PackedLinear``
    (a tied head gets a packed copy of its own; the embedding keeps its table) and return
    ``model``, in eval mode. ``ValueError`` from ``PackedLinear.from_linear`` where this torch
    has no oneDNN."""
    for name, linear in _float_linears(model):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear.from_linear(linear))
    return model.eval()

