"""Checkpoints that survive crashes and never run code when loaded.

    RUN_DIR/checkpoints/
      step-00000500/
        model.safetensors          the weights
        config.json, tokenizer.json  whatever the caller passes (enough to rebuild the model)
        trainer_state.safetensors  optimizer moments, RNG byte states
        trainer_state.json         step, counters, optimizer hyper-parameters, Python/NumPy RNG
        COMMITTED.json             written last: every other file's size and sha256
      best.json                    which checkpoint holds the best validation loss
      .tmp-…/                      an interrupted write or delete; removed at the next start

A checkpoint is written into ``.tmp-step-…/``; every file is fsynced, then the commit marker,
then the folder is renamed to ``step-…`` and the parent fsynced. A ``step-…`` folder therefore
exists only once it is complete, and a crash at any point leaves the previous ones untouched.
Loading uses safetensors and JSON only (no pickle), checks every file against the marker
first, and turns any problem into a ``CheckpointError`` naming the file.

A checkpoint folder may come from someone else, so nothing in it is trusted to point
elsewhere: a checkpoint root, a ``step-…`` entry or a file listed in a commit marker that is
a symbolic link is refused (never read or written through), a marker's file names must be
plain names, and a checkpoint's step is the one its own marker records — checked against its
folder's name. Nothing non-finite is ever committed: ``save_checkpoint`` refuses weights or
optimizer state holding NaN or Inf (``NonFiniteStateError``), so a diverged step can never
rotate the last good checkpoint out.

The writer reports its progress to an optional ``on_phase(phase, step)`` callable, once per
phase in ``PHASES`` order (see ``save_checkpoint``): to log or time the phases, or to stop a
process at a chosen moment of the write and check what survives.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import Tensor, nn

from handformer.atomic import atomic_write_text, fsync_dir
from handformer.train.state import TrainerState
from handformer.train.tensor_file import TensorFileError, check_tensor_file

__all__ = [
    "MARKER", "PHASES", "CheckpointError", "CheckpointInfo", "CheckpointManager",
    "NonFiniteStateError", "PhaseHook", "first_nonfinite", "is_checkpoint_entry",
    "list_checkpoints", "load_weights", "read_checkpoint_json", "read_trainer_state",
    "remove_checkpoint_entry", "remove_stale", "save_checkpoint", "verify_checkpoint",
]

WEIGHTS = "model.safetensors"
STATE_TENSORS = "trainer_state.safetensors"
STATE_META = "trainer_state.json"
MARKER = "COMMITTED.json"
BEST = "best.json"
FORMAT, VERSION = "handformer-checkpoint", 1
TMP_PREFIX = ".tmp-"
_RESERVED = {WEIGHTS, STATE_TENSORS, STATE_META, MARKER}
_NAME = re.compile(r"^step-(\d{8,})$")
# What save_checkpoint and _discard name a folder they have not finished writing or deleting:
# .tmp-step-00000500-<pid>-<hex> and .tmp-del-step-00000500-<hex>. Nothing else is ours.
_TMP_NAME = re.compile(r"^\.tmp-(?:del-)?step-\d{8,}(?:-[0-9a-f]+)+$")

# The moments ``save_checkpoint`` reports to its ``on_phase`` hook, in order. Until
# "committed" the new checkpoint exists only as a ``.tmp-`` folder:
#   "started"          the temporary folder exists, nothing is written yet
#   "weights_written"  model.safetensors is written
#   "files_written"    every file but the commit marker is written (not yet fsynced)
#   "marker_written"   every file and the marker are fsynced; the rename comes next
#   "committed"        renamed to step-NNNNNNNN and the parent fsynced (before any pruning)
PHASES = ("started", "weights_written", "files_written", "marker_written", "committed")
PhaseHook = Callable[[str, int], None]  # on_phase(phase, step)


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, damaged or foreign; the message names the file."""


class NonFiniteStateError(CheckpointError):
    """Weights or optimizer state holding NaN or Inf: never committed, never resumed."""


