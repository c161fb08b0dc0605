"""Distributed training under torchrun (gloo on CPU, 2 processes): the proofs of issue #9.

* DDP and FSDP with 2 ranks × b windows equal one process with a global batch of 2b (losses,
  validation losses, weights and optimizer state), with gradient accumulation (``no_sync``);
* a DDP run's checkpoint loads in a single process and gives the same validation loss;
* a single-process checkpoint resumes under DDP and under FSDP and ends where the
  single-process run ended;
* a rank that raises ends the whole job, non-zero, within a bounded time;
* two launchers meeting at a rendezvous endpoint (as two machines would) train the same run.

Ports: ``--standalone`` (torch 2.13) binds its rendezvous store and the workers' shared store
on port 0, so the OS picks a free port and no other process can take it in between; the
two-node test holds its rendezvous store open itself (see that test).

The real ``torchrun`` starts real processes: these tests are slow-marked (a few seconds per
launch) and still run in CI. Tolerances: fp32 sums over ranks in a different order, so
weights agree to 1e-5 (measured ~4e-7), losses to 1e-5.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from handformer import DecoderLM, ModelConfig
from handformer.config import TrainConfig
from handformer.data import Batch, LMWindows, train_val_split
from handformer.data.corpora import builtin_text
from handformer.loss import lm_loss
from handformer.runs import load_run
from handformer.train.distributed import DistContext, check_batch_splits, shard_rows
from handformer.train.trainer import Trainer

LAUNCH_TIMEOUT_S = 180
TOL = 1e-5
STEPS = 8
# A global micro-batch of 8 windows, 2 micro-batches per step: each rank takes 4 per micro-step.
ARGS = ["--preset", "tiny", "--max-steps", str(STEPS), "--eval-interval", "4",
        "--log-interval", "1", "--batch-size", "8", "--grad-accum", "2", "--dropout", "0",
        "--keep-last", "10", "--no-progress", "--no-plot"]


CRASH_LAUNCHER = Path(__file__).parents[1] / "reference" / "crash_launcher.py"


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HANDFORMER_DIST_TIMEOUT_S": "120"}


def _single(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "handformer", "train", *args], cwd=cwd,
                          env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)


def _torchrun(args: list[str], cwd: Path, raise_at: str | None = None,
              ) -> subprocess.CompletedProcess[str]:
    """``handformer train ARGS`` on 2 ranks; ``raise_at="RANK@STEP"`` makes that rank raise
    there (see tests/reference/crash_launcher.py)."""
    launch = ["-m", "handformer"] if raise_at is None else \
        [str(CRASH_LAUNCHER), "--raise-at", raise_at]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *launch, "train", *args]
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)


def _ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-6000:]}"
    return proc


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    worst = 0.0
    for name in a:
        if a[name].dtype.is_floating_point:
            worst = max(worst, float((a[name].double() - b[name].double()).abs().max()))
        else:
            assert torch.equal(a[name], b[name]), name
    return worst


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One single-process run and the same recipe under torchrun with DDP and FSDP."""
    root = tmp_path_factory.mktemp("dist")
    (root / "text.txt").write_text(builtin_text()[:60_000], encoding="utf-8")
    data = ["--data", "text.txt"]
    out: dict[str, Path] = {"root": root}
    single = _ok(_single([*data, *ARGS, "--out", "single"], root))
    assert "training on" in single.stdout
    out["single"] = root / "single"
    for strategy in ("ddp", "fsdp"):
        proc = _ok(_torchrun([*data, *ARGS, "--out", strategy, "--strategy", strategy], root))
        # Rank 0 alone prints (and writes): one banner, one summary.
        assert proc.stdout.count("training on") == 1, proc.stdout
        assert f"trained on 2 processes ({strategy})" in proc.stdout
        out[strategy] = root / strategy
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_equal_one_process_with_the_global_batch(runs: dict[str, Path],
                                                           strategy: str) -> None:
    single, multi = _metrics(runs["single"]), _metrics(runs[strategy])
    # Only rank 0 writes metrics: the same number of lines as the single process.
    assert [m["step"] for m in multi] == [m["step"] for m in single]
    for a, b in zip(single, multi, strict=True):
        for key in ("loss", "val_loss", "grad_norm"):
            if key in a:
                assert b[key] == pytest.approx(a[key], abs=TOL), (a["step"], key)
    assert _max_diff(load_file(runs["single"] / "model.safetensors"),
                     load_file(runs[strategy] / "model.safetensors")) < TOL
    # The gathered checkpoint has the single-process format: weights, AdamW moments, RNG.
    ckpt = f"checkpoints/step-{STEPS:08d}"
    for name in ("model.safetensors", "trainer_state.safetensors"):
        assert _max_diff(load_file(runs["single"] / ckpt / name),
                         load_file(runs[strategy] / ckpt / name)) < TOL, name


