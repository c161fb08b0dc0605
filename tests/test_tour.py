"""The guided tours run: every ```python block in docs/tour.md and docs/tour.zh.md is executed
and its printed output compared with the ```text block that follows it.

The tours run as a reader runs them, from an installed package: in a fresh Python process
started in an empty temporary folder outside the repository, with only the installed
``handformer`` on its path, so ``import tests`` (or any other file of the checkout) fails
there. The one data file a tour reads, the stored length study (``TOUR_READS``), is copied
beside it, as a reader who has the repository's ``docs/`` folder has it.

Within one tour the blocks run in order in one shared namespace (a later block may use names
an earlier one defined), each with its stdout captured. Every python block must be followed
by a text block holding exactly what it prints (trailing whitespace ignored), in the same
section: an output block under the next heading reads as that section's output and is
refused. Blocks inside ``<details>`` (the exercises' solutions) run like any other.

A text block may show output that is not the same on every CPU (a trained model's losses and
the text it writes, which follow the kernels' rounding): then the line right above its fence is
``<!-- output varies by CPU: CLAUSES -->`` (hidden when rendered; the document must tell the
reader in words too), and the output is compared as its clauses allow, no more loosely:
``numbers within P %`` compares every decimal number within P per cent of the one shown (the
words around them exactly), ``line N matches REGEX`` requires line N of both the shown and the
printed output to match REGEX in full (see ``output_rules``).

Every text block is the output of the python block right above it: a text block after
another text block, or with no python block before it in its section, is an orphan (a pasted
output left twice, a snippet deleted without its output) and is refused.

Links are checked the way a renderer (GitHub's included) resolves them: the href, read as a
path relative to the document (``#anchor`` aside), must be an existing file — so no ``::``
in an href: ``../tests/x.py::test_name`` is a file named ``x.py::test_name`` to a renderer. A
test is linked as its file, with its name in the link text; a link whose text is a code span
naming a Python object (`` [`causal_mask`](../src/handformer/masks.py) ``,
`` [`test_x`](../tests/test_x.py) ``) must point at a file that defines it, and one naming a
file (`` [`test_x.py`](../tests/test_x.py) ``) must point at that file.

The two languages must agree: the same sections, the same code, and in each section the same
figures in the prose (every number with a decimal point or a percent sign), so a figure
corrected in one tour cannot stay wrong in the other. Every picture a
tour shows must exist, be small, and be one that ``docs/make_pictures.py`` draws (the
command the tours name).

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
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tokenize
import traceback
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOURS = [ROOT / "docs" / "tour.md", ROOT / "docs" / "tour.zh.md"]
# The data files the tours and the build track read, relative to the folder they run in.
TOUR_READS = ["docs/img/length_convergence.json", "docs/results/length_convergence_seed1.json",
              "docs/img/build_progression.json"]
RUN_TIMEOUT_S = 600  # a hung snippet fails the test instead of the whole suite
# CPU seconds past which a document's snippets have run away (a training left at full size, a
# loop that never ends early). A guard, not a speed figure: CPU time follows the kernels the
# CPU's libraries pick, and under ATEN_CPU_CAPABILITY=default (the scalar path, which CI runs
# too) the same snippets take about twice what they take on AVX-512, so the bound sits well
# above the slowest path rather than just above one machine's figure.
RUNAWAY_CPU_S = {"tour": 120.0, "build": 240.0}

FENCE = re.compile(r"^```\s*([\w.+-]*)\s*$")
HEADING = re.compile(r"^#{1,6} ")
LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)|!\[([^\]]*)\]\(([^)\s]+)\)")
CODE_NAME = re.compile(r"^`([A-Za-z_][\w.]*)(?:\(\))?`$")
FILE_NAME = re.compile(r"^`([\w./-]+\.(?:py|md|json|png|toml|txt|yml|yaml|cfg|jsonl))`$")
FIGURE = re.compile(r"(?<![\w.])(\d+\.\d+|\d+(?=\s*%))(?![\w.]*\d)")


def _varies_pattern() -> re.Pattern[str]:
    """The one line before a ```text block that says how its output may vary (module
    docstring), as the notebook maker spells it: one pattern for both readers."""
    spec = importlib.util.spec_from_file_location("make_notebooks",
                                                  ROOT / "docs" / "make_notebooks.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.VARIES


VARIES = _varies_pattern()
DECIMAL = re.compile(r"-?\d+\.\d+")


@dataclass
class Block:
    lang: str
    line: int  # 1-based line of the opening fence
    body: str
    end: int  # 1-based line of the closing fence
    section: str = ""  # the heading the block sits under ("" before the first one)
    varies: str | None = None  # a text block's "output varies by CPU" marker, if it has one


def parse_blocks(text: str, source: str = "<tour>") -> list[Block]:
    """Fenced code blocks in order. An unterminated fence is an error, not a silent skip."""
    blocks: list[Block] = []
    lines = text.splitlines()
    section = ""
    varies = None  # the marker on the last non-blank line, if that line was one
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            if HEADING.match(lines[i]):
                section = lines[i].strip()
            if lines[i].strip():
                marker = VARIES.fullmatch(lines[i].strip())
                varies = marker.group(1) if marker else None
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
        if varies is not None and lang != "text":
            raise ValueError(f"{source}:{start + 1}: an 'output varies by CPU' marker stands "
                             f"before a ```{lang} block; it belongs right above a ```text block")
        blocks.append(Block(lang, start + 1, "\n".join(body) + "\n", i + 1, section,
                            varies if lang == "text" else None))
        varies = None
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


def output_rules(varies: str) -> tuple[float, dict[int, str]]:
    """A marker's clauses, separated by ``;``: ``numbers within P %`` (every decimal number
    compared within P per cent of the one shown) and ``line N matches REGEX`` (line N, from
    1, must match REGEX in full: text a trained model writes). Anything else is refused."""
    tolerance, patterns = 0.0, {}
    for clause in (c.strip() for c in varies.split(";")):
        numbers = re.fullmatch(r"numbers within (\d+(?:\.\d+)?) %", clause)
        line = re.fullmatch(r"line (\d+) matches (.+)", clause)
        if numbers:
            tolerance = float(numbers.group(1)) / 100
        elif line:
            patterns[int(line.group(1))] = line.group(2)
        else:
            raise ValueError(f"output varies by CPU: cannot read {clause!r}; expected "
                             "'numbers within P %' or 'line N matches REGEX'")
    return tolerance, patterns


def same_output(want: str, got: str, varies: str | None = None) -> bool:
    """Does ``got`` print what the text block ``want`` shows? Exactly (trailing whitespace
    aside), or within what the block's "output varies by CPU" marker allows."""
    want, got = _normalise(want), _normalise(got)
    if varies is None or want == got:
        return want == got
    tolerance, patterns = output_rules(varies)
    shown, printed = want.splitlines(), got.splitlines()
    if len(shown) != len(printed):
        return False
    for n, (a, b) in enumerate(zip(shown, printed, strict=True), start=1):
        if n in patterns:
            if not (re.fullmatch(patterns[n], a) and re.fullmatch(patterns[n], b)):
                return False
            continue
        if DECIMAL.split(a) != DECIMAL.split(b):  # the words around the numbers, exactly
            return False
        for x, y in zip(DECIMAL.findall(a), DECIMAL.findall(b), strict=True):
            if abs(float(y) - float(x)) > tolerance * abs(float(x)):
                return False
    return True


def output_block(blocks: list[Block], n: int) -> Block | None:
    """The output of python block ``n``: the next block, if it is a text block under the
    same heading."""
    following = blocks[n + 1] if n + 1 < len(blocks) else None
    if following is None or following.lang != "text":
        return None
    return following if following.section == blocks[n].section else None


@dataclass
class TourRun:
    outcomes: list[Outcome]
    cpu_seconds: float  # the child's CPU time for the blocks (a busy machine must not fail it)


def run_tour(path: Path) -> TourRun:
    """Execute the python blocks of one tour in one namespace, in a fresh process started in
    an empty temporary folder outside the repository, with only the installed ``handformer``
    on its path (see the module docstring); capture each block's stdout."""
    import handformer

    blocks = parse_blocks(path.read_text(encoding="utf-8"), str(path))
    with tempfile.TemporaryDirectory(prefix="handformer-tour-") as tmp:
        folder = Path(tmp) / "reader"
        folder.mkdir()
        for name in TOUR_READS:
            if (ROOT / name).is_file():
                (folder / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(ROOT / name, folder / name)
        results = Path(tmp) / "outcomes.json"
        env = {**os.environ, "PYTHONPATH": str(Path(handformer.__file__).resolve().parents[1])}
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--run", str(path), str(results)],
            cwd=folder, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        if proc.returncode != 0 or not results.is_file():
            raise RuntimeError(f"the tour runner failed (exit {proc.returncode}):\n"
                               f"{proc.stdout}{proc.stderr}")
        ran = json.loads(results.read_text(encoding="utf-8"))
    index = {b.line: n for n, b in enumerate(blocks)}
    outcomes = [Outcome(blocks[index[r["line"]]], output_block(blocks, index[r["line"]]),
                        r["actual"], r["error"]) for r in ran["blocks"]]
    return TourRun(outcomes, ran["cpu_seconds"])


def _outside_the_checkout() -> str | None:
    """Why this process could reach the repository's files, or None if it cannot."""
    here = Path(__file__).resolve().parent
    if sys.path and sys.path[0] and Path(sys.path[0]).resolve() == here:
        del sys.path[0]  # the script's own folder, which ``python tests/test_tour.py`` adds
    if Path.cwd().resolve().is_relative_to(ROOT):
        return f"the tour runs in {Path.cwd()}, inside the repository {ROOT}"
    on_path = [p for p in sys.path if (Path(p or ".").resolve()) == ROOT]
    if on_path:
        return f"the repository {ROOT} is on sys.path"
    spec = importlib.util.find_spec("tests")
    if spec is not None and spec.origin and Path(spec.origin).resolve().is_relative_to(ROOT):
        return f"`import tests` finds the repository's test suite ({spec.origin})"
    return None


def _run_blocks(path: Path, results: Path) -> int:
    """The child of ``run_tour``: run the tour's python blocks here, write what each printed
    (or raised) to ``results`` as JSON."""
    why = _outside_the_checkout()
    if why is not None:
        print(f"refusing to run the tour: {why}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(int(os.environ.get("HANDFORMER_TEST_THREADS", "1")))  # as conftest
    torch.manual_seed(0)  # as conftest's autouse seed
    started = time.process_time()  # CPU time: a busy shared machine must not fail the test
    blocks = parse_blocks(path.read_text(encoding="utf-8"), str(path))
    namespace: dict[str, object] = {"__name__": "__tour__"}
    ran: list[dict[str, object]] = []
    for block in blocks:
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
        ran.append({"line": block.line, "actual": buffer.getvalue(), "error": error})
        if error is not None:
            break  # later blocks depend on this one's names
    results.write_text(json.dumps({"blocks": ran,
                                   "cpu_seconds": time.process_time() - started}),
                       encoding="utf-8")
    return 0


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
        if not same_output(o.expected.body, o.actual, o.expected.varies):
            want, got = _normalise(o.expected.body), _normalise(o.actual)  # for the diff
            diff = "\n".join(difflib.unified_diff(
                want.splitlines(), got.splitlines(),
                f"expected (text block at line {o.expected.line})", "actual output",
                lineterm=""))
            allowed = ("" if o.expected.varies is None
                       else f" by more than its marker allows ({o.expected.varies})")
            problems.append(f"{where}: output differs{allowed}\n{diff}")
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
    if parts[0] in module_parts and (parts[0] != "__init__" and len(parts) == 1):
        return file.stem == parts[0] or file.parent.name == parts[0]  # the module itself
    node: ast.AST = tree
    for part in parts:
        found = _defined_names(node).get(part)
        if found is None:
            return False
        node = found
    return True


def check_links(path: Path) -> list[str]:
    """Each link as a renderer resolves it: the href (percent-decoded, ``#anchor`` aside) is
    a path relative to the document and must be an existing file; ``::`` is part of that
    path, so a ``file.py::test_name`` href is refused."""
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
            if "::" in target:
                problems.append(f"{where}: link [{label}]({target}): a renderer reads '::' as "
                                "part of the file name; link the file and put the test's "
                                "name in the link text")
                continue
            file_part = urllib.parse.unquote(target.split("#", 1)[0])
            resolved = (path.parent / file_part).resolve()
            if not resolved.is_file():
                problems.append(f"{where}: link [{label}]({target}) points at a missing file")
                continue
            file_named = FILE_NAME.match(label.strip())
            if file_named and not resolved.as_posix().endswith("/" + file_named.group(1)):
                problems.append(f"{where}: link [{label}]({target}): the label names "
                                f"{file_named.group(1)} but the link opens {resolved.name}")
                continue
            named = CODE_NAME.match(label.strip())
            if (named and resolved.suffix == ".py" and not named.group(1).endswith(".py")
                    and not python_object_exists(resolved, named.group(1))):
                problems.append(f"{where}: link [{label}]({target}): {file_part} does not "
                                f"define {named.group(1)}")
    return problems


def orphan_outputs(path: Path, blocks: list[Block]) -> list[str]:
    """Text blocks that are no python block's output (see the module docstring)."""
    problems = []
    for n, block in enumerate(blocks):
        if block.lang != "text":
            continue
        before = blocks[n - 1] if n else None
        if before is None or before.lang != "python" or before.section != block.section:
            what = ("repeats the output block above it" if before is not None
                    and before.lang == "text" and before.body == block.body
                    else "follows no python block in its section")
            problems.append(f"{path.relative_to(ROOT)}:{block.line}: this ```text block {what}")
    return problems


