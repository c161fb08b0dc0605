"""Make Jupyter notebooks of the tour and the build track, in both languages, from their
Markdown: the .md files are the one source, the notebooks are generated (never edited).

    pip install 'handformer[notebook]'
    python docs/make_notebooks.py                # → notebooks/*.ipynb at the repository root
    python docs/make_notebooks.py --out DIR      # somewhere else
    jupyter lab notebooks/build.ipynb            # (jupyterlab itself is not in the extra)

jupytext reads each document: every ```python block becomes a code cell, the prose around it
markdown. Then, for a notebook:

* the ```text block under a code cell (what it must print) leaves the markdown; it is kept in
  the cell's metadata (``handformer.expected_output``), which tests/test_notebooks.py compares
  with what the executed cell prints; so does the ``<!-- output varies by CPU: ... -->`` line
  right above it, if any (``handformer.output_varies``: how loosely; tests/test_tour.py
  reads it);
* a solution folded in ``<details>`` becomes a code cell whose source is hidden (JupyterLab's
  ``jupyter.source_hidden``): click to unfold it;
* shell blocks (```bash) stay markdown: they are commands to read, not to run from here;
* the first cell changes to the repository root, where the snippets expect to run (they read
  ``docs/img/*.json``), and links are rewritten to work from ``notebooks/``.

The notebooks land in ``notebooks/`` (ignored by git) or ``--out``: a folder this script made,
or one holding only notebooks it wrote; anything else is refused rather than overwritten.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("tour.md", "tour.zh.md", "build.md", "build.zh.md")
DEFAULT_OUT = ROOT / "notebooks"
COMMAND = "python docs/make_notebooks.py"
MARK = "handformer"  # the metadata key of this script's notebooks and cells

# The line right above a ```text block that says how loosely its output is compared; the
# tour's test (tests/test_tour.py) reads its clauses with this same pattern.
VARIES = re.compile(r"<!-- output varies by CPU: (.+?) -->")
TEXT_BLOCK = re.compile(rf"\A(?:{VARIES.pattern}\n+)?```text\n(.*?)\n```\n*", re.S)
LINK = re.compile(r"(\]\()([^)\s]+)(\))")
SETUP = ("# The snippets run from the repository root (they read docs/img/*.json):\n"
         "import os\n\nos.chdir(\"..\")")


def notebook_name(doc: str) -> str:
    return doc.replace(".zh.md", ".zh.ipynb").replace(".md", ".ipynb")


def _relink(markdown: str) -> str:
    """Links written from docs/ made to work from a sibling folder (notebooks/)."""
    def fix(m: re.Match) -> str:
        target = m.group(2)
        if re.match(r"^[a-z]+:|^#|^\.\./", target):
            return m.group(0)
        return f"{m.group(1)}../docs/{target}{m.group(3)}"
    return LINK.sub(fix, markdown)


def convert(markdown: str):
    """One document's Markdown → an nbformat notebook (see the module docstring)."""
    import jupytext
    import nbformat

    nb = jupytext.reads(markdown, fmt="md")
    cells = [nbformat.v4.new_code_cell(SETUP, metadata={MARK: {"setup": True}})]
    folded = False
    for cell in nb.cells:
        source = cell.source
        if cell.cell_type == "code" and source.startswith("%%bash\n"):
            cell = nbformat.v4.new_markdown_cell("```bash\n" + source[len("%%bash\n"):] + "\n```")
            source = cell.source
        if cell.cell_type == "markdown":
            m = TEXT_BLOCK.match(source)
            if m and cells and cells[-1].cell_type == "code":
                mine = cells[-1].metadata.setdefault(MARK, {})
                mine["expected_output"] = m.group(2) + "\n"
                if m.group(1) is not None:
                    mine["output_varies"] = m.group(1)
                source = source[m.end():]
            if "<details>" in source:
                folded = True
            if "</details>" in source:
                folded = False
            source = re.sub(r"<details>\s*<summary>(.*?)</summary>",
                            r"**\1** (the next cell is folded: click to show it)", source,
                            flags=re.S)
            source = _relink(source.replace("</details>", "")).strip()
            if source:
                cells.append(nbformat.v4.new_markdown_cell(source))
            continue
        metadata = {MARK: {}}
        if folded:
            metadata["jupyter"] = {"source_hidden": True}
        cells.append(nbformat.v4.new_code_cell(source, metadata=metadata))
    out = nbformat.v4.new_notebook(cells=cells)
    out.metadata = {MARK: {"generated_by": COMMAND},
                    "kernelspec": {"name": "python3", "display_name": "Python 3",
                                   "language": "python"},
                    "language_info": {"name": "python"}}
    return out


def _claim(out: Path) -> None:
    """Refuse a folder holding anything this script did not write."""
    if not out.exists():
        out.mkdir(parents=True)
        return
    foreign = sorted(p.name for p in out.iterdir()
                     if p.name not in {notebook_name(d) for d in DOCS})
    if foreign:
        raise SystemExit(f"{out} holds files this script did not write ({foreign[:3]}); "
                         "pass an empty or new folder with --out")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    try:
        import nbformat
    except ImportError:
        raise SystemExit("the notebooks need jupytext and nbformat: "
                         "pip install 'handformer[notebook]'") from None
    _claim(args.out)
    for doc in DOCS:
        nb = convert((ROOT / "docs" / doc).read_text(encoding="utf-8"))
        path = args.out / notebook_name(doc)
        nbformat.write(nb, str(path))
        print(f"{path} ({sum(c.cell_type == 'code' for c in nb.cells)} code cells)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