def _val_loss(run: Path) -> float:
    """The run's validation loss recomputed in this (single) process from its run folder."""
    loaded = load_run(run, kind="lm")
    model, tokenizer = loaded.model, loaded.tokenizer
    cfg = json.loads((run / "config.json").read_text())["train"]
    text = (run.parent / "text.txt").read_text(encoding="utf-8")
    _, val_ids = train_val_split(tokenizer.encode_array(text), cfg["val_fraction"])
    batches = LMWindows(val_ids, cfg["block_size"]).fixed_batches(cfg["eval_batches"],
                                                                 cfg["batch_size"])
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            total += float(lm_loss(model(batch.ids), batch.targets)) * batch.num_tokens
            count += batch.num_tokens
    return total / count


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_distributed_run_loads_in_one_process_with_the_same_val_loss(
        runs: dict[str, Path], strategy: str) -> None:
    summary = json.loads((runs[strategy] / "summary.json").read_text())
    # The all-reduced validation loss (over both ranks' shards) is the full one.
    assert _val_loss(runs[strategy]) == pytest.approx(summary["final_val_loss"], abs=TOL)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_single_process_checkpoint_resumes_under_torchrun(runs: dict[str, Path],
                                                            strategy: str) -> None:
    root = runs["root"]
    resumed = root / f"resumed-{strategy}"
    shutil.copytree(runs["single"], resumed)
    for late in sorted((resumed / "checkpoints").glob("step-*"))[1:]:  # keep step 4 only
        shutil.rmtree(late)
    (resumed / "checkpoints" / "best.json").unlink()
    proc = _ok(_torchrun(["--resume", str(resumed), "--strategy", strategy], root))
    assert "resumed from step 4" in proc.stdout
    assert _max_diff(load_file(runs["single"] / "model.safetensors"),
                     load_file(resumed / "model.safetensors")) < TOL
    steps = [m["step"] for m in _metrics(resumed) if "loss" in m]
    assert steps == list(range(1, STEPS + 1))  # continued from 4, no duplicates


@pytest.mark.slow
def test_a_rank_that_raises_ends_the_job_nonzero_without_a_hang(runs: dict[str, Path]) -> None:
    root = runs["root"]
    start = time.monotonic()  # rank 1 raises after step 5, i.e. after the checkpoint at step 4
    proc = _torchrun(["--data", "text.txt", *ARGS, "--out", "crashed"], root, raise_at="1@5")
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    # Rank 0 was waiting in the next step's all-reduce; torchrun stopped it (no timeout).
    assert elapsed < 90, f"the job took {elapsed:.0f}s to end"
    assert "rank 1 fails at step 5" in proc.stderr
    checkpoints = sorted(p.name for p in (root / "crashed" / "checkpoints").glob("step-*"))
    assert checkpoints == ["step-00000004"]  # the last one before the crash, committed