def prose_figures(text: str) -> dict[str, set[str]]:
    """The figures of each numbered section's prose (outside code blocks and link targets)."""
    figures: dict[str, set[str]] = {}
    section = None
    in_code = False
    for line in text.splitlines():
        if FENCE.match(line) or line.strip() == "```":
            in_code = not in_code
            continue
        heading = re.match(r"^## (\d+)\.", line)
        if heading:
            section = heading.group(1)
            figures[section] = set()
        elif section is not None and not in_code:
            figures[section].update(FIGURE.findall(re.sub(r"\]\([^)]*\)", "]", line)))
    return figures


def figure_drift(english: str, chinese: str) -> list[str]:
    """Sections whose prose figures differ between the two tours."""
    en, zh = prose_figures(english), prose_figures(chinese)
    return [f"§{s}: only in tour.md {sorted(en[s] - zh.get(s, set()))}, only in tour.zh.md "
            f"{sorted(zh.get(s, set()) - en[s])}" for s in en if en[s] != zh.get(s, set())]


# -- the tests --------------------------------------------------------------------------------
@pytest.mark.parametrize("tour", TOURS, ids=[p.name for p in TOURS])
def test_every_snippet_runs_and_prints_what_the_tour_shows(tour: Path) -> None:
    run = run_tour(tour)
    problems = describe_failures(tour, run.outcomes)
    assert run.outcomes, f"{tour} has no python blocks"
    assert not problems, "\n\n".join(problems)
    cpu = run.cpu_seconds
    assert cpu < RUNAWAY_CPU_S["tour"], f"{tour.name} took {cpu:.1f} s of CPU; a snippet ran away"


