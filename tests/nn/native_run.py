"""Run a snippet in a fresh Python process against this checkout's package, with a kernel
cache of its own: what the C kernels do under another ATen level, or with no compiler, is
decided once per process, so those cases cannot be tried in this one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_python(code: str, tmp_path: Path, **env: str) -> str:
    """``python -c code`` with ``env`` added; its stdout, stripped (its stderr on failure)."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    full = {**os.environ, "PYTHONPATH": src, "HANDFORMER_CACHE": str(tmp_path), **env}
    done = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()
