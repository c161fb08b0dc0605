"""The guided tours run: every ```python block in docs/tour.md and docs/tour.zh.md is executed
and its printed output compared with the ```text block that follows it.

Within one tour the blocks run in order in one shared namespace (a later block may use names
an earlier one defined), from the repository root, each with its stdout captured. Every python
block must be followed by a text block holding exactly what it prints (trailing whitespace
ignored), in the same section: an output block under the next heading reads as that section's
output and is refused. Blocks inside ``<details>`` (the exercises' solutions) run like any
other. Links in the tours must point at files that exist; a link
``../tests/test_x.py::test_name`` at a test function that exists; a link whose text is a code
span naming a Python object (`` [`causal_mask`](../src/handformer/masks.py) ``) at a file that
defines it. Every picture a tour shows must exist, be small, and be one that
``docs/make_pictures.py`` draws (the command the tours name).

To refresh the expected output after changing a snippet, run the snippet and paste what it
prints, or let this file do exactly that::

    python tests/test_tour.py --update docs/tour.md docs/tour.zh.md
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import importlib.util
import io
import re
import sys
import time
import tokenize
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOURS = [ROOT / "docs" / "tour.md", ROOT / "docs" / "tour.zh.md"]

FENCE = re.compile(r"^```\s*([\w.+-]*)\s*$")
HEADING = re.compile(r"^#{1,6} ")
LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)|!\[([^\]]*)\]\(([^)\s]+)\)")
CODE_NAME = re.compile(r"^`([A-Za-z_][\w.]*)(?:\(\))?`$")


@dataclass
class Block:
    lang: str
    line: int  # 1-based line of the opening fence
    body: str
    end: int  # 1-based line of the closing fence
    section: str = ""  # the heading the block sits under ("" before the first one)


def parse_blocks(text: str, source: str = "<tour>") -> list[Block]:
    """Fenced code blocks in order. An unterminated fence is an error, not a silent skip."""
    blocks: list[Block] = []
    lines = text.splitlines()
    section = ""
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            if HEADING.match(lines[i]):
                section = lines[i].strip()
            i += 1
            continue
        start, lang = i, m.group(1).lower()
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{source}:{start + 1}: code fence opened here is never closed")
        blocks.append(Block(lang, start + 1, "\n".join(body) + "\n", i + 1, section))
        i += 1
    return blocks


@dataclass
class Outcome:
    block: Block
    expected: Block | None
    actual: str
    error: str | None


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def output_block(blocks: list[Block], n: int) -> Block | None:
    """The output of python block ``n``: the next block, if it is a text block under the
    same heading."""
    following = blocks[n + 1] if n + 1 < len(blocks) else None
    if following is None or following.lang != "text":
        return None
    return following if following.section == blocks[n].section else None


def run_tour(path: Path) -> list[Outcome]:
    """Execute the python blocks of one tour in one namespace, from the repository root (a
    snippet may read a file of the repository); capture each one's stdout."""
    blocks = parse_blocks(path.read_text(encoding="utf-8"), str(path))
    namespace: dict[str, object] = {"__name__": "__tour__"}
    outcomes: list[Outcome] = []
    with contextlib.chdir(ROOT):
        for n, block in enumerate(blocks):
            if block.lang != "python":
                continue
            buffer = io.StringIO()
            error = None
            try:
                code = compile(block.body, f"{path.name}:{block.line}", "exec")
                with contextlib.redirect_stdout(buffer):
                    exec(code, namespace)  # the tour is our own documentation
            except Exception:  # reported with the block's line number
                error = traceback.format_exc(limit=-3)
            outcomes.append(Outcome(block, output_block(blocks, n), buffer.getvalue(), error))
            if error is not None:
                break  # later blocks depend on this one's names
    return outcomes


def describe_failures(path: Path, outcomes: list[Outcome]) -> list[str]:
    problems: list[str] = []
    for o in outcomes:
        where = f"{path.relative_to(ROOT)}:{o.block.line}"
        if o.error is not None:
            problems.append(f"{where}: the python block raised\n{o.error}")
            continue
        if o.expected is None:
            problems.append(f"{where}: the python block has no ```text output block after it "
                            f"in its own section ({o.block.section or 'before any heading'}); "
                            f"it printed:\n{o.actual}")
            continue
        want, got = _normalise(o.expected.body), _normalise(o.actual)
        if want != got:
            diff = "\n".join(difflib.unified_diff(
                want.splitlines(), got.splitlines(),
                f"expected (text block at line {o.expected.line})", "actual output",
                lineterm=""))
            problems.append(f"{where}: output differs\n{diff}")
    return problems


# -- links ------------------------------------------------------------------------------------
def _defined_names(tree: ast.AST) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


def python_object_exists(file: Path, dotted: str) -> bool:
    """Does ``file`` define ``dotted`` (``name`` or ``Class.method``)? A leading module path
    (``handformer.masks.causal_mask`` for masks.py) is accepted too."""
    tree = ast.parse(file.read_text(encoding="utf-8"))
    parts = dotted.split(".")
    module_parts = list(file.with_suffix("").parts)
    # Drop leading components that name the module itself: handformer.masks.x → x.
    while len(parts) > 1 and parts[0] in module_parts:
        parts = parts[1:]
    node: ast.AST = tree
    for part in parts:
        found = _defined_names(node).get(part)
        if found is None:
            return False
        node = found
    return True


