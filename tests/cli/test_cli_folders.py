"""Every command that writes a folder refuses one it did not write, before doing any work,
and leaves it byte-identical: one error line, no traceback. ``--overwrite`` writes into it
but removes nothing of it. ``--out ''`` is a usage error. Two ``train`` processes into one
folder: the second fails naming the first's PID; after a SIGKILL the folder is free again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from handformer.cli import main
from handformer.config import ModelConfig
from handformer.models.decoder_lm import DecoderLM
from handformer.runs import load_run, save_run
from handformer.runs.guard import FOLDER_MARKER
from handformer.runs.lock import LOCK_FILE
from handformer.tokenizers import CharTokenizer
from tests.train.helpers import toy_text

try:  # the exit-code contract (cli/errors.py): a refusal is a runtime error
    from handformer.cli.errors import EXIT_ERROR as REFUSED  # type: ignore[import-not-found]
except ImportError:  # before it: every ValueError exited 2
    REFUSED = 2

TINY = ["--preset", "tiny", "--max-steps", "4", "--no-progress", "--no-plot", "--device", "cpu"]


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


def foreign(root: Path) -> Path:
    """Another tool's output folder, with the names handformer would use."""
    (root / "checkpoints" / "epoch-1").mkdir(parents=True)
    (root / "checkpoints" / "epoch-1" / "weights.pt").write_bytes(b"theirs")
    (root / "tensorboard").mkdir()
    (root / "tensorboard" / "events.out.tfevents.1.host.1.0").write_bytes(b"their events")
    (root / "notes.txt").write_text("do not lose")
    return root


def lm_run(root: Path) -> Path:
    tok = CharTokenizer.from_text("abcdefgh ")
    torch.manual_seed(0)
    save_run(root, DecoderLM(ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_heads=2,
                                         n_layers=1, max_len=8)), tok)
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(toy_text(1500), encoding="utf-8")
    return path


