"""Checkpoints: atomic directories with a commit marker, loaded without pickle, and every
damaged, truncated or foreign file refused with a CheckpointError that names it."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from handformer.train.checkpoint import (
    MARKER,
    PHASES,
    CheckpointError,
    CheckpointManager,
    list_checkpoints,
    load_weights,
    read_checkpoint_json,
    read_trainer_state,
    remove_stale,
    save_checkpoint,
    verify_checkpoint,
)
from handformer.train.state import TrainerState
from tests.train.helpers import make_trainer, train_config, weights

FILES = ["model.safetensors", "trainer_state.safetensors", "trainer_state.json", MARKER]


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A real checkpoint after 4 steps of a tiny run."""
    trainer = make_trainer(train_config(max_steps=4, eval_interval=4), ckpt_dir=tmp_path / "ck")
    trainer.fit()
    (path,) = [c.path for c in list_checkpoints(tmp_path / "ck")]
    return path


def forge_marker(path: Path) -> None:
    """Rewrite the commit marker to match the files as they are now: what a foreign tool or
    an attacker could do, so that the file parsers themselves must refuse bad bytes."""
    marker = json.loads((path / MARKER).read_text())
    for name in marker["files"]:
        data = (path / name).read_bytes()
        marker["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / MARKER).write_text(json.dumps(marker))


def load_everything(path: Path) -> None:
    """What ``--resume`` does with a checkpoint folder."""
    trainer = make_trainer(train_config(max_steps=8))
    trainer.resume(path)


def test_round_trip_restores_weights_optimizer_rngs_and_counters(checkpoint: Path) -> None:
    names = sorted(p.name for p in checkpoint.iterdir())
    assert names == sorted(FILES)
    source = make_trainer(train_config(max_steps=4, eval_interval=4))
    source.fit()  # same seeds → the same state as the saved run
    trainer = make_trainer(train_config(max_steps=8), model_seed=99)
    assert not all(torch.equal(a, b) for a, b in
                   zip(weights(trainer.model).values(), weights(source.model).values(),
                       strict=True))
    torch.manual_seed(12345)  # scramble the global RNG: resume must restore it
    trainer.resume(checkpoint)
    for (ka, a), (kb, b) in zip(weights(trainer.model).items(), weights(source.model).items(),
                                strict=True):
        assert ka == kb and torch.equal(a, b), ka
    assert trainer.step == 4 and trainer.best_step == 4
    assert trainer.best_val_loss == pytest.approx(source.best_val_loss, abs=0)
    assert torch.equal(trainer.generator.get_state(), source.generator.get_state())
    assert torch.equal(torch.get_rng_state(), read_trainer_state(checkpoint).tensors["rng.torch"])
    sa, sb = trainer.optimizer.state_dict(), source.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for pid, state in sb["state"].items():
        for key, value in state.items():
            assert torch.equal(sa["state"][pid][key], value), (pid, key)


def test_marker_lists_every_file_with_size_and_hash(checkpoint: Path) -> None:
    marker = json.loads((checkpoint / MARKER).read_text())
    assert set(marker["files"]) == set(FILES) - {MARKER}
    for name, entry in marker["files"].items():
        data = (checkpoint / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert verify_checkpoint(checkpoint).step == 4


@pytest.mark.parametrize("name", FILES)
def test_truncated_file_gives_checkpoint_error(checkpoint: Path, tmp_path: Path,
                                               name: str) -> None:
    original = (checkpoint / name).read_bytes()
    cuts = sorted({0, 1, 2, 7, 8, 9, 16, 64, len(original) // 3, len(original) // 2,
                   len(original) - 100, len(original) - 1} & set(range(len(original))))
    for cut in cuts:
        (checkpoint / name).write_bytes(original[:cut])
        with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
            load_everything(checkpoint)
        if name != MARKER:  # the parsers themselves, with a marker that matches the damage
            forge_marker(checkpoint)
            with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
                load_everything(checkpoint)
        (checkpoint / name).write_bytes(original)
        if name != MARKER:
            forge_marker(checkpoint)
    load_everything(checkpoint)  # restored bytes load again


def test_flipped_byte_is_caught_by_the_hash(checkpoint: Path) -> None:
    file = checkpoint / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[-3] ^= 0xFF  # same size, one weight changed
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: sha256 differs"):
        load_everything(checkpoint)


class _Payload:
    """Unpickling this runs a shell command: the classic malicious checkpoint."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_pickle_payload_is_refused_and_never_runs(checkpoint: Path, tmp_path: Path) -> None:
    # The payload is live: plain unpickling really does run the command.
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(_Payload(proof)))
    assert proof.exists()

    pwned = tmp_path / "pwned"
    buffer = tmp_path / "payload.pt"
    torch.save({"state": _Payload(pwned)}, buffer)  # torch's own (zip + pickle) format
    for name in ("model.safetensors", "trainer_state.safetensors", "trainer_state.json"):
        original = (checkpoint / name).read_bytes()
        for payload in (buffer.read_bytes(), pickle.dumps(_Payload(pwned))):
            (checkpoint / name).write_bytes(payload)
            forge_marker(checkpoint)
            with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
                load_everything(checkpoint)
            assert not pwned.exists(), f"loading {name} ran the pickled command"
        (checkpoint / name).write_bytes(original)
        forge_marker(checkpoint)


def test_foreign_model_and_foreign_files_are_named(checkpoint: Path, tmp_path: Path) -> None:
    from handformer.models.decoder_lm import DecoderLM
    from tests.train.helpers import model_config

    bigger = DecoderLM(model_config(d_model=64))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: does not fit"):
        load_weights(bigger, checkpoint)

    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    meta = json.loads((other / "trainer_state.json").read_text())
    meta["format"] = "someone-elses-trainer"
    (other / "trainer_state.json").write_text(json.dumps(meta))
    forge_marker(other)
    with pytest.raises(CheckpointError, match=r"trainer_state\.json: not a handformer"):
        read_trainer_state(other)

    (other / MARKER).write_text(json.dumps({"format": "handformer-checkpoint", "version": 7}))
    with pytest.raises(CheckpointError, match=r"COMMITTED\.json: not a handformer"):
        verify_checkpoint(other)
    (other / MARKER).unlink()
    with pytest.raises(CheckpointError, match=r"COMMITTED\.json: missing"):
        verify_checkpoint(other)


def test_trainer_state_of_another_model_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    from handformer.models.decoder_lm import DecoderLM
    from handformer.train.trainer import Trainer
    from tests.train.helpers import TRAIN_WINDOWS, model_config

    cfg = train_config(max_steps=2, eval_interval=2)
    deeper = Trainer(DecoderLM(model_config(n_layers=3)), cfg,
                     train_batch=lambda g: TRAIN_WINDOWS.random_batch(4, g), progress=False,
                     checkpoints=CheckpointManager(tmp_path / "deep"))
    deeper.fit()
    (foreign,) = list_checkpoints(tmp_path / "deep")
    for name in ("trainer_state.safetensors", "trainer_state.json"):
        shutil.copy(foreign.path / name, checkpoint / name)
    forge_marker(checkpoint)
    with pytest.raises(CheckpointError, match=r"trainer_state.*optimizer state holds"):
        load_everything(checkpoint)


def test_uncommitted_folders_are_invisible_and_cleaned(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    model = make_trainer(train_config()).model
    save_checkpoint(root, 3, model, TrainerState(meta={"step": 3}))
    (root / ".tmp-step-00000006-1-ab").mkdir()  # a write killed half-way
    (root / ".tmp-step-00000006-1-ab" / "model.safetensors").write_bytes(b"partial")
    (root / "step-00000009").mkdir()  # a folder without a marker is not a checkpoint
    assert [c.step for c in list_checkpoints(root)] == [3]
    removed = remove_stale(root)
    assert [p.name for p in removed] == [".tmp-step-00000006-1-ab"]
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())


def test_keep_last_k_plus_the_best(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    manager = CheckpointManager(root, keep_last=2, files={"note.json": "{}"})
    model = make_trainer(train_config()).model
    for step in range(1, 7):
        manager.save(step, model, TrainerState(meta={"step": step}), best_step=2,
                     best_val_loss=1.5)
    assert [c.step for c in list_checkpoints(root)] == [2, 5, 6]
    assert json.loads((root / "best.json").read_text())["checkpoint"] == "step-00000002"
    assert read_checkpoint_json(root / "step-00000006", "note.json") == {}
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())


def test_saving_a_step_again_replaces_it(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    trainer = make_trainer(train_config())
    save_checkpoint(root, 5, trainer.model, TrainerState(meta={"step": 5, "v": 1}))
    save_checkpoint(root, 5, trainer.model, TrainerState(meta={"step": 5, "v": 2}))
    assert [c.step for c in list_checkpoints(root)] == [5]
    assert read_trainer_state(root / "step-00000005").meta["v"] == 2
    with pytest.raises(ValueError, match="step 4"):
        save_checkpoint(root, 5, trainer.model, TrainerState(meta={"step": 4}))


def test_the_writer_reports_each_phase_in_order(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    seen: list[tuple[str, int, list[str]]] = []

    def on_phase(phase: str, step: int) -> None:  # what exists on disk at each phase
        seen.append((phase, step, sorted(p.name for p in root.iterdir())))

    manager = CheckpointManager(root, on_phase=on_phase)
    manager.save(3, make_trainer(train_config()).model, TrainerState(meta={"step": 3}))
    assert [(phase, step) for phase, step, _ in seen] == [(p, 3) for p in PHASES]
    assert all(len(names) == 1 and names[0].startswith(".tmp-step-00000003")
               for _, _, names in seen[:-1])  # only a temporary folder until the commit
    assert seen[-1][2] == ["step-00000003"]


def test_a_hook_that_raises_before_the_commit_leaves_no_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    model = make_trainer(train_config()).model
    save_checkpoint(root, 2, model, TrainerState(meta={"step": 2}))

    def fail(phase: str, step: int) -> None:
        if phase == "marker_written":
            raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        save_checkpoint(root, 4, model, TrainerState(meta={"step": 4}), on_phase=fail)
    assert [p.name for p in root.iterdir()] == ["step-00000002"]  # the temporary one removed


def test_an_interrupt_while_re_saving_a_step_keeps_the_old_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-saving a step moves the old folder aside, renames the new one in, then deletes the
    old: a Ctrl-C between the two renames puts the old one back."""
    root = tmp_path / "ck"
    model = make_trainer(train_config()).model
    save_checkpoint(root, 5, model, TrainerState(meta={"step": 5, "v": 1}))
    real_replace = os.replace

    def interrupted_replace(src: str | Path, dst: str | Path) -> None:
        if Path(src).name.startswith(".tmp-step-"):  # the new folder's rename into place
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr("handformer.train.checkpoint.os.replace", interrupted_replace)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, 5, model, TrainerState(meta={"step": 5, "v": 2}))
    assert [p.name for p in root.iterdir()] == ["step-00000005"]
    verify_checkpoint(root / "step-00000005")
    assert read_trainer_state(root / "step-00000005").meta["v"] == 1


# -- nothing in a checkpoint points elsewhere; nothing non-finite is committed or resumed ------
def snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


def test_a_checkpoint_renamed_to_another_step_is_refused(checkpoint: Path) -> None:
    renamed = checkpoint.with_name("step-00000009")
    checkpoint.rename(renamed)
    with pytest.raises(CheckpointError, match=r"records step 4, but its folder is named "
                                              r"step-00000009"):
        verify_checkpoint(renamed)


def test_a_file_the_marker_lists_that_is_a_link_is_never_read(checkpoint: Path,
                                                              tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    shutil.copyfile(checkpoint / "trainer_state.json", outside)
    (checkpoint / "trainer_state.json").unlink()
    (checkpoint / "trainer_state.json").symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"trainer_state.json is a symbolic link"):
        verify_checkpoint(checkpoint)


def test_links_in_a_checkpoint_root_are_refused_never_written_through(tmp_path: Path) -> None:
    model = make_trainer(train_config()).model
    other = tmp_path / "other"
    save_checkpoint(other, 3, model, TrainerState(meta={"step": 3, "v": "theirs"}))
    before = snapshot(other)
    (tmp_path / "mine").symlink_to(other)
    with pytest.raises(CheckpointError, match="mine is a symbolic link"):
        save_checkpoint(tmp_path / "mine", 3, model, TrainerState(meta={"step": 3}))
    with pytest.raises(CheckpointError, match="mine is a symbolic link"):
        list_checkpoints(tmp_path / "mine")
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "step-00000003").symlink_to(other / "step-00000003")
    with pytest.raises(CheckpointError, match="step-00000003 is a symbolic link"):
        list_checkpoints(tmp_path / "own")
    with pytest.raises(CheckpointError, match="step-00000003 is a symbolic link"):
        save_checkpoint(tmp_path / "own", 3, model, TrainerState(meta={"step": 3}))
    assert snapshot(other) == before


