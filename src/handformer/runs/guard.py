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

**A folder is untrusted input.** A run folder may come from someone else, and its marker is
a file like any other: nothing it says may point a delete, a write or a read outside the
folder. So a marker's names are checked against what handformer really writes for its kind
(every ``FolderSpec`` a module defines is known by its kind): a name that is absolute, climbs
out (``..``), or is not one of those names (``*``) makes the folder refused by name, before
any file is touched. A marker of a kind this process does not know is only a note: the folder
is treated as foreign, and nothing in it is removed. Symbolic links where handformer reads or
writes (its marker and lock, the files and folders a spec writes, ``checkpoints/`` and the
entries in it) are refused too: a link would carry a write or a delete to wherever it points.

**A trained run is not replaced without a word.** A folder holding a finished run (its
weights and config) of the kind the command writes is refused unless ``overwrite``, naming
the run, its steps and its best loss: re-running a command is easy, training is not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import math
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
    "CHECKPOINTS", "CLASSIFIER_FOLDER", "CONFUSION", "ENCODER_FOLDER", "FOLDER_MARKER",
    "LM_FOLDER", "LOSS_CURVE", "RUN_FOLDERS", "SEQ2SEQ_FOLDER", "TENSORBOARD", "FolderSpec",
    "FolderState",
    "check_destination", "check_in_place", "describe_run", "folder_path", "read_folder",
    "remove_if_ours", "writing_folder",
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

    def __post_init__(self) -> None:
        # Known by its kind: a marker naming this kind is checked against these names.
        same = _KNOWN.setdefault(self.kind, [])
        if self not in same:
            same.append(self)


# Every FolderSpec defined in this process, by kind (FolderSpec.__post_init__ fills it).
_KNOWN: dict[str, list[FolderSpec]] = {}


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
ENCODER_FOLDER = FolderSpec(
    "encoder", "a pretrained encoder", "handformer convert --from hf", (WEIGHTS, CONFIG, TOKENIZER))
# The run folders of ``runs.folder``, by its kind names (``load_run``'s ``kind``).
RUN_FOLDERS: dict[str, FolderSpec] = {s.kind: s for s in (LM_FOLDER, CLASSIFIER_FOLDER,
                                                          SEQ2SEQ_FOLDER, ENCODER_FOLDER)}
_CONFIG_CLASSES: dict[str, Any] = {"lm": ModelConfig, "classifier": ClassifierConfig,
                                   "seq2seq": Seq2SeqConfig, "encoder": ModelConfig}


@dataclass(frozen=True)
class FolderState:
    """A destination as found. ``entries``: its names besides handformer's marker and lock.
    ``spec``: what handformer wrote there (from the marker, or a run folder written before
    markers existed); None for a missing, empty or foreign folder. ``kept``: names that were
    there before handformer claimed the folder. ``checkpoint``: the folder is one checkpoint.
    ``names`` and ``checkpoints``: what a clean may remove — the marker's names (each checked
    to be one ``spec``'s kind writes) and its checkpoint folder, or ``spec``'s own for a
    folder written before markers existed."""

    path: Path
    exists: bool
    entries: tuple[str, ...] = ()
    spec: FolderSpec | None = None
    kept: tuple[str, ...] = ()
    checkpoint: bool = False
    note: str = ""
    names: tuple[str, ...] = ()
    checkpoints: str | None = None

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
def _link_refusal(path: Path) -> RunFolderError:
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return RunFolderError(
        f"{path} is a symbolic link{target}: handformer never reads, writes or removes "
        "through a link in a folder it writes (it could point anywhere, another run's files "
        "included); replace the link with the real file or folder, or give another folder")


def _escapes(name: str) -> bool:
    """True for a name that is not a plain relative path inside the folder."""
    return (name.startswith(("/", "\\")) or "\\" in name or "\x00" in name
            or os.path.isabs(name)
            or any(part in ("", ".", "..") for part in name.split("/")))


def _tampered(folder: Path, what: str, value: object, why: str) -> RunFolderError:
    return RunFolderError(
        f"{folder / FOLDER_MARKER} lists {what} {value!r}, {why}: the marker was edited or "
        f"written by another tool, and handformer touches nothing on its word; give another "
        f"folder, or remove {FOLDER_MARKER} if you trust what the folder holds (it is then "
        "treated as a folder handformer did not write: nothing in it is removed)")