def refused(argv: list[str], capsys: pytest.CaptureFixture[str], *phrases: str) -> str:
    """Run ``handformer ARGV``; it must fail with one error line holding ``phrases``."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code == REFUSED, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and errors[0].startswith(f"handformer {argv[0]}"), err
    for phrase in phrases:
        assert phrase in errors[0], err
    return errors[0]


# -- each writing command refuses a folder it did not write -----------------------------------
def test_train_refuses_another_tools_folder_and_leaves_it_as_it_was(
        tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = foreign(tmp_path / "theirs")
    before = snapshot(out)
    refused(["train", "--data", str(corpus), "--out", str(out), *TINY], capsys,
            "handformer did not write it", "checkpoints/", "--overwrite")
    assert snapshot(out) == before


def test_train_with_overwrite_keeps_every_foreign_file(
        tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = foreign(tmp_path / "theirs")
    before = snapshot(out)
    assert main(["train", "--data", str(corpus), "--out", str(out), *TINY, "--overwrite"]) == 0
    after = snapshot(out)
    assert {k: after.get(k) for k in before} == before
    assert load_run(out, kind="lm").kind == "lm"
    # A finished run is replaced only with --overwrite, naming its steps and loss; then the
    # fresh run removes its own files and still keeps theirs.
    ours = snapshot(out)
    assert main(["train", "--data", str(corpus), "--out", str(out), *TINY]) == 1
    err = capsys.readouterr().err
    assert "finished (trained 4 steps, best validation loss" in err and "--overwrite" in err
    assert snapshot(out) == ours
    assert main(["train", "--data", str(corpus), "--out", str(out), *TINY, "--overwrite"]) == 0
    after = snapshot(out)
    assert {k: after.get(k) for k in before} == before


@pytest.mark.parametrize("option", ["--out", "--resume"])
def test_an_empty_path_is_a_usage_error(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["train", option, ""])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert option in err and "empty path" in err and "Traceback" not in err


def test_classify_and_seq2seq_refuse_a_language_model_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = lm_run(tmp_path / "lm")
    before = snapshot(run)
    refused(["classify", "train", "--out", str(run), "--max-steps", "2", "--no-progress"],
            capsys, "holds a language-model run", "`handformer classify train`")
    refused(["seq2seq", "train", "--out", str(run), "--max-steps", "2", "--no-progress"],
            capsys, "holds a language-model run", "`handformer seq2seq train`")
    assert snapshot(run) == before


def test_convert_refuses_a_foreign_destination_and_its_own_source(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = lm_run(tmp_path / "run")
    dst = foreign(tmp_path / "hf")
    (dst / "config.json").write_text('{"model_type": "gpt2"}')
    before, run_before = snapshot(dst), snapshot(run)
    refused(["convert", "--to", "hf", str(run), str(dst)], capsys, "handformer did not write")
    refused(["convert", "--to", "hf", str(run), str(run), "--overwrite"], capsys,
            "is the source folder")
    refused(["convert", "--from", "hf", str(tmp_path / "nowhere"), str(dst)], capsys,
            "handformer did not write")
    assert snapshot(dst) == before and snapshot(run) == run_before


def test_bench_refuses_a_foreign_results_folder_and_json_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = foreign(tmp_path / "results")
    before = snapshot(out)
    refused(["bench", "--quick", "--only", "tokenizer", "--out-dir", str(out)], capsys,
            "handformer did not write")
    assert snapshot(out) == before
    theirs = tmp_path / "summary.json"
    theirs.write_text('{"accuracy": 0.9}')
    refused(["bench", "--quick", "--only", "tokenizer", "--out-dir", str(tmp_path / "new"),
             "--json", str(theirs)], capsys, f"--json {theirs} exists and handformer did "
            "not write it")
    assert theirs.read_text() == '{"accuracy": 0.9}'
    assert not (tmp_path / "new").exists()


def test_classify_predict_never_replaces_a_file_it_did_not_write(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    picture = tmp_path / "cm.png"
    picture.write_bytes(b"someone's picture")
    (tmp_path / "val.csv").write_text("text,label\n(),yes\n")
    refused(["classify", "predict", "--run", str(tmp_path / "run"), "--data",
             str(tmp_path / "val.csv"), "--label-col", "label", "--confusion", str(picture)],
            capsys, f"--confusion {picture} exists", "--overwrite")
    assert picture.read_bytes() == b"someone's picture"


def test_doctor_and_experiment_refuse_before_doing_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = foreign(tmp_path / "pics")
    before = snapshot(out)
    started = time.monotonic()
    refused(["doctor", "--preset", "tiny", "--pictures", str(out)], capsys,
            "handformer did not write")
    refused(["experiment", "length", "--quick", "--steps", "1", "--out", str(out)], capsys,
            "handformer did not write")
    assert time.monotonic() - started < 60  # no checklist, no training ran
    assert snapshot(out) == before


# -- two writers -----------------------------------------------------------------------------
def test_a_second_train_into_the_same_folder_fails_naming_the_first_pid(
        tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        [sys.executable, "-m", "handformer", "train", "--data", str(corpus), "--out", str(out),
         "--preset", "tiny", "--max-steps", "100000", "--no-progress", "--no-plot",
         "--device", "cpu"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait until it holds the lock
            lock = out / LOCK_FILE
            if lock.is_file() and lock.read_text().startswith("{"):
                break
            assert first.poll() is None, first.stderr.read() if first.stderr else ""
            time.sleep(0.2)
        else:
            pytest.fail("the first train never took the lock")
        for overwrite in ([], ["--overwrite"]):  # busy, not "unfinished", either way
            refused(["train", "--data", str(corpus), "--out", str(out), *TINY, *overwrite],
                    capsys, "being written by another handformer process",
                    f"PID {first.pid}, `handformer train`")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    # The kernel released the dead process's lock: the folder is free (its run is ours).
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == first.pid
    assert main(["train", "--data", str(corpus), "--out", str(out), *TINY, "--overwrite"]) == 0
    assert json.loads((out / FOLDER_MARKER).read_text())["kind"] == "lm"
    history = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text()
               .splitlines()]
    assert history == sorted(history) and max(history) == 4  # one run's records, not two


def test_resume_is_refused_while_another_process_holds_the_run(
        tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.runs.test_lock import start_holder

    out = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--out", str(out), *TINY]) == 0
    holder = start_holder(out)
    try:
        before = snapshot(out)  # the holder's PID in the lock file included
        refused(["train", "--resume", str(out), "--max-steps", "8", "--no-progress"], capsys,
                f"PID {holder.pid}")
        assert snapshot(out) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    assert main(["train", "--resume", str(out), "--max-steps", "8", "--no-progress"]) == 0
