"""The int8 benchmarks' own arithmetic: the bytes a decoding step reads (each row's floor)
and the quality measures (validation loss, greedy agreement)."""

from __future__ import annotations

import pytest
import torch

from handformer.bench.generation_speed import (
    QUICK_CASES,
    stack_split,
    step_bytes,
    token_products_row,
)
from handformer.bench.int8_quality import (
    greedy_agreement,
    next_token_agreement,
    top_two_gap,
    validation_loss,
)
from handformer.generate import generate
from handformer.loss import lm_loss
from handformer.models.decoder_lm import DecoderLM
from handformer.models.quantize import quantize_int8
from handformer.nn import decode_block
from handformer.nn.int8_native import native_status
from tests.conftest import tiny_config


def test_step_bytes_counts_weights_once_a_row_of_embeddings_and_the_cache() -> None:
    cfg = tiny_config(positional="learned", n_kv_heads=2)  # V=37, C=32, 2 layers, max_len 16
    model = DecoderLM(cfg)
    c, v, f, layers, kv_width = 32, 37, 128, 2, 2 * 2 * 8
    per_layer = (c * (c + kv_width) + (c + kv_width)) + (c * c + c) + (c * f + f) + \
        (f * c + c) + 2 * (2 * c)  # in_proj, out_proj, fc_in, fc_out, two LayerNorms
    weights = layers * per_layer + 2 * c + v * c + c  # final norm, tied head, a position row
    assert step_bytes(model, 0, torch.float32) == 4 * weights
    assert step_bytes(model, 10, torch.float32) == 4 * weights + 4 * layers * kv_width * 10
    # int8: a byte per weight and a float scale per row; the float embedding reads one row.
    int8 = step_bytes(quantize_int8(model), 0, torch.float32)
    assert int8 < 0.35 * step_bytes(model, 0, torch.float32)


def test_validation_loss_is_the_mean_over_every_window() -> None:
    model = DecoderLM(tiny_config()).eval()
    ids = torch.randint(0, 37, (3 * 8 + 1,))
    windows = ids.unfold(0, 9, 8)  # (3, 9)
    with torch.no_grad():
        want = float(lm_loss(model(windows[:, :-1]), windows[:, 1:]))
    assert abs(validation_loss(model, ids, 8, batch=2) - want) < 1e-5


def test_agreement_measures() -> None:
    a = torch.tensor([[1, 2, 3, 4, 5, 6]])
    b = torch.tensor([[1, 2, 3, 9, 5, 6]])
    assert greedy_agreement(a, a, 2) == (1.0, 4)
    assert greedy_agreement(a, b, 2) == (0.75, 1)
    model = DecoderLM(tiny_config()).eval()
    seq = torch.randint(0, 37, (1, 12))
    assert next_token_agreement(model, model, seq, 4, 16) == 1.0


def test_top_two_gap_is_the_lead_of_the_best_token_in_log_probability() -> None:
    model = DecoderLM(tiny_config()).eval()
    seq = torch.randint(0, 37, (1, 12))
    with torch.no_grad():  # generate's window of 4 at 7 tokens: slid by 4 → tokens 4..6
        logp = torch.log_softmax(model(seq[:, 4:7])[0, -1], dim=-1)
    best, second = logp.topk(2).values.tolist()
    assert abs(top_two_gap(model, seq, 7, 4) - (best - second)) < 1e-6
    assert top_two_gap(model, seq, 7, 4) >= 0


@pytest.mark.skipif(native_status() is not None, reason="the C int8 loop cannot build here")
def test_token_products_count_a_tokens_layer_weights_and_their_rate() -> None:
    """Per layer q·k·v (3C × C), the output projection (C × C) and the FFN (4C × C, C × 4C):
    12 C² int8 bytes; the rate is those bytes over the median time."""
    case = QUICK_CASES["2L-64d"]
    row = token_products_row("2L-64d", case, repeats=1, bandwidth=1e10)
    assert row is not None and row["products"] == 4 * case.n_layers
    assert row["weight_mb"] == pytest.approx(case.n_layers * 12 * case.d_model ** 2 / 1e6)
    assert row["gb_per_s"] == pytest.approx(row["weight_mb"] / row["median_ms"])
    assert row["fraction_of_bandwidth"] == pytest.approx(row["gb_per_s"] * 1e9 / 1e10)


@pytest.mark.skipif(decode_block.block_step_status() is not None,
                    reason=f"no C kernel here: {decode_block.block_step_status()}")
def test_stack_split_times_the_block_stack_calls_of_a_generation() -> None:
    """One whole-token call per generated token after the first (the prompt's forward is not
    one), time on both sides of them; a model the kernel declines (float32) has no split, and
    the module's functions are the originals again afterwards."""
    originals = decode_block.stack_step, decode_block.token_step, decode_block.greedy_token
    fp32 = DecoderLM(tiny_config(positional="learned")).eval()
    int8 = quantize_int8(fp32)
    prompt = torch.randint(0, 37, (1, 3))
    split = stack_split(lambda: generate(int8, prompt, 6, temperature=0), 2)
    assert split is not None and split["calls"] == 5
    assert split["inside_s"] > 0 and split["outside_s"] > 0
    assert stack_split(lambda: generate(fp32, prompt, 6, temperature=0), 1) is None
    assert (decode_block.stack_step, decode_block.token_step,
            decode_block.greedy_token) == originals


def test_run_case_reads_its_floor_among_its_contenders(monkeypatch: pytest.MonkeyPatch) -> None:
    """The floor's bandwidth comes from sums timed between the contenders' runs (a row
    each for the contenders only), and each row's floor is its bytes at that rate."""
    from handformer.bench import generation_speed as gs

    calls: list[str] = []

    def fake(setup: gs.Setup) -> list[gs.Contender]:
        def run() -> torch.Tensor:
            calls.append("run")
            return torch.zeros(1, gs.PROMPT + setup.case.new_tokens, dtype=torch.long)
        return [gs.Contender("fake", "float32", run, bytes_per_token=3e6)]

    monkeypatch.setattr(gs, "CONTENDER_FACTORIES", [fake])
    rows = gs.run_case("2L-64d", QUICK_CASES["2L-64d"], repeats=2, megabytes=8)
    assert [r["contender"] for r in rows] == ["fake"] and len(calls) == 3  # warm-up + 2
    bandwidth = rows[0]["bandwidth_gb_per_s"] * 1e9
    assert bandwidth > 1e8
    assert rows[0]["floor_ms_per_token"] == pytest.approx(1000 * 3e6 / bandwidth)
