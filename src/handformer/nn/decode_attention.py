"""The hand-written decoding attention (``decode_attention.c``): one query per head over a cache.

Why its own kernel: a cached decoding step's attention has one query row per head, so it is
bound by reading the cached keys and values once; torch's fused CPU kernel is built for
blocks of queries and spends several times that read on a single row. The C loop reads each
head's keys once for the scores and its values once for the weighted sum, and it takes a
batch of requests packed one after another (``serve``'s segments) in one call.

It is the kernel ``nn.attention`` runs for a single query row without mask, bias, dropout or
gradient, in float32 on the CPU, whenever the model asked for ``sdpa``, ``tiled`` or
``auto`` (``manual`` stays the written-out reference everywhere). Everything else — a
mask, ALiBi's bias, training, bf16, a GPU — keeps the kernel it had. Tests hold it equal to
the reference kernel.

The path (AVX-512, AVX2, plain C) is chosen at run time from the CPU, capped by ATen's own
level (``ATEN_CPU_CAPABILITY``), and every path does the same float operations in the same
order, so the output bits do not depend on it. Built once per source version by
``nn.native_build``; where nothing can build or load it, ``decode_status()`` says why and
attention keeps torch's kernel.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from handformer.nn.native_build import NativeLibrary

__all__ = ["DECODE_ISA_NAMES", "attend", "decode_attention", "decode_isa", "decode_status",
           "usable"]

DECODE_ISA_NAMES = ("scalar", "avx2", "avx512")  # the C file's ISA_* values, in order
_ATEN_CAP = {"DEFAULT": 0, "AVX2": 1, "AVX512": 2}
_I64 = ctypes.c_int64


def _bind(lib: ctypes.CDLL) -> None:
    call = lib.hf_decode_attention
    call.restype = ctypes.c_int
    call.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, _I64, ctypes.c_void_p,
                     _I64, _I64, _I64, *[ctypes.c_void_p] * 2, _I64, _I64, _I64, _I64,
                     ctypes.c_float, ctypes.c_void_p]


_LIB = NativeLibrary("decode_attention.c", "hf_decode_best_isa", _ATEN_CAP, _bind,
                     includes=("scratch.h",))


def decode_status() -> str | None:
    """Why the hand-written decoding attention cannot run in this process, or None (it can)."""
    _LIB.lib()
    return _LIB.broken


def decode_isa() -> str:
    """The path the kernel takes here by default (the CPU's best, capped by ATen's level)."""
    _LIB.lib()
    return DECODE_ISA_NAMES[_LIB.default]


def _layout_problem(q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """Which of the loop's conditions on shapes, dtypes and layout these tensors fail —
    ``"shapes"``, ``"layout"`` or ``"heads"`` — or None. ``usable`` declines by it and
    ``decode_attention`` refuses by it with a message; a name, not the message, because on
    attention's path (bf16, a gradient-free GQA view, ...) a declined call is routine."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or k.shape[::3] != q.shape[::3]:
        return "shapes"
    if (any(x.dtype != torch.float32 or not x.is_cpu or x.stride(-1) != 1 for x in (q, k, v))
            or k.stride() != v.stride()):
        return "layout"
    if k.shape[2] < 1 or q.shape[1] % k.shape[1]:
        return "heads"
    return None


