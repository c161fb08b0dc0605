"""Mixed precision: which autocast dtype to run the forward pass in, and whether the loss
needs scaling.

* ``fp32``: plain float32, no autocast (nothing added to the step).
* ``bf16``: ``torch.autocast`` with bfloat16 on CPU or CUDA. bfloat16 keeps float32's
  exponent range, so gradients do not underflow and no scaler is needed.
* ``fp16``: autocast with float16 plus a ``GradScaler`` (CUDA only): float16's small range
  makes small gradients underflow to zero unless the loss is scaled up first.
* ``auto``: bf16 where the hardware multiplies bfloat16 natively, fp32 elsewhere — decided at
  start-up from what this machine supports (``choose_precision``), never from a profile of
  another machine. A CPU without bf16 dot-product instructions (``avx512_bf16``, AMX) runs
  bf16 autocast by converting to float32 and back around every matmul: slower than fp32.

Weights and optimizer state stay float32 in every mode.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from handformer.config import PRECISIONS

__all__ = ["Precision", "choose_precision", "resolve_precision"]


@dataclass
class Precision:
    name: str
    device_type: str
    dtype: torch.dtype | None  # None: no autocast
    scaler: torch.amp.GradScaler | None
    why: str = ""  # for precision='auto': why this one was chosen

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


# Values of ONEDNN_MAX_CPU_ISA that still allow oneDNN's native bf16 kernels.
_ONEDNN_BF16_ISAS = ("ALL", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX",
                     "AVX512_CORE_AMX_FP16", "AVX10_1_512", "AVX10_1_512_AMX",
                     "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2")


def choose_precision(device: torch.device) -> tuple[str, str]:
    """``(precision, why)`` for ``precision='auto'`` on ``device``.

    CUDA: bf16 where the GPU supports it. CPU: bf16 only when the CPU has native bfloat16
    dot products (the ``avx512_bf16`` or ``amx_bf16`` flag) *and* the kernels may use them —
    torch's capability is AVX-512 and ``ONEDNN_MAX_CPU_ISA`` (if set) allows bf16. Other
    devices: fp32.
    """
    import os

    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16", "this GPU supports bfloat16"
        return "fp32", "this GPU has no bfloat16 support"
    if device.type != "cpu":
        return "fp32", f"no bf16 choice is made for {device.type}"
    from handformer.machine import cpu_flags

    native = sorted({"avx512_bf16", "amx_bf16"} & cpu_flags())
    if not native:
        return "fp32", "this CPU has no native bf16 dot products (avx512_bf16, amx_bf16)"
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith("AVX512"):
        return "fp32", f"torch's CPU kernels run at {capability} (not AVX512)"
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    if isa not in _ONEDNN_BF16_ISAS:
        return "fp32", f"ONEDNN_MAX_CPU_ISA={isa} rules out oneDNN's bf16 kernels"
    return "bf16", f"this CPU multiplies bf16 natively ({', '.join(native)})"


def resolve_precision(name: str, device: torch.device) -> Precision:
    """Check that ``name`` works on ``device`` and build what it needs (``auto``: the choice
    of ``choose_precision``)."""
    if name not in PRECISIONS:
        raise ValueError(f"precision={name!r} is not one of {PRECISIONS}")
    if name == "auto":
        chosen, why = choose_precision(device)
        precision = resolve_precision(chosen, device)
        precision.why = f"auto: {why}"
        return precision
    if name == "fp32":
        return Precision(name, device.type, None, None)
    if name == "bf16":
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"precision='bf16' runs on cpu or cuda; got device {device}")
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError("precision='bf16' requested but this GPU has no bfloat16 support; "
                             "use fp16 or fp32")
        return Precision(name, device.type, torch.bfloat16, None)
    if device.type != "cuda":
        raise ValueError(f"precision='fp16' needs CUDA (it relies on GradScaler); got device "
                         f"{device}. On CPU use bf16 or fp32")
    return Precision(name, "cuda", torch.float16, torch.amp.GradScaler("cuda"))