@pytest.mark.parametrize("tour", TOURS, ids=[p.name for p in TOURS])
def test_every_output_block_belongs_to_the_snippet_above_it(tour: Path) -> None:
    problems = orphan_outputs(tour, parse_blocks(tour.read_text(encoding="utf-8"), str(tour)))
    assert not problems, "\n".join(problems)


def test_both_tours_state_the_same_figures_in_each_section() -> None:
    problems = figure_drift(*(t.read_text(encoding="utf-8") for t in TOURS))
    assert not problems, "\n".join(problems)


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
        "[gone](../nowhere.py) [t](../tests/test_tour.py::parse_blocks)\n"
        "[`parse_blocks`](../tests/test_tour.py) [`no_such_name`](../tests/test_tour.py)\n"
        "[`test_that_does_not_exist`](../tests/test_tour.py) [folder](../tests)\n"
        "[`parse_blocks`](../tests/test%5Ftour.py#L1)\n"
        "[`test_other.py`](../tests/test_tour.py) [`tests/test_tour.py`](../tests/test_tour.py)\n"
        "\n```text\n2\n```\n",
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
        problems = describe_failures(tour, run_tour(tour).outcomes)
        links = check_links(tour)
        misplaced_problems = describe_failures(misplaced, run_tour(misplaced).outcomes)
        orphans = orphan_outputs(tour, parse_blocks(tour.read_text(encoding="utf-8")))
        misplaced_orphans = orphan_outputs(misplaced, parse_blocks(misplaced.read_text("utf-8")))
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
    assert len(links) == 6, links  # the percent-encoded link with an anchor resolves
    assert "missing file" in links[0]
    assert "a renderer reads '::' as part of the file name" in links[1]
    assert "does not define no_such_name" in links[2]
    assert "does not define test_that_does_not_exist" in links[3]
    assert "[folder](../tests) points at a missing file" in links[4]
    assert "the label names test_other.py but the link opens test_tour.py" in links[5]
    assert orphans == ["docs/tour.md:33: this ```text block repeats the output block above it"]
    assert misplaced_orphans == [
        "docs/misplaced.md:11: this ```text block follows no python block in its section"]


