"""What a figure was measured on: the CPU's model name, the ISA level torch's kernels take,
the threads, and the instruction-set extensions that change which precision is fast.

Every benchmark's JSON carries ``describe_machine()``, so a figure read later (or on another
machine) says where it came from; speed choices made at run time read ``cpu_flags()``.
"""

from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path

import torch

__all__ = ["cpu_flags", "cpu_model", "describe_machine", "machine_line"]

_CPUINFO = Path("/proc/cpuinfo")
# The extensions that decide whether bf16 matmuls run natively (avx512_bf16, amx_bf16) and
# which vector width the kernels use.
_NOTABLE = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


@lru_cache(maxsize=1)
def _cpuinfo_fields() -> dict[str, str]:
    try:
        text = _CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    return fields


def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo``'s ``model name``), or the platform's."""
    return _cpuinfo_fields().get("model name") or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where ``/proc/cpuinfo`` is not available)."""
    return frozenset(_cpuinfo_fields().get("flags", "").split())


def describe_machine() -> dict[str, object]:
    """CPU model, torch's kernel ISA level, threads and cores, and the notable extensions."""
    flags = cpu_flags()
    knobs = {k: os.environ[k] for k in ("MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY",
                                        "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS")
             if k in os.environ}
    return {"cpu": cpu_model(), "isa": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "logical_cpus": os.cpu_count(),
            "extensions": [f for f in _NOTABLE if f in flags], "knobs": knobs,
            "torch": torch.__version__}


def machine_line(info: dict[str, object] | None = None) -> str:
    """One line for a table's caption: ``AMD EPYC … · AVX512 (avx512_bf16) · 2 threads``.
    ``info["threads"]`` may be a text (``"1, 2"``) for a table that runs several counts."""
    info = info or describe_machine()
    ext = [e for e in info["extensions"] if "bf16" in e or "amx" in e]  # type: ignore[union-attr]
    isa = f"{info['isa']}" + (f" ({', '.join(ext)})" if ext else "")
    knobs = "".join(f" · {k}={v}" for k, v in info["knobs"].items())  # type: ignore[union-attr]
    threads = info["threads"]
    word = "thread" if threads == 1 else "threads"
    return f"{info['cpu']} · {isa} · {threads} {word}{knobs}"
