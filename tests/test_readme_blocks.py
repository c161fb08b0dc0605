"""The README check's rules, in seconds: both READMEs parse, every block is a command or an
output sample, every marker is well-formed and every skip says why — so a README edit that
the minutes-long ``python tests/readme_check.py`` (run by .ci/run) would trip on fails here
first. The runner itself is tested on small READMEs of its own."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from tests.readme_check import (
    READMES,
    ROOT,
    ReadmeError,
    _run,
    parse_readme,
    plan,
    run_steps,
    strip_comment,
    summary,
)


def test_both_readmes_parse_and_every_command_runs_is_skipped_or_covered() -> None:
    steps = plan(ROOT)
    assert {s.command.source for s in steps} == set(READMES)
    ran = [s for s in steps if s.skip is None and s.covered_by is None]
    assert len(ran) >= 20, "most README commands are cheap and must run"
    for step in steps:
        if step.covered_by is not None:
            assert step.command.source == "README.zh.md"
            assert step.covered_by.command.source == "README.md"
            assert step.covered_by.command.key == step.command.key


def test_every_skip_says_why() -> None:
    for step in plan(ROOT):
        if step.skip is not None:
            assert len(step.skip.split()) >= 3, f"{step.command.where}: skip reason {step.skip!r}"


def test_the_quick_start_train_line_runs_literally() -> None:
    first = plan(ROOT)[0].command
    assert first.source == "README.md" and first.number == 1
    assert strip_comment(first.text) == "pip install -r requirements.txt && handformer train"
    # Checks of its result only: nothing that prepares, feeds or skips it.
    assert set(first.markers) <= {"after", "expect", "stderr", "timeout"}, first.markers


def test_a_quick_start_line_left_to_ci_says_so_and_ci_runs_it_and_the_check() -> None:
    second = plan(ROOT)[1]
    assert strip_comment(second.command.text).endswith("&& pytest")
    assert second.skip is not None and ".ci/run" in second.skip
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    # The check runs beside the suite (one core each), started after the same installs.
    check = [i for i, line in enumerate(ci) if "python tests/readme_check.py" in line]
    installs = [i for i, line in enumerate(ci) if line.startswith("python -m pip install")]
    assert check and "pytest" in ci and installs and installs[-1] < check[0]


@pytest.mark.parametrize(("text", "message"), [
    ("<!-- readme-check: skipp: typo -->\n```bash\ntrue\n```\n", "unknown readme-check marker"),
    ("<!-- readme-check: skip: -->\n```bash\ntrue\n```\n", "marker reads"),
    ("<!-- readme-check: skip 2: one command only -->\n```bash\ntrue\n```\n", "has 1"),
    ("<!-- readme-check: skip: why -->\n\n```bash\ntrue\n```\n", "right before"),
    ("<!-- readme-check: skip: why -->\n", "end of the file"),
    ("<!-- readme-check: expect: x -->\n```\noutput\n```\n", "holds no command"),
    ("<!-- readme-check: same: 1 -->\n```bash\ntrue\ntrue\n```\n", "names its command"),
    ("<!-- readme-check: same 1: 2 -->\n```bash\ntrue\ntrue\n```\n", "earlier command"),
    ("<!-- readme-check: expect: ( -->\n```bash\ntrue\n```\n", "regular expression"),
    ("<!-- readme-check: exit: one -->\n```bash\ntrue\n```\n", "must be a number"),
    ("<!-- readme-check: timeout: 0 -->\n```bash\ntrue\n```\n", "must be > 0"),
    ("<!-- readme-check: skip: why so -->\n<!-- readme-check: expect: x -->\n```bash\ntrue\n```\n",
     "never be checked"),
    ("<!-- readme-check: skip: a -->\n<!-- readme-check: skip: b -->\n```bash\ntrue\n```\n",
     "second 'skip'"),
    ("<!-- readme-check: stdin: x -->\n```python\nprint(1)\n```\n", "does not apply"),
    ("<!-- readme-check skip: no colon -->\n```bash\ntrue\n```\n", "marker reads"),
    ("```toml\nx = 1\n```\n", "a ```toml block"),
    ("```bash\ntrue\n", "never closed"),
    ("```bash\necho a \\\n```\n", "inside a continued line"),
])
def test_malformed_markers_and_blocks_are_refused_by_line(text: str, message: str) -> None:
    with pytest.raises(ReadmeError, match="README.md:[0-9]+: .*" if message else None) as info:
        parse_readme(text, "README.md")
    assert message in str(info.value)


def test_commands_split_by_line_with_continuations_and_comments() -> None:
    text = ("<!-- readme-check: skip 2: needs two machines -->\n"
            "```bash\n# a comment line\necho 'a # b' \"c # d\"   # a comment\n"
            "torchrun --nnodes=2 \\\n    -m handformer train\n\npytest\n```\n")
    (block,) = parse_readme(text, "README.md")
    assert [(c.line, c.number) for c in block.commands] == [(4, 1), (5, 2), (8, 3)]
    first, second, _ = block.commands
    assert first.key == "echo 'a # b' \"c # d\""
    assert second.key == "torchrun --nnodes=2 -m handformer train"
    assert second.markers == {"skip": "needs two machines"}


def test_zh_commands_are_covered_by_identical_english_ones_and_others_run(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("```bash\necho one   # English\necho two\n```\n")
    (tmp_path / "README.zh.md").write_text(
        "```bash\necho one   # 中文\necho three\n```\n"
        "<!-- readme-check: expect: two -->\n```bash\necho two\n```\n")
    steps = plan(tmp_path)
    covered = [s.covered_by.command.where if s.covered_by else None for s in steps]
    # A zh command with markers of its own runs with them.
    assert covered == [None, None, "README.md:2", None, None]


def _runner_readme(port: int) -> str:
    return f"""