def check_links(path: Path) -> list[str]:
    problems: list[str] = []
    text = path.read_text(encoding="utf-8")
    in_code = False
    for lineno, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line) or line.strip() == "```":
            in_code = not in_code
            continue
        if in_code:
            continue
        for m in LINK.finditer(line):
            label, target = (m.group(1), m.group(2)) if m.group(2) else (m.group(3), m.group(4))
            where = f"{path.relative_to(ROOT)}:{lineno}"
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue  # URLs and in-page anchors
            file_part, _, test_name = target.partition("::")
            file_part = file_part.split("#", 1)[0]
            resolved = (path.parent / file_part).resolve()
            if not resolved.exists():
                problems.append(f"{where}: link [{label}]({target}) points at a missing file")
                continue
            if test_name:
                if resolved.suffix != ".py" or not python_object_exists(resolved, test_name):
                    problems.append(f"{where}: link [{label}]({target}): no function "
                                    f"{test_name} in {file_part}")
                continue
            named = CODE_NAME.match(label.strip())
            if (named and resolved.suffix == ".py" and not named.group(1).endswith(".py")
                    and not python_object_exists(resolved, named.group(1))):
                problems.append(f"{where}: link [{label}]({target}): {file_part} does not "
                                f"define {named.group(1)}")
    return problems


# -- the tests --------------------------------------------------------------------------------
@pytest.mark.parametrize("tour", TOURS, ids=[p.name for p in TOURS])
def test_every_snippet_runs_and_prints_what_the_tour_shows(tour: Path) -> None:
    started = time.process_time()  # CPU time: a busy shared machine must not fail the test
    outcomes = run_tour(tour)
    problems = describe_failures(tour, outcomes)
    assert outcomes, f"{tour} has no python blocks"
    assert not problems, "\n\n".join(problems)
    cpu = time.process_time() - started
    assert cpu < 30, f"{tour.name} took {cpu:.1f} s of CPU; the tour must stay quick"


LINKED = [*TOURS, ROOT / "README.md", ROOT / "README.zh.md"]


@pytest.mark.parametrize("doc", LINKED, ids=[p.name for p in LINKED])
def test_every_link_in_the_tours_and_readmes_resolves(doc: Path) -> None:
    problems = check_links(doc)
    assert not problems, "\n".join(problems)


