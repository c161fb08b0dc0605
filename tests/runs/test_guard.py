"""handformer.runs.guard: where a command may write. A folder handformer did not write is
refused and left byte-identical; ``overwrite`` writes into it but removes only what
handformer wrote; a run of another kind, a checkpoint folder, a file, an empty path are
refused by name; one writer at a time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from handformer.config import ModelConfig
from handformer.models.decoder_lm import DecoderLM
from handformer.runs import (
    CLASSIFIER_FOLDER,
    LM_FOLDER,
    FolderBusyError,
    FolderLock,
    FolderSpec,
    RunFolderError,
    check_destination,
    folder_path,
    save_run,
    writing_folder,
)
from handformer.runs.guard import FOLDER_MARKER, read_folder
from handformer.runs.lock import LOCK_FILE
from handformer.tokenizers import CharTokenizer
from handformer.train.checkpoint import list_checkpoints, remove_stale, save_checkpoint
from handformer.train.state import TrainerState

TOK = CharTokenizer.from_text("abcdefgh ")
PICS = FolderSpec("pics", "some pictures", "handformer pics", ("p_*.png", "index.json"))


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file's bytes and every folder (None) under ``root``, by relative path."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


def foreign_run(root: Path) -> Path:
    """Another tool's training folder: its own checkpoints/ and tensorboard/."""
    (root / "checkpoints" / "epoch-3").mkdir(parents=True)
    (root / "checkpoints" / "epoch-3" / "weights.pt").write_bytes(b"not ours")
    (root / "checkpoints" / ".tmp-upload").write_text("theirs")
    (root / "checkpoints" / "step-00000001").mkdir()  # our naming, but no commit marker
    (root / "tensorboard").mkdir()
    (root / "tensorboard" / "events.out.tfevents.1.host.1.0").write_bytes(b"their events")
    (root / "config.json").write_text('{"model": "resnet"}')
    (root / "notes.txt").write_text("do not lose")
    return root


def claim(path: Path | str, spec: FolderSpec, *, overwrite: bool = False) -> None:
    """Open ``path`` for writing as ``spec`` says, and close it again at once."""
    with writing_folder(path, spec, overwrite=overwrite):
        pass


def lm() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(ModelConfig(vocab_size=TOK.vocab_size, d_model=16, n_heads=2, n_layers=1,
                                 max_len=8))


def checkpoint(run: Path, step: int, *, finished: bool) -> None:
    save_checkpoint(run / "checkpoints", step, lm(),
                    TrainerState({"x": torch.zeros(1)}, {"step": step, "finished": finished}))


def lm_run(root: Path, *, finished: bool = True) -> Path:
    """A language-model run as ``handformer train`` leaves it (claimed, so marked)."""
    with writing_folder(root, LM_FOLDER) as run:
        checkpoint(run, 2, finished=finished)
        if finished:
            save_run(run, lm(), TOK)
            (run / "loss_curve.png").write_bytes(b"png")
            (run / "tensorboard").mkdir()
            (run / "tensorboard" / "events.out.tfevents.9.h.9.0").write_bytes(b"ours")
    return root


# -- what is refused, and that a refusal changes nothing ---------------------------------------
def test_empty_paths_are_refused_by_name() -> None:
    for text in ("", "  "):
        with pytest.raises(ValueError, match="empty path"):
            folder_path(text)
        with pytest.raises(ValueError, match="empty path"):
            claim(text, LM_FOLDER)


