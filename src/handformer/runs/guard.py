"""Where a command may write: the rules every folder-writing command follows.

Files you did not write are not yours (DESIGN.md). A command that writes a folder (``train``,
``classify train``, ``seq2seq train``, ``convert``, ``bench``, ``doctor --pictures``,
``experiment length``) opens it with ``writing_folder(path, spec, overwrite=...)``:

* a missing or empty folder is created and claimed;
* a folder handformer wrote for the same kind of output is reused (an LM run whose newest
  checkpoint is unfinished is refused unless ``overwrite``: it is what ``--resume`` needs);
* anything else that is not empty — another tool's folder, another kind of handformer
  output, a checkpoint folder — is refused by name, and stays byte-identical; ``overwrite``
  lets the command write into it (never into a checkpoint), and even then it removes only
  what handformer wrote there: its own files by name, checkpoint folders it can recognise;
* an empty path string, or a file where the folder should be, is refused;
* the folder stays locked (``runs.lock``) until the block ends: a second writer fails at once.

**The marker.** A claimed folder carries ``.handformer.json``: which kind of output it is,
the command that wrote it, the file names that command writes, and the names that were
already there when ``overwrite`` claimed someone else's folder (those are never removed).
Why a file of its own rather than ``config.json``'s kind key: an unfinished LM run has no
``config.json`` yet (it is written at the end), a Hugging Face export's ``config.json`` is
Hugging Face's, benchmark results and doctor pictures have none, and another tool may well
write a ``config.json`` with a ``"model"`` key. The marker is written before anything else,
so even a run killed at its first step is recognised. Run folders written before the marker
existed are still recognised (``config.json`` whose model config parses, or committed
handformer checkpoints), so they can be replaced or resumed as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from handformer.atomic import atomic_write_text
from handformer.config import ClassifierConfig, ModelConfig, Seq2SeqConfig
from handformer.runs.files import (
    CONFIG,
    LABELS,
    METRICS,
    SUMMARY,
    TOKENIZER,
    WEIGHTS,
    RunFolderError,
    read_json,
)
from handformer.runs.folder import RUN_KINDS, run_kind
from handformer.runs.lock import LOCK_FILE, FolderLock, check_not_busy
from handformer.train.checkpoint import (
    MARKER as CHECKPOINT_MARKER,
)
from handformer.train.checkpoint import (
    CheckpointError,
    is_checkpoint_entry,
    list_checkpoints,
    read_checkpoint_json,
    remove_checkpoint_entry,
)

__all__ = [
    "CHECKPOINTS", "CLASSIFIER_FOLDER", "CONFUSION", "FOLDER_MARKER", "LM_FOLDER", "LOSS_CURVE",
    "RUN_FOLDERS", "SEQ2SEQ_FOLDER", "TENSORBOARD", "FolderSpec", "FolderState",
    "check_destination", "folder_path", "read_folder", "writing_folder",
]

FOLDER_MARKER = ".handformer.json"
_FORMAT, _VERSION = "handformer-folder", 1
CHECKPOINTS, TENSORBOARD, LOSS_CURVE, CONFUSION = (
    "checkpoints", "tensorboard", "loss_curve.png", "confusion.png")
_OURS = (FOLDER_MARKER, LOCK_FILE)  # never counted as content, never foreign
_SHOWN = 5  # entries named in a refusal


@dataclass(frozen=True)
class FolderSpec:
    """What one command writes into a folder.

    ``kind`` names the kind of output (folders of the same kind may replace each other);
    ``what`` and ``command`` are for messages; ``names`` are the files it writes, as names
    or ``fnmatch`` patterns, top-level or one folder down (``"tensorboard/events.*"``: such
    a folder is removed once empty); ``checkpoints`` is the subfolder of checkpoint folders
    (``train.checkpoint``), if any; ``resume`` is the command line that continues an
    unfinished run (``{path}`` filled in).
    """

    kind: str
    what: str
    command: str
    names: tuple[str, ...]
    checkpoints: str | None = None
    resume: str | None = None


LM_FOLDER = FolderSpec(
    "lm", "a language-model run", "handformer train",
    (WEIGHTS, CONFIG, TOKENIZER, METRICS, SUMMARY, LOSS_CURVE,
     f"{TENSORBOARD}/events.out.tfevents.*"),
    checkpoints=CHECKPOINTS, resume="handformer train --resume {path}")
CLASSIFIER_FOLDER = FolderSpec(
    "classifier", "a classifier run", "handformer classify train",
    (WEIGHTS, CONFIG, TOKENIZER, LABELS, METRICS, SUMMARY, CONFUSION))
SEQ2SEQ_FOLDER = FolderSpec(
    "seq2seq", "a seq2seq run", "handformer seq2seq train",
    (WEIGHTS, CONFIG, TOKENIZER, METRICS, SUMMARY))
# The run folders of ``runs.folder``, by its kind names (``load_run``'s ``kind``).
RUN_FOLDERS: dict[str, FolderSpec] = {s.kind: s for s in (LM_FOLDER, CLASSIFIER_FOLDER,
                                                          SEQ2SEQ_FOLDER)}
_CONFIG_CLASSES: dict[str, Any] = {"lm": ModelConfig, "classifier": ClassifierConfig,
                                   "seq2seq": Seq2SeqConfig}


@dataclass(frozen=True)
class FolderState:
    """A destination as found. ``entries``: its names besides handformer's marker and lock.
    ``spec``: what handformer wrote there (from the marker, or a run folder written before
    markers existed); None for a missing, empty or foreign folder. ``kept``: names that were
    there before handformer claimed the folder. ``checkpoint``: the folder is one checkpoint."""

    path: Path
    exists: bool
    entries: tuple[str, ...] = ()
    spec: FolderSpec | None = None
    kept: tuple[str, ...] = ()
    checkpoint: bool = False
    note: str = ""

    @property
    def empty(self) -> bool:
        """Missing, or holding nothing but handformer's marker and lock."""
        return not self.entries


