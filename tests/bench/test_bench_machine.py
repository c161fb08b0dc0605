"""Every benchmark says where it ran: its JSON carries ``describe_machine()`` (CPU model,
torch's ISA level, threads) and its table a ``machine_line()``; the training benchmarks'
FLOP floor counts what a step really multiplies. Tiny sizes; nothing about speed is asserted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from handformer.bench import (
    attention_memory,
    generation_speed,
    int8_quality,
    tokenizer_throughput,
    train_throughput,
)
from handformer.bench.flops import matmul_flops, matmul_peaks, model_flops_per_token
from handformer.cli import main as cli_main
from handformer.machine import cpu_model, describe_machine, machine_line
from handformer.models.decoder_lm import DecoderLM
from tests.bench.scripts import load_script
from tests.conftest import tiny_config


def _says_where_it_ran(data: dict[str, Any], threads: object | None = None) -> None:
    machine = data["machine"]
    assert machine["cpu"] == cpu_model()
    assert machine["isa"] == torch.backends.cpu.get_cpu_capability()
    assert machine["threads"] == (torch.get_num_threads() if threads is None else threads)


def test_machine_line_names_the_cpu_isa_and_threads() -> None:
    info = {**describe_machine(), "cpu": "Some CPU", "isa": "AVX2", "extensions": ["avx2"],
            "knobs": {}}
    assert machine_line({**info, "threads": 1}) == "Some CPU · AVX2 · 1 thread"
    assert machine_line({**info, "threads": "1, 2"}) == "Some CPU · AVX2 · 1, 2 threads"
    bf16 = {**info, "isa": "AVX512", "extensions": ["avx512f", "avx512_bf16"], "threads": 2,
            "knobs": {"ATEN_CPU_CAPABILITY": "avx2"}}
    assert machine_line(bf16) == ("Some CPU · AVX512 (avx512_bf16) · 2 threads · "
                                  "ATEN_CPU_CAPABILITY=avx2")


def test_model_flops_count_every_matmul_weight_and_attention() -> None:
    """GPT-2's block (GELU, d_ff 4C, tied head): 12·C² weights a layer + the C·V head."""
    cfg = tiny_config(d_model=32, n_heads=2, n_layers=3, vocab_size=50)
    c, layers, v, t = cfg.d_model, cfg.n_layers, cfg.vocab_size, 16
    want = 6 * (layers * 12 * c * c + c * v) + 12 * layers * c * t
    assert model_flops_per_token(DecoderLM(cfg), t) == want
    assert train_throughput.flops_per_step(train_throughput.QUICK["tiny"]) == 4 * 16 * (
        6 * (2 * 12 * 32 * 32 + 32 * train_throughput.VOCAB) + 12 * 2 * 32 * 16)


def test_matmul_probe_reports_flops_per_dtype() -> None:
    assert matmul_flops(torch.float32, n=64, reps=1) > 0
    assert set(matmul_peaks((torch.float32, torch.bfloat16), n=64)) == {"float32", "bfloat16"}


def test_tokenizer_throughput(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.json"
    assert tokenizer_throughput.main(["--quick", "--chars", "20000", "--repeats", "1",
                                      "--out", str(out)]) == 0
    _says_where_it_ran(json.loads(out.read_text()))
    assert machine_line() in capsys.readouterr().out


def test_generation_speed_names_every_thread_count(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # The decoding rows (timed whole generations, an int8 kernel compiled) are what the
    # benchmark measures; here only the JSON and the caption around them are tested.
    monkeypatch.setattr(generation_speed, "run_case", lambda *a: [])
    out = tmp_path / "g.json"
    assert generation_speed.main(["--quick", "--no-kernels", "--repeats", "1", "--threads",
                                  "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    _says_where_it_ran(data, threads=[1])
    assert machine_line({**data["machine"], "threads": "1"}) in capsys.readouterr().out
    assert [b["threads"] for b in data["bandwidth"]] == [1]


def test_train_throughput_states_mfu_against_the_measured_peak(tmp_path: Path) -> None:
    out = tmp_path / "tt.json"
    assert train_throughput.main(["--quick", "--repeats", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    _says_where_it_ran(data)
    for r in data["rows"]:
        assert r["peak_dtype"] == "float32"
        assert r["mfu"] == pytest.approx(r["achieved_flops"] / r["peak_fp32_flops"])


def test_attention_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One subprocess per point is what the benchmark measures; the JSON it writes is tested.
    monkeypatch.setattr(attention_memory, "measure", lambda *a: {"skipped": "not measured"})
    out = tmp_path / "a.json"
    assert attention_memory.main(["--lengths", "16", "--out", str(out)]) == 0
    _says_where_it_ran(json.loads(out.read_text()))


def test_int8_quality(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert cli_main(["train", "--preset", "tiny", "--max-steps", "2", "--out", str(run),
                     "--no-progress"]) == 0
    out = tmp_path / "q.json"
    assert int8_quality.main(["--run", str(run), "--prompts", "1", "--new-tokens", "2",
                              "--out", str(out)]) == 0
    _says_where_it_ran(json.loads(out.read_text()), threads=1)


def test_build_progression(tmp_path: Path) -> None:
    module = load_script("build_progression")
    assert module.main(["--steps", "2", "--chars", "4000", "--val-batches", "1",
                        "--warmup", "1", "--out", str(tmp_path)]) == 0
    _says_where_it_ran(json.loads((tmp_path / "build_progression.json").read_text()),
                       threads=1)