def test_a_file_where_the_folder_should_be_is_refused(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("a file")
    with pytest.raises(RunFolderError, match="exists and is not a folder"):
        claim(tmp_path / "out", LM_FOLDER, overwrite=True)
    assert (tmp_path / "out").read_text() == "a file"


def test_a_foreign_folder_is_refused_and_stays_byte_identical(tmp_path: Path) -> None:
    root = foreign_run(tmp_path / "theirs")
    before = snapshot(root)
    with pytest.raises(RunFolderError, match=r"handformer did not write it.*checkpoints/.*"
                                             r"--overwrite"):
        claim(root, LM_FOLDER)
    assert snapshot(root) == before  # not even a lock file or a marker


def test_overwrite_writes_into_a_foreign_folder_but_removes_nothing_of_it(
        tmp_path: Path) -> None:
    root = foreign_run(tmp_path / "theirs")
    before = snapshot(root)
    with writing_folder(root, LM_FOLDER, overwrite=True) as run:
        checkpoint(run, 4, finished=True)
    after = snapshot(root)
    kept = {k: v for k, v in before.items() if k != "config.json"}
    assert {k: after[k] for k in kept} == kept  # every foreign file and folder is still there
    marker = json.loads((root / FOLDER_MARKER).read_text())
    assert marker["kind"] == "lm" and "tensorboard" in marker["kept"]

    # A second fresh run there (over a finished run: --overwrite) removes its own checkpoint
    # and files, still none of theirs.
    save_run(root, lm(), TOK)
    claim(root, LM_FOLDER, overwrite=True)
    after = snapshot(root)
    assert {k: after[k] for k in kept} == kept
    assert not list_checkpoints(root / "checkpoints")
    assert "model.safetensors" not in after


def test_another_kind_of_handformer_folder_is_refused_naming_both(tmp_path: Path) -> None:
    run = lm_run(tmp_path / "lm")
    before = snapshot(run)
    with pytest.raises(RunFolderError, match=r"holds a language-model run \(written by "
                                             r"`handformer train`\); `handformer classify "
                                             r"train` writes a classifier run"):
        check_destination(run, CLASSIFIER_FOLDER)
    assert snapshot(run) == before


def test_overwrite_replaces_another_kind_removing_only_its_files(tmp_path: Path) -> None:
    run = lm_run(tmp_path / "lm")
    (run / "notes.txt").write_text("mine")
    claim(run, CLASSIFIER_FOLDER, overwrite=True)
    left = sorted(p.name for p in run.iterdir())
    assert left == sorted([FOLDER_MARKER, LOCK_FILE, "notes.txt"])
    assert json.loads((run / FOLDER_MARKER).read_text())["kind"] == "classifier"


def test_a_finished_run_is_replaced_only_with_overwrite_an_unfinished_one_kept(
        tmp_path: Path) -> None:
    finished = lm_run(tmp_path / "done")
    (finished / "notes.txt").write_text("mine")
    before = snapshot(finished)
    with pytest.raises(RunFolderError, match=r"holds a language-model run, finished .*"
                                             r"--overwrite"):
        claim(finished, LM_FOLDER)
    assert snapshot(finished) == before
    with writing_folder(finished, LM_FOLDER, overwrite=True):
        left = sorted(p.name for p in finished.iterdir())
    assert left == sorted([FOLDER_MARKER, LOCK_FILE, "notes.txt"])  # tensorboard/ too

    unfinished = lm_run(tmp_path / "killed", finished=False)
    before = snapshot(unfinished)
    with pytest.raises(RunFolderError, match=r"unfinished run \(last checkpoint: step 2\); "
                       rf"continue it with `handformer train --resume {unfinished}`"):
        claim(unfinished, LM_FOLDER)
    assert snapshot(unfinished) == before
    with writing_folder(unfinished, LM_FOLDER, overwrite=True):
        assert not list_checkpoints(unfinished / "checkpoints")


def test_a_checkpoint_folder_is_never_written_into(tmp_path: Path) -> None:
    run = lm_run(tmp_path / "run")
    (step,) = list_checkpoints(run / "checkpoints")
    before = snapshot(step.path)
    with pytest.raises(RunFolderError, match="checkpoint folder"):
        check_destination(step.path, LM_FOLDER, overwrite=True)
    assert snapshot(step.path) == before


def test_run_folders_from_before_the_marker_are_still_recognised(tmp_path: Path) -> None:
    save_run(tmp_path / "old", lm(), TOK)  # no marker: written by an older handformer
    assert read_folder(tmp_path / "old").spec == LM_FOLDER
    with pytest.raises(RunFolderError, match="holds a language-model run"):
        check_destination(tmp_path / "old", CLASSIFIER_FOLDER)
    claim(tmp_path / "old", LM_FOLDER, overwrite=True)
    assert not (tmp_path / "old" / "model.safetensors").exists()
    # A config.json with a "model" key that is no handformer config is not enough.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"model": {"arch": "x"}, "train": {}}')
    assert read_folder(tmp_path / "other").spec is None


def test_a_damaged_marker_makes_the_folder_foreign(tmp_path: Path) -> None:
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / FOLDER_MARKER).write_text("{not json")
    (tmp_path / "f" / "data.bin").write_bytes(b"x")
    with pytest.raises(RunFolderError, match=f"its {FOLDER_MARKER} is not handformer's"):
        check_destination(tmp_path / "f", PICS)


