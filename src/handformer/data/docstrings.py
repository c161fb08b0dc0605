"""A labelled task made of real text that ships with Python: which part of the standard
library does a docstring come from?

Every public function, class and method of a few standard-library modules gives its
docstring's first paragraph (20–200 characters, signatures such as ``spawnl(mode, …)`` left
out), labelled by the group its module belongs to: ``files`` (os, shutil, pathlib, …),
``network`` (socket, http, urllib, email, …), ``concurrency`` (threading, asyncio,
multiprocessing, …) or ``numbers`` (math, decimal, statistics, …). A text that occurs in two
groups is dropped. The rows are English written by Python's developers — the kind of text a
pretrained encoder has read, and a from-scratch character model has not — and need no
download. Their exact count depends on the Python version (about a thousand).
"""

from __future__ import annotations

import csv
import importlib
import inspect
import random
import re
from pathlib import Path

__all__ = ["DOCSTRING_GROUPS", "docstring_rows", "write_docstrings_csv"]

DOCSTRING_GROUPS: dict[str, tuple[str, ...]] = {
    "files": ("os", "os.path", "shutil", "pathlib", "glob", "tempfile", "io", "zipfile",
              "tarfile", "filecmp", "fnmatch"),
    "network": ("socket", "ssl", "http.client", "http.server", "http.cookies", "urllib.request",
                "urllib.parse", "email.message", "smtplib", "ftplib", "ipaddress"),
    "concurrency": ("threading", "multiprocessing", "asyncio", "concurrent.futures", "queue",
                    "subprocess", "sched", "selectors"),
    "numbers": ("math", "cmath", "statistics", "decimal", "fractions", "random", "numbers"),
}
_SIGNATURE = re.compile(r"^[\w.]+\(")


def _summary(obj: object) -> str | None:
    doc = inspect.getdoc(obj)
    if not doc:
        return None
    first = " ".join(doc.strip().split("\n\n")[0].split())
    if not 20 <= len(first) <= 200 or _SIGNATURE.match(first) or "->" in first:
        return None
    return first


def _module_texts(name: str) -> set[str]:
    """The docstring summaries of ``name``'s public functions, classes and their methods
    (objects it only re-exports from another package are left out)."""
    module = importlib.import_module(name)
    package = name.split(".")[0]
    found: set[str] = set()
    for attr, obj in sorted(vars(module).items()):
        owner = getattr(obj, "__module__", None)
        if attr.startswith("_") or (owner and not str(owner).startswith(package)):
            continue
        if not (inspect.isclass(obj) or callable(obj)):
            continue
        members = [obj] + ([v for k, v in sorted(vars(obj).items())
                            if not k.startswith("_") and callable(v)]
                           if inspect.isclass(obj) else [])
        found.update(t for t in map(_summary, members) if t is not None)
    return found


def docstring_rows(seed: int = 0) -> tuple[list[str], list[str]]:
    """(texts, labels), shuffled with ``seed``."""
    by_group = {g: set().union(*map(_module_texts, mods)) for g, mods in DOCSTRING_GROUPS.items()}
    seen: dict[str, int] = {}
    for texts in by_group.values():
        for text in texts:
            seen[text] = seen.get(text, 0) + 1
    rows = sorted((t, g) for g, texts in by_group.items() for t in texts if seen[t] == 1)
    random.Random(seed).shuffle(rows)
    return [t for t, _ in rows], [g for _, g in rows]


def write_docstrings_csv(path: str | Path, *, seed: int = 0, limit: int | None = None) -> Path:
    """Write the task as a CSV with ``text`` and ``label`` columns (the first ``limit`` rows
    of the shuffled task, if given); a file already there is refused."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists; give a new file name for the docstring task")
    texts, labels = docstring_rows(seed)
    n = len(texts) if limit is None else min(limit, len(texts))
    with open(path, "x", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        writer.writerows(zip(texts[:n], labels[:n], strict=True))
    return path