def _known_spec(folder: Path, data: dict[str, Any]) -> tuple[FolderSpec | None,
                                                             tuple[str, ...], str | None]:
    """(the known spec the marker's kind and command name, its checked names, its checked
    checkpoint folder); ``RunFolderError`` for a name handformer would never write there.
    ``(None, (), None)`` for a kind no spec of this process has."""
    names = data["names"]
    if not isinstance(names, list):
        raise TypeError(f"names is a {type(names).__name__}, not a list")
    known = _KNOWN.get(str(data["kind"]))
    for name in names:
        if not isinstance(name, str) or _escapes(name):
            raise _tampered(folder, "the file name", name,
                            f"which is not a plain name inside {folder}")
        if name.count("/") > 1:
            raise _tampered(folder, "the file name", name,
                            "more than one folder down, where handformer writes nothing")
    checkpoints = data.get("checkpoints")
    if checkpoints is not None and (not isinstance(checkpoints, str) or _escapes(checkpoints)
                                    or "/" in checkpoints):
        raise _tampered(folder, "the checkpoint folder", checkpoints,
                        f"which is not a plain folder name inside {folder}")
    if known is None:
        return None, (), None
    written = {n for spec in known for n in spec.names}
    for name in names:
        if name not in written:
            raise _tampered(folder, "the file name", name,
                            f"which no handformer command writes into {known[0].what}")
    if checkpoints not in {spec.checkpoints for spec in known}:
        raise _tampered(folder, "the checkpoint folder", checkpoints,
                        f"where no handformer command keeps checkpoints of {known[0].what}")
    spec = next((s for s in known if s.command == data.get("command")),
                next((s for s in known if s.checkpoints == checkpoints), known[0]))
    return spec, tuple(names), checkpoints


def _read_marker(folder: Path) -> FolderState:
    """The folder as its marker describes it; a marker handformer did not write (unreadable,
    another format, a kind this process does not know) gives a foreign folder and a note.
    ``RunFolderError`` for a marker that names what handformer would never write there."""
    entries = tuple(sorted(n for n in os.listdir(folder) if n not in _OURS))
    path = folder / FOLDER_MARKER
    if path.is_symlink():
        raise _link_refusal(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != _FORMAT:
            raise ValueError(f"format {data.get('format')!r}")
        spec, names, checkpoints = _known_spec(folder, data)
        kept = data.get("kept", [])
        if not isinstance(kept, list) or not all(isinstance(n, str) for n in kept):
            raise TypeError("kept is not a list of names")
        if spec is None:
            return FolderState(folder, True, entries, note=(
                f"its {FOLDER_MARKER} says {str(data['command'])[:60]!r} wrote it, a kind of "
                f"output ({str(data['kind'])[:40]!r}) this command does not know"))
        return FolderState(folder, True, entries, spec, tuple(kept), names=names,
                           checkpoints=checkpoints)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        if isinstance(err, RunFolderError):
            raise
        return FolderState(folder, True, entries, note=(
            f"its {FOLDER_MARKER} is not handformer's or is damaged ({err})"))


def _legacy_kind(folder: Path) -> str | None:
    """The run kind of a folder written before markers existed: ``config.json`` with a run
    kind's key, a training recipe and a model config that parses; or committed checkpoints."""
    config_path = folder / CONFIG
    if config_path.is_file() and not config_path.is_symlink():
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
    if (folder / FOLDER_MARKER).exists() or (folder / FOLDER_MARKER).is_symlink():
        return _read_marker(folder)
    kind = _legacy_kind(folder) if entries else None
    if kind is None:
        return FolderState(folder, True, entries)
    spec = RUN_FOLDERS[kind]
    return FolderState(folder, True, entries, spec, names=spec.names,
                       checkpoints=spec.checkpoints)


def _unfinished_step(folder: Path, checkpoints: str | None) -> int | None:
    """The newest checkpoint's step if the run there did not finish; None otherwise."""
    if checkpoints is None:
        return None
    found = list_checkpoints(folder / checkpoints)
    if not found:
        return None
    try:
        meta = read_checkpoint_json(found[-1].path, "trainer_state.json", verify=False)
    except CheckpointError:
        return found[-1].step
    return None if meta.get("finished") is True else found[-1].step


def _number(value: object) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) else None  # type: ignore[arg-type]


