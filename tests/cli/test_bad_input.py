"""Bad input to every command, as a table: each case is one ``handformer`` command line run
in a fresh folder, and every case must

* end with the exit code THE CONTRACT documents: 2 when the command line itself is wrong
  (argparse's errors, a value out of range or not finite, options that contradict each
  other), 1 for everything refused while running (files, folders, run state, sizes);
* say so in ONE line on stderr, ``handformer <command>: error: <message>``, as its last line,
  naming what was wrong (the case's expected piece of the message), and for a usage error
  (exit 2) ending with a pointer to the command's ``--help``; the only lines allowed before
  it are ``handformer <command>: warning: ...`` lines (argparse's usage block is not);
* print no ``Traceback`` on stderr or stdout;
* leave every file that was in the folder before it byte-identical (names, sizes, sha256).

How it runs: the small run folders the cases damage (an LM from ``train --preset tiny
--max-steps 2``, a classifier, a seq2seq run, a transformers export) are built once per
module. Each case gets its own folder, set up by the case, snapshotted, and then all cases
are run by ``bad_input_driver.py`` — one warm interpreter that forks a child per case
(own cwd and stdio files, the exit code of ``python -m handformer``, a timeout, a memory
ceiling), two at a time. A handful of cases at the end run as real ``python -m handformer``
subprocesses, signals included.

The ``part`` column records which part of the issue made each case pass (the table was
written to THE CONTRACT's final behaviour while they were being built): A run-folder safety,
B validation, C exit codes and budgets; "AC"/"BC": A's or B's refusal, with C's exit code 1
for it; "D": found by this table once A, B and C had landed, and fixed with it (seeds and
devices as argparse types, experiment's counts as positive ints, a damaged transformers or
BERT config.json / model.safetensors named); "E": the second sweep — a run folder as
untrusted input (markers naming files outside or not ours, links where handformer reads or
writes, checkpoints renamed), trained runs replaced only with --overwrite, non-finite state
never resumed, tokenizers smaller than the vocabulary, folders another process writes.
Empty: right before any of them. A case that
was right at the start may still carry a part: the one whose change had to keep it right
(a usage error that exited 2 only because every ValueError did, before C's mapping).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("bad_input_driver.py")
SRC = Path(__file__).resolve().parents[2] / "src"
CASE_TIMEOUT_S = 60.0
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
    p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)}

Setup = Callable[[Path, "Fixtures"], None]


@dataclass(frozen=True)
class Fixtures:
    """Run folders built once: an LM, a classifier, a seq2seq run, a transformers folder."""

    lm: Path
    clf: Path
    s2s: Path
    hf: Path
    values: dict[str, str] = field(default_factory=dict)  # {busy_port} and the like


@dataclass(frozen=True)
class Case:
    id: str
    argv: list[str]
    code: int | tuple[int, ...]  # THE CONTRACT's exit code (a tuple: any of them is right)
    message: str  # in the error line, case-insensitive; "a|b" = either
    setup: tuple[Setup, ...] = ()
    part: str = ""  # which part of the issue makes it pass (A, B, C), if not today's code
    timeout: float = CASE_TIMEOUT_S


# -- set-up helpers: each returns a function that prepares a case folder ----------------------
def copy(kind: str, name: str | None = None) -> Setup:
    """Copy the fixture run ``kind`` (lm, clf, s2s, hf) into the case folder as ``name``."""
    def setup(case: Path, fx: Fixtures) -> None:
        shutil.copytree(getattr(fx, kind), case / (name or kind))
    return setup


def write(name: str, content: str | bytes) -> Setup:
    def setup(case: Path, fx: Fixtures) -> None:
        path = case / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    return setup


def mkdir(name: str) -> Setup:
    def setup(case: Path, fx: Fixtures) -> None:
        (case / name).mkdir(parents=True, exist_ok=True)
    return setup


def remove(name: str) -> Setup:
    def setup(case: Path, fx: Fixtures) -> None:
        path = case / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return setup


def truncate(name: str, keep: int) -> Setup:
    def setup(case: Path, fx: Fixtures) -> None:
        path = case / name
        path.write_bytes(path.read_bytes()[:keep])
    return setup


def edit_json(name: str, change: Callable[[Any], Any]) -> Setup:
    """Rewrite a JSON file as ``change(data)`` returns it (``change`` may edit in place)."""
    def setup(case: Path, fx: Fixtures) -> None:
        path = case / name
        data = json.loads(path.read_text(encoding="utf-8"))
        new = change(data)
        path.write_text(json.dumps(data if new is None else new), encoding="utf-8")
    return setup


def edit_tensors(name: str, change: Callable[[dict[str, Any]], dict[str, Any]]) -> Setup:
    """Rewrite a safetensors file with ``change(tensors)``."""
    def setup(case: Path, fx: Fixtures) -> None:
        from safetensors.torch import load_file, save_file

        path = case / name
        save_file(change(load_file(path)), path, metadata={"format": "pt"})
    return setup


def recommit(checkpoint: str) -> Setup:
    """Re-sign a checkpoint's COMMITTED.json after an edit, so that the damage gets past the
    size/sha256 check and reaches the check behind it."""
    def setup(case: Path, fx: Fixtures) -> None:
        folder = case / checkpoint
        marker = json.loads((folder / "COMMITTED.json").read_text(encoding="utf-8"))
        for name, entry in marker["files"].items():
            data = (folder / name).read_bytes()
            entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
        (folder / "COMMITTED.json").write_text(json.dumps(marker), encoding="utf-8")
    return setup


def hf_tokenizer(folder: str, size: int = 0) -> Setup:
    """A Hugging Face ``tokenizer.json`` (one token per letter, plus ``size`` made-up ones) in
    a transformers folder, so that ``convert --from hf`` gets past its source checks."""
    def setup(case: Path, fx: Fixtures) -> None:
        from tokenizers import Tokenizer, models, pre_tokenizers

        vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}}
        vocab.update({f"tok{i}": len(vocab) + i for i in range(size)})
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
        tok.save(str(case / folder / "tokenizer.json"))
    return setup


def bert(name: str, *, config: str | None = None, weights: int = 4096) -> Setup:
    """A BERT-style folder from the MiniLM package: its config.json (or ``config``) and
    tokenizer.json, and the first ``weights`` bytes of its model.safetensors."""
    def setup(case: Path, fx: Fixtures) -> None:
        from handformer.interop.bert import minilm_path

        src, dst = minilm_path(), case / name
        dst.mkdir()
        shutil.copyfile(src / "tokenizer.json", dst / "tokenizer.json")
        (dst / "config.json").write_text(config if config is not None else
                                         (src / "config.json").read_text(encoding="utf-8"))
        with (src / "model.safetensors").open("rb") as fh:
            (dst / "model.safetensors").write_bytes(fh.read(weights))
    return setup


def foreign(name: str) -> Setup:
    """Another tool's folder: its own checkpoints/, tensorboard/ and notes."""
    return _many(write(f"{name}/checkpoints/epoch-3.ckpt", b"\x80\x04 not ours" * 50),
                 write(f"{name}/tensorboard/events.out.tfevents.1", b"\x00\x01 events"),
                 write(f"{name}/NOTES.md", "my experiment, do not delete\n"))


def _many(*steps: Setup) -> Setup:
    def setup(case: Path, fx: Fixtures) -> None:
        for step in steps:
            step(case, fx)
    return setup


def _set(path: str, value: Any) -> Callable[[Any], None]:
    """``data[k1][k2]... = value`` for a dotted ``path``."""
    keys = path.split(".")

    def change(data: Any) -> None:
        for key in keys[:-1]:
            data = data[key]
        data[keys[-1]] = value
    return change


def _to_int(tensors: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {k: (v * 100).to(torch.int32) if v.is_floating_point() else v
            for k, v in tensors.items()}


def _reshape_first_matrix(tensors: dict[str, Any]) -> dict[str, Any]:
    import torch

    name = next(k for k, v in sorted(tensors.items()) if v.dim() == 2)
    rows, cols = tensors[name].shape
    return {**tensors, name: torch.zeros(rows + 3, cols)}


def _drop_one(tensors: dict[str, Any]) -> dict[str, Any]:
    return dict(sorted(tensors.items())[1:])


def _bigger_vocab(tok: dict[str, Any]) -> None:
    tok["chars"] = list(tok["chars"]) + [chr(0x4E00 + i) for i in range(300)]


def _smaller_vocab(tok: dict[str, Any]) -> None:
    tok["chars"] = list(tok["chars"])[:-3]


# -- set-ups for the second sweep: markers, links, replaced runs, non-finite state, locks -------
def marker(folder: str, **fields: Any) -> Setup:
    """Edit ``folder``'s ``.handformer.json``; a callable value gets the case folder (for
    absolute paths into it)."""
    def setup(case: Path, fx: Fixtures) -> None:
        path = case / folder / ".handformer.json"
        data = json.loads(path.read_text(encoding="utf-8"))
        data.update({k: v(case) if callable(v) else v for k, v in fields.items()})
        path.write_text(json.dumps(data), encoding="utf-8")
    return setup


def link(name: str, target: str) -> Setup:
    """``name`` becomes a symbolic link to ``target`` (relative to the link's folder, as
    ``ln -s`` takes it); whatever was at ``name`` goes first."""
    def setup(case: Path, fx: Fixtures) -> None:
        path = case / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, path)
    return setup


