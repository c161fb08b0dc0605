"""The hand-written int8 product (``int8_kernel.c``): built on first use, called through ctypes.

Why C and not inductor: inductor's loop converts each int8 weight to float and multiplies
it in float, three instructions per byte, which is slower than memory delivers the bytes.
The C loop rounds each input row to an int16 grid instead and multiplies integers, 32 pairs
an instruction (see the C file's header for the arithmetic and why its sum is exact).

The path is chosen at run time: the best one the CPU has (AVX-512 VNNI, AVX-512, AVX2, plain
C), capped by the level ATen itself runs at (``torch.backends.cpu.get_cpu_capability()``), so
``ATEN_CPU_CAPABILITY=avx2`` or ``=default`` makes this loop take the older path as well.
Every path computes the same integers, hence the same output bits.

The shared library is compiled once per source version with the system's C compiler into
``$HANDFORMER_CACHE`` (default ``~/.cache/handformer``) and reused by later processes.
Where nothing can compile or load it, ``native_status()`` says why and callers fall back.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from handformer.nn.native_build import NativeLibrary

__all__ = ["ISA_NAMES", "NativeProduct", "native_build_seconds", "native_isa", "native_linear",
           "native_status"]

ISA_NAMES = ("scalar", "avx2", "avx512", "avx512_vnni")  # the C file's ISA_* values, in order
_ATEN_CAP = {"DEFAULT": 0, "AVX2": 1, "AVX512": 3}  # the highest C path each ATen level allows


def _bind(lib: ctypes.CDLL) -> None:
    lib.hf_int8_linear.restype = ctypes.c_int
    lib.hf_int8_linear.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 4,
                                   *[ctypes.c_int64] * 3, ctypes.c_void_p]


_NATIVE = NativeLibrary("int8_kernel.c", "hf_int8_best_isa", _ATEN_CAP, _bind,
                        includes=("scratch.h",))


def native_status() -> str | None:
    """Why the hand-written kernel cannot run in this process, or None (it can)."""
    _NATIVE.lib()
    return _NATIVE.broken


def native_build_seconds() -> float:
    """Seconds this process spent compiling the C library (0 if it came from the cache or was
    never asked for)."""
    return _NATIVE.seconds


def native_isa() -> str:
    """The path ``native_linear`` takes by default here: the CPU's best, capped by ATen's level
    (``ATEN_CPU_CAPABILITY``). Loads the library on first call; "scalar" where none loads."""
    _NATIVE.lib()
    return ISA_NAMES[_NATIVE.default]


def _check(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None) -> None:
    """The C loop reads raw memory: anything but the layout it expects is refused here."""
    want = ((x, torch.float32, 2), (q, torch.int8, 2), (scale, torch.float32, 1))
    parts = (*want, (bias, torch.float32, 1)) if bias is not None else want
    for t, dtype, dims in parts:
        if t.dtype != dtype or t.dim() != dims or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"int8 kernel: expected contiguous {dims}-D {dtype} tensors on the "
                             f"CPU; got {tuple(t.shape)} {t.dtype} on {t.device}")
    n, k = q.shape
    if x.shape[1] != k or scale.shape[0] != n or (bias is not None and bias.shape[0] != n):
        raise ValueError(f"int8 kernel: x {tuple(x.shape)}, q {tuple(q.shape)}, scale "
                         f"{tuple(scale.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit")


def _level(isa: str | None) -> int:
    """The C file's ISA_* value for ``isa`` (None: ``native_isa()``); ``ValueError`` for a
    path this CPU lacks."""
    if isa is None:
        return _NATIVE.default
    if isa in ISA_NAMES[: _NATIVE.best + 1]:
        return ISA_NAMES.index(isa)
    raise ValueError(f"int8 kernel path {isa!r}: expected one of "
                     f"{ISA_NAMES[:_NATIVE.best + 1]} on this CPU")


class NativeProduct:
    """``x ↦ native_linear(x, q, scale, bias, isa)`` for one stored weight, checked once.

    Why: at batch 1 the C loop streams a weight in tens of µs, and checking four tensors'
    dtype, layout and device on every call (plus finding the library and the path) costs a
    visible share of that. A layer binds its stored tensors here once and then passes only
    its input, whose checks are the few that can change between calls. ``matches`` says
    whether the bound tensors are still the ones given (the same objects at the same
    addresses), so a layer whose weights are replaced binds again. ``RuntimeError`` where
    the kernel cannot load (``native_status()``); ``ValueError`` as ``native_linear``.
    """

    __slots__ = ("_call", "_level", "_pointers", "_tensors", "k", "n")

    def __init__(self, q: Tensor, scale: Tensor, bias: Tensor | None = None,
                 isa: str | None = None) -> None:
        lib = _NATIVE.lib()
        if lib is None:
            raise RuntimeError(f"the hand-written int8 kernel is unavailable: {_NATIVE.broken}")
        self._level = _level(isa)
        n, k = q.shape if q.dim() == 2 else (-1, -1)
        _check(torch.empty(0, k if k >= 0 else 0), q, scale, bias)
        self.n, self.k = n, k
        self._call = lib.hf_int8_linear
        self._tensors = (q, scale, bias)  # kept alive: the C loop reads their memory
        self._pointers = (q.data_ptr(), scale.data_ptr(),
                          None if bias is None else bias.data_ptr())

    @property
    def vectorized(self) -> bool:
        """Whether it runs a vector path (AVX2 or AVX-512), not the plain C loop."""
        return self._level != ISA_NAMES.index("scalar")

    def matches(self, q: Tensor, scale: Tensor, bias: Tensor | None) -> bool:
        """Whether these are the tensors bound here, still at the same addresses."""
        bq, bs, bb = self._tensors
        return (q is bq and scale is bs and bias is bb
                and (q.data_ptr(), scale.data_ptr(),
                     None if bias is None else bias.data_ptr()) == self._pointers)

    def __call__(self, x: Tensor) -> Tensor:
        """x (..., K) float32, contiguous, on the CPU → (..., N) float32 (every leading dim
        is a row: the loop reads them as one (M, K) block, with no reshape)."""
        k = self.k
        if (x.dtype != torch.float32 or x.dim() == 0 or x.shape[-1] != k
                or not x.is_contiguous() or not x.is_cpu):
            layout = "contiguous" if x.is_contiguous() else "not contiguous"
            raise ValueError(f"int8 kernel: expected a contiguous float32 (..., {k}) tensor on "
                             f"the CPU; got {tuple(x.shape)} {x.dtype}, {layout}, on {x.device}")
        m = x.numel() // k if k else 0
        y = torch.empty((*x.shape[:-1], self.n), dtype=torch.float32)  # (..., N)
        q_ptr, scale_ptr, bias_ptr = self._pointers
        if self._call(self._level, x.data_ptr(), q_ptr, scale_ptr, bias_ptr, m, self.n, k,
                      y.data_ptr()) != 0:
            raise MemoryError(f"int8 kernel: no memory for the int16 copy of a ({m}, {k}) "
                              "input")
        return y


def native_linear(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None = None,
                  isa: str | None = None) -> Tensor:
    """x (M, K) float32, q (N, K) int8, scale (N,) float32, bias (N,) float32 or None → (M, N)
    float32, all contiguous on the CPU: ``round_to_int16_grid(x) · qᵀ · scale + bias`` (the C
    file says exactly how). ``isa`` forces one path (``ISA_NAMES``; ``ValueError`` for one this
    CPU lacks); by default ``native_isa()``. ``RuntimeError`` where the kernel cannot load
    (``native_status()``) — callers check that first. A layer that calls it for the same
    weight again and again binds a ``NativeProduct`` instead."""
    product = NativeProduct(q, scale, bias, isa)
    _check(x, q, scale, bias)
    return product(x)
