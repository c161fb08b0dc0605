"""The README is a test: every shell and Python block of README.md, then README.zh.md, run as
a new user runs it — on a fresh clone, in order, exactly as printed.

    python tests/readme_check.py            # what CI runs beside pytest (minutes, not collected)
    python tests/readme_check.py --list     # the plan: what runs, what is skipped and why

The run happens in a temporary folder: a ``git clone`` of this repository's HEAD (commit
before you check: uncommitted files are not part of a fresh clone) and, beside it, a venv
made with ``--system-site-packages`` whose ``bin`` comes first on PATH for every command. So
the Quick start's ``pip install -r requirements.txt`` (which holds ``-e .``) installs the
clone into that venv only, everything else being satisfied from the system's site-packages,
and ``handformer`` runs the clone's code. The system's own environment is fingerprinted
before and after, and a change fails the run.

Blocks: ```` ```bash ````, ```` ```sh ```` and ```` ```shell ```` blocks run in bash, one
command per line as printed (``\\`` continues a line; comment lines are not commands), each
with ``bash -e``, from the clone's root. ```` ```python ```` blocks run whole with ``python
-``. Blocks with no language, ```` ```text ```` or ```` ```console ```` are output samples,
not commands. A README.zh.md command identical to a README.md one (comments aside) is
covered by it and is not run twice; every other README.zh.md command runs too.

Markers are HTML comments on the lines right before a block (GitHub does not show them), one
per line, ``<!-- readme-check: KIND[ TARGETS]: VALUE -->``. TARGETS are the block's command
numbers (``2``, ``1,3``, ``2-4``; 1-based, comment lines not counted); without them a marker
applies to every command of the block.

    skip      the command cannot run here; VALUE says why (required)
    expect    a regular expression stdout must match (re.search, multiline)
    stderr    a regular expression stderr must match
    exit      the exit status the command must end with (default 0), for a refusal shown
    timeout   seconds before the command is stopped and failed (default 600, or --timeout)
    stdin     text fed to the command's stdin (``\\n`` for a newline; default: nothing)
    setup     a shell command run first, for a file the README assumes the user has
    after     a shell command run after it, which must succeed: a check of what it wrote
    same      ``same 3: 2`` — command 3 prints what command 2 printed (the README's "the same")
    same-end  ``same-end 8: 3`` — command 3's output ends with what command 8 prints, which is
              not empty (the same continuation, printed without its prompt)
    serve     a URL: the command is a server; it must answer the URL, then Ctrl-C must stop
              it with exit 0

The run prints one line per command and ends with the skipped commands and their reasons,
then ``N passed, M failed, K skipped`` alone on the last line; it exits 1 if anything failed.
tests/test_readme_blocks.py checks, in seconds, that both READMEs parse and every marker is
well-formed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READMES = ("README.md", "README.zh.md")
SHELL_LANGS = frozenset({"bash", "sh", "shell"})
PYTHON_LANGS = frozenset({"python"})
OUTPUT_LANGS = frozenset({"", "text", "console"})
KINDS = ("skip", "expect", "stderr", "exit", "timeout", "stdin", "setup", "after", "same",
         "same-end", "serve")
NEEDS_TARGETS = frozenset({"same", "same-end", "serve"})
DEFAULT_TIMEOUT_S = 600.0
SERVE_WAIT_S = 120.0

FENCE = re.compile(r"^```\s*([\w.+-]*)\s*$")
MARKER_START = "<!-- readme-check"
MARKER = re.compile(r"^<!-- readme-check: ([a-z-]+)((?: [0-9,-]+)?): (.*?) -->$")


class ReadmeError(ValueError):
    """A README block or marker this checker cannot read: the message names file and line."""


@dataclass
class Marker:
    kind: str
    targets: tuple[int, ...] | None  # None: every command of the block
    value: str
    line: int


@dataclass
class Command:
    source: str  # "README.md"
    line: int  # 1-based line of the command's first line in the README
    number: int  # 1-based position in its block
    text: str  # as printed (continuations kept), or a python block's whole body
    lang: str  # "shell" or "python"
    block: int  # 1-based line of its block's opening fence
    markers: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"

    @property
    def key(self) -> str:
        """The command with comments dropped and spaces collapsed: what makes two the same."""
        if self.lang == "python":
            return "python\n" + self.text.strip()
        return " ".join(strip_comment(self.text.replace("\\\n", " ")).split())

    @property
    def shown(self) -> str:
        return " ".join(self.text.split())


@dataclass
class Block:
    source: str
    line: int  # 1-based line of the opening fence
    lang: str
    body: str
    markers: list[Marker]
    commands: list[Command]


def strip_comment(line: str) -> str:
    """``line`` without a trailing shell comment: a ``#`` that starts a word outside quotes."""
    quote, escaped = "", False
    for i, ch in enumerate(line):
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _targets(raw: str, where: str) -> tuple[int, ...] | None:
    raw = raw.strip()
    if not raw:
        return None
    numbers: list[int] = []
    for part in raw.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ReadmeError(f"{where}: marker targets must be numbers like 2, 1,3 or 2-4; "
                              f"got {raw!r}")
        first, last = int(lo), int(hi or lo)
        if first < 1 or last < first:
            raise ReadmeError(f"{where}: marker targets must count from 1 upwards; got {raw!r}")
        numbers.extend(range(first, last + 1))
    return tuple(numbers)


