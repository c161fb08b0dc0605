"""The build track runs as a reader runs it: every ```python block of docs/build.md and
docs/build.zh.md is executed in order, in one fresh Python process started in an empty folder
outside the repository, and must print the ```text block under it (the harness of
tests/test_tour.py, which also checks the links, the output blocks, the pictures and that
both languages keep the same code and figures).

To refresh the expected output after changing a snippet::

    python tests/test_tour.py --update docs/build.md docs/build.zh.md
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_tour import (
    ROOT,
    RUNAWAY_CPU_S,
    check_links,
    code_shape,
    describe_failures,
    figure_drift,
    load_make_pictures,
    orphan_outputs,
    parse_blocks,
    run_tour,
    shown_pictures,
)

BUILD = [ROOT / "docs" / "build.md", ROOT / "docs" / "build.zh.md"]
IDS = [p.name for p in BUILD]


@pytest.mark.slow
def test_every_snippet_of_the_build_track_runs_and_prints_what_it_shows() -> None:
    """The English track is run; the Chinese one has the same code (see below) and must show
    the same outputs, so running it again would only repeat this (its notebook is executed in
    tests/test_notebooks.py)."""
    doc = BUILD[0]
    run = run_tour(doc)
    problems = describe_failures(doc, run.outcomes)
    assert run.outcomes, f"{doc} has no python blocks"
    assert not problems, "\n\n".join(problems)
    assert run.cpu_seconds < RUNAWAY_CPU_S["build"], (
        f"{doc.name} took {run.cpu_seconds:.1f} s of CPU; a snippet ran away")


@pytest.mark.parametrize("doc", BUILD, ids=IDS)
def test_links_output_blocks_and_pictures_of_the_build_track(doc: Path) -> None:
    assert not check_links(doc), "\n".join(check_links(doc))
    text = doc.read_text(encoding="utf-8")
    assert not orphan_outputs(doc, parse_blocks(text)), orphan_outputs(doc, parse_blocks(text))
    make_pictures = load_make_pictures()
    drawn = {f: p for p in make_pictures.PICTURES for f in p.files}
    for target in shown_pictures(doc):
        name = Path(target).name
        assert name in drawn and (make_pictures.IMG / name).is_file(), target
        if not drawn[name].quick:
            assert f"{make_pictures.COMMAND} {drawn[name].name}" in text


def test_the_reader_writes_every_piece_no_library_layer_goes_into_the_model() -> None:
    """From handformer the track imports the built-in text and the checkers only."""
    for doc in BUILD:
        imports = re.findall(r"^\s*(?:from|import) (handformer[\w.]*)", doc.read_text("utf-8"),
                             re.M)
        assert set(imports) == {"handformer", "handformer.data.corpora"}, (doc.name, imports)
        assert re.findall(r"^from handformer import (.+)$", doc.read_text("utf-8"), re.M) == [
            "learn"]


def test_both_languages_walk_the_same_track() -> None:
    english, chinese = (d.read_text(encoding="utf-8") for d in BUILD)
    heading = re.compile(r"^## (\d+)\.", re.M)
    assert heading.findall(english) == heading.findall(chinese)
    en, zh = ([code_shape(b.body) for b in parse_blocks(t) if b.lang == "python"]
              for t in (english, chinese))
    assert en == zh, "the python blocks differ between build.md and build.zh.md"
    outputs = [[b.body for b in parse_blocks(t) if b.lang == "text"] for t in (english, chinese)]
    assert outputs[0] == outputs[1], "the output blocks differ between build.md and build.zh.md"
    assert not figure_drift(english, chinese), figure_drift(english, chinese)
