"""Every random number generator a training step touches, captured and restored exactly.

Dropout draws from torch's global generator, batch sampling from the trainer's own
``torch.Generator`` (that generator's state *is* the data position), and user code may use
Python's ``random`` or NumPy. Byte states are tensors (for safetensors); Python's and NumPy's
Mersenne-Twister states are lists of ints (for JSON).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from handformer.train.state import TrainerState, TrainerStateError

__all__ = ["capture_rng", "restore_rng"]


def capture_rng(generator: torch.Generator) -> TrainerState:
    tensors = {"rng.torch": torch.get_rng_state(), "rng.batches": generator.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    meta: dict[str, Any] = {
        "python": [version, list(mt), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    return TrainerState(tensors, meta)


def restore_rng(generator: torch.Generator, saved: TrainerState) -> None:
    """Raises ``TrainerStateError`` naming the generator whose saved state is unusable."""
    for name, setter in (("rng.torch", torch.set_rng_state), ("rng.batches", generator.set_state)):
        try:
            setter(saved.tensors[name])
        except (KeyError, RuntimeError, TypeError) as err:
            raise TrainerStateError(
                f"{name}: cannot restore ({type(err).__name__}: {err})") from None
    cuda = sorted(k for k in saved.tensors if k.startswith("rng.cuda."))
    if cuda and torch.cuda.is_available():
        try:
            torch.cuda.set_rng_state_all([saved.tensors[k] for k in cuda])
        except (RuntimeError, IndexError) as err:
            raise TrainerStateError(f"rng.cuda: cannot restore ({err})") from None
    try:
        version, mt, gauss = saved.meta["python"]
        random.setstate((int(version), tuple(int(x) for x in mt), gauss))
    except (KeyError, TypeError, ValueError) as err:
        raise TrainerStateError(f"python RNG state: cannot restore ({err})") from None
    try:
        kind, keys, pos, has_gauss, cached = saved.meta["numpy"]
        np.random.set_state((str(kind), np.asarray(keys, dtype=np.uint32), int(pos),
                             int(has_gauss), float(cached)))
    except (KeyError, TypeError, ValueError) as err:
        raise TrainerStateError(f"numpy RNG state: cannot restore ({err})") from None