def code_shape(source: str) -> list[str]:
    """The tokens of a snippet with comments dropped and every string literal blanked: what
    must agree between the two languages (the words printed and explained may differ)."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return ['""' if t.type == tokenize.STRING else t.string for t in tokens
            if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                              tokenize.DEDENT, tokenize.ENDMARKER)]


def test_both_tours_have_the_same_sections_and_code() -> None:
    """The Chinese tour is written for its readers, but walks the same road: the same
    sections and the same python code (comments and strings aside), so neither falls
    behind."""
    english, chinese = (t.read_text(encoding="utf-8") for t in TOURS)
    heading = re.compile(r"^## (\d+)\.", re.M)
    assert heading.findall(english) == heading.findall(chinese)
    en, zh = ([code_shape(b.body) for b in parse_blocks(text) if b.lang == "python"]
              for text in (english, chinese))
    if len(en) != len(zh):
        pytest.fail(f"{len(en)} python blocks in tour.md, {len(zh)} in tour.zh.md; if one tour "
                    "has a section the other has not yet, write it in both")
    differ = [n for n, (a, b) in enumerate(zip(en, zh, strict=True)) if a != b]
    assert not differ, f"python blocks {differ} (0-based) differ between the two tours"


def test_the_checker_catches_wrong_output_missing_output_and_bad_links(tmp_path: Path) -> None:
    """The harness itself: a wrong expected output, a missing output block, a raising block,
    a dead file link and a dead test link are each reported with the line number."""
    docs = tmp_path / "docs"
    docs.mkdir()
    tour = docs / "tour.md"
    tour.write_text(
        "# t\n\n```python\nx = 2\nprint(x * 21)\n```\n\n```text\n41\n```\n\n"
        "```python\nprint('no output block')\n```\n\n"
        "## a section\n\n```python\nprint(x)\nraise RuntimeError('boom')\n```\n\n"
        "```text\n2\n```\n\n"
        "[gone](../nowhere.py) [t](../tests/test_tour.py::test_that_does_not_exist)\n"
        "[`parse_blocks`](../tests/test_tour.py) [`no_such_name`](../tests/test_tour.py)\n",
        encoding="utf-8")
    misplaced = docs / "misplaced.md"  # the output sits under the next heading
    misplaced.write_text("## one\n\n```python\nprint(1)\n```\n\n## two\n\ntext\n\n"
                         "```text\n1\n```\n", encoding="utf-8")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_tour.py").write_text(Path(__file__).read_text("utf-8"), "utf-8")
    global ROOT
    saved = ROOT
    ROOT = tmp_path
    try:
        problems = describe_failures(tour, run_tour(tour))
        links = check_links(tour)
        misplaced_problems = describe_failures(misplaced, run_tour(misplaced))
    finally:
        ROOT = saved
    assert len(problems) == 3, problems
    assert problems[0].startswith("docs/tour.md:3: output differs")
    assert "-41" in problems[0] and "+42" in problems[0]
    assert problems[1].startswith("docs/tour.md:12: the python block has no ```text")
    assert problems[2].startswith("docs/tour.md:18: the python block raised")
    assert "RuntimeError: boom" in problems[2]
    assert len(misplaced_problems) == 1, misplaced_problems
    assert misplaced_problems[0].startswith("docs/misplaced.md:3: the python block has no ```text")
    assert "in its own section (## one)" in misplaced_problems[0]
    assert len(links) == 3, links
    assert "missing file" in links[0]
    assert "no function test_that_does_not_exist" in links[1]
    assert "does not define no_such_name" in links[2]


# -- pictures ---------------------------------------------------------------------------------
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
MAX_PICTURE_BYTES = 160_000  # docs/img is committed: keep each picture small


def load_make_pictures():
    spec = importlib.util.spec_from_file_location("make_pictures",
                                                  ROOT / "docs" / "make_pictures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_pictures"] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def shown_pictures(path: Path) -> list[str]:
    """The pictures a tour shows (``![…](img/x.png)``), as paths relative to docs/."""
    return IMAGE.findall(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("tour", TOURS, ids=[p.name for p in TOURS])
def test_every_picture_the_tour_shows_exists_and_is_drawn_by_make_pictures(tour: Path) -> None:
    make_pictures = load_make_pictures()
    drawn = {f: p for p in make_pictures.PICTURES for f in p.files}
    text = tour.read_text(encoding="utf-8")
    shown = shown_pictures(tour)
    assert shown, f"{tour.name} shows no picture"
    assert make_pictures.COMMAND in text, f"{tour.name} never names {make_pictures.COMMAND!r}"
    for target in shown:
        file = (tour.parent / target).resolve()
        assert file.parent == make_pictures.IMG, f"{target}: pictures live in docs/img/"
        assert file.name in drawn, f"{target}: docs/make_pictures.py does not draw it"
        assert file.is_file(), f"{target} is missing; run {make_pictures.COMMAND}"
        assert file.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{target} is not a PNG"
        size = file.stat().st_size
        assert size < MAX_PICTURE_BYTES, f"{target} is {size} bytes; keep it small"
        picture = drawn[file.name]
        if not picture.quick:  # drawn only on request: the tour must say how
            assert f"{make_pictures.COMMAND} {picture.name}" in text, (
                f"{tour.name} shows {target} without naming "
                f"`{make_pictures.COMMAND} {picture.name}`")


def test_every_file_in_docs_img_is_one_make_pictures_draws() -> None:
    make_pictures = load_make_pictures()
    drawn = {f for p in make_pictures.PICTURES for f in p.files}
    stray = sorted(f.name for f in make_pictures.IMG.iterdir() if f.name not in drawn)
    assert not stray, f"docs/img holds files nothing regenerates: {stray}"


def test_make_pictures_draws_the_quick_untrained_pictures(tmp_path: Path) -> None:
    """The pictures that need no training, drawn for real into a scratch folder (the trained
    ones take minutes: ``python docs/make_pictures.py`` draws them all)."""
    make_pictures = load_make_pictures()
    assert make_pictures.main(["positions", "masks", "--out", str(tmp_path)]) == 0
    for name in ("positions.png", "doctor-masks.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < len(data) < MAX_PICTURE_BYTES
    with pytest.raises(SystemExit):
        make_pictures.main(["no-such-picture", "--out", str(tmp_path)])


# -- refreshing the expected output -----------------------------------------------------------
def update(path: Path) -> None:
    """Rewrite each python block's text block with what the block prints now (inserting one
    where it is missing). Stops at the first block that raises."""
    lines = path.read_text(encoding="utf-8").splitlines()
    outcomes = run_tour(path)
    for o in reversed(outcomes):  # from the bottom, so earlier line numbers stay valid
        if o.error is not None:
            print(f"{path}:{o.block.line} raised; nothing after it was updated\n{o.error}",
                  file=sys.stderr)
            continue
        new = ["```text", *o.actual.rstrip("\n").splitlines(), "```"]
        if o.expected is not None:
            lines[o.expected.line - 1:o.expected.end] = new
        else:
            lines[o.block.end:o.block.end] = ["", *new]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "--update":
        sys.exit("usage: python tests/test_tour.py --update docs/tour.md [docs/tour.zh.md]")
    import torch

    sys.path.insert(0, str(ROOT))  # the tours import parity helpers from tests/reference/
    torch.set_num_threads(1)  # as in the test suite (tests/conftest.py)
    for name in sys.argv[2:]:
        t0 = time.perf_counter()
        update(Path(name).resolve())
        print(f"{name}: {time.perf_counter() - t0:.1f} s")