def rename(src: str, dst: str) -> Setup:
    def setup(case: Path, fx: Fixtures) -> None:
        (case / src).rename(case / dst)
    return setup


_HELD: list[Any] = []  # locks this test process holds while the cases run


def locked(folder: str) -> Setup:
    """Another live process (this test's) writes ``folder``: it holds the folder's lock."""
    def setup(case: Path, fx: Fixtures) -> None:
        from handformer.runs import FolderLock

        _HELD.append(FolderLock(case / folder, command="handformer train").acquire())
    return setup


def claimed_for_hf_export(folder: str) -> Setup:
    """``folder`` claimed by ``convert --to hf --overwrite`` as it was: its files are then
    recorded in the marker as the user's own (``kept``)."""
    def setup(case: Path, fx: Fixtures) -> None:
        from handformer.interop.hf_folder import HF_FOLDER
        from handformer.runs import writing_folder

        with writing_folder(case / folder, HF_FOLDER, overwrite=True):
            pass
    return setup


def _non_finite(prefix: str, value: float) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Put ``value`` into the first floating tensor whose name starts with ``prefix``."""
    def change(tensors: dict[str, Any]) -> dict[str, Any]:
        name = next(k for k, v in sorted(tensors.items())
                    if k.startswith(prefix) and v.is_floating_point() and v.numel() > 1)
        tensor = tensors[name].clone()
        tensor.view(-1)[0] = value
        return {**tensors, name: tensor}
    return change


CKPT = "lm/checkpoints/step-00000002"
RESUME = ["train", "--resume", "lm", "--max-steps", "4", "--no-progress"]
TEXT = "the quick brown fox jumps over the lazy dog. " * 400
CSV = "text,label\n" + "".join(f"{'ab' * (i % 7 + 1)},{'yes' if i % 2 else 'no'}\n"
                               for i in range(60))
TRAIN = ["train", "--preset", "tiny", "--max-steps", "2", "--no-progress", "--no-plot"]
GEN = ["generate", "--run", "lm", "--max-new-tokens", "5", "--seed", "0"]
CLF_TRAIN = ["classify", "train", "--max-steps", "2", "--seq-len", "16", "--d-model", "16",
             "--n-layers", "1", "--batch-size", "8", "--no-progress"]
S2S_TRAIN = ["seq2seq", "train", "--max-steps", "2", "--max-len", "6", "--d-model", "16",
             "--n-layers", "1", "--no-progress"]
DOCTOR = ["doctor", "--preset", "tiny", "--learning-steps", "2"]
EXPLORE = ["explore", "--port", "0"]
LM_CONFIG = {"vocab_size": 200, "d_model": 16, "n_heads": 2, "n_layers": 1, "max_len": 16}


def C(id: str, argv: list[str], code: int | tuple[int, ...], message: str,
      *setup: Setup, part: str = "", timeout: float = CASE_TIMEOUT_S) -> Case:
    return Case(id, argv, code, message, tuple(setup), part, timeout)


CASES: list[Case] = [
    # ---------------------------------------------------------------- the command line
    C("no-command", [], 2, "required|command"),
    C("unknown-command", ["fly"], 2, "invalid choice"),
    C("unknown-option", ["train", "--nope"], 2, "--nope"),
    # ---------------------------------------------------------------- train: options
    C("train-max-steps-0", [*TRAIN, "--max-steps", "0"], 2, "--max-steps"),
    C("train-max-steps-text", [*TRAIN, "--max-steps", "many"], 2, "--max-steps"),
    C("train-batch-size-negative", [*TRAIN, "--batch-size", "-3"], 2, "--batch-size"),
    C("train-grad-accum-0", [*TRAIN, "--grad-accum", "0"], 2, "--grad-accum"),
    C("train-eval-interval-0", [*TRAIN, "--eval-interval", "0"], 2, "--eval-interval"),
    C("train-preset-unknown", [*TRAIN, "--preset", "huge"], 2, "--preset"),
    C("train-attention-unknown", [*TRAIN, "--attention", "flash9"], 2, "--attention"),
    C("train-lr-inf", [*TRAIN, "--lr", "inf"], 2, "--lr", part="B"),
    C("train-lr-nan", [*TRAIN, "--lr", "nan"], 2, "--lr", part="B"),
    C("train-lr-negative", [*TRAIN, "--lr", "-0.1"], 2, "--lr|lr", part="B"),
    C("train-lr-text", [*TRAIN, "--lr", "fast"], 2, "--lr"),
    C("train-dropout-nan", [*TRAIN, "--dropout", "nan"], 2, "--dropout", part="B"),
    C("train-dropout-1.5", [*TRAIN, "--dropout", "1.5"], 2, "dropout", part="B"),
    C("train-vocab-size-without-bpe", [*TRAIN, "--vocab-size", "300"], 2, "--vocab-size",
      part="C"),
    C("train-resume-with-recipe-options", ["train", "--resume", "lm", "--lr", "0.1"], 2,
      "--resume", copy("lm"), part="C"),
    C("train-out-empty", [*TRAIN, "--out", ""], 2, "--out", part="A"),
    C("train-batch-size-1e8", [*TRAIN, "--batch-size", "100000000"], 1,
      "memory|batch", part="C"),
    C("train-device-unknown", [*TRAIN, "--device", "quantum"], 2, "quantum", part="D"),
    # ---------------------------------------------------------------- train: data files
    C("train-data-missing", [*TRAIN, "--data", "missing.txt"], 1, "missing.txt", part="C"),
    C("train-data-empty", [*TRAIN, "--data", "empty.txt"], 1, "empty.txt",
      write("empty.txt", ""), part="C"),
    C("train-data-whitespace", [*TRAIN, "--data", "blank.txt"], 1, "blank.txt",
      write("blank.txt", " \n\n\t \n"), part="C"),
    C("train-data-directory", [*TRAIN, "--data", "folder"], 1, "folder", mkdir("folder"),
      part="C"),
    C("train-data-binary", [*TRAIN, "--data", "blob.bin"], 1, "utf-8",
      write("blob.bin", bytes(range(256)) * 8), part="C"),
    C("train-data-dev-zero", [*TRAIN, "--data", "/dev/zero"], 1, "/dev/zero", part="C"),
    C("train-data-too-short", [*TRAIN, "--data", "short.txt"], 1, "short.txt|too short|window",
      write("short.txt", "hello"), part="C"),
    # ---------------------------------------------------------------- train: where it writes
    C("train-out-foreign-folder", [*TRAIN, "--out", "theirs"], 1, "theirs", foreign("theirs"),
      part="AC"),
    C("train-out-is-a-file", [*TRAIN, "--out", "note.txt"], 1, "note.txt",
      write("note.txt", "mine\n"), part="AC"),
    C("train-out-classifier-run", [*TRAIN, "--out", "clf"], 1, "clf", copy("clf"), part="AC"),
    C("train-out-seq2seq-run", [*TRAIN, "--out", "s2s"], 1, "s2s", copy("s2s"), part="AC"),
    C("train-out-transformers-folder", [*TRAIN, "--out", "hf"], 1, "hf", copy("hf"), part="AC"),
    C("train-out-unfinished-run", [*TRAIN, "--out", "lm"], 1, "--resume",
      copy("lm"), remove("lm/summary.json"), remove("lm/checkpoints/step-00000002"),
      edit_json("lm/checkpoints/step-00000001/trainer_state.json",
                _set("max_steps", 1000)), part="C"),
    # ---------------------------------------------------------------- train --resume
    C("resume-missing", ["train", "--resume", "nothing-here"], 1, "nothing-here", part="C"),
    C("resume-a-file", ["train", "--resume", "note.txt"], 1, "note.txt",
      write("note.txt", "x"), part="C"),
    C("resume-classifier-run", ["train", "--resume", "clf"], 1, "clf|checkpoint", copy("clf"),
      part="C"),
    C("resume-without-checkpoints", ["train", "--resume", "lm"], 1, "checkpoint",
      copy("lm"), remove("lm/checkpoints"), part="C"),
    C("resume-truncated-checkpoint", ["train", "--resume", "lm", "--max-steps", "4"], 1,
      "model.safetensors|checkpoint", copy("lm"),
      truncate("lm/checkpoints/step-00000002/model.safetensors", 100), part="C"),
    C("resume-checkpoint-file-replaced", ["train", "--resume", "lm", "--max-steps", "4"], 1,
      "trainer_state", copy("lm"),
      write("lm/checkpoints/step-00000002/trainer_state.json", "{not json"), part="C"),
    C("resume-trainer-state-not-json", ["train", "--resume", "lm", "--max-steps", "4"], 1,
      "trainer_state", copy("lm"),
      write("lm/checkpoints/step-00000002/trainer_state.json", "{not json"),
      recommit("lm/checkpoints/step-00000002"), part="C"),
    C("resume-mismatched-tokenizer", ["train", "--resume", "lm", "--max-steps", "4"], 1,
      "tokenizer", copy("lm"), edit_json("lm/checkpoints/step-00000002/tokenizer.json",
                                         _bigger_vocab),
      recommit("lm/checkpoints/step-00000002"), part="BC"),
    C("resume-weights-are-integers", ["train", "--resume", "lm", "--max-steps", "4"], 1,
      "dtype|int|float", copy("lm"),
      edit_tensors("lm/checkpoints/step-00000002/model.safetensors", _to_int),
      recommit("lm/checkpoints/step-00000002"), part="BC"),
    # ---------------------------------------------------------------- generate: options
    C("generate-temperature-nan", [*GEN, "--temperature", "nan"], 2, "--temperature",
      copy("lm"), part="B"),
    C("generate-temperature-inf", [*GEN, "--temperature", "inf"], 2, "--temperature",
      copy("lm"), part="B"),
    C("generate-temperature-negative", [*GEN, "--temperature", "-1"], 2, "temperature",
      copy("lm"), part="C"),
    # Either refused as below a documented minimum (2) or sampled greedily (0): part B says.
    C("generate-temperature-1e-40", [*GEN, "--temperature", "1e-40"], (0, 2), "temperature",
      copy("lm"), part="B"),
    C("generate-repetition-penalty-nan", [*GEN, "--repetition-penalty", "nan"], 2,
      "--repetition-penalty", copy("lm"), part="B"),
    C("generate-repetition-penalty-0", [*GEN, "--repetition-penalty", "0"], 2,
      "repetition", copy("lm"), part="B"),
    C("generate-repetition-penalty-negative", [*GEN, "--repetition-penalty", "-2"], 2,
      "repetition", copy("lm"), part="B"),
    C("generate-top-p-0", [*GEN, "--top-p", "0"], 2, "top", copy("lm"), part="C"),
    C("generate-top-p-1.5", [*GEN, "--top-p", "1.5"], 2, "top", copy("lm"), part="C"),
    C("generate-top-p-nan", [*GEN, "--top-p", "nan"], 2, "--top-p", copy("lm"), part="B"),
    C("generate-top-k-0", [*GEN, "--top-k", "0"], 2, "top", copy("lm"), part="C"),
    C("generate-top-k-negative", [*GEN, "--top-k", "-4"], 2, "top", copy("lm"), part="C"),
    C("generate-max-new-tokens-negative", [*GEN, "--max-new-tokens", "-5"], 2,
      "--max-new-tokens|max_new_tokens", copy("lm"), part="C"),
    C("generate-max-new-tokens-1e12", [*GEN, "--max-new-tokens", "1000000000000"], 1,
      "memory|max-new-tokens|max_new_tokens", copy("lm"), part="C"),
    C("generate-seed-too-big", [*GEN, "--seed", str(2**70)], 2, "seed", copy("lm"), part="D"),
    C("generate-empty-prompt", [*GEN, "--prompt", ""], 2, "prompt", copy("lm"), part="C"),
    C("generate-prompt-and-file", [*GEN, "--prompt", "a", "--prompt-file", "p.txt"], 2,
      "not allowed with", copy("lm")),
    C("generate-dtype-unknown", [*GEN, "--dtype", "float8"], 2, "--dtype", copy("lm")),
    C("generate-device-unknown", [*GEN, "--device", "quantum"], 2, "quantum", copy("lm"),
      part="D"),
    C("generate-no-run", ["generate", "--prompt", "a"], 2, "--run"),
    # ---------------------------------------------------------------- generate: prompt files
    C("generate-prompt-file-missing", [*GEN, "--prompt-file", "p.txt"], 1, "p.txt", copy("lm"),
      part="C"),
    C("generate-prompt-file-empty", [*GEN, "--prompt-file", "p.txt"], 1, "p.txt", copy("lm"),
      write("p.txt", ""), part="C"),
    C("generate-prompt-file-binary", [*GEN, "--prompt-file", "p.txt"], 1, "utf-8", copy("lm"),
      write("p.txt", b"\xff\xfe\x00abc"), part="C"),
    C("generate-prompt-file-directory", [*GEN, "--prompt-file", "d"], 1, "directory|d",
      copy("lm"), mkdir("d"), part="C"),
    C("generate-prompt-file-dev-zero", [*GEN, "--prompt-file", "/dev/zero"], 1, "/dev/zero",
      copy("lm"), part="C"),
    # ---------------------------------------------------------------- generate: run folders
    C("generate-run-missing", ["generate", "--run", "nowhere"], 1, "nowhere", part="C"),
    C("generate-run-is-a-file", ["generate", "--run", "f.txt"], 1, "f.txt",
      write("f.txt", "x"), part="C"),
    C("generate-run-empty-folder", ["generate", "--run", "empty"], 1, "empty", mkdir("empty"),
      part="C"),
    C("generate-run-no-weights", GEN, 1, "model.safetensors", copy("lm"),
      remove("lm/model.safetensors"), part="C"),
    C("generate-run-no-config", GEN, 1, "config.json", copy("lm"), remove("lm/config.json"),
      part="C"),
    C("generate-run-no-tokenizer", GEN, 1, "tokenizer.json", copy("lm"),
      remove("lm/tokenizer.json"), part="C"),
    C("generate-weights-truncated", GEN, 1, "model.safetensors", copy("lm"),
      truncate("lm/model.safetensors", 200), part="C"),
    C("generate-weights-empty", GEN, 1, "model.safetensors", copy("lm"),
      write("lm/model.safetensors", b""), part="C"),
    C("generate-weights-garbage", GEN, 1, "model.safetensors", copy("lm"),
      write("lm/model.safetensors", os.urandom(4096)), part="C"),
    C("generate-weights-are-integers", GEN, 1, "dtype|int|float", copy("lm"),
      edit_tensors("lm/model.safetensors", _to_int), part="BC"),
    C("generate-weights-wrong-shape", GEN, 1, "shape", copy("lm"),
      edit_tensors("lm/model.safetensors", _reshape_first_matrix), part="C"),
    C("generate-weights-missing-tensor", GEN, 1, "missing|model.safetensors", copy("lm"),
      edit_tensors("lm/model.safetensors", _drop_one), part="C"),
    C("generate-config-not-json", GEN, 1, "config.json", copy("lm"),
      write("lm/config.json", "{model: oops"), part="C"),
    C("generate-config-a-list", GEN, 1, "config.json", copy("lm"),
      write("lm/config.json", "[1, 2, 3]"), part="C"),
    C("generate-config-no-model-key", GEN, 1, "config.json|model", copy("lm"),
      edit_json("lm/config.json", lambda c: {"train": c["train"]}), part="C"),
    C("generate-config-string-size", GEN, 1, "d_model", copy("lm"),
      edit_json("lm/config.json", _set("model.d_model", "32")), part="BC"),
    C("generate-config-string-bool", GEN, 1, "tie_weights", copy("lm"),
      edit_json("lm/config.json", _set("model.tie_weights", "false")), part="BC"),
    C("generate-config-unknown-key", GEN, 1, "flux_capacitor", copy("lm"),
      edit_json("lm/config.json", _set("model.flux_capacitor", 3)), part="C"),
    C("generate-config-negative-vocab", GEN, 1, "vocab_size", copy("lm"),
      edit_json("lm/config.json", _set("model.vocab_size", -5)), part="C"),
    C("generate-config-heads-do-not-divide", GEN, 1, "n_heads|d_model", copy("lm"),
      edit_json("lm/config.json", _set("model.n_heads", 5)), part="C"),
    C("generate-config-a-million-layers", GEN, 1, "memory|n_layers", copy("lm"),
      edit_json("lm/config.json", _set("model.n_layers", 1_000_000)), part="C"),
    C("generate-config-d-model-1e9", GEN, 1, "memory|d_model", copy("lm"),
      edit_json("lm/config.json", _set("model.d_model", 1_000_000_000)), part="C"),
    C("generate-tokenizer-not-json", GEN, 1, "tokenizer.json", copy("lm"),
      write("lm/tokenizer.json", "\x00\x01"), part="C"),
    C("generate-tokenizer-unknown-type", GEN, 1, "tokenizer", copy("lm"),
      edit_json("lm/tokenizer.json", _set("type", "wordpiece")), part="C"),
    C("generate-tokenizer-larger-than-model", GEN, 1, "tokenizer", copy("lm"),
      edit_json("lm/tokenizer.json", _bigger_vocab), part="BC"),
    C("generate-classifier-run", ["generate", "--run", "clf"], 1, "classif", copy("clf"),
      part="C"),
    C("generate-seq2seq-run", ["generate", "--run", "s2s"], 1, "seq2seq", copy("s2s"),
      part="C"),
    C("generate-transformers-folder", ["generate", "--run", "hf"], 1, "hf|tokenizer.json",
      copy("hf"), part="C"),
    # ---------------------------------------------------------------- classify train
    C("classify-data-missing", [*CLF_TRAIN[:2], "--data", "no.csv", "--max-steps", "2"], 1,
      "no.csv", part="C"),
    C("classify-data-empty", [*CLF_TRAIN[:2], "--data", "e.csv", "--max-steps", "2"], 1,
      "e.csv", write("e.csv", ""), part="C"),
    C("classify-data-no-label-column", [*CLF_TRAIN[:2], "--data", "d.csv", "--max-steps", "2"],
      1, "label", write("d.csv", "text,kind\nab,x\nba,y\n" * 20), part="C"),
    C("classify-data-one-class", [*CLF_TRAIN[:2], "--data", "d.csv", "--max-steps", "2"], 1,
      "label|class", write("d.csv", "text,label\n" + "ab,yes\n" * 40), part="C"),
    C("classify-data-bad-jsonl", [*CLF_TRAIN[:2], "--data", "d.jsonl", "--max-steps", "2"], 1,
      "d.jsonl", write("d.jsonl", '{"text": "a", "label": "x"}\n{oops\n'), part="C"),
    C("classify-data-binary", [*CLF_TRAIN[:2], "--data", "d.csv", "--max-steps", "2"], 1,
      "d.csv|utf-8", write("d.csv", b"text,label\n\xff\xfe,1\n"), part="C"),
    C("classify-val-without-data", [*CLF_TRAIN, "--val", "v.csv"], 2, "--val",
      write("v.csv", CSV), part="C"),
    C("classify-seq-len-with-data", [*CLF_TRAIN, "--data", "d.csv"], 2, "--seq-len",
      write("d.csv", CSV), part="C"),
    C("classify-val-fraction-1.5", [*CLF_TRAIN[:2], "--data", "d.csv", "--val-fraction", "1.5"],
      2, "val", write("d.csv", CSV), part="C"),
    C("classify-val-fraction-nan", [*CLF_TRAIN[:2], "--data", "d.csv", "--val-fraction", "nan"],
      2, "--val-fraction", write("d.csv", CSV), part="B"),
    C("classify-lr-nan", [*CLF_TRAIN, "--lr", "nan"], 2, "--lr", part="B"),
    C("classify-pooling-unknown", [*CLF_TRAIN, "--pooling", "max"], 2, "--pooling"),
    C("classify-out-empty", [*CLF_TRAIN, "--out", ""], 2, "--out", part="A"),
    C("classify-out-lm-run", [*CLF_TRAIN, "--out", "lm"], 1, "lm", copy("lm"), part="AC"),
    C("classify-out-foreign", [*CLF_TRAIN, "--out", "theirs"], 1, "theirs", foreign("theirs"),
      part="AC"),
    # an option beyond config.MODEL_LIMITS is a usage error (2); the same size read from a
    # config.json is a runtime one (1, generate-config-d-model-1e9)
    C("classify-d-model-1e9", [*CLF_TRAIN, "--d-model", "1000000000"], 2,
      "d_model|d-model", part="C"),
    # ---------------------------------------------------------------- classify predict
    C("predict-lm-run", ["classify", "predict", "--run", "lm", "--text", "ab"], 1,
      "classif|lm", copy("lm"), part="C"),
    C("predict-seq2seq-run", ["classify", "predict", "--run", "s2s", "--text", "ab"], 1,
      "classif|seq2seq", copy("s2s"), part="C"),
    C("predict-run-missing", ["classify", "predict", "--run", "gone", "--text", "ab"], 1,
      "gone", part="C"),
    C("predict-no-labels", ["classify", "predict", "--run", "clf", "--text", "()"], 1,
      "labels.json", copy("clf"), remove("clf/labels.json"), part="C"),
    C("predict-labels-not-json", ["classify", "predict", "--run", "clf", "--text", "()"], 1,
      "labels.json", copy("clf"), write("clf/labels.json", "balanced, unbalanced"), part="C"),
    C("predict-labels-mismatch", ["classify", "predict", "--run", "clf", "--text", "()"], 1,
      "labels", copy("clf"), edit_json("clf/labels.json", _set("labels", ["a", "b", "c"])),
      part="BC"),
    C("predict-weights-truncated", ["classify", "predict", "--run", "clf", "--text", "()"], 1,
      "model.safetensors", copy("clf"), truncate("clf/model.safetensors", 64), part="C"),
    C("predict-config-wrong-type", ["classify", "predict", "--run", "clf", "--text", "()"], 1,
      "num_classes", copy("clf"), edit_json("clf/config.json",
                                            _set("classifier.num_classes", "two")), part="BC"),
    C("predict-data-missing", ["classify", "predict", "--run", "clf", "--data", "x.csv"], 1,
      "x.csv", copy("clf"), part="C"),
    C("predict-unknown-label", ["classify", "predict", "--run", "clf", "--data", "d.csv",
                                "--label-col", "label"], 1, "maybe",
      copy("clf"), write("d.csv", "text,label\n(),balanced\n)(,maybe\n"), part="C"),
    C("predict-confusion-without-labels", ["classify", "predict", "--run", "clf", "--text",
                                           "()", "--confusion", "c.png"], 2, "--confusion",
      copy("clf"), part="C"),
    C("predict-no-input", ["classify", "predict", "--run", "clf"], 2, "--text", copy("clf")),
    # ---------------------------------------------------------------- seq2seq
    C("seq2seq-max-len-1e6", [*S2S_TRAIN, "--max-len", "1000000"], 1, "memory|max-len|max_len",
      part="C"),
    C("seq2seq-min-over-max", [*S2S_TRAIN, "--min-len", "9", "--max-len", "4"], 2,
      "min", part="C"),
    C("seq2seq-task-unknown", [*S2S_TRAIN, "--task", "fly"], 2, "--task"),
    C("seq2seq-out-empty", [*S2S_TRAIN, "--out", ""], 2, "--out", part="A"),
    C("seq2seq-out-lm-run", [*S2S_TRAIN, "--out", "lm"], 1, "lm", copy("lm"), part="AC"),
    C("seq2seq-lr-inf", [*S2S_TRAIN, "--lr", "inf"], 2, "--lr", part="B"),
    C("seq2seq-predict-lm-run", ["seq2seq", "predict", "--run", "lm", "--text", "123"], 1,
      "seq2seq|lm", copy("lm"), part="C"),
    C("seq2seq-predict-classifier-run", ["seq2seq", "predict", "--run", "clf", "--text", "1"],
      1, "seq2seq|classif", copy("clf"), part="C"),
    C("seq2seq-predict-missing-run", ["seq2seq", "predict", "--run", "gone", "--text", "1"], 1,
      "gone", part="C"),
    C("seq2seq-predict-no-weights", ["seq2seq", "predict", "--run", "s2s", "--text", "12"], 1,
      "model.safetensors", copy("s2s"), remove("s2s/model.safetensors"), part="C"),
    C("seq2seq-predict-config-wrong-type", ["seq2seq", "predict", "--run", "s2s", "--text",
                                            "12"], 1, "n_layers", copy("s2s"),
      edit_json("s2s/config.json", _set("seq2seq.encoder.n_layers", 1.5)), part="BC"),
    C("seq2seq-predict-no-text", ["seq2seq", "predict", "--run", "s2s"], 2, "--text",
      copy("s2s")),
    # ---------------------------------------------------------------- doctor
    C("doctor-run-missing", ["doctor", "--run", "gone"], 1, "gone", part="C"),
    C("doctor-run-classifier", ["doctor", "--run", "clf"], 1, "classif|lm", copy("clf"),
      part="C"),
    C("doctor-run-seq2seq", ["doctor", "--run", "s2s"], 1, "seq2seq|lm", copy("s2s"), part="C"),
    C("doctor-run-damaged", ["doctor", "--run", "lm"], 1, "model.safetensors", copy("lm"),
      truncate("lm/model.safetensors", 10), part="C"),
    C("doctor-config-missing", ["doctor", "--config", "m.json"], 1, "m.json", part="C"),
    C("doctor-config-not-json", ["doctor", "--config", "m.json"], 1, "m.json",
      write("m.json", "d_model = 16"), part="C"),
    C("doctor-config-a-list", ["doctor", "--config", "m.json"], 1, "m.json",
      write("m.json", "[16, 2]"), part="C"),
    C("doctor-config-wrong-type", ["doctor", "--config", "m.json"], 1, "d_model",
      write("m.json", json.dumps({**LM_CONFIG, "d_model": "big"})), part="BC"),
    C("doctor-config-unknown-key", ["doctor", "--config", "m.json"], 1, "warp_drive",
      write("m.json", json.dumps({**LM_CONFIG, "warp_drive": True})), part="C"),
    C("doctor-config-vocab-too-small", ["doctor", "--config", "m.json"], 1, "vocab_size",
      write("m.json", json.dumps({**LM_CONFIG, "vocab_size": 3})), part="C"),
    C("doctor-config-a-million-layers", ["doctor", "--config", "m.json"], 1,
      "memory|n_layers", write("m.json", json.dumps({**LM_CONFIG, "vocab_size": 200,
                                                      "n_layers": 1_000_000})), part="C"),
    C("doctor-data-missing", [*DOCTOR, "--data", "t.txt"], 1, "t.txt", part="C"),
    C("doctor-data-empty", [*DOCTOR, "--data", "t.txt"], 1, "t.txt", write("t.txt", ""),
      part="C"),
    C("doctor-data-dev-zero", [*DOCTOR, "--data", "/dev/zero"], 1, "/dev/zero", part="C"),
    C("doctor-batch-size-0", [*DOCTOR, "--batch-size", "0"], 2, "--batch-size"),
    C("doctor-batch-size-text", [*DOCTOR, "--batch-size", "four"], 2, "--batch-size"),
    C("doctor-lr-nan", [*DOCTOR, "--lr", "nan"], 2, "--lr", part="B"),
    C("doctor-run-and-config", ["doctor", "--run", "lm", "--config", "m.json"], 2,
      "not allowed with", copy("lm")),
    C("doctor-pictures-is-a-file", [*DOCTOR, "--pictures", "pics"], 1, "pics",
      write("pics", "not a folder"), part="AC"),
    C("doctor-pictures-foreign-folder", [*DOCTOR, "--pictures", "theirs"], 1, "theirs",
      foreign("theirs"), part="AC"),
    # ---------------------------------------------------------------- explore
    C("explore-run-missing", [*EXPLORE, "--run", "gone"], 1, "gone", part="C"),
    C("explore-seq2seq-run", [*EXPLORE, "--run", "s2s"], 1, "seq2seq", copy("s2s"), part="C"),
    C("explore-damaged-config", [*EXPLORE, "--run", "lm"], 1, "config.json", copy("lm"),
      write("lm/config.json", "{"), part="C"),
    C("explore-mismatched-tokenizer", [*EXPLORE, "--run", "lm"], 1, "tokenizer", copy("lm"),
      edit_json("lm/tokenizer.json", _bigger_vocab), part="BC"),
    C("explore-remote-host", [*EXPLORE, "--run", "lm", "--host", "0.0.0.0"], 2,
      "--allow-remote", copy("lm"), part="C"),
    C("explore-host-not-an-address", [*EXPLORE, "--run", "lm", "--host", "not a host!"], 2,
      "--allow-remote", copy("lm"), part="C"),
    C("explore-host-unresolvable", [*EXPLORE, "--run", "lm", "--host", "nowhere.invalid",
                                    "--allow-remote"], 1, "nowhere.invalid", copy("lm"),
      part="C"),
    C("explore-host-bad-ip", [*EXPLORE, "--run", "lm", "--host", "999.1.1.1",
                              "--allow-remote"], 1, "999.1.1.1", copy("lm"), part="C"),
    C("explore-port-busy", ["explore", "--run", "lm", "--port", "{busy_port}"], 1,
      "{busy_port}", copy("lm"), part="C"),
    C("explore-port-too-big", ["explore", "--run", "lm", "--port", "70000"], 2, "--port",
      copy("lm")),
    C("explore-port-negative", ["explore", "--run", "lm", "--port", "-1"], 2, "--port",
      copy("lm")),
    C("explore-port-text", ["explore", "--run", "lm", "--port", "http"], 2, "--port",
      copy("lm")),
    C("explore-device-unknown", [*EXPLORE, "--run", "lm", "--device", "quantum"], 2, "quantum",
      copy("lm"), part="D"),
    # ---------------------------------------------------------------- embed
    C("embed-model-missing", ["embed", "--model", "gone", "a cat"], 1, "gone", part="C"),
    C("embed-model-a-file", ["embed", "--model", "f.bin", "a cat"], 1, "f.bin",
      write("f.bin", b"\x00" * 64), part="C"),
    C("embed-model-empty-folder", ["embed", "--model", "empty", "a cat"], 1, "empty",
      mkdir("empty"), part="C"),
    C("embed-model-lm-run", ["embed", "--model", "lm", "a cat"], 1, "lm|bert", copy("lm"),
      part="C"),
    C("embed-model-gpt2-folder", ["embed", "--model", "hf", "a cat"], 1, "hf|bert", copy("hf"),
      part="C"),
    C("embed-no-sentences", ["embed"], 2, "sentences"),
    C("embed-bert-weights-truncated", ["embed", "--model", "bert", "a cat"], 1,
      "model.safetensors", bert("bert"), part="D"),
    C("embed-bert-config-not-json", ["embed", "--model", "bert", "a cat"], 1, "config.json",
      bert("bert", config="{'hidden_size': 384}"), part="D"),
    C("embed-bert-config-gpt2", ["embed", "--model", "bert", "a cat"], 1, "model_type",
      bert("bert", config='{"model_type": "gpt2"}'), part="C"),
    # ---------------------------------------------------------------- convert
    C("convert-no-direction", ["convert", "lm", "out"], 2, "--to|--from", copy("lm")),
    C("convert-src-missing", ["convert", "--to", "hf", "gone", "out"], 1, "gone", part="C"),
    C("convert-classifier-run", ["convert", "--to", "hf", "clf", "out"], 1, "classif|clf",
      copy("clf"), part="C"),
    C("convert-seq2seq-run", ["convert", "--to", "hf", "s2s", "out"], 1, "seq2seq|s2s",
      copy("s2s"), part="C"),
    C("convert-damaged-run", ["convert", "--to", "hf", "lm", "out"], 1, "config.json",
      copy("lm"), write("lm/config.json", "nope"), part="C"),
    C("convert-mismatched-tokenizer", ["convert", "--to", "hf", "lm", "out"], 1, "tokenizer",
      copy("lm"), edit_json("lm/tokenizer.json", _bigger_vocab), part="BC"),
    C("convert-into-foreign-folder", ["convert", "--to", "hf", "lm", "theirs"], 1, "theirs",
      copy("lm"), foreign("theirs"), part="AC"),
    C("convert-into-a-file", ["convert", "--to", "hf", "lm", "out.txt"], 1, "out.txt",
      copy("lm"), write("out.txt", "mine"), part="AC"),
    C("convert-into-itself", ["convert", "--to", "hf", "lm", "lm"], 1, "lm", copy("lm"),
      part="AC"),
    C("convert-out-empty", ["convert", "--to", "hf", "lm", ""], 2, "dst|out|empty",
      copy("lm"), part="A"),
    C("convert-from-not-transformers", ["convert", "--from", "hf", "lm", "back"], 1, "lm",
      copy("lm"), part="C"),
    C("convert-from-missing", ["convert", "--from", "hf", "gone", "back"], 1, "gone",
      part="C"),
    C("convert-from-bad-config", ["convert", "--from", "hf", "hf", "back"], 1, "config.json",
      copy("hf"), write("hf/config.json", "{]"), part="D"),
    C("convert-from-into-classifier-run", ["convert", "--from", "hf", "hf", "clf"], 1, "clf",
      copy("hf"), hf_tokenizer("hf"), copy("clf"), part="AC"),
    C("convert-from-into-foreign-folder", ["convert", "--from", "hf", "hf", "theirs"], 1,
      "theirs", copy("hf"), hf_tokenizer("hf"), foreign("theirs"), part="AC"),
    C("convert-from-tokenizer-too-big", ["convert", "--from", "hf", "hf", "back"], 1,
      "tokenizer", copy("hf"), hf_tokenizer("hf", size=5000), part="C"),
    # ---------------------------------------------------------------- experiment, bench
    C("experiment-no-name", ["experiment"], 2, "required|experiment"),
    C("experiment-steps-0", ["experiment", "length", "--quick", "--steps", "0"], 2, "--steps",
      part="D"),
    C("experiment-steps-negative", ["experiment", "length", "--quick", "--steps", "-3"], 2,
      "--steps", part="D"),
    C("experiment-train-len-0", ["experiment", "length", "--quick", "--train-len", "0"], 2,
      "--train-len", part="D"),
    C("experiment-positional-unknown", ["experiment", "length", "--positional", "spiral"], 2,
      "--positional"),
    C("experiment-out-is-a-file", ["experiment", "length", "--quick", "--steps", "1",
                                   "--positional", "learned", "--out", "r.txt"], 1, "r.txt",
      write("r.txt", "mine"), part="C"),
    C("bench-only-unknown", ["bench", "--only", "everything"], 2, "--only"),
    C("bench-out-dir-is-a-file", ["bench", "--quick", "--only", "tokenizer", "--out-dir",
                                  "r.txt"], 1, "r.txt", write("r.txt", "mine"), part="C"),
    C("bench-out-dir-foreign", ["bench", "--quick", "--only", "tokenizer", "--out-dir",
                                "theirs"], 1, "theirs", foreign("theirs"), part="AC"),
    C("bench-data-missing", ["bench", "--quick", "--only", "time_to_loss", "--data", "t.txt",
                             "--out-dir", "out"], 1, "t.txt", part="C"),
    # ================================================================ the second sweep
    # Part "E": a run folder is untrusted input (its marker, links, checkpoints), no trained
    # run replaced without a word, nothing non-finite committed, tokenizers that do not fit.
    # ---------------------------------------------------------------- markers
    C("train-out-marker-names-the-parent", [*TRAIN, "--out", "parent/lm"], 1,
      ".handformer.json", copy("lm", "parent/lm"), write("parent/notes.txt", "mine\n"),
      marker("parent/lm", names=["../*"]), part="E"),
    C("train-overwrite-marker-names-the-parent", [*TRAIN, "--out", "parent/lm", "--overwrite"],
      1, ".handformer.json", copy("lm", "parent/lm"), write("parent/notes.txt", "mine\n"),
      marker("parent/lm", names=["../*"]), part="E"),
    C("train-out-marker-names-everything", [*TRAIN, "--out", "lm"], 1, "'*'",
      copy("lm"), write("lm/notes.txt", "mine\n"), marker("lm", names=["*"]), part="E"),
    C("train-overwrite-marker-names-everything", [*TRAIN, "--out", "lm", "--overwrite"], 1,
      "'*'", copy("lm"), write("lm/notes.txt", "mine\n"), marker("lm", names=["*"]),
      part="E"),
    C("train-out-marker-names-an-absolute-path", [*TRAIN, "--out", "lm", "--overwrite"], 1,
      "not a plain name", copy("lm"), write("victim.txt", "mine\n"),
      marker("lm", names=lambda case: [str(case / "victim.txt")]), part="E"),
    C("train-out-marker-names-a-users-file", [*TRAIN, "--out", "lm", "--overwrite"], 1,
      "notes.txt", copy("lm"), write("lm/notes.txt", "mine\n"),
      marker("lm", names=["model.safetensors", "notes.txt"]), part="E"),
    C("train-out-marker-checkpoints-of-another-run", [*TRAIN, "--out", "lm", "--overwrite"], 1,
      "checkpoint folder", copy("lm"), copy("lm", "other"),
      marker("lm", checkpoints="../other/checkpoints"), part="E"),
    C("train-out-marker-checkpoints-absolute", [*TRAIN, "--out", "lm", "--overwrite"], 1,
      "checkpoint folder", copy("lm"), copy("lm", "other"),
      marker("lm", checkpoints=lambda case: str(case / "other" / "checkpoints")), part="E"),
    C("train-out-marker-checkpoints-a-users-folder", [*TRAIN, "--out", "lm", "--overwrite"], 1,
      "checkpoint folder", copy("lm"), write("lm/mine/step-00000001/COMMITTED.json", "{}"),
      marker("lm", checkpoints="mine"), part="E"),
    C("train-out-marker-kept-not-a-list", [*TRAIN, "--out", "lm"], 1, "damaged",
      copy("lm"), marker("lm", kept="../*"), part="E"),
    C("train-out-marker-of-an-unknown-kind", [*TRAIN, "--out", "lm"], 1, "does not know",
      copy("lm"), marker("lm", kind="time-machine", names=["*"]), part="E"),
    C("classify-out-marker-names-the-parent", [*CLF_TRAIN, "--out", "parent/clf",
                                               "--overwrite"], 1, ".handformer.json",
      copy("clf", "parent/clf"), write("parent/notes.txt", "mine\n"),
      marker("parent/clf", names=["../*"]), part="E"),
    C("seq2seq-out-marker-names-everything", [*S2S_TRAIN, "--out", "s2s", "--overwrite"], 1,
      "'*'", copy("s2s"), marker("s2s", names=["*"]), part="E"),
    C("convert-to-hf-marker-names-the-parent", ["convert", "--to", "hf", "lm", "out/hf",
                                                "--overwrite"], 1, ".handformer.json",
      copy("lm"), copy("hf", "out/hf"), write("out/notes.txt", "mine\n"),
      marker("out/hf", names=["../*"]), part="E"),
    C("bench-out-dir-marker-names-the-parent", ["bench", "--quick", "--only", "tokenizer",
                                                "--out-dir", "parent/b"], 1, ".handformer.json",
      write("parent/notes.txt", "mine\n"),
      write("parent/b/.handformer.json", json.dumps({
          "format": "handformer-folder", "version": 1, "kind": "bench",
          "what": "benchmark results", "command": "handformer bench", "names": ["../*"],
          "checkpoints": None, "resume": None, "kept": []})), part="E"),
    C("doctor-pictures-marker-names-everything", [*DOCTOR, "--pictures", "pics"], 1, "'*'",
      write("pics/notes.txt", "mine\n"),
      write("pics/.handformer.json", json.dumps({
          "format": "handformer-folder", "version": 1, "kind": "doctor-pictures",
          "what": "the doctor's pictures", "command": "handformer doctor --pictures",
          "names": ["*"], "checkpoints": None, "resume": None, "kept": []})), part="E"),
    # ---------------------------------------------------------------- links
    C("train-out-marker-is-a-link", [*TRAIN, "--out", "lm", "--overwrite"], 1,
      "symbolic link", copy("lm"), write("elsewhere.json", "{}"),
      link("lm/.handformer.json", "../elsewhere.json"), part="E"),
    C("train-out-lock-is-a-link", [*TRAIN, "--out", "lm", "--overwrite"], 1, "symbolic link",
      copy("lm"), write("victim.txt", "do not truncate\n"),
      link("lm/.handformer.lock", "../victim.txt"), part="E"),
    C("train-out-checkpoints-link-to-another-run", [*TRAIN, "--out", "fresh"], 1,
      "symbolic link", copy("lm"), mkdir("fresh"),
      link("fresh/checkpoints", "../lm/checkpoints"), part="E"),
    C("train-overwrite-checkpoints-link-to-another-run", [*TRAIN, "--out", "fresh",
                                                          "--overwrite"], 1, "symbolic link",
      copy("lm"), mkdir("fresh"), write("fresh/notes.txt", "mine\n"),
      link("fresh/checkpoints", "../lm/checkpoints"), part="E"),
    C("train-out-checkpoint-entry-is-a-link", [*TRAIN, "--out", "lm", "--overwrite"], 1,
      "step-00000009", copy("lm"), copy("lm", "other"),
      link("lm/checkpoints/step-00000009", "../../other/checkpoints/step-00000002"), part="E"),
    C("train-out-weights-are-a-link", [*TRAIN, "--out", "lm", "--overwrite"], 1,
      "model.safetensors", copy("lm"), copy("lm", "other"),
      link("lm/model.safetensors", "../other/model.safetensors"), part="E"),
    C("train-out-tensorboard-is-a-link", [*TRAIN, "--out", "lm", "--overwrite"], 1,
      "tensorboard", copy("lm"), write("theirs/events.out.tfevents.1", b"\x00theirs"),
      link("lm/tensorboard", "../theirs"), part="E"),
    C("resume-checkpoints-link-to-another-run", [*RESUME[:2], "lm2", *RESUME[3:]], 1,
      "symbolic link", copy("lm"), copy("lm", "lm2"),
      link("lm2/checkpoints", "../lm/checkpoints"), part="E"),
    C("resume-checkpoint-is-a-link", RESUME, 1, "step-00000002", copy("lm"),
      copy("lm", "other"), link(CKPT, "../../other/checkpoints/step-00000002"), part="E"),
    C("resume-metrics-is-a-link", RESUME, 1, "metrics.jsonl", copy("lm"),
      write("victim.txt", "do not append\n"), link("lm/metrics.jsonl", "../victim.txt"),
      part="E"),
    C("resume-checkpoint-file-is-a-link", RESUME, 1, "trainer_state.json", copy("lm"),
      copy("lm", "other"),
      link(f"{CKPT}/trainer_state.json",
           "../../../other/checkpoints/step-00000002/trainer_state.json"), part="E"),
    # ---------------------------------------------------------------- replaced runs
    C("train-out-finished-run", [*TRAIN, "--out", "lm"], 1, "finished (trained 2 steps",
      copy("lm"), part="E"),
    C("train-draft-for-itself", ["train", "--draft-for", "lm", "--out", "lm", "--max-steps",
                                 "2", "--no-progress"], 2, "--draft-for", copy("lm"),
      part="E"),
    C("train-draft-for-itself-overwrite", ["train", "--draft-for", "lm", "--out", "./lm",
                                           "--max-steps", "2", "--no-progress",
                                           "--overwrite"], 2, "--draft-for", copy("lm"),
      part="E"),
    C("train-draft-into-a-finished-run", ["train", "--draft-for", "lm", "--out", "lm2",
                                          "--max-steps", "2", "--no-progress"], 1, "finished",
      copy("lm"), copy("lm", "lm2"), part="E"),
    C("classify-out-finished-run", [*CLF_TRAIN, "--out", "clf"], 1, "finished", copy("clf"),
      part="E"),
    C("seq2seq-out-finished-run", [*S2S_TRAIN, "--out", "s2s"], 1, "finished", copy("s2s"),
      part="E"),
    C("convert-from-into-a-trained-run", ["convert", "--from", "hf", "hf", "lm"], 1,
      "finished (trained 2 steps", copy("hf"), hf_tokenizer("hf"), copy("lm"), part="E"),
    C("convert-quantize-into-a-trained-run", ["convert", "--quantize", "int8", "lm", "lm2"], 1,
      "finished (trained 2 steps", copy("lm"), copy("lm", "lm2"), part="E"),
    C("convert-quantize-into-itself", ["convert", "--quantize", "int8", "lm", "lm"], 1,
      "source", copy("lm"), part="E"),
    # An export into a folder whose marker records the user's handformer_tokenizer.json as
    # theirs: the export succeeds and the file stays.
    C("convert-to-hf-keeps-the-users-handformer-tokenizer", ["convert", "--to", "hf", "lm",
                                                             "out"], 0, "",
      copy("lm"), write("out/handformer_tokenizer.json", '{"mine": true}'),
      claimed_for_hf_export("out"), part="E"),
    C("convert-to-hf-overwrite-keeps-the-users-handformer-tokenizer",
      ["convert", "--to", "hf", "lm", "out", "--overwrite"], 0, "", copy("lm"),
      write("out/handformer_tokenizer.json", '{"mine": true}'), write("out/notes.txt", "mine"),
      part="E"),
    # ---------------------------------------------------------------- non-finite state
    C("resume-optimizer-state-nan", RESUME, 1, "trainer_state.safetensors", copy("lm"),
      edit_tensors(f"{CKPT}/trainer_state.safetensors", _non_finite("optimizer.", math.nan)),
      recommit(CKPT), part="E"),
    C("resume-optimizer-state-inf", RESUME, 1, "nan or inf", copy("lm"),
      edit_tensors(f"{CKPT}/trainer_state.safetensors", _non_finite("optimizer.", math.inf)),
      recommit(CKPT), part="E"),
    C("resume-weights-nan", RESUME, 1, "model.safetensors", copy("lm"),
      edit_tensors(f"{CKPT}/model.safetensors", _non_finite("", math.nan)),
      recommit(CKPT), part="E"),
    C("resume-weights-minus-inf", RESUME, 1, "nan or inf", copy("lm"),
      edit_tensors(f"{CKPT}/model.safetensors", _non_finite("blocks.", -math.inf)),
      recommit(CKPT), part="E"),
    C("resume-recipe-differs-from-its-state", RESUME, 1, "base_lr", copy("lm"),
      edit_json(f"{CKPT}/config.json", _set("train.lr", 0.5)), recommit(CKPT), part="E"),
    C("resume-checkpoint-renamed", RESUME, 1, "records step 2", copy("lm"),
      rename(CKPT, "lm/checkpoints/step-00000007"), part="E"),
    C("resume-trainer-state-step-differs", RESUME, 1, "step", copy("lm"),
      edit_json(f"{CKPT}/trainer_state.json", _set("step", 1)), recommit(CKPT), part="E"),
    # ---------------------------------------------------------------- tokenizers that do not fit
    C("generate-tokenizer-smaller-than-model", GEN, 1, "character tokenizer", copy("lm"),
      edit_json("lm/tokenizer.json", _smaller_vocab), part="E"),
    C("explore-tokenizer-smaller-than-model", [*EXPLORE, "--run", "lm"], 1, "tokens but",
      copy("lm"), edit_json("lm/tokenizer.json", _smaller_vocab), part="E"),
    C("convert-tokenizer-smaller-than-model", ["convert", "--to", "hf", "lm", "out"], 1,
      "tokenizer.json", copy("lm"), edit_json("lm/tokenizer.json", _smaller_vocab), part="E"),
    C("convert-quantize-tokenizer-smaller", ["convert", "--quantize", "int8", "lm", "out"], 1,
      "tokenizer.json", copy("lm"), edit_json("lm/tokenizer.json", _smaller_vocab), part="E"),
    C("doctor-run-tokenizer-smaller", ["doctor", "--run", "lm"], 1, "tokenizer.json",
      copy("lm"), edit_json("lm/tokenizer.json", _smaller_vocab), part="E"),
    C("resume-tokenizer-smaller", RESUME, 1, "tokenizer.json", copy("lm"),
      edit_json(f"{CKPT}/tokenizer.json", _smaller_vocab), recommit(CKPT), part="E"),
    C("embed-binary-bytes", ["embed", "a cat", "\udcff\udcfe"], 2, "utf-8", part="E"),
    # ---------------------------------------------------------------- another process writes it
    C("train-out-busy", [*TRAIN, "--out", "lm", "--overwrite"], 1, "another handformer process",
      copy("lm"), locked("lm"), part="E"),
    C("resume-busy", RESUME, 1, "another handformer process", copy("lm"), locked("lm"),
      part="E"),
    C("convert-quantize-into-busy", ["convert", "--quantize", "int8", "lm", "lm2",
                                     "--overwrite"], 1, "another handformer process",
      copy("lm"), copy("lm", "lm2"), locked("lm2"), part="E"),
    C("classify-out-busy", [*CLF_TRAIN, "--out", "clf", "--overwrite"], 1,
      "another handformer process", copy("clf"), locked("clf"), part="E"),
    C("convert-to-hf-busy", ["convert", "--to", "hf", "lm", "hf", "--overwrite"], 1,
      "another handformer process", copy("lm"), copy("hf"), locked("hf"), part="E"),
]


# -- running the table ----------------------------------------------------------------------
def _tree(root: Path) -> dict[str, tuple[str, int, str]]:
    """Every file and folder under ``root``: kind, size and sha256 (files). A run folder's
    lock file is left out: it is handformer's own, and by design (runs/lock.py) holds the
    PID of whichever command last took the lock, refused or not."""
    from handformer.runs.lock import LOCK_FILE

    found: dict[str, tuple[str, int, str]] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.name == LOCK_FILE:
            continue
        if path.is_symlink():
            found[rel] = ("link", 0, os.readlink(path))
        elif path.is_dir():
            found[rel] = ("dir", 0, "")
        elif path.is_file():
            found[rel] = ("file", path.stat().st_size,
                          hashlib.sha256(path.read_bytes()).hexdigest())
    return found


def _build(argv: list[str], root: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "handformer", *argv], cwd=root, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fixtures]:
    """The run folders the cases copy and damage, built by the CLI itself."""
    root = tmp_path_factory.mktemp("bad-input-fixtures")
    jobs = {
        "lm": _build([*TRAIN, "--out", "lm"], root),
        "clf": _build([*CLF_TRAIN, "--out", "clf"], root),
        "s2s": _build([*S2S_TRAIN, "--out", "s2s"], root),
    }
    for name, proc in jobs.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"building the {name} fixture failed:\n{out[-3000:]}"
    proc = _build(["convert", "--to", "hf", "lm", "hf"], root)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    with socket.socket() as busy:  # a port that is taken while the cases run
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield Fixtures(root / "lm", root / "clf", root / "s2s", root / "hf",
                       {"busy_port": str(busy.getsockname()[1])})


@dataclass
class Outcome:
    code: int | None
    signal: int | None
    timed_out: bool
    seconds: float
    stdout: str
    stderr: str
    before: dict[str, tuple[str, int, str]]
    after: dict[str, tuple[str, int, str]]


def _selected(request: pytest.FixtureRequest) -> list[Case]:
    """The cases this session selected (``-k`` runs only those)."""
    ids = {item.callspec.params["case"].id for item in request.session.items
           if item.originalname == "test_bad_input" and hasattr(item, "callspec")}
    return [case for case in CASES if case.id in ids]


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest, fixtures: Fixtures,
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    cases = _selected(request)
    root = tmp_path_factory.mktemp("bad-input")
    specs, befores = [], {}
    for case in cases:
        folder = root / "cases" / case.id
        folder.mkdir(parents=True)
        for step in case.setup:
            step(folder, fixtures)
        befores[case.id] = _tree(folder)
        logs = root / "logs" / case.id
        logs.mkdir(parents=True)
        specs.append({"id": case.id, "cwd": str(folder), "timeout": case.timeout,
                      "argv": [a.format(**fixtures.values) for a in case.argv],
                      "stdout": str(logs / "stdout"), "stderr": str(logs / "stderr")})
    if not specs:
        return {}
    spec_path, results_path = root / "spec.json", root / "results.json"
    spec_path.write_text(json.dumps(specs), encoding="utf-8")
    budget = sum(s["timeout"] for s in specs) / 2 + 120
    driver = subprocess.run([sys.executable, str(DRIVER), str(spec_path), str(results_path),
                             "--jobs", "2"], env=ENV, capture_output=True, text=True,
                            timeout=budget)
    assert driver.returncode == 0, driver.stderr[-4000:]
    results = json.loads(results_path.read_text(encoding="utf-8"))
    found = {}
    for case in cases:
        logs = root / "logs" / case.id
        r = results[case.id]
        found[case.id] = Outcome(
            r["code"], r["signal"], r["timed_out"], r["seconds"],
            (logs / "stdout").read_text(encoding="utf-8", errors="replace"),
            (logs / "stderr").read_text(encoding="utf-8", errors="replace"),
            befores[case.id], _tree(root / "cases" / case.id))
    summary = root / "summary.txt"  # for the person reading a failure
    summary.write_text("\n".join(f"{cid}\t{o.code}\t{o.seconds}s\t{o.stderr.strip()[-200:]!r}"
                                 for cid, o in found.items()), encoding="utf-8")
    return found


def check_failure(command: str, code: int | tuple[int, ...], message: str, *,
                  returncode: int | None, stdout: str, stderr: str) -> None:
    """THE CONTRACT for a failed command (or, where ``code`` allows 0, a clean success)."""
    allowed = code if isinstance(code, tuple) else (code,)
    shown = f"exit {returncode}\n--- stderr ---\n{stderr[-3000:]}\n--- stdout ---\n" \
            f"{stdout[-1500:]}"
    assert "Traceback" not in stderr and "Traceback" not in stdout, shown
    assert returncode in allowed, f"expected exit {allowed}; {shown}"
    lines = [line for line in stderr.splitlines() if line.strip()]
    prefix = f"handformer {command}".strip()
    if returncode == 0:
        assert not any(": error:" in line for line in lines), shown
        return
    assert lines, f"nothing on stderr; {shown}"
    errors = [line for line in lines if ": error:" in line]
    assert len(errors) == 1 and errors[0] == lines[-1], f"expected one error line, last; {shown}"
    # an unknown command (or none) is refused by the top-level parser, "handformer:"
    speaker = rf"handformer( {re.escape(command)}( [a-z]+)?)?" if returncode == 2 else \
        rf"{re.escape(prefix)}( [a-z]+)?"
    said = re.match(rf"^({speaker}): error: \S", lines[-1])
    assert said, shown
    if returncode == 2:
        assert lines[-1].endswith(f" (see {said.group(1)} --help)"), shown
    for line in lines[:-1]:  # warnings only
        assert line.startswith(prefix) and ": warning: " in line, \
            f"unexpected line {line!r}; {shown}"
    text = lines[-1].lower()
    assert any(piece.lower() in text for piece in message.split("|")), \
        f"the error should mention {message!r}; {shown}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, outcomes: dict[str, Outcome], fixtures: Fixtures) -> None:
    out = outcomes[case.id]
    assert not out.timed_out, f"no answer within {case.timeout:.0f}s (a hang)\n" \
                              f"{out.stderr[-2000:]}"
    assert out.signal is None, f"killed by signal {out.signal}\n{out.stderr[-2000:]}"
    check_failure(case.argv[0] if case.argv else "", case.code,
                  case.message.format(**fixtures.values), returncode=out.code,
                  stdout=out.stdout, stderr=out.stderr)
    changed = {name: (was, out.after.get(name)) for name, was in out.before.items()
               if out.after.get(name) != was}
    assert not changed, f"files that were there before changed or vanished: {changed}"


def test_the_table_is_big_and_its_ids_unique() -> None:
    assert len(CASES) >= 250
    assert sum(c.part == "E" for c in CASES) >= 40  # the second sweep's
    assert len({c.id for c in CASES}) == len(CASES)
    commands = {c.argv[0] for c in CASES if c.argv}
    assert commands >= {"train", "generate", "classify", "seq2seq", "doctor", "explore",
                        "embed", "convert", "experiment", "bench"}


# -- a handful as real processes: the interpreter's own exit path, and signals --------------
def _handformer(argv: list[str], cwd: Path, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "handformer", *argv], cwd=cwd, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["generate", "--run", "lm", "--temperature", "nan"], 2, "--temperature"),
    (["generate", "--run", "nowhere"], 1, "nowhere"),
    (["train", "--preset", "tiny", "--max-steps", "2", "--out", ""], 2, "--out"),
    (["classify", "predict", "--run", "lm", "--text", "x"], 1, "classif|lm"),
], ids=["usage-nan", "runtime-missing-run", "usage-empty-out", "runtime-wrong-kind"])
def test_as_a_real_process(argv: list[str], code: int, message: str, fixtures: Fixtures,
                           tmp_path: Path) -> None:
    shutil.copytree(fixtures.lm, tmp_path / "lm")
    before = _tree(tmp_path)
    proc = _handformer(argv, tmp_path)
    out, err = proc.communicate(timeout=120)
    check_failure(argv[0], code, message, returncode=proc.returncode, stdout=out, stderr=err)
    assert _tree(tmp_path) == before


def _interrupt_when_running(proc: subprocess.Popen[str], sig: int, marker: str,
                            timeout: float = 120) -> tuple[str, str]:
    """Wait until ``marker`` shows on stdout (the command is busy), then send ``sig``."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    seen = b""
    while marker.encode() not in seen:
        assert proc.poll() is None, f"ended early ({proc.returncode}): {seen[-2000:]!r}"
        assert time.monotonic() < deadline, f"never printed {marker!r}: {seen[-2000:]!r}"
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            seen += os.read(fd, 65536)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    return seen.decode(errors="replace") + out, err


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["sigint", "sigterm"])
def test_a_signal_during_generation(sig: int, code: int, fixtures: Fixtures,
                                    tmp_path: Path) -> None:
    """Ctrl-C (or a SIGTERM) while tokens stream: the documented code, one line, no
    traceback (part C)."""
    shutil.copytree(fixtures.lm, tmp_path / "lm")
    before = _tree(tmp_path)
    proc = _handformer(["generate", "--run", "lm", "--prompt", "The", "--max-new-tokens",
                        "1000000", "--no-cache", "--seed", "0"], tmp_path)
    out, err = _interrupt_when_running(proc, sig, "The")
    assert proc.returncode == code, f"exit {proc.returncode}\n{err[-3000:]}"
    assert "Traceback" not in err and "Traceback" not in out, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("handformer generate: "), err[-3000:]
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM],
                         ids=["ctrl-c", "sigterm"])