def parse_marker(line: str, where: str) -> Marker:
    m = MARKER.match(line.strip())
    if m is None:
        raise ReadmeError(f"{where}: a readme-check marker reads "
                          f"'<!-- readme-check: KIND[ TARGETS]: VALUE -->'; got {line.strip()!r}")
    kind, targets, value = m.group(1), _targets(m.group(2), where), m.group(3).strip()
    if kind not in KINDS:
        raise ReadmeError(f"{where}: unknown readme-check marker {kind!r}; "
                          f"expected one of {', '.join(KINDS)}")
    if not value:
        raise ReadmeError(f"{where}: the {kind!r} marker needs a value"
                          + (" (the reason it cannot run here)" if kind == "skip" else ""))
    if kind in NEEDS_TARGETS and targets is None:
        raise ReadmeError(f"{where}: the {kind!r} marker names its command ('{kind} 3: ...')")
    if kind in ("exit", "timeout", "same", "same-end"):
        try:
            number = float(value) if kind == "timeout" else int(value)
        except ValueError:
            raise ReadmeError(f"{where}: the {kind!r} marker's value must be a number; "
                              f"got {value!r}") from None
        if number <= 0 and kind != "exit":
            raise ReadmeError(f"{where}: the {kind!r} marker's value must be > 0; got {value!r}")
    if kind in ("expect", "stderr"):
        try:
            re.compile(value)
        except re.error as e:
            raise ReadmeError(f"{where}: the {kind!r} marker's regular expression: {e}") from None
    return Marker(kind, targets, value, int(where.rsplit(":", 1)[1]))


def split_shell(body: str, source: str, fence: int) -> list[Command]:
    """One command per line; a line ending in a backslash continues on the next. Blank and
    comment-only lines are not commands."""
    commands: list[Command] = []
    lines = body.split("\n")
    i = 0
    while i < len(lines):
        if not lines[i].strip() or lines[i].lstrip().startswith("#"):
            i += 1
            continue
        start, parts = i, [lines[i]]
        while parts[-1].rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            parts.append(lines[i])
        if parts[-1].rstrip().endswith("\\"):
            raise ReadmeError(f"{source}:{fence + 1 + i}: the block ends inside a "
                              "continued line")
        commands.append(Command(source, fence + 1 + start, len(commands) + 1,
                                "\n".join(parts), "shell", fence))
        i += 1
    return commands


def _attach(block: Block) -> None:
    """Give each command the markers that target it; refuse markers that target nothing."""
    for marker in block.markers:
        where = f"{block.source}:{marker.line}"
        if not block.commands:
            raise ReadmeError(f"{where}: a readme-check marker before a block that holds no "
                              f"command ({block.lang or 'no language'})")
        targets = marker.targets or tuple(c.number for c in block.commands)
        for t in targets:
            if t > len(block.commands):
                raise ReadmeError(f"{where}: marker for command {t}; the block at line "
                                  f"{block.line} has {len(block.commands)}")
            command = block.commands[t - 1]
            if marker.kind in command.markers:
                raise ReadmeError(f"{where}: a second {marker.kind!r} marker for command {t}")
            if marker.kind in ("same", "same-end"):
                other = int(marker.value)
                if not 1 <= other < t:
                    raise ReadmeError(f"{where}: '{marker.kind} {t}: {other}' must name an "
                                      "earlier command of the block")
            command.markers[marker.kind] = marker.value
    for command in block.commands:
        if "skip" in command.markers and len(command.markers) > 1:
            others = sorted(set(command.markers) - {"skip"})
            raise ReadmeError(f"{command.where}: a skipped command with other markers "
                              f"({', '.join(others)}): they would never be checked")
        if command.lang == "python" and "stdin" in command.markers:
            raise ReadmeError(f"{command.where}: a python block reads its code from stdin; "
                              "'stdin' does not apply")
        if "serve" in command.markers and "exit" in command.markers:
            raise ReadmeError(f"{command.where}: a served command is stopped with Ctrl-C and "
                              "must exit 0; 'exit' does not apply")