def describe_run(folder: Path) -> str | None:
    """What a finished run in ``folder`` is, for a refusal ("trained 200 steps, best
    validation loss 1.2345"); None if it holds no weights and config (nothing finished)."""
    weights, config_path = folder / WEIGHTS, folder / CONFIG
    if not (weights.is_file() and config_path.is_file()):
        return None
    try:
        config = read_json(config_path)
    except RunFolderError:
        return f"weights of {weights.stat().st_size:,} bytes; its {CONFIG} does not read"
    summary = config.get("summary") if isinstance(config.get("summary"), dict) else {}
    train = config.get("train") if isinstance(config.get("train"), dict) else {}
    steps = summary.get("steps", train.get("max_steps"))
    parts = [f"trained {steps} steps"] if isinstance(steps, int) and steps > 0 else []
    for key, what in (("best_val_loss", "best validation loss"),
                      ("final_val_loss", "validation loss"),
                      ("val_accuracy", "validation accuracy")):
        value = _number(summary.get(key))
        if value is not None:
            parts.append(f"{what} {value:.4f}")
            break
    for key, what in (("converted_from", "converted from"), ("quantized_from", "int8 copy of")):
        if isinstance(config.get(key), str):
            parts.append(f"{what} {config[key]}")
    return ", ".join(parts) or "weights and a config, no training record"


def _listing(state: FolderState) -> str:
    shown = [n + ("/" if (state.path / n).is_dir() else "") for n in state.entries[:_SHOWN]]
    more = len(state.entries) - _SHOWN
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def _refuse_links(state: FolderState, spec: FolderSpec) -> None:
    """Refuse a folder where a name handformer would read, write or remove is a link."""
    names = (*spec.names, *state.names)
    top = [n for n in names if "/" not in n]
    subs = {n.split("/", 1)[0] for n in names if "/" in n}
    subs |= {c for c in (spec.checkpoints, state.checkpoints) if c}
    for entry in (*state.entries, *_OURS):
        path = state.path / entry
        if path.is_symlink() and (entry in _OURS or entry in subs or _matches(entry, top)):
            raise _link_refusal(path)


def check_in_place(path: str | os.PathLike[str], spec: FolderSpec) -> FolderState:
    """For a command that continues ``spec``'s output in place (``train --resume``): refuse
    (``RunFolderError``) a folder whose marker names what handformer never writes there, or
    where a file or folder it reads or writes is a symbolic link. Reads only."""
    state = read_folder(path)
    if state.exists:
        _refuse_links(state, spec)
    return state


def check_destination(path: str | os.PathLike[str], spec: FolderSpec, *,
                      overwrite: bool = False) -> FolderState:
    """Refuse (``RunFolderError``; ``FolderBusyError`` while another process writes it) a
    destination ``spec``'s command may not write, without writing anything; otherwise
    return what is there. See the module docstring."""
    state = read_folder(path)
    if state.exists:
        _refuse_links(state, spec)  # the lock file is opened next: never through a link
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
    _refuse_links(state, spec)
    if state.empty:
        return
    if other is not None and other.kind == spec.kind:
        step = _unfinished_step(folder, state.checkpoints)
        if step is not None and not overwrite:
            hint = "" if other.resume is None else \
                f"continue it with `{other.resume.format(path=folder)}`, or "
            raise RunFolderError(
                f"{folder} holds an unfinished run (last checkpoint: step {step}); {hint}"
                "pass --overwrite to replace it")
        finished = describe_run(folder) if spec.kind in RUN_FOLDERS else None
        if finished is not None and not overwrite:
            raise RunFolderError(
                f"{folder} holds {other.what}, finished ({finished}); `{spec.command}` "
                "would replace it: give another folder, or pass --overwrite to replace it")
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
    names = list(state.names) if owner is not None else []
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
    for sub in {c for c in (state.checkpoints, spec.checkpoints) if c}:
        path = folder / sub
        if not path.is_dir() or path.is_symlink():
            continue
        for entry in sorted(path.iterdir()):
            if is_checkpoint_entry(entry):
                remove_checkpoint_entry(entry)
        if sub not in kept:
            _rmdir_if_empty(path)


def remove_if_ours(folder: str | os.PathLike[str], name: str) -> None:
    """Remove ``folder/name`` (a file of an older version of the output) unless the folder's
    marker records it among the names that were there before handformer claimed the folder:
    those are the user's own, and stay. A link is never removed through."""
    folder = Path(folder)
    try:
        kept = json.loads((folder / FOLDER_MARKER).read_text(encoding="utf-8")).get("kept", [])
    except (OSError, ValueError, AttributeError):
        return  # no marker of ours: nothing here is known to be ours
    if name not in kept and not (folder / name).is_dir():
        (folder / name).unlink(missing_ok=True)


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
