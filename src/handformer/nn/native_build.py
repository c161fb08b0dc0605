"""Compile one of the package's C files into a shared library, once per source version.

Why its own module: the hand-written C kernels (``int8_kernel.c``, ``decode_attention.c``)
are built the same way — with the system's C compiler, on first use, into
``$HANDFORMER_CACHE`` (default ``~/.cache/handformer``) under a name that carries the hash of
the source and the flags, so an edited source builds anew and later processes reuse the file.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

__all__ = ["FLAGS", "build_library", "cache_dir"]

FLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off")  # no fused a·b + c anywhere


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$HANDFORMER_CACHE/kernels``."""
    root = os.environ.get("HANDFORMER_CACHE") or os.path.join(Path.home(), ".cache", "handformer")
    return Path(root) / "kernels"


def build_library(source_name: str) -> tuple[Path, bool]:
    """The compiled library of ``handformer/nn/<source_name>`` and whether it was compiled now:
    from the cache, else compiled under a temporary name and renamed into place (two
    processes may race; either wins, and both files are the same). ``RuntimeError`` off
    x86-64, without a compiler, or when the compiler fails."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"the C kernels are written for x86-64; this CPU is "
                           f"{platform.machine()}")
    source = resources.files("handformer.nn").joinpath(source_name).read_bytes()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    stem = Path(source_name).stem
    digest = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = cache_dir() / f"{stem}-{digest}.so"
    if target.is_file():
        return target, False
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / source_name, Path(tmp) / f"{stem}.so"
        src.write_bytes(source)
        done = subprocess.run([compiler, *FLAGS, "-o", str(out), str(src), "-lm"],
                              capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {(done.stderr or done.stdout).strip()}")
        os.replace(out, target)
    return target, True