def test_patterns_and_atomic_write_leftovers_are_cleaned_others_kept(tmp_path: Path) -> None:
    with writing_folder(tmp_path / "p", PICS) as out:
        for name in ("p_1.png", "p_2.png", "index.json", ".index.json.ab12.tmp", "q.png"):
            (out / name).write_bytes(b"x")
    with writing_folder(tmp_path / "p", PICS) as out:
        assert sorted(p.name for p in out.iterdir()) == sorted([FOLDER_MARKER, LOCK_FILE,
                                                                "q.png"])


# -- claiming, locking, and leaving no trace on failure ---------------------------------------
def test_a_new_folder_is_created_marked_and_locked_while_writing(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    with writing_folder(target, PICS) as out:
        assert out == target and (out / FOLDER_MARKER).is_file()
        before = snapshot(out)
        with pytest.raises(FolderBusyError, match="being written by another handformer process"):
            claim(target, PICS)
        assert snapshot(out) == before
    with writing_folder(target, PICS):  # released when the block ends
        pass


def test_a_run_being_written_is_busy_not_unfinished(tmp_path: Path) -> None:
    run = lm_run(tmp_path / "run", finished=False)
    with FolderLock(run, command="handformer train"):
        before = snapshot(run)
        for overwrite in (False, True):
            with pytest.raises(FolderBusyError, match="`handformer train`"):
                check_destination(run, LM_FOLDER, overwrite=overwrite)
        assert snapshot(run) == before


def test_a_failed_first_write_leaves_no_folder_an_existing_one_stays(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), writing_folder(tmp_path / "new", PICS):
        raise RuntimeError("the job failed before writing")
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(RuntimeError), writing_folder(tmp_path / "empty", PICS):
        raise RuntimeError("the job failed before writing")
    assert (tmp_path / "empty").is_dir()


def test_only_handformers_checkpoint_leftovers_are_stale(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    root.mkdir()
    ours = [root / ".tmp-step-00000006-123-abcd1234", root / ".tmp-del-step-00000002-ab12cd34"]
    theirs = [root / ".tmp-upload", root / ".tmp-step-notes"]
    for path in ours + theirs:
        path.mkdir()
    assert sorted(remove_stale(root)) == sorted(ours)
    assert all(p.is_dir() for p in theirs)


# -- a folder is untrusted input: its marker and links point nowhere outside it ----------------
def edit_marker(run: Path, **fields: object) -> None:
    marker = json.loads((run / FOLDER_MARKER).read_text())
    marker.update(fields)
    (run / FOLDER_MARKER).write_text(json.dumps(marker))


def other_run(root: Path) -> Path:
    """Another run next to the one a marker is edited in, with a committed checkpoint."""
    return lm_run(root)


@pytest.mark.parametrize("names", [["../*"], ["*"], ["/etc/passwd"], ["notes.txt"],
                                   ["tensorboard/../../x"], ["a/b/c"], [3]],
                         ids=["parent", "star", "absolute", "not-ours", "climbs", "deep",
                              "not-a-string"])
def test_a_marker_naming_what_handformer_never_writes_is_refused_before_anything(
        names: list[object], tmp_path: Path) -> None:
    parent = tmp_path / "parent"
    run = lm_run(parent / "run")
    (parent / "precious.txt").write_text("the parent's own")
    (run / "notes.txt").write_text("mine")
    edit_marker(run, names=names)
    before = snapshot(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(RunFolderError, match=rf"{FOLDER_MARKER} lists the file name "
                                                 r".*handformer touches nothing"):
            claim(run, LM_FOLDER, overwrite=overwrite)
        assert snapshot(tmp_path) == before


@pytest.mark.parametrize("where", ["../other/checkpoints", "ABSOLUTE", "..", "tensorboard"],
                         ids=["sibling", "absolute", "parent", "not-a-checkpoint-folder"])
def test_a_marker_pointing_its_checkpoints_elsewhere_is_refused(where: str,
                                                                tmp_path: Path) -> None:
    other = other_run(tmp_path / "other")
    run = lm_run(tmp_path / "run")
    target = str(other / "checkpoints") if where == "ABSOLUTE" else where
    edit_marker(run, checkpoints=target)
    before = snapshot(tmp_path)
    with pytest.raises(RunFolderError, match=r"lists the checkpoint folder"):
        claim(run, LM_FOLDER, overwrite=True)
    assert snapshot(tmp_path) == before
    assert list_checkpoints(other / "checkpoints")


def test_a_marker_of_a_kind_nobody_here_writes_is_a_note_and_nothing_is_removed(
        tmp_path: Path) -> None:
    run = lm_run(tmp_path / "run")
    edit_marker(run, kind="time-machine", command="handformer fly", names=["*"])
    before = snapshot(run)
    with pytest.raises(RunFolderError, match=r"handformer did not write it .*'handformer fly'"):
        claim(run, PICS)
    assert snapshot(run) == before
    claim(run, PICS, overwrite=True)
    after = snapshot(run)
    ours = (FOLDER_MARKER, LOCK_FILE)
    assert {k: after[k] for k in before if k not in ours} == \
        {k: v for k, v in before.items() if k not in ours}


def test_a_checkpoint_folder_that_is_a_link_is_never_written_through(tmp_path: Path) -> None:
    other = other_run(tmp_path / "other")
    run = tmp_path / "fresh"
    run.mkdir()
    (run / "checkpoints").symlink_to(other / "checkpoints")
    before = snapshot(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=r"checkpoints is a symbolic link"):
            claim(run, LM_FOLDER, overwrite=overwrite)
        assert snapshot(tmp_path) == before


def test_a_checkpoint_entry_that_is_a_link_is_refused(tmp_path: Path) -> None:
    other = other_run(tmp_path / "other")
    run = lm_run(tmp_path / "run")
    (step,) = list_checkpoints(other / "checkpoints")
    (run / "checkpoints" / "step-00000009").symlink_to(step.path)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=r"step-00000009 is a symbolic link"):
        claim(run, LM_FOLDER, overwrite=True)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["model.safetensors", "metrics.jsonl", "tensorboard",
                                  FOLDER_MARKER, LOCK_FILE])
def test_a_link_where_handformer_reads_or_writes_is_refused(name: str, tmp_path: Path) -> None:
    run = lm_run(tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("not yours")
    path = run / name
    if path.is_dir():
        import shutil

        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    path.symlink_to(elsewhere / "keep" if name != "tensorboard" else elsewhere)
    before = snapshot(tmp_path)
    with pytest.raises(RunFolderError, match=rf"{name} is a symbolic link"):
        claim(run, LM_FOLDER, overwrite=True)
    assert snapshot(tmp_path) == before
    assert (elsewhere / "keep").read_text() == "not yours"


def test_a_lock_file_that_is_a_link_is_never_written_through(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "victim").write_text("do not truncate")
    (tmp_path / "run" / LOCK_FILE).symlink_to(tmp_path / "victim")
    with pytest.raises(RunFolderError, match="symbolic link"):
        FolderLock(tmp_path / "run").acquire()
    assert (tmp_path / "victim").read_text() == "do not truncate"


def test_a_finished_run_is_refused_naming_its_steps_and_best_loss(tmp_path: Path) -> None:
    run = lm_run(tmp_path / "run")
    config = json.loads((run / "config.json").read_text())
    config["summary"] = {"steps": 200, "best_val_loss": 1.23456}
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(RunFolderError, match=r"finished \(trained 200 steps, best validation "
                                             r"loss 1\.2346\)"):
        check_destination(run, LM_FOLDER)
    check_destination(run, LM_FOLDER, overwrite=True)


def test_an_older_outputs_file_is_removed_only_when_it_is_not_the_users(tmp_path: Path) -> None:
    from handformer.runs.guard import remove_if_ours

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "old.json").write_text("mine")
    claim(theirs, PICS, overwrite=True)  # the marker records old.json as there before
    remove_if_ours(theirs, "old.json")
    assert (theirs / "old.json").read_text() == "mine"
    with writing_folder(tmp_path / "ours", PICS) as ours:
        (ours / "old.json").write_text("an older version wrote this")
    remove_if_ours(tmp_path / "ours", "old.json")
    assert not (tmp_path / "ours" / "old.json").exists()