def parse_readme(text: str, source: str) -> list[Block]:
    """The fenced blocks of one README, in order, with their markers and commands."""
    blocks: list[Block] = []
    pending: list[Marker] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        where = f"{source}:{i + 1}"
        if line.strip().startswith(MARKER_START):
            pending.append(parse_marker(line, where))
            i += 1
            continue
        m = FENCE.match(line)
        if m is None:
            if pending:
                raise ReadmeError(f"{source}:{pending[0].line}: readme-check markers must sit "
                                  "on the lines right before a code block's opening fence")
            i += 1
            continue
        start, lang = i, m.group(1).lower()
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ReadmeError(f"{source}:{start + 1}: a code fence opened here is never closed")
        text_body = "\n".join(body)
        if lang in SHELL_LANGS:
            commands = split_shell(text_body, source, start + 1)
        elif lang in PYTHON_LANGS:
            commands = [Command(source, start + 2, 1, text_body + "\n", "python", start + 1)]
        elif lang in OUTPUT_LANGS:
            commands = []
        else:
            raise ReadmeError(f"{source}:{start + 1}: a ```{lang} block: the checker runs "
                              f"{'/'.join(sorted(SHELL_LANGS | PYTHON_LANGS))} and reads "
                              "blocks without a language (or text, console) as output")
        block = Block(source, start + 1, lang, text_body, pending, commands)
        _attach(block)
        blocks.append(block)
        pending = []
        i += 1
    if pending:
        raise ReadmeError(f"{source}:{pending[0].line}: readme-check markers at the end of the "
                          "file, before no code block")
    return blocks


@dataclass
class Step:
    """One command of the plan, and what becomes of it."""

    command: Command
    skip: str | None = None  # the reason, for a skipped command
    covered_by: Step | None = None  # an identical README.md command
    status: str = "pending"  # pending, passed, failed, skipped, covered
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    stdout: str = ""
    ended_as_expected: bool = False  # ran and exited as it should (its own checks aside)


def plan(root: Path) -> list[Step]:
    """Every command of README.md, then README.zh.md, in order; a README.zh.md command that
    is the same as a README.md one is covered by it."""
    steps: list[Step] = []
    first_by_key: dict[str, Step] = {}
    for name in READMES:
        for block in parse_readme((root / name).read_text(encoding="utf-8"), name):
            for command in block.commands:
                step = Step(command, skip=command.markers.get("skip"))
                original = first_by_key.get(command.key)
                if name != READMES[0] and original is not None and not command.markers:
                    step.covered_by = original
                first_by_key.setdefault(command.key, step)
                steps.append(step)
    return steps


# -- running ----------------------------------------------------------------------------------
def _kill_group(proc: subprocess.Popen[str], sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: float,
         stdin: str = "") -> tuple[int | None, str, str]:
    """Run in its own process group; on timeout the whole group is killed (rc None), and so
    it is if the check itself is stopped (Ctrl-C, SIGTERM)."""
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        return None, out, err
    except BaseException:
        _kill_group(proc)
        proc.wait()
        raise
    return proc.returncode, out, err


