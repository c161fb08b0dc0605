"""precision='auto' decides from what this machine supports: bf16 only with native bf16 dot
products that the kernels may use, fp32 otherwise; a resumed run keeps the precision it was
trained in."""

from __future__ import annotations

import pytest
import torch

import handformer.machine as machine
from handformer.train.precision import choose_precision, resolve_precision
from tests.train.helpers import make_trainer, train_config

CPU = torch.device("cpu")


@pytest.fixture
def flags(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    def set_flags(*names: str, capability: str = "AVX512") -> None:
        monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset(names))
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    return set_flags


def test_a_cpu_without_native_bf16_trains_in_fp32(flags) -> None:  # type: ignore[no-untyped-def]
    flags("avx2", "avx512f", "avx512_vnni")
    name, why = choose_precision(CPU)
    assert name == "fp32" and "no native bf16" in why
    precision = resolve_precision("auto", CPU)
    assert precision.name == "fp32" and precision.dtype is None and precision.why.startswith("auto")


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_native_bf16_dot_products_choose_bf16(flags, flag: str) -> None:  # type: ignore[no-untyped-def]
    flags("avx512f", flag)
    precision = resolve_precision("auto", CPU)
    assert precision.name == "bf16" and precision.dtype is torch.bfloat16 and flag in precision.why


def test_knobs_that_force_an_older_code_path_choose_fp32(
        flags, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    flags("avx512f", "avx512_bf16", capability="AVX2")
    assert choose_precision(CPU) == ("fp32", "torch's CPU kernels run at AVX2 (not AVX512)")
    flags("avx512f", "avx512_bf16")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert choose_precision(CPU)[0] == "fp32"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core_bf16")
    assert choose_precision(CPU)[0] == "bf16"


def test_a_resumed_auto_run_keeps_the_precision_it_was_trained_in(flags) -> None:  # type: ignore[no-untyped-def]
    flags("avx512f", "avx512_bf16")
    first = make_trainer(train_config(max_steps=2, eval_interval=100, precision="auto"))
    assert first.precision.name == "bf16"
    first.fit()
    state = first.state_dict()
    flags("avx2")  # "another machine": auto would now choose fp32
    second = make_trainer(train_config(max_steps=4, eval_interval=100, precision="auto"))
    assert second.precision.name == "fp32"
    second.load_state_dict(state)
    assert second.precision.name == "bf16" and "resumed" in second.precision.why
