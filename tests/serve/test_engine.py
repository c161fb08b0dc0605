"""Batching changes nothing: every request's greedy text is what ``generate_text`` gives
that prompt alone — whatever else is in flight, with staggered arrivals, windows that
slide, prompts read in chunks and preemption forced by a small pool."""

from __future__ import annotations

import pytest
import torch

from handformer.generate import generate_text
from handformer.models.packing import pack_linears
from handformer.models.quantize import quantize_int8, set_int8_kernel
from handformer.nn.packed import onednn_packing_available
from handformer.serve.engine import Engine, QueueFullError, RequestTooLargeError
from handformer.serve.request import Request, SamplingParams
from tests.serve.helpers import TOKENIZER, prompts, run_engine, tiny_lm

ARCHITECTURES = {
    "learned": dict(positional="learned"),
    "rope": dict(positional="rope"),
    "alibi": dict(positional="alibi"),
    "sinusoidal": dict(positional="sinusoidal"),
    # The shape of an imported Llama/Qwen3 run: RMSNorm, SwiGLU, grouped-query heads,
    # QK-norm, no biases, an untied head.
    "qwen3-like": dict(positional="rope", norm_type="rmsnorm", activation="swiglu",
                       n_kv_heads=2, qk_norm=True, bias=False, tie_weights=False),
}


def _alone(model, text: str, max_tokens: int, **sampling) -> str:
    return generate_text(model, TOKENIZER, text, max_tokens, **sampling)[0]


@pytest.mark.filterwarnings("ignore::handformer.data.classification.DataWarning")
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_output_in_a_crowd_equals_generate_alone(arch: str) -> None:
    model = tiny_lm(**ARCHITECTURES[arch])  # window 24: prompts up to 30 + 30 new slide it
    engine = Engine(model, TOKENIZER, num_blocks=14, block_size=4, max_batch=8,
                    prefill_chunk=5, step_tokens=8)
    work = prompts(14, seed=1)
    jobs = [(TOKENIZER.encode(p), SamplingParams(max_tokens=n, temperature=0.0))
            for p, n in work]
    def blocks_add_up(e: Engine) -> None:  # after every step: each block held exactly once
        held = [b for r in e.scheduler.running for b in r.table]
        assert len(held) == len(set(held)) == e.blocks.used <= e.blocks.num_blocks
        assert all(not r.table for r in e.scheduler.waiting)
        assert all(len(r.table) * 4 >= r.cached for r in e.scheduler.running)

    texts = run_engine(engine, jobs, hook=blocks_add_up)
    assert engine.scheduler.preemptions > 0  # the small pool forced recomputation
    assert texts == [_alone(model, p, n, temperature=0) for p, n in work]
    assert engine.blocks.free == engine.blocks.num_blocks  # every block came back
    assert 0 < engine.blocks.peak <= engine.blocks.num_blocks  # the high-water mark


@pytest.mark.filterwarnings("ignore::handformer.data.classification.DataWarning")
def test_int8_weights_serve_what_they_generate_alone() -> None:
    model = set_int8_kernel(quantize_int8(tiny_lm(), inplace=True), "dequantized")
    engine = Engine(model, TOKENIZER, num_blocks=30, block_size=4, max_batch=6)
    work = prompts(6, seed=2)
    jobs = [(TOKENIZER.encode(p), SamplingParams(max_tokens=n, temperature=0.0))
            for p, n in work]
    assert run_engine(engine, jobs) == [_alone(model, p, n, temperature=0) for p, n in work]


@pytest.mark.skipif(not onednn_packing_available(), reason="this torch build has no oneDNN")
@pytest.mark.filterwarnings("ignore::handformer.data.classification.DataWarning")
def test_onednn_packed_weights_serve_what_they_generate_alone() -> None:
    model = pack_linears(tiny_lm())  # what `handformer serve` runs where the probe picks oneDNN
    engine = Engine(model, TOKENIZER, num_blocks=30, block_size=4, max_batch=6)
    work = prompts(6, seed=3)
    jobs = [(TOKENIZER.encode(p), SamplingParams(max_tokens=n, temperature=0.0))
            for p, n in work]
    assert run_engine(engine, jobs) == [_alone(model, p, n, temperature=0) for p, n in work]


def test_a_seeded_sampled_request_is_the_same_alone_or_in_a_crowd() -> None:
    model = tiny_lm(positional="rope", max_len=64)
    seeded = (TOKENIZER.encode("hello there"),
              SamplingParams(max_tokens=25, temperature=0.9, top_p=0.95, seed=1234))
    alone = run_engine(Engine(model, TOKENIZER, num_blocks=40, block_size=4), [seeded])[0]
    crowd = [(TOKENIZER.encode(p), SamplingParams(max_tokens=n, temperature=1.0, seed=i))
             for i, (p, n) in enumerate(prompts(9, seed=3))]
    engine = Engine(model, TOKENIZER, num_blocks=16, block_size=4, max_batch=6)
    texts = run_engine(engine, [*crowd[:4], seeded, *crowd[4:]], every=1)
    assert engine.scheduler.preemptions > 0
    assert texts[4] == alone
    # ... and that is generate's own seeded sampling, token for token.
    assert alone == _alone(model, "hello there", 25, temperature=0.9, top_p=0.95, seed=1234)