@pytest.mark.parametrize("where", ["weight", "optimizer state"])
def test_non_finite_weights_or_state_are_never_committed(where: str, tmp_path: Path) -> None:
    from handformer.train.checkpoint import NonFiniteStateError

    root = tmp_path / "ck"
    model = make_trainer(train_config()).model
    save_checkpoint(root, 2, model, TrainerState(meta={"step": 2}))
    before = snapshot(root)
    tensors = {"optimizer.0.exp_avg": torch.zeros(3)}
    if where == "weight":
        with torch.no_grad():
            next(model.parameters())[0] = float("nan")
    else:
        tensors["optimizer.0.exp_avg"][1] = float("inf")
    with pytest.raises(NonFiniteStateError, match=rf"the {where} .* holds NaN or Inf"):
        save_checkpoint(root, 4, model, TrainerState(tensors, meta={"step": 4}))
    assert snapshot(root) == before


def test_a_resume_whose_optimizer_state_is_not_finite_is_refused_naming_the_file(
        checkpoint: Path) -> None:
    from safetensors.torch import load_file, save_file

    from handformer.train.checkpoint import NonFiniteStateError

    file = checkpoint / "trainer_state.safetensors"
    tensors = load_file(file)
    name = next(k for k, v in sorted(tensors.items()) if k.endswith("exp_avg"))
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, file)
    forge_marker(checkpoint)  # the commit record re-hashed: the file checks pass
    with pytest.raises(NonFiniteStateError, match=rf"trainer_state.safetensors: '{name}' "
                                                  r"holds NaN or Inf"):
        load_everything(checkpoint)


