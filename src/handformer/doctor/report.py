"""What the doctor found: one ``CheckResult`` per check, gathered into a ``Report``.

A result says PASS / WARN / FAIL (or SKIP, with the reason), the *evidence* (numbers measured
on the user's model, never a canned sentence) and, when something is wrong, a *hint* that
names the fix. The report prints for people (``format_text``) and for machines
(``to_dict`` / ``to_json``); ``exit_code`` is 0 unless some check FAILed.
"""

from __future__ import annotations

import enum
import functools
import json
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

__all__ = [
    "SECTIONS",
    "CheckResult",
    "ModuleRow",
    "Report",
    "Status",
    "guarded",
]

# The tutorial's troubleshooting order: structure before data, static before dynamic.
SECTIONS: tuple[str, ...] = ("shapes", "masks", "loss", "gradients", "learning", "paths",
                             "output")
SECTION_TITLES: dict[str, str] = {
    "shapes": "forward pass and shapes",
    "masks": "masks and attention",
    "loss": "loss and targets",
    "gradients": "gradients after one backward",
    "learning": "learning: overfit one batch",
    "paths": "paths agree",
    "output": "output",
}


class Status(str, enum.Enum):
    """A check's verdict: PASS, WARN (suspicious, not proven wrong), FAIL (a bug, with the
    evidence) or SKIP (not applicable, or an earlier failure makes it meaningless)."""

    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass
class CheckResult:
    """One check's verdict. ``details`` holds JSON-able numbers for machines."""

    section: str
    name: str
    status: Status
    evidence: str
    hint: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status.value}


@dataclass
class ModuleRow:
    """One line of the per-module shape table, filled in by forward hooks."""

    name: str
    kind: str
    input_shape: list[int] | None
    output_shape: list[int] | None
    params: int
    calls: int = 1

    @property
    def depth(self) -> int:
        return 0 if self.name == "" else self.name.count(".") + 1


F = TypeVar("F", bound=Callable[..., CheckResult])


def guarded(section: str, name: str, hint: str) -> Callable[[F], F]:
    """Turn an exception inside a check into a FAIL that shows it, instead of a crash.

    A doctor that dies on the first broken model is no use: the exception *is* the evidence.
    """

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> CheckResult:
            try:
                return fn(*args, **kwargs)
            except Exception as err:  # reported, not swallowed
                where = traceback.extract_tb(err.__traceback__)[-1]
                return CheckResult(
                    section, name, Status.FAIL,
                    f"raised {type(err).__name__}: {err} (at {where.filename}:{where.lineno})",
                    hint, {"exception": type(err).__name__},
                )

        return inner  # type: ignore[return-value]

    return wrap


def _shape(shape: list[int] | None) -> str:
    return "-" if shape is None else "(" + ", ".join(str(s) for s in shape) + ")"


@dataclass
class Report:
    """All results in check order, the module table, the subject's description, timing."""

    checks: list[CheckResult]
    modules: list[ModuleRow] = field(default_factory=list)
    subject: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    pictures: list[str] = field(default_factory=list)

    # -- queries ------------------------------------------------------------------------
    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status is Status.FAIL]

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def get(self, name: str) -> CheckResult:
        """The result of the check called ``name`` (KeyError names the known checks)."""
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(f"no check named {name!r}; checks: {[c.name for c in self.checks]}")

    def counts(self) -> dict[str, int]:
        return {s.value: sum(c.status is s for c in self.checks) for s in Status}

    # -- output -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "counts": self.counts(),
            "seconds": round(self.seconds, 3),
            "subject": self.subject,
            "checks": [c.to_dict() for c in self.checks],
            "modules": [asdict(m) for m in self.modules],
            "pictures": self.pictures,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def format_text(self, *, max_module_depth: int | None = 2, width: int = 100) -> str:
        """The terminal report: sections in tutorial order, the module table under shapes.

        The table shows modules up to ``max_module_depth`` (None: all) — all of them when the
        forward pass failed, since then the deepest finished module is the clue.
        """
        if any(c.name == "forward pass" and c.status is Status.FAIL for c in self.checks):
            max_module_depth = None
        lines: list[str] = []
        s = self.subject
        head = f"handformer doctor: {s.get('model', 'model')}"
        if "parameters" in s:
            head += f", {s['parameters']:,} parameters"
        if "batch" in s:
            head += f", probe batch {_shape(s['batch'])}"
        if "vocab_size" in s:
            head += f", V={s['vocab_size']}"
        if "source" in s:
            head += f"\nsubject: {s['source']}"
        lines += [head, "checks follow the tutorial's order: shapes → masks → loss → "
                  "gradients → learning → paths", ""]
        for number, section in enumerate(SECTIONS, start=1):
            results = [c for c in self.checks if c.section == section]
            if not results:
                continue
            lines.append(f"{number}. {SECTION_TITLES[section]}")
            if section == "shapes" and self.modules:
                lines += self._module_table(max_module_depth)
            for c in results:
                lines += _wrap(f"  {c.status.value:<5} {c.name}: {c.evidence}", width, 8)
                if c.hint and c.status is not Status.PASS:
                    lines += _wrap(f"        hint: {c.hint}", width, 14)
            lines.append("")
        if self.pictures:
            lines.append("pictures: " + ", ".join(self.pictures))
        n = self.counts()
        lines.append(f"summary: {n['PASS']} PASS, {n['WARN']} WARN, {n['FAIL']} FAIL, "
                     f"{n['SKIP']} SKIP in {self.seconds:.1f} s"
                     + ("" if self.ok else " — fix the first FAIL first; later checks "
                        "often fail because of it"))
        return "\n".join(lines)

    def _module_table(self, max_depth: int | None) -> list[str]:
        rows = [m for m in self.modules if max_depth is None or m.depth <= max_depth]
        cells = [(m.name or "(model)", m.kind, _shape(m.input_shape), _shape(m.output_shape),
                  f"{m.params:,}") for m in rows]
        header = ("module", "type", "input", "output", "params")
        widths = [max(len(r[i]) for r in [header, *cells]) for i in range(5)]
        out = ["  " + "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
               .rstrip()]
        out += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                for r in cells]
        hidden = len(self.modules) - len(rows)
        if hidden:
            out.append(f"  ({hidden} deeper modules not shown; --verbose or --json lists all)")
        return out


def _wrap(text: str, width: int, indent: int) -> list[str]:
    """Wrap ``text``; continuation lines start ``indent`` spaces in."""
    import textwrap

    return textwrap.wrap(text, width=width, subsequent_indent=" " * indent,
                         break_on_hyphens=False) or [""]
