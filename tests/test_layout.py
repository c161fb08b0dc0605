"""The house plan holds (DESIGN.md, "Layout"): floors run upward, no import loops, a small
package face, an engine that knows no model, no test machinery and no second forward path
in the package.

Every ``import`` counts, including the ones inside functions (a lazy import is still a
dependency). Run this file as a script to print the floors and the longest import chain.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "handformer"

# Floor of each room; a module may import only from its own floor or below.
FLOORS: dict[str, int] = {
    "handformer.masks": 0, "handformer.loss": 0, "handformer.atomic": 0, "handformer.machine": 0,
    "handformer.tokenizers": 1, "handformer.nn": 1, "handformer.data": 1,
    "handformer.config": 2,
    "handformer.models": 3,
    "handformer.generate": 4, "handformer.capture": 4, "handformer.train": 4,
    "handformer.runs": 5,
    "handformer.jobs": 6,
    "handformer.doctor": 7, "handformer.explore": 7, "handformer.interop": 7,
    "handformer.bench": 7, "handformer.learn": 7, "handformer.serve": 7,
    "handformer.cli": 8, "handformer.__main__": 8,
}
# The training engine is model-agnostic: it takes any module and a loss function.
ENGINE_MAY_NOT_IMPORT = ("handformer.models", "handformer.jobs", "handformer.runs",
                         "handformer.generate", "handformer.capture")
MAX_LOOSE_MODULES = 9


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


@functools.cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The handformer modules ``name`` imports, anywhere in the file."""
    path, known = modules()[name], modules()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in known else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in known and m != name}


def floor_of(name: str) -> int | None:
    for room in sorted(FLOORS, key=len, reverse=True):
        if name == room or name.startswith(room + "."):
            return FLOORS[room]
    return None


def graph() -> dict[str, set[str]]:
    return {name: imports_of(name) for name in modules()}


def longest_chain(edges: dict[str, set[str]]) -> list[str]:
    @functools.cache
    def from_(name: str) -> tuple[str, ...]:
        best: tuple[str, ...] = ()
        for dep in edges[name]:
            chain = from_(dep)
            if len(chain) > len(best):
                best = chain
        return (name, *best)

    return list(max((from_(n) for n in edges), key=len))


def test_every_module_has_a_floor() -> None:
    homeless = [n for n in modules() if n != "handformer" and floor_of(n) is None]
    assert not homeless, f"modules outside the plan (add them to FLOORS): {homeless}"


def test_imports_never_run_from_a_lower_floor_to_a_higher_one() -> None:
    upward = []
    for name, deps in graph().items():
        if name == "handformer":  # the package face gathers the public names
            continue
        for dep in deps:
            if dep == "handformer":
                upward.append(f"{name} imports the package face; import the module itself")
            elif floor_of(dep) > floor_of(name):  # type: ignore[operator]
                upward.append(f"{name} (floor {floor_of(name)}) imports {dep} "
                              f"(floor {floor_of(dep)})")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_loops() -> None:
    edges = graph()
    state: dict[str, int] = {}
    loops: list[list[str]] = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(edges[name]):
            if state.get(dep) == 1:
                loops.append([*path[path.index(dep):], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert not loops, "import loops:\n" + "\n".join(" → ".join(loop) for loop in loops)


def test_the_training_engine_imports_no_model_and_no_job() -> None:
    bad = {name: sorted(d for d in deps if d.startswith(ENGINE_MAY_NOT_IMPORT))
           for name, deps in graph().items() if name.startswith("handformer.train")}
    assert not any(bad.values()), {k: v for k, v in bad.items() if v}


def test_few_modules_loose_at_the_top() -> None:
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= MAX_LOOSE_MODULES, loose


def test_no_test_machinery_in_the_package() -> None:
    hits = [f"{p.relative_to(PACKAGE)}:{i}" for p in PACKAGE.rglob("*.py")
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if "HANDFORMER_TEST" in line]
    assert not hits, f"test switches read inside the package: {hits}"


def test_one_forward_path_per_module() -> None:
    """Speed comes from a lean or compiled ``forward``, never from a second hand-kept copy
    (``decode_step``, ``fast_forward``, …) that hooks and captures cannot see."""
    second = re.compile(r"^\s*def (decode_step|\w*_forward_fast|fast_forward|step_forward)\(",
                        re.M)
    hits = [f"{p.relative_to(PACKAGE)}: {m.group(1)}" for p in PACKAGE.rglob("*.py")
            for m in second.finditer(p.read_text(encoding="utf-8"))]
    assert not hits, hits


@pytest.mark.parametrize("name", ["handformer.nn.attention", "handformer.jobs.lm"])
def test_the_checker_sees_real_imports(name: str) -> None:
    """The graph is not vacuous: known edges are found (lazy imports included)."""
    expected = {"handformer.nn.attention": "handformer.masks",
                "handformer.jobs.lm": "handformer.train.trainer"}[name]
    assert expected in imports_of(name)


if __name__ == "__main__":
    edges = graph()
    for floor in sorted(set(FLOORS.values())):
        rooms = sorted(r for r, f in FLOORS.items() if f == floor)
        print(f"floor {floor}: {', '.join(r.removeprefix('handformer.') for r in rooms)}")
    chain = longest_chain(edges)
    print(f"{len(modules())} modules; longest import chain ({len(chain)}):")
    print("  " + " → ".join(chain))
    sys.exit(0)
