"""Compile one of the package's C files into a shared library, once per source version, and
load it once per process.

Why its own module: the hand-written C kernels (``int8_kernel.c``, ``decode_attention.c``,
and ``decode_block.c``, which includes both) are built and loaded the same way — with the
system's C compiler, on first use, into ``$HANDFORMER_CACHE`` (default
``~/.cache/handformer``) under a name that carries the hash of the sources and the flags, so
an edited source builds anew and later processes reuse the file; each names the best path
the CPU runs, and ATen's own level caps it, so the knob runs (``ATEN_CPU_CAPABILITY``) reach
the older paths too.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from pathlib import Path

import torch

__all__ = ["FLAGS", "NativeLibrary", "build_library", "cache_dir"]

FLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off")  # no fused a·b + c anywhere


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$HANDFORMER_CACHE/kernels``."""
    root = os.environ.get("HANDFORMER_CACHE") or os.path.join(Path.home(), ".cache", "handformer")
    return Path(root) / "kernels"


def build_library(source_name: str, includes: Sequence[str] = ()) -> tuple[Path, bool]:
    """The compiled library of ``handformer/nn/<source_name>`` and whether it was compiled now:
    from the cache, else compiled under a temporary name and renamed into place (two
    processes may race; either wins, and both files are the same). ``includes`` are the
    sibling C files it ``#include``s: copied beside it and hashed with it. ``RuntimeError``
    off x86-64, without a compiler, or when the compiler fails."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"the C kernels are written for x86-64; this CPU is "
                           f"{platform.machine()}")
    package = resources.files("handformer.nn")
    source = package.joinpath(source_name).read_bytes()
    included = {name: package.joinpath(name).read_bytes() for name in includes}
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    stem = Path(source_name).stem
    digest = hashlib.sha256(b"".join([source, *included.values()])
                            + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = cache_dir() / f"{stem}-{digest}.so"
    if target.is_file():
        return target, False
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / source_name, Path(tmp) / f"{stem}.so"
        src.write_bytes(source)
        for name, text in included.items():
            (Path(tmp) / name).write_bytes(text)
        done = subprocess.run([compiler, *FLAGS, "-o", str(out), str(src), "-lm"],
                              capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {(done.stderr or done.stdout).strip()}")
        os.replace(out, target)
    return target, True


class NativeLibrary:
    """One C file's library, built and loaded on first ``lib()``, once per process (thread-
    safe); None where it cannot be, and ``broken`` says why. ``best`` is the path index its
    ``best_isa`` function reports for this CPU, ``default`` the same capped by ATen's level
    (``aten_caps``: ATen's level name → the highest index it allows), ``seconds`` the time
    spent compiling it here (0 when it came from the cache). ``bind`` declares the library's
    other functions' signatures before anyone can call them; ``includes`` are the sibling C
    files the source ``#include``s (see ``build_library``)."""

    def __init__(self, source_name: str, best_isa: str, aten_caps: Mapping[str, int],
                 bind: Callable[[ctypes.CDLL], None], includes: Sequence[str] = ()) -> None:
        self._source, self._best_isa, self._aten_caps, self._bind = (
            source_name, best_isa, aten_caps, bind)
        self._includes = tuple(includes)
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        self.broken: str | None = None
        self.best = 0
        self.default = 0
        self.seconds = 0.0

    def lib(self) -> ctypes.CDLL | None:
        if not self._tried:
            with self._lock:
                if not self._tried:
                    self._lib = self._load()
                    self._tried = True
        return self._lib

    def _load(self) -> ctypes.CDLL | None:
        t0 = time.perf_counter()
        try:
            path, compiled = build_library(self._source, self._includes)
            lib = ctypes.CDLL(str(path))
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            text = str(err).strip()
            self.broken = f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"
            return None
        if compiled:
            self.seconds = time.perf_counter() - t0
        best = getattr(lib, self._best_isa)
        best.restype, best.argtypes = ctypes.c_int, []
        self._bind(lib)
        self.best = int(best())
        cap = self._aten_caps.get(torch.backends.cpu.get_cpu_capability(), 0)
        self.default = min(self.best, cap)
        return lib