def usable(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether attention may run these tensors through ``attend``: a layout the loop reads
    (``_layout_problem``: float32 on the CPU, k and v of one shape with at least one key,
    q's batch and head dim, unit stride along D, the same strides), k and v in one storage,
    no gradient being recorded, not under ``torch.compile``, and a library that loaded."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    if torch.compiler.is_compiling() or _layout_problem(q, k, v) is not None:
        return False
    if k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
        return False
    return _LIB.lib() is not None


def decode_attention(q: Tensor, k: Tensor, v: Tensor,
                     spans: Sequence[tuple[int, int, int, int]] | None = None,
                     isa: str | None = None) -> Tensor:
    """Softmax attention of single query rows over their keys, scaled by 1/√D, no mask.

    Without ``spans``: q (B, H, 1, D), k and v (B, Hkv, S, D) → (B, H, 1, D); row b attends
    over its S keys. With ``spans`` (a packed batch, ``serve.paged``): q (1, H, T, D), k and
    v (1, Hkv, S, D), and ``spans[i] = (query, 1, key start, keys)`` — segment i's one query
    is column ``query``, its keys columns [key start, key start + keys) → (1, H, n, D) for
    n spans, in their order (all of T when they are its every column, one each). The
    output's (B, T|n, H, D) transpose is contiguous, so merging heads costs no copy. ``isa``
    forces a path (``DECODE_ISA_NAMES``). ``ValueError`` for tensors the loop cannot read;
    ``RuntimeError`` where the library did not load (``decode_status()``).
    """
    lib = _LIB.lib()
    if lib is None:
        raise RuntimeError(f"the decoding attention kernel is unavailable: {_LIB.broken}")
    problem = _layout_problem(q, k, v)
    if problem == "shapes":
        raise ValueError(f"decode attention takes q (B, H, T, D) and k, v (B, Hkv, S, D) "
                         f"alike; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if problem == "layout":
        raise ValueError("decode attention takes float32 CPU tensors with unit stride along D, "
                         "k and v with the same strides (see usable()); "
                         f"got {q.dtype}/{k.dtype}/{v.dtype}, k strides {k.stride()}, "
                         f"v strides {v.stride()}")
    if problem == "heads":
        raise ValueError(f"decode attention needs ≥ 1 key column and Hkv dividing H; got "
                         f"{k.shape[2]} columns, H {q.shape[1]}, Hkv {k.shape[1]}")
    return _attend(lib, q, k, v, spans, isa)


def attend(q: Tensor, k: Tensor, v: Tensor,
           spans: Sequence[tuple[int, int, int, int]] | None = None) -> Tensor:
    """``decode_attention`` for tensors ``usable`` accepted (attention's decoding steps):
    their layout is not checked again."""
    return _attend(_LIB.lib(), q, k, v, spans, None)


def _attend(lib: ctypes.CDLL, q: Tensor, k: Tensor, v: Tensor,
            spans: Sequence[tuple[int, int, int, int]] | None, isa: str | None) -> Tensor:
    """The spans checked and the loop called, on tensors of a layout it reads."""
    b, h, t, d = q.shape
    hkv = k.shape[1]
    if spans is None:
        if t != 1:
            raise ValueError(f"decode attention takes one query row; got q {tuple(q.shape)}")
        n_seg = b
        q_base = [i * q.stride(0) for i in range(b)]
        base = [i * k.stride(0) for i in range(b)]
        keys = [k.shape[2]] * b
    else:
        if (b != 1 or not spans or any(n != 1 or not 0 <= i < t for i, n, _, _ in spans)
                or any(start < 0 or start + n > k.shape[2] for _, _, start, n in spans)):
            raise ValueError(f"decode attention over a packed batch takes one query column "
                             f"of q and a run of the {k.shape[2]} key columns per segment; "
                             f"got q {tuple(q.shape)} and spans {list(spans)}")
        n_seg = len(spans)
        q_base = [i * q.stride(2) for i, _, _, _ in spans]
        base = [start * k.stride(2) for _, _, start, _ in spans]
        keys = [n for _, _, _, n in spans]
    if min(keys) < 1:
        raise ValueError(f"decode attention needs ≥ 1 key per row; got keys {keys}")
    allowed = DECODE_ISA_NAMES[: _LIB.best + 1]
    level = _LIB.default if isa is None else allowed.index(isa) if isa in allowed else -1
    if level < 0:
        raise ValueError(f"decode attention path {isa!r}: expected one of "
                         f"{allowed} on this CPU")
    out = torch.empty(n_seg, h, d)  # (segments, H, D)
    q_bases, bases, counts = (_I64 * n_seg)(*q_base), (_I64 * n_seg)(*base), (_I64 * n_seg)(*keys)
    v_offset = (v.data_ptr() - k.data_ptr()) // 4
    if lib.hf_decode_attention(level, q.data_ptr(), q_bases, q.stride(1), k.data_ptr(),
                               v_offset, k.stride(2), k.stride(1), bases, counts, n_seg, h,
                               hkv, d, 1.0 / math.sqrt(d), out.data_ptr()) != 0:
        raise MemoryError(f"decode attention: no memory for the scores of {max(keys)} keys")
    if spans is None:
        return out.view(b, 1, h, d).transpose(1, 2)  # (B, H, 1, D)
    return out.view(1, n_seg, h, d).transpose(1, 2)  # (1, H, T|n, D)