def test_ctrl_c_of_a_serving_explorer_under_load_exits_cleanly(
        fixtures: Fixtures, tmp_path: Path, stop_signal: signal.Signals) -> None:
    """Ctrl-C or SIGTERM while requests are being answered: exit 0 and "stopped", never an
    abort at exit ("terminate called without an active exception": a thread cut off
    inside torch while the interpreter tears down), and the run folder untouched (part E)."""
    import threading
    import urllib.request

    shutil.copytree(fixtures.lm, tmp_path / "lm")
    before = _tree(tmp_path)
    body = json.dumps({"prompt": "the quick brown fox " * 3, "layer": 0,
                       "head": "all"}).encode()
    for attempt in range(3):
        proc = _handformer(["explore", "--run", "lm", "--port", "0"], tmp_path)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = re.search(r"(http://\S+/)", line)
        assert url, line
        stop = threading.Event()

        def hammer(base: str = url.group(1), stop: threading.Event = stop) -> None:
            while not stop.is_set():
                req = urllib.request.Request(base + "api/attention", data=body,
                                             headers={"Content-Type": "application/json"})
                with contextlib.suppress(OSError):
                    urllib.request.urlopen(req, timeout=5).read()

        clients = [threading.Thread(target=hammer, daemon=True) for _ in range(4)]
        for client in clients:
            client.start()
        try:
            time.sleep(0.3 + 0.2 * attempt)  # requests in flight
            proc.send_signal(stop_signal)
            out, err = proc.communicate(timeout=60)
        finally:  # a failure leaves neither the explorer nor its load running
            stop.set()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, f"exit {proc.returncode}\n{err[-2000:]}"
        assert "terminate called" not in err and "Traceback" not in err, err[-2000:]
        assert "handformer explore: stopped" in out
    assert _tree(tmp_path) == before