def _serve(args: list[str], url: str, cwd: Path, env: dict[str, str],
           timeout: float) -> tuple[int | None, str, str, str | None]:
    """Start a server, wait until ``url`` answers 200, then Ctrl-C it (SIGINT to its group,
    as a terminal sends it). Returns rc, stdout, stderr and what went wrong, if anything."""
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    problem: str | None = f"{url} did not answer within {min(timeout, SERVE_WAIT_S):.0f} s"
    deadline = time.monotonic() + min(timeout, SERVE_WAIT_S)
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:  # a local server
                    if response.status == 200:
                        problem = None
                        break
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        if proc.poll() is not None and problem is not None:
            problem = f"the server ended (exit {proc.returncode}) before {url} answered"
        _kill_group(proc, signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            return None, out, err, (problem or "Ctrl-C did not stop it within 30 s")
    except BaseException:
        _kill_group(proc)
        proc.wait()
        raise
    return proc.returncode, out, err, problem


def _tail(text: str, lines: int = 15) -> str:
    kept = [line[-300:] for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def _compare(kind: str, out: str, other: Step | None, number: str) -> list[str]:
    """The ``same`` and ``same-end`` checks against an earlier command's stdout."""
    if other is None or not other.ended_as_expected:
        return [f"command {number} of the block, whose output this one must repeat, did not "
                "run to its end"]
    mine, theirs = out.rstrip("\n"), other.stdout.rstrip("\n")
    agrees = mine == theirs if kind == "same" else bool(mine) and theirs.endswith(mine)
    if agrees:
        return []
    relation = "the same text as" if kind == "same" else "the end of what was printed by"
    return [f"should print {relation} command {number} of the block:\n"
            f"  this:  {mine[:300]!r}\n  there: {theirs[:300]!r}"]


def execute(step: Step, cwd: Path, env: dict[str, str], earlier: dict[int, Step],
            default_timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Run one command and check what its markers say about the result."""
    command, marks = step.command, step.command.markers
    timeout = float(marks.get("timeout", default_timeout))
    started = time.monotonic()
    problems: list[str] = []
    if "setup" in marks:
        rc, out, err = _run(["bash", "-e", "-c", marks["setup"]], cwd, env, timeout)
        if rc != 0:
            problems.append(f"setup `{marks['setup']}` ended with {rc}\n{_tail(out + err)}")
    if not problems:
        args = (["python", "-"] if command.lang == "python"
                else ["bash", "-e", "-c", command.text])
        stdin = command.text if command.lang == "python" else \
            marks.get("stdin", "").replace("\\n", "\n")
        if "serve" in marks:
            rc, out, err, trouble = _serve(args, marks["serve"], cwd, env, timeout)
            if trouble:
                problems.append(trouble)
        else:
            rc, out, err = _run(args, cwd, env, timeout, stdin)
        want = int(marks.get("exit", 0))
        if rc is None:
            problems.append(f"still running after {timeout:g} s (the 'timeout' marker "
                            "raises the limit)")
        elif rc != want:
            problems.append(f"exit {rc}, expected {want}")
        step.ended_as_expected = not problems
        if "expect" in marks and not re.search(marks["expect"], out, re.M):
            problems.append(f"stdout does not match {marks['expect']!r}")
        if "stderr" in marks and not re.search(marks["stderr"], err, re.M):
            problems.append(f"stderr does not match {marks['stderr']!r}")
        for kind in ("same", "same-end"):
            if kind in marks:
                problems += _compare(kind, out, earlier.get(int(marks[kind])), marks[kind])
        if problems:
            problems.append(_tail(f"{out}\n--- stderr ---\n{err}" if err.strip() else out))
        elif "after" in marks:
            rc2, out2, err2 = _run(["bash", "-e", "-c", marks["after"]], cwd, env, timeout)
            if rc2 != 0:
                problems.append(f"the check after it, `{marks['after']}`, ended with {rc2}\n"
                                f"{_tail(out2 + err2)}")
        step.stdout = out
    step.seconds = time.monotonic() - started
    step.problems = problems
    step.status = "failed" if problems else "passed"


def run_steps(steps: list[Step], cwd: Path, env: dict[str, str],
              say: Callable[[str], None] = print,
              timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Run the plan in order, one line per command as it ends."""
    blocks: dict[tuple[str, int], dict[int, Step]] = {}
    for step in steps:
        command = step.command
        earlier = blocks.setdefault((command.source, command.block), {})
        if step.covered_by is not None:
            step.status = "covered"
            say(f"SAME  {command.where}  {command.shown[:100]}  (= {step.covered_by.command.where}"
                f", {step.covered_by.status})")
        elif step.skip is not None:
            step.status = "skipped"
            say(f"SKIP  {command.where}  {command.shown[:100]}  ({step.skip})")
        else:
            execute(step, cwd, env, earlier, timeout)
            say(f"{'PASS' if step.status == 'passed' else 'FAIL'}  {command.where}  "
                f"{step.seconds:6.1f} s  {command.shown[:100]}")
            for problem in step.problems:
                say("      " + problem.replace("\n", "\n      "))
        earlier[command.number] = step


def summary(steps: Iterable[Step], extra_failures: int = 0) -> list[str]:
    """The closing lines: each skip with its reason, what was covered, what failed, and the
    count line (``extra_failures``: checks of the run itself, such as the environment's)."""
    steps = list(steps)
    by = {s: [x for x in steps if x.status == s] for s in
          ("passed", "failed", "skipped", "covered")}
    lines: list[str] = []
    if by["skipped"]:
        lines.append(f"skipped ({len(by['skipped'])}):")
        lines += [f"  {s.command.where}  {s.command.shown[:90]}\n      why: {s.skip}"
                  for s in by["skipped"]]
    if by["covered"]:
        lines.append(f"covered by the same README.md command, not run twice "
                     f"({len(by['covered'])}): " + ", ".join(
                         f"{s.command.where} = {s.covered_by.command.where}"
                         for s in by["covered"] if s.covered_by is not None))
    if by["failed"]:
        lines.append(f"failed ({len(by['failed'])}): "
                     + ", ".join(s.command.where for s in by["failed"]))
    lines.append(f"{len(by['passed'])} passed, {len(by['failed']) + extra_failures} failed, "
                 f"{len(by['skipped'])} skipped")
    return lines


# -- the fresh clone --------------------------------------------------------------------------
FINGERPRINT = """
import importlib.metadata as m, json
try:
    import handformer; where = handformer.__file__
except ImportError:
    where = None
print(json.dumps({"handformer": where, "distributions": sorted(
    f"{d.metadata['Name']}=={d.version}@{d.locate_file('')}" for d in m.distributions())}))
"""


def system_fingerprint(env: dict[str, str]) -> str:
    """What the system's Python sees: where ``import handformer`` leads, and every installed
    distribution with its version and location."""
    clean = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", FINGERPRINT], cwd="/", env=clean,
                          capture_output=True, text=True, check=True).stdout


def prepare(tmp: Path, say: Callable[[str], None]) -> tuple[Path, dict[str, str]]:
    """A fresh clone of HEAD and a venv beside it; the environment every command runs in."""
    found = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                           text=True)
    if found.returncode != 0:
        raise ReadmeError(f"{ROOT} is not a git checkout with a commit: the check runs on a "
                          f"fresh clone of HEAD ({found.stderr.strip()})")
    head = found.stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout
    if dirty.strip():
        say("note: uncommitted changes are not part of the fresh clone and are not checked")
    clone = tmp / "handformer"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "checkout", "--quiet", "--detach", head], cwd=clone, check=True)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    say(f"readme check: a fresh clone of {head[:7]} in {clone}, a venv (system site-packages) "
        f"in {venv}")
    return clone, env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the plan and run nothing")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds a command without a 'timeout' marker may take "
                        f"(default {DEFAULT_TIMEOUT_S:.0f})")
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error(f"--timeout must be > 0; got {args.timeout}")
    try:
        steps = plan(ROOT)
    except ReadmeError as e:
        print(f"readme check: {e}", file=sys.stderr)
        return 1
    if args.list:
        for step in steps:
            what = ("skip: " + step.skip if step.skip is not None else
                    f"same as {step.covered_by.command.where}" if step.covered_by else "run")
            print(f"{step.command.where}  {step.command.shown[:90]}  [{what}]")
        return 0
    # SIGTERM (a CI runner giving up) unwinds like Ctrl-C: the running command's process
    # group is killed and the temporary folder removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # .ci/run starts this check in the background, which a shell without job control does
    # with Ctrl-C ignored, inherited by every command: the servers it stops with Ctrl-C would
    # not stop. A Python handler here is reset to the default in each child at exec.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.monotonic()
    before = system_fingerprint(dict(os.environ))
    tmp = Path(tempfile.mkdtemp(prefix="readme-check-"))
    try:
        clone, env = prepare(tmp, print)
        sys.stdout.flush()
        run_steps(steps, clone, env, lambda line: print(line, flush=True), args.timeout)
    except ReadmeError as e:
        print(f"readme check: {e}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    after = system_fingerprint(dict(os.environ))
    changed = after != before
    if changed:
        old, new = ({*json.loads(x)["distributions"], f"handformer: {json.loads(x)['handformer']}"}
                    for x in (before, after))
        print("FAIL  the system's Python environment changed during the run: "
              f"gone {sorted(old - new)}, new {sorted(new - old)}")
    else:
        print(f"the system's Python environment is unchanged (handformer from "
              f"{json.loads(after)['handformer']})")
    print(f"readme check took {time.monotonic() - started:.0f} s")
    print("\n".join(summary(steps, extra_failures=int(changed))))
    return 1 if changed or any(s.status == "failed" for s in steps) else 0


if __name__ == "__main__":
    raise SystemExit(main())
