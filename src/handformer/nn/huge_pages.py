"""Tensors laid out one after another in memory mapped in 2 MiB pages, for what a decoding step
streams whole: the int8 weights and the KV caches.

Why: at batch 1 a token reads every int8 weight and cached key and value once, tens of MB, in 4
KiB pages as torch's allocator gets them: a TLB miss and a page walk every 4 KiB, and a
hardware prefetcher that stops at each page's end. Linux backs a range with transparent huge
pages (2 MiB) where the range asks for them (``madvise(MADV_HUGEPAGE)``; the system setting is
often ``madvise``, so nothing else gets them), which torch's allocator never does. ``zeros``
maps one anonymous private region aligned to 2 MiB, asks for huge pages and lays tensors in it
back to back (each 64-byte aligned) in the order given — the order a step reads them, so the
stream runs on across tensors too; ``pack`` copies given tensors there (the int8 weights of a
model; ``DecoderCache`` takes its layers' buffers from ``zeros``). Each tensor has its own
storage over its own bytes (``torch.frombuffer``), so saving, loading into it, moving and
freeing work as for any tensor; the region lives while any of them does. Where the kernel gives
4 KiB pages anyway, the tensors work the same. The pages are taken at first touch, 2 MiB at a
time.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import sys
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["HUGE_PAGE", "huge_pages_supported", "pack", "zeros"]

HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
_ALIGN = 64  # each tensor starts on a cache line


def huge_pages_supported() -> bool:
    """Whether this system can be asked for huge pages (Linux with ``MADV_HUGEPAGE``)."""
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")


def zeros(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> list[Tensor] | None:
    """Zero tensors of ``shapes`` back to back in one huge-page region, in the order given;
    None where huge pages cannot be asked for, the region cannot be mapped, a shape is empty,
    or together they fill less than one huge page. (Fresh anonymous memory is zero: nothing
    is written.)"""
    size = torch.empty((), dtype=dtype).element_size()
    counts = [math.prod(shape) for shape in shapes]
    if not counts or not huge_pages_supported() or min(counts) <= 0:
        return None
    offsets, total = [], 0
    for count in counts:
        offsets.append(total)
        total += (count * size + _ALIGN - 1) // _ALIGN * _ALIGN
    if total < HUGE_PAGE:
        return None
    length = (total + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    try:
        region = mmap.mmap(-1, length + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, OverflowError):
        return None  # no such mapping here (an address-space limit): torch's memory serves
    start = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % HUGE_PAGE  # 2 MiB aligned
    # a kernel without transparent huge pages refuses: the tensors still work, in 4 KiB pages
    with contextlib.suppress(OSError):
        region.madvise(mmap.MADV_HUGEPAGE, start, length)
    return [torch.frombuffer(region, dtype=dtype, count=count, offset=start + offset).view(shape)
            for shape, count, offset in zip(shapes, counts, offsets, strict=True)]


def pack(tensors: Sequence[Tensor]) -> list[Tensor] | None:
    """Copies of ``tensors`` (contiguous CPU tensors of one dtype) back to back in one
    huge-page region, in the order given; None (nothing copied) where ``zeros`` gives None or
    a tensor is not a contiguous CPU one of that dtype."""
    if not tensors or not all(t.device.type == "cpu" and t.is_contiguous()
                              and t.dtype == tensors[0].dtype for t in tensors):
        return None
    copies = zeros([tuple(t.shape) for t in tensors], tensors[0].dtype)
    if copies is None:
        return None
    return [copy.copy_(t) for copy, t in zip(copies, tensors, strict=True)]