def test_an_output_that_varies_by_cpu_is_compared_only_as_loosely_as_its_marker_says() -> None:
    doc = ("```python\nprint(1)\n```\n\n<!-- output varies by CPU: numbers within 2 %; "
           "line 2 matches 'The .{3,}' -->\n\n```text\nloss 1.500 at step 200\n'The cat'\n```\n")
    (_, block) = parse_blocks(doc)
    assert block.varies == "numbers within 2 %; line 2 matches 'The .{3,}'"
    assert same_output(block.body, "loss 1.520 at step 200\n'The dog'\n", block.varies)
    assert not same_output(block.body, "loss 1.540 at step 200\n'The dog'\n", block.varies)
    assert not same_output(block.body, "loss 1.500 at step 201\n'The dog'\n", block.varies)
    assert not same_output(block.body, "loss 1.500 at step 200\n'A dog'\n", block.varies)
    assert not same_output(block.body, "loss 1.500 at step 200\n", block.varies)
    assert not same_output(block.body, "loss 1.501 at step 200\n'The cat'\n")  # no marker
    with pytest.raises(ValueError, match="cannot read 'numbers roughly'"):
        same_output("1.0", "1.1", "numbers roughly")
    with pytest.raises(ValueError, match="belongs right above a ```text block"):
        parse_blocks("<!-- output varies by CPU: numbers within 2 % -->\n```python\nx\n```\n")