@pytest.mark.slow
def test_two_nodes_meet_through_a_rendezvous_endpoint(runs: dict[str, Path]) -> None:
    """Two torchrun launchers (as on two machines: --nnodes=2, one process each, each with
    LOCAL_RANK 0) meet at a c10d rendezvous endpoint and train the same run.

    The endpoint's store is held open by this test on a port the OS chose (port 0), and both
    launchers join it as clients (``is_host=false``). Picking a free port, closing it and
    handing the number to torchrun left a window in which another process on the machine
    could take it; a store that is already listening leaves none. (The launchers' own
    ports — the bootstrap store rank 0 hosts, gloo's pairs — are bound on port 0 too.)"""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True,
                     wait_for_workers=False)
    root = runs["root"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
           "--rdzv-backend=c10d", "--rdzv-id=handformer-test",
           f"--rdzv-endpoint=127.0.0.1:{store.port}", "--rdzv-conf=is_host=false",
           "-m", "handformer", "train", "--data", "text.txt", *ARGS, "--out", "two-nodes"]
    try:
        nodes = [subprocess.Popen(cmd, cwd=root, env=_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        outputs = [node.communicate(timeout=LAUNCH_TIMEOUT_S) for node in nodes]
    finally:
        del store
    for node, (out, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, f"{out[-2000:]}\n{err[-4000:]}"
    assert sum("trained on 2 processes" in out for out, _ in outputs) == 1  # global rank 0
    assert _max_diff(load_file(runs["single"] / "model.safetensors"),
                     load_file(root / "two-nodes" / "model.safetensors")) < TOL


# -- in-process pieces: fast ---------------------------------------------------------------
def _batch(rows: int) -> Batch:
    ids = torch.arange(rows * 3).view(rows, 3)
    return Batch(ids, ids + 1, torch.ones(rows, 3, dtype=torch.bool))


def test_shard_rows_gives_each_rank_its_contiguous_rows() -> None:
    batch = _batch(6)
    parts = [shard_rows(batch, DistContext(rank=r, world_size=3)) for r in range(3)]
    assert [p.ids.shape for p in parts] == [torch.Size([2, 3])] * 3
    assert torch.equal(torch.cat([p.ids for p in parts]), batch.ids)
    assert torch.equal(torch.cat([p.targets for p in parts]), batch.targets)
    assert shard_rows(batch, DistContext()) is batch  # one process: untouched


def test_a_global_batch_that_does_not_split_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match=r"batch_size=7 .* multiple of 2"):
        check_batch_splits(7, DistContext(rank=0, world_size=2))
    with pytest.raises(ValueError, match="multiple of 4"):
        shard_rows(_batch(6), DistContext(rank=1, world_size=4))
    model = DecoderLM(ModelConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=1, max_len=8))
    cfg = TrainConfig(batch_size=7, block_size=8, device="cpu")
    with pytest.raises(ValueError, match="must split evenly over 2 ranks"):
        Trainer(model, cfg, train_batch=lambda g: _batch(7),
                dist=DistContext(rank=0, world_size=2))


def test_dropout_streams_differ_by_rank_and_step_and_rank0_keeps_its_own() -> None:
    assert DistContext(rank=0, world_size=2).dropout_seed(1, 5) is None
    seeds = {DistContext(rank=r, world_size=4).dropout_seed(1, s) for r in (1, 2, 3)
             for s in range(50)}
    assert len(seeds) == 150
    assert DistContext(rank=1, world_size=2).dropout_seed(1, 5) == \
        DistContext(rank=1, world_size=2).dropout_seed(1, 5)


def test_strategy_is_part_of_the_recipe() -> None:
    assert TrainConfig().strategy == "ddp"
    assert TrainConfig.from_dict({**TrainConfig().to_dict(), "strategy": "fsdp"}).strategy == \
        "fsdp"
    with pytest.raises(ValueError, match="strategy"):
        TrainConfig(strategy="horovod")


def test_other_commands_refuse_to_run_under_torchrun(tmp_path: Path) -> None:
    """In a process of its own: under torchrun the command line ends the worker itself
    (``exit_worker``), so the exit code is the process's."""
    env = {**_env(), "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    proc = subprocess.run([sys.executable, "-m", "handformer", "doctor", "--preset", "tiny"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "only `handformer train` runs under torchrun" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.slow
def test_muon_under_ddp_equals_one_process_and_fsdp_refuses_it(
        runs: dict[str, Path]) -> None:
    """Every DDP rank holds whole matrices and the all-reduced gradient, so its Muon step is
    the single process's. Muon orthogonalises in bf16, which turns the ranks' fp32 sum-order
    differences (~1e-7) into differences of about one bf16 rounding in an update: after 8
    steps the weights agree to 1e-2 and the losses to 1e-3, where AdamW's agree to 1e-5. How
    far those roundings carry depends on the CPU's bf16 matmul path (AMX, AVX-512 or a
    fallback), so the check that this is still a small gap — several times smaller than the
    gap between Muon's run and AdamW's — leaves room for the CPU that rounds worst."""
    root = runs["root"]
    muon = ["--data", "text.txt", *ARGS, "--optimizer", "muon"]
    _ok(_single([*muon, "--out", "muon-single"], root))
    proc = _ok(_torchrun([*muon, "--out", "muon-ddp", "--strategy", "ddp"], root))
    assert "trained on 2 processes (ddp)" in proc.stdout
    single, multi = _metrics(root / "muon-single"), _metrics(root / "muon-ddp")
    assert [m["step"] for m in multi] == [m["step"] for m in single]
    for a, b in zip(single, multi, strict=True):
        for key in ("loss", "val_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], abs=1e-3), (a["step"], key)
    muon_single = load_file(root / "muon-single" / "model.safetensors")
    ddp_gap = _max_diff(muon_single, load_file(root / "muon-ddp" / "model.safetensors"))
    assert ddp_gap < 1e-2
    assert _max_diff(muon_single, load_file(runs["single"] / "model.safetensors")) > 4 * ddp_gap
    summary = json.loads((root / "muon-ddp" / "summary.json").read_text())
    assert summary["optimizer_split"]["muon"]
    refused = _torchrun([*muon, "--out", "muon-fsdp", "--strategy", "fsdp"], root)
    assert refused.returncode != 0
    # The CLI's one-line refusal (torchrun then adds its own report of the failed ranks).
    assert "handformer train: error: optimizer='muon' cannot train under strategy='fsdp'" \
        in refused.stderr