def test_a_resume_whose_recorded_recipe_differs_from_its_state_is_refused(
        checkpoint: Path) -> None:
    """The optimizer groups a checkpoint saved carry the base lr; one that differs from the
    recipe the trainer is built with would train at a learning rate nobody recorded."""
    trainer = make_trainer(train_config(max_steps=8, lr=0.05))
    with pytest.raises(CheckpointError, match=r"base_lr=0.003 but the recorded recipe "
                                              r"\(config.json\) gives base_lr=0.05"):
        trainer.resume(checkpoint)
    make_trainer(train_config(max_steps=8)).resume(checkpoint)  # the same recipe resumes


def test_a_step_that_ruins_the_weights_stops_the_run_and_commits_nothing(
        tmp_path: Path) -> None:
    from handformer.train.trainer import NonFiniteError

    trainer = make_trainer(train_config(max_steps=8, eval_interval=2), ckpt_dir=tmp_path / "ck")
    trainer.fit(stop_at=2)
    before = snapshot(tmp_path / "ck")
    with torch.no_grad():  # what a NaN moment does to the weights after one step
        next(trainer.model.parameters()).fill_(float("inf"))
    with pytest.raises(NonFiniteError, match=r"holds NaN or Inf.*the last good checkpoint is "
                                             r".*step-00000002"):
        trainer.fit()
    assert snapshot(tmp_path / "ck") == before