def first_nonfinite(tensors: Mapping[str, Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an Inf, or None."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and tensor.numel() and \
                not bool(torch.isfinite(tensor).all()):
            return name
    return None


def _refuse_link(path: Path, what: str) -> None:
    if path.is_symlink():
        raise CheckpointError(f"{path} is a symbolic link ({what}): handformer never reads or "
                              "writes a checkpoint through a link, which could point at "
                              "another run's files; put the real folder or file there")


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint folder (``…/step-00000500``) and the step it holds."""

    path: Path
    step: int


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


# -- writing ------------------------------------------------------------------------------
def _digest_and_sync(path: Path) -> dict[str, Any]:
    """sha256 and size of a written file, fsyncing it on the way."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
        os.fsync(fh.fileno())
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


def _discard(path: Path) -> None:
    """Remove a folder so that a crash half-way leaves only a ``.tmp-`` name behind."""
    doomed = path.with_name(f"{TMP_PREFIX}del-{path.name}-{secrets.token_hex(4)}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def save_checkpoint(root: str | Path, step: int, model: nn.Module, state: TrainerState,
                    files: Mapping[str, str] | None = None, *,
                    on_phase: PhaseHook | None = None) -> Path:
    """Write ``root/step-NNNNNNNN/`` atomically and return its path.

    ``on_phase(phase, step)``, if given, is called at each of ``PHASES`` in order. An
    exception it raises before "committed" removes the temporary folder and propagates (the
    checkpoint is not written); one raised at "committed" propagates, the checkpoint stays.
    """
    def phase(name: str) -> None:
        if on_phase is not None:
            on_phase(name, step)

    root = Path(root)
    if state.meta.get("step", step) != step:
        raise ValueError(f"trainer state is at step {state.meta['step']}; asked to save it as "
                         f"step {step}")
    bad = first_nonfinite(model.state_dict())
    where = "weight" if bad is not None else "optimizer state"
    bad = bad if bad is not None else first_nonfinite(state.tensors)
    if bad is not None:
        raise NonFiniteStateError(
            f"step {step}: the {where} {bad!r} holds NaN or Inf, so no checkpoint is "
            f"committed into {root} (the last good one stays)")
    name = checkpoint_name(step)
    final, old = root / name, None
    _refuse_link(root, "the checkpoint folder")
    _refuse_link(final, "a checkpoint")
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{TMP_PREFIX}{name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        phase("started")
        save_model(model, str(tmp / WEIGHTS))  # tied weights are stored once
        phase("weights_written")
        save_file(state.tensors, str(tmp / STATE_TENSORS))
        meta = {**state.meta, "format": FORMAT, "version": VERSION, "step": step}
        (tmp / STATE_META).write_text(json.dumps(meta, allow_nan=False), encoding="utf-8")
        for fname, text in (files or {}).items():
            (tmp / fname).write_text(text, encoding="utf-8")
        phase("files_written")
        entries = {p.name: _digest_and_sync(p) for p in sorted(tmp.iterdir())}
        marker = {"format": FORMAT, "version": VERSION, "step": step, "files": entries}
        with open(tmp / MARKER, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(marker, indent=1))
            fh.flush()
            os.fsync(fh.fileno())
        fsync_dir(tmp)
        phase("marker_written")
        if final.exists():  # re-saving a step (e.g. after resuming from an older checkpoint):
            # the old folder steps aside and is deleted only once the new one is in place, so
            # an interrupt (Ctrl-C, SIGTERM) between the two renames can put it back.
            old = final.with_name(f"{TMP_PREFIX}del-{name}-{secrets.token_hex(4)}")
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and old.exists() and not final.exists():
            os.replace(old, final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    phase("committed")
    return final


# -- finding and cleaning -----------------------------------------------------------------
def list_checkpoints(root: str | Path) -> list[CheckpointInfo]:
    """Committed checkpoints under ``root`` (those with a commit marker), oldest first."""
    root = Path(root)
    _refuse_link(root, "the checkpoint folder")
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = _NAME.match(path.name)
        if m:
            _refuse_link(path, "a checkpoint")
        if m and path.is_dir() and (path / MARKER).is_file():
            found.append(CheckpointInfo(path, int(m.group(1))))
    return sorted(found, key=lambda c: c.step)


def _is_committed(path: Path) -> bool:
    """A ``step-…`` folder whose commit marker says handformer wrote it (not verified)."""
    if not (_NAME.match(path.name) and path.is_dir() and not path.is_symlink()):
        return False
    try:
        marker = json.loads((path / MARKER).read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == FORMAT


def is_checkpoint_entry(path: str | Path) -> bool:
    """True for what a ``CheckpointManager`` writes into its folder and nothing else: a
    committed ``step-…`` folder (its marker names handformer's format), an interrupted
    ``.tmp-…step-…`` folder, or ``best.json``. Used to clean a checkpoint folder without
    touching files another tool put there."""
    path = Path(path)
    if path.name == BEST:
        if path.is_symlink():
            return False
        try:
            best = json.loads(path.read_bytes().decode("utf-8"))
        except (OSError, ValueError):
            return False
        return isinstance(best, dict) and {"step", "checkpoint"} <= set(best)
    if _TMP_NAME.match(path.name):
        return not path.is_symlink()
    return _is_committed(path)


def remove_checkpoint_entry(path: str | Path) -> None:
    """Delete one entry ``is_checkpoint_entry`` recognised; a committed folder is renamed to
    a ``.tmp-del-`` name first, so a crash half-way leaves a name ``remove_stale`` cleans."""
    path = Path(path)
    if _NAME.match(path.name) and path.is_dir():
        _discard(path)
    elif path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def remove_stale(root: str | Path) -> list[Path]:
    """Delete leftovers of interrupted writes (handformer's own ``.tmp-…step-…`` names only:
    another tool's ``.tmp-`` files stay). Call only when no other process writes checkpoints
    into ``root``."""
    root = Path(root)
    if not root.is_dir():
        return []
    stale = [p for p in root.iterdir() if _TMP_NAME.match(p.name)]
    for p in stale:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return stale


def prune(root: str | Path, keep_last: int, keep_steps: Iterable[int | None] = ()) -> list[Path]:
    """Remove all but the newest ``keep_last`` committed checkpoints and those in
    ``keep_steps`` (the best one)."""
    protected = {s for s in keep_steps if s is not None}
    complete = list_checkpoints(root)
    doomed = [c.path for c in complete[: max(0, len(complete) - keep_last)]
              if c.step not in protected]
    for path in doomed:
        _discard(path)
    return doomed


# -- reading ------------------------------------------------------------------------------
def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{file}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object; got {type(data).__name__}")
    return data


def _check_format(file: Path, data: dict[str, Any]) -> int:
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise CheckpointError(
            f"{file}: not a handformer checkpoint file (format={data.get('format')!r}, "
            f"version={data.get('version')!r}; expected {FORMAT!r}, {VERSION})")
    step = data.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{file}: step must be an int >= 0; got {step!r}")
    return step


def verify_checkpoint(path: str | Path) -> CheckpointInfo:
    """Check every file against the commit marker (presence, size, sha256)."""
    path = Path(path)
    _refuse_link(path, "a checkpoint")
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint folder not found")
    marker_file = path / MARKER
    _refuse_link(marker_file, "a commit marker")
    if not marker_file.is_file():
        raise CheckpointError(f"{marker_file}: missing; {path} is not a committed checkpoint")
    marker = _read_json(marker_file)
    step = _check_format(marker_file, marker)
    named = _NAME.match(path.name)
    if named and int(named.group(1)) != step:
        raise CheckpointError(f"{marker_file}: records step {step}, but its folder is named "
                              f"{path.name}: renamed or copied over another checkpoint")
    files = marker.get("files")
    if not isinstance(files, dict) or not {WEIGHTS, STATE_TENSORS, STATE_META} <= set(files):
        raise CheckpointError(f"{marker_file}: file list is missing or incomplete; expected "
                              f"at least {sorted(_RESERVED - {MARKER})}")
    for fname, entry in files.items():
        file = path / str(fname)
        if "/" in fname or "\\" in fname or fname in ("", ".", "..") or fname == MARKER \
                or "\x00" in fname:
            raise CheckpointError(f"{marker_file}: bad file name {fname!r}")
        _refuse_link(file, f"listed in {MARKER}")
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (listed in {MARKER})")
        if not isinstance(entry, dict):
            raise CheckpointError(f"{marker_file}: entry for {fname} is not an object")
        size = file.stat().st_size
        if size != entry.get("size"):
            raise CheckpointError(f"{file}: {size} bytes, but {MARKER} says "
                                  f"{entry.get('size')} (truncated or replaced)")
        if _digest_and_sync(file)["sha256"] != entry.get("sha256"):
            raise CheckpointError(f"{file}: sha256 differs from {MARKER} (damaged or replaced)")
    return CheckpointInfo(path, step)


def read_checkpoint_json(path: str | Path, name: str, *, verify: bool = True) -> dict[str, Any]:
    """One of the caller's JSON files (e.g. ``config.json``) from a checkpoint."""
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    return _read_json(path / name)


def read_trainer_state(path: str | Path, *, verify: bool = True) -> TrainerState:
    """The trainer state: tensors via safetensors, the rest via JSON; nothing is unpickled."""
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    meta = _read_json(path / STATE_META)
    _check_format(path / STATE_META, meta)
    file = path / STATE_TENSORS
    try:
        tensors = load_file(str(file))
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing") from None
    except Exception as err:  # safetensors raises several types on foreign bytes
        raise CheckpointError(f"{file}: not a readable safetensors file "
                              f"({type(err).__name__}: {err})") from None
    return TrainerState(tensors, meta)


def load_weights(model: nn.Module, path: str | Path, *, verify: bool = True) -> None:
    """Load ``model.safetensors`` from a checkpoint into ``model`` (strict: every name, every
    shape must match, and a float weight is never filled from an integer tensor — checked
    from the header before anything is read; see ``train.tensor_file``)."""
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    file = path / WEIGHTS
    try:  # names, shapes and dtypes from the header first: copy_ would cast ints silently
        check_tensor_file(model, file)
    except TensorFileError as err:
        raise CheckpointError(str(err)) from None
    device = next(model.parameters()).device
    try:
        missing, unexpected = load_model(model, str(file), strict=False, device=str(device))
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing") from None
    except RuntimeError as err:
        raise CheckpointError(f"{file}: does not fit this model ({err})") from None
    except Exception as err:
        raise CheckpointError(f"{file}: not a readable safetensors file "
                              f"({type(err).__name__}: {err})") from None
    if missing or unexpected:
        raise CheckpointError(f"{file}: does not fit this model: missing {sorted(missing)[:5]}, "
                              f"unexpected {sorted(unexpected)[:5]}")


# -- the trainer's handle -----------------------------------------------------------------
class CheckpointManager:
    """Saves into one folder, keeps the newest ``keep_last`` plus the best, and records the
    best in ``best.json``. ``files`` are extra text files copied into every checkpoint;
    ``on_phase`` (also settable as an attribute) is passed to every ``save_checkpoint``."""

    def __init__(self, root: str | Path, *, keep_last: int = 3,
                 files: Mapping[str, str] | None = None,
                 on_phase: PhaseHook | None = None) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1; got {keep_last}")
        clash = sorted(_RESERVED & set(files or {}))
        if clash:
            raise ValueError(f"extra checkpoint files may not be named {clash}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.files = dict(files or {})
        self.on_phase = on_phase

    def latest(self) -> CheckpointInfo | None:
        found = list_checkpoints(self.root)
        return found[-1] if found else None

    def remove_stale(self) -> list[Path]:
        return remove_stale(self.root)

    def save(self, step: int, model: nn.Module, state: TrainerState, *,
             best_step: int | None = None, best_val_loss: float | None = None) -> Path:
        path = save_checkpoint(self.root, step, model, state, self.files,
                               on_phase=self.on_phase)
        if best_step == step:
            atomic_write_text(self.root / BEST, json.dumps(
                {"step": step, "checkpoint": path.name, "val_loss": best_val_loss}, indent=1))
        prune(self.root, self.keep_last, keep_steps=[best_step])
        return path
