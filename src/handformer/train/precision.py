"""Mixed precision: which autocast dtype to run the forward pass in, and whether the loss
needs scaling.

* ``fp32``: plain float32, no autocast (nothing added to the step).
* ``bf16``: ``torch.autocast`` with bfloat16 on CPU or CUDA. bfloat16 keeps float32's
  exponent range, so gradients do not underflow and no scaler is needed.
* ``fp16``: autocast with float16 plus a ``GradScaler`` (CUDA only): float16's small range
  makes small gradients underflow to zero unless the loss is scaled up first.

Weights and optimizer state stay float32 in every mode.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from handformer.config import PRECISIONS

__all__ = ["Precision", "resolve_precision"]


@dataclass
class Precision:
    name: str
    device_type: str
    dtype: torch.dtype | None  # None: no autocast
    scaler: torch.amp.GradScaler | None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


def resolve_precision(name: str, device: torch.device) -> Precision:
    """Check that ``name`` works on ``device`` and build what it needs."""
    if name not in PRECISIONS:
        raise ValueError(f"precision={name!r} is not one of {PRECISIONS}")
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