def test_figure_drift_names_the_section_and_the_figures() -> None:
    english = "## 1. a\n\nloss 0.764, 50 %, step 200\n\n```text\n9.99\n```\n## 2. b\n\n1.5\n"
    chinese = "## 1. 甲\n\n损失 0.746，50%，第 200 步\n\n```text\n1.23\n```\n## 2. 乙\n\n1.5\n"
    assert figure_drift(english, chinese) == [
        "§1: only in tour.md ['0.764'], only in tour.zh.md ['0.746']"]


def test_the_tour_runs_outside_the_checkout(tmp_path: Path) -> None:
    """The reader's seat: the snippets run in a folder outside the repository, where the
    test suite cannot be imported and handformer is the installed package."""
    tour = tmp_path / "tour.md"
    tour.write_text(
        "```python\nimport os\nfrom pathlib import Path\n"
        f"print(Path.cwd().resolve().is_relative_to({str(ROOT)!r}))\n"
        "try:\n    import tests.test_tour\nexcept ModuleNotFoundError as err:\n"
        "    print(err)\nimport handformer\nprint(handformer.__name__)\n```\n",
        encoding="utf-8")
    (outcome,) = run_tour(tour).outcomes
    assert outcome.error is None, outcome.error
    assert outcome.actual.splitlines() == ["False", "No module named 'tests'", "handformer"]


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
    outcomes = run_tour(path).outcomes
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
    if len(sys.argv) == 4 and sys.argv[1] == "--run":  # run_tour's child
        sys.exit(_run_blocks(Path(sys.argv[2]), Path(sys.argv[3])))
    if len(sys.argv) < 3 or sys.argv[1] != "--update":
        sys.exit("usage: python tests/test_tour.py --update docs/tour.md [docs/tour.zh.md]")
    for name in sys.argv[2:]:
        t0 = time.perf_counter()
        update(Path(name).resolve())
        print(f"{name}: {time.perf_counter() - t0:.1f} s")