def folder_path(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path; an empty (or blank) string is refused by name, since ``Path("")``
    would silently mean the current directory."""
    text = os.fspath(path)
    if not text.strip():
        raise ValueError(f"expected a folder path; got an empty path {text!r} (use '.' to "
                         "mean the current folder)")
    return Path(text)


# -- reading a destination ------------------------------------------------------------------
def _read_marker(folder: Path) -> tuple[FolderSpec | None, tuple[str, ...], str]:
    """(what the marker says was written, the kept names, a note if it is unreadable)."""
    try:
        data = json.loads((folder / FOLDER_MARKER).read_text(encoding="utf-8"))
        if data.get("format") != _FORMAT:
            raise ValueError(f"format {data.get('format')!r}")
        names = tuple(str(n) for n in data["names"])
        spec = FolderSpec(str(data["kind"]), str(data["what"]), str(data["command"]), names,
                          data.get("checkpoints"), data.get("resume"))
        return spec, tuple(str(n) for n in data.get("kept", ())), ""
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        return None, (), f"its {FOLDER_MARKER} is not handformer's or is damaged ({err})"


def _legacy_kind(folder: Path) -> str | None:
    """The run kind of a folder written before markers existed: ``config.json`` with a run
    kind's key, a training recipe and a model config that parses; or committed checkpoints."""
    config_path = folder / CONFIG
    if config_path.is_file():
        try:
            config = read_json(config_path)
            kind = run_kind(config, config_path)
            if "train" in config:
                _CONFIG_CLASSES[kind].from_dict(config[RUN_KINDS[kind][0]])
                return kind
        except (RunFolderError, KeyError, TypeError, ValueError):
            pass
    if list_checkpoints(folder / CHECKPOINTS):
        return "lm"
    return None


def read_folder(path: str | os.PathLike[str]) -> FolderState:
    """What is at ``path`` (reads only). A file there raises ``RunFolderError``."""
    folder = folder_path(path)
    if not folder.exists() and not folder.is_symlink():
        return FolderState(folder, exists=False)
    if not folder.is_dir():
        raise RunFolderError(f"{folder} exists and is not a folder; give a folder path (new, "
                             "empty, or one handformer wrote)")
    entries = tuple(sorted(n for n in os.listdir(folder) if n not in _OURS))
    if (folder / CHECKPOINT_MARKER).is_file():
        return FolderState(folder, True, entries, checkpoint=True)
    if (folder / FOLDER_MARKER).exists():
        spec, kept, note = _read_marker(folder)
        return FolderState(folder, True, entries, spec, kept, note=note)
    kind = _legacy_kind(folder) if entries else None
    return FolderState(folder, True, entries, None if kind is None else RUN_FOLDERS[kind])


def _unfinished_step(folder: Path, spec: FolderSpec) -> int | None:
    """The newest checkpoint's step if the run there did not finish; None otherwise."""
    if spec.checkpoints is None:
        return None
    found = list_checkpoints(folder / spec.checkpoints)
    if not found:
        return None
    try:
        meta = read_checkpoint_json(found[-1].path, "trainer_state.json", verify=False)
    except CheckpointError:
        return found[-1].step
    return None if meta.get("finished") is True else found[-1].step


def _listing(state: FolderState) -> str:
    shown = [n + ("/" if (state.path / n).is_dir() else "") for n in state.entries[:_SHOWN]]
    more = len(state.entries) - _SHOWN
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def check_destination(path: str | os.PathLike[str], spec: FolderSpec, *,
                      overwrite: bool = False) -> FolderState:
    """Refuse (``RunFolderError``; ``FolderBusyError`` while another process writes it) a
    destination ``spec``'s command may not write, without writing anything; otherwise
    return what is there. See the module docstring."""
    state = read_folder(path)
    if state.exists:
        check_not_busy(state.path)  # first: a run being written looks unfinished, and is not
    _refuse(state, spec, overwrite=overwrite)
    return state


def _refuse(state: FolderState, spec: FolderSpec, *, overwrite: bool) -> None:
    """The rules of ``check_destination``, on a folder already read."""
    folder, other = state.path, state.spec
    if state.checkpoint:
        raise RunFolderError(
            f"{folder} is a checkpoint folder of a run (it holds {CHECKPOINT_MARKER}); "
            f"`{spec.command}` never writes into one: give another folder")
    if state.empty:
        return
    if other is not None and other.kind == spec.kind:
        step = _unfinished_step(folder, other)
        if step is not None and not overwrite:
            hint = "" if other.resume is None else \
                f"continue it with `{other.resume.format(path=folder)}`, or "
            raise RunFolderError(
                f"{folder} holds an unfinished run (last checkpoint: step {step}); {hint}"
                "pass --overwrite to replace it")
        return
    if overwrite:
        return
    if other is not None:
        raise RunFolderError(
            f"{folder} holds {other.what} (written by `{other.command}`); `{spec.command}` "
            f"writes {spec.what}: give another folder, or pass --overwrite to replace it "
            "(only the files handformer wrote there are removed)")
    why = f" ({state.note})" if state.note else ""
    raise RunFolderError(
        f"{folder} is not empty and handformer did not write it{why}: it holds "
        f"{_listing(state)}. `{spec.command}` writes only into a new or empty folder or one "
        f"it wrote before: give another folder, or pass --overwrite to write into this one "
        "(files of the names it writes are replaced; nothing else is removed)")


# -- cleaning what handformer wrote, and only that --------------------------------------------
def _matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _remove_files(folder: Path, patterns: list[str], kept: frozenset[str]) -> None:
    """Remove the plain files (or links) in ``folder`` whose names match; atomic-write
    leftovers of those names (``.NAME.xxxx.tmp``) too."""
    leftovers = [f".{p}.*.tmp" for p in patterns]
    for entry in sorted(os.listdir(folder)):
        path = folder / entry
        if entry in kept or (path.is_dir() and not path.is_symlink()):
            continue
        if _matches(entry, patterns) or _matches(entry, leftovers):
            path.unlink(missing_ok=True)


def _rmdir_if_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not empty: something else lives there, and stays
        folder.rmdir()


def _clean(state: FolderState, spec: FolderSpec) -> None:
    """Before a fresh write: remove what handformer wrote into ``state.path`` earlier."""
    folder, owner = state.path, state.spec
    kept = frozenset(state.kept if owner is not None else state.entries)
    names = list(owner.names) if owner is not None else []
    top = [n for n in names if "/" not in n]
    _remove_files(folder, top, kept)
    for sub in sorted({n.split("/", 1)[0] for n in names if "/" in n} - kept):
        path = folder / sub
        if path.is_dir() and not path.is_symlink():
            _remove_files(path, [n.split("/", 1)[1] for n in names
                                 if n.startswith(sub + "/")], frozenset())
            _rmdir_if_empty(path)
    # Checkpoint folders prove who wrote them (a commit marker in handformer's format), so
    # they go even from a folder handformer did not claim: a fresh run must not resume them.
    for sub in {c for c in ((owner.checkpoints if owner else None), spec.checkpoints) if c}:
        path = folder / sub
        if not path.is_dir() or path.is_symlink():
            continue
        for entry in sorted(path.iterdir()):
            if is_checkpoint_entry(entry):
                remove_checkpoint_entry(entry)
        if sub not in kept:
            _rmdir_if_empty(path)


def _write_marker(state: FolderState, spec: FolderSpec) -> None:
    kept = state.kept if state.spec is not None else state.entries
    record = {"format": _FORMAT, "version": _VERSION, **dataclasses.asdict(spec),
              "names": list(spec.names), "kept": sorted(kept)}
    atomic_write_text(state.path / FOLDER_MARKER, json.dumps(record, indent=1))


@contextmanager
def writing_folder(path: str | os.PathLike[str], spec: FolderSpec, *,
                   overwrite: bool = False) -> Iterator[Path]:
    """Check, create, lock and claim ``path`` for a fresh write by ``spec``'s command; yield
    it as a Path. (To continue a run in place, hold its ``FolderLock`` instead.)

    Refusals (``RunFolderError``; ``FolderBusyError`` when another process holds the lock)
    come before anything is written. Then what handformer wrote there before is removed
    (its own files by name, its checkpoints; never anything else) and the marker written.
    The lock is held until the block ends. A folder this call created is removed again if
    the block fails before anything but the marker was written into it.
    """
    check_destination(path, spec, overwrite=overwrite)  # before creating anything
    folder = folder_path(path)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    lock = FolderLock(folder, command=spec.command).acquire()
    succeeded = False
    try:
        # Again under the lock: another writer may have claimed or filled it meanwhile.
        state = read_folder(folder)
        _refuse(state, spec, overwrite=overwrite)
        _clean(state, spec)
        _write_marker(state, spec)
        yield folder
        succeeded = True
    finally:
        if not succeeded and created and not any(
                n not in _OURS for n in os.listdir(folder)):
            for name in _OURS:
                (folder / name).unlink(missing_ok=True)
            _rmdir_if_empty(folder)
        lock.release()