def test_a_long_prompt_is_read_in_chunks_while_others_keep_decoding() -> None:
    model = tiny_lm(max_len=128)
    engine = Engine(model, TOKENIZER, num_blocks=64, block_size=4, prefill_chunk=8,
                    step_tokens=8)
    streamed: list[int] = []
    short = Request(TOKENIZER.encode("ab"), SamplingParams(max_tokens=40, temperature=0.0),
                    lambda out: streamed.append(out.completion_tokens))
    long = Request(TOKENIZER.encode("abcdefgh" * 10), SamplingParams(max_tokens=2,
                                                                    temperature=0.0))
    with torch.inference_mode():
        engine.submit(short)
        engine.step()
        engine.submit(long)
        for _ in range(10):  # 80 prompt tokens in chunks of 8: 10 steps
            before = short.generated
            engine.step()
            assert short.generated == before + 1  # the short request streamed every step
        assert long.generated == 1 and long.cached == 80


def test_stop_strings_end_the_text_before_them_and_free_the_blocks() -> None:
    model = tiny_lm()
    free_run = run_engine(Engine(model, TOKENIZER, num_blocks=20, block_size=4),
                          [(TOKENIZER.encode("abc"), SamplingParams(20, temperature=0.0))])[0]
    stop = free_run[5:7]
    engine = Engine(model, TOKENIZER, num_blocks=20, block_size=4)
    text = run_engine(engine, [(TOKENIZER.encode("abc"),
                                SamplingParams(20, temperature=0.0, stop=(stop,)))])[0]
    assert text == free_run[: free_run.index(stop)]
    assert text == _alone(model, "abc", 20, temperature=0, stop=[stop])
    assert engine.blocks.used == 0


def test_cancel_frees_blocks_and_refusals_come_before_any_work() -> None:
    model = tiny_lm(max_len=64)
    engine = Engine(model, TOKENIZER, num_blocks=6, block_size=4, max_waiting=2)
    outs = []
    request = Request(TOKENIZER.encode("abcdefgh"), SamplingParams(10, temperature=0.0),
                      outs.append)
    engine.submit(request)
    with torch.inference_mode():
        engine.step()
    assert engine.blocks.used == 2  # the 8 prompt tokens (the new one is cached next step)
    with pytest.raises(RequestTooLargeError, match="can never fit the KV pool"):
        engine.submit(Request(TOKENIZER.encode("a" * 20), SamplingParams(max_tokens=10)))
    with pytest.raises(ValueError, match="prompt ids must lie in"):
        engine.submit(Request([5, 999], SamplingParams(max_tokens=3)))
    engine.submit(Request([5], SamplingParams(max_tokens=3)))
    engine.submit(Request([6], SamplingParams(max_tokens=3)))
    with pytest.raises(QueueFullError, match="queue is full"):
        engine.submit(Request([7], SamplingParams(max_tokens=3)))
    engine.cancel(request)
    with torch.inference_mode():
        engine.step()
    assert outs[-1].finished and outs[-1].finish_reason == "cancelled"
    assert request.table == [] and engine.queued == 0


@pytest.mark.filterwarnings("ignore::handformer.data.classification.DataWarning")
def test_a_steps_outputs_are_handed_over_together_at_its_end() -> None:
    """``deliver`` gets each step's outputs in one call, in order, and nothing reaches a
    request's ``on_output`` before its step ends; the texts are what each gives alone."""
    model = tiny_lm()
    engine = Engine(model, TOKENIZER, num_blocks=30, block_size=4)
    batches: list[list] = []
    engine.deliver = batches.append
    work = prompts(4, seed=5)
    requests = [Request(TOKENIZER.encode(p), SamplingParams(n, temperature=0.0),
                        lambda out: pytest.fail("on_output called behind deliver's back"))
                for p, n in work]
    for request in requests:
        engine.submit(request)
    steps = 0
    with torch.inference_mode():
        while engine.has_work():
            before = len(batches)
            engine.step()
            steps += 1
            assert len(batches) - before <= 1  # at most one hand-over a step
    assert len(batches) > 1 and steps >= len(batches)
    for batch in batches:
        ids = [request.id for request, _ in batch]
        assert len(ids) == len(set(ids))  # one output per request and step
    texts = {r.id: "" for r in requests}
    for batch in batches:
        for request, out in batch:
            texts[request.id] += out.text
    assert [texts[r.id] for r in requests] == [_alone(model, p, n, temperature=0)
                                               for p, n in work]
    assert [out.finished for b in batches for r, out in b if r is requests[0]][-1]


def test_logits_that_cannot_be_sampled_end_their_requests_not_the_engine() -> None:
    model = tiny_lm()
    with torch.no_grad():
        model.final_norm.weight.fill_(float("nan"))  # every logit NaN
    engine = Engine(model, TOKENIZER, num_blocks=20, block_size=4)
    outs: list = []
    for temperature in (0.0, 0.0, 1.0):
        engine.submit(Request(TOKENIZER.encode("abc"), SamplingParams(5, temperature),
                              outs.append))
    with torch.inference_mode():
        while engine.has_work():
            engine.step()
    assert [o.finish_reason for o in outs] == ["error"] * 3
    assert all("cannot be sampled" in o.error for o in outs)
    assert engine.blocks.used == 0


def test_the_default_pool_is_a_window_per_request_within_a_quarter_of_free_memory(
        monkeypatch) -> None:
    import handformer.serve.engine as engine_module

    model = tiny_lm(max_len=24)  # 2 layers × 4 heads × 8 dims × 2 (k, v) × 4 bytes a token
    monkeypatch.setattr(engine_module, "available_memory", lambda device: 1 << 30)
    assert Engine(model, TOKENIZER, block_size=4, max_batch=3).blocks.num_blocks == 3 * 6
    per_block = 2 * 4 * 2 * 4 * 8 * 4
    monkeypatch.setattr(engine_module, "available_memory", lambda device: 40 * per_block)
    assert Engine(model, TOKENIZER, block_size=4, max_batch=3).blocks.num_blocks == 10