<!-- readme-check: expect 1: ^hello$ -->
<!-- readme-check: exit 2: 3 -->
<!-- readme-check: stdin 3: a\\nb -->
<!-- readme-check: same 4: 1 -->
<!-- readme-check: same-end 5: 1 -->
<!-- readme-check: setup 6: printf 'The \\nA \\n' > prompts.txt -->
<!-- readme-check: after 7: test -f prompts.txt -->
<!-- readme-check: skip 8: needs a GPU -->
```bash
echo hello
exit 3
cat   # reads stdin
echo hello
echo llo
cat prompts.txt
true
nvidia-smi
```

<!-- readme-check: expect: ^6$ -->
```python
print(2 * 3)
```

<!-- readme-check: serve 1: http://127.0.0.1:{port}/ -->
<!-- readme-check: timeout 5: 0.5 -->
<!-- readme-check: same 6: 1 -->
<!-- readme-check: same-end 7: 1 -->
<!-- readme-check: after 8: test -f never-written.txt -->
<!-- readme-check: same 9: 6 -->
<!-- readme-check: same 10: 3 -->
<!-- readme-check: stderr 11: ^bye$ -->
<!-- readme-check: expect 12: ^bye$ -->
```bash
"{sys.executable}" -m http.server {port} --bind 127.0.0.1
echo one
false
exit 1
sleep 30
echo two
echo ""
true
echo two
echo x
echo bye >&2
echo hi
```
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_runner_checks_what_the_markers_say(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text(_runner_readme(_free_port()))
    (tmp_path / "README.zh.md").write_text("```bash\necho hello\n```\n")
    steps = plan(tmp_path)
    said: list[str] = []
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run_steps(steps, tmp_path, env, said.append)
    status = [(s.command.line, s.status) for s in steps]
    assert status == [
        (11, "passed"), (12, "passed"), (13, "passed"), (14, "passed"), (15, "passed"),
        (16, "passed"), (17, "passed"), (18, "skipped"),
        (23, "passed"),
        (36, "passed"),  # the server answered, then stopped at Ctrl-C with exit 0
        (37, "passed"), (38, "failed"), (39, "failed"),
        (40, "failed"),  # the timeout
        (41, "failed"),  # other text than command 1
        (42, "failed"),  # empty: not a continuation
        (43, "failed"),  # the check after it
        (44, "passed"),  # command 6 ran to its end: only its own comparison failed
        (45, "failed"),  # command 3 did not
        (46, "passed"), (47, "failed"),  # stderr matches; stdout does not
        (2, "covered"),
    ], "\n".join(said)
    assert steps[2].stdout == "a\nb"
    problems = {s.command.line: " ".join(s.problems) for s in steps}
    assert "exit 1, expected 0" in problems[38]
    assert "still running after 0.5 s" in problems[40]
    assert "the same text as command 1" in problems[41]
    assert "the end of what was printed by command 1" in problems[42]
    assert "test -f never-written.txt" in problems[43]
    assert "stdout does not match '^bye$'" in problems[47]
    assert "command 3 of the block, whose output this one must repeat, did not run" in \
        problems[45]
    lines = summary(steps)
    assert lines[-1] == "12 passed, 8 failed, 1 skipped"
    assert "why: needs a GPU" in "\n".join(lines)
    assert "README.zh.md:2 = README.md:11" in "\n".join(lines)


def test_a_stopped_check_leaves_no_command_running(tmp_path: Path) -> None:
    """Ctrl-C (here an alarm raising in the middle of a command) kills the command's whole
    process group, a child it started in the background included."""
    pid_file = tmp_path / "pid"

    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            _run(["bash", "-c", f"echo $$ > {pid_file}; sleep 60 & sleep 60"], tmp_path,
                 dict(os.environ), timeout=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    group = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(group, signal.SIGKILL)
    pytest.fail("the command's process group outlived the stopped check")
