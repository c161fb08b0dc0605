"""The engine in a process of its own (``serve.process``): what a crowd gets through the pipe
is what the engine gives in-process; the child's build errors are the parent's errors; a
child that dies ends what was in flight with an error; a parent that dies ends the child."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from handformer.cli.common import UsageError
from handformer.serve.engine import Engine, QueueFullError, RequestTooLargeError
from handformer.serve.process import EngineGoneError, EngineProcess
from handformer.serve.request import Request, RequestOutput, SamplingParams
from tests.serve.helpers import ENDLESS, prompts, run_engine, tiny_lm
from tests.serve.server import engine_of

ENGINE = dict(num_blocks=24, block_size=4, max_batch=8, prefill_chunk=8, step_tokens=16)


def _refuses(message: str) -> tuple[Engine, dict]:
    raise UsageError(message)


class _Unpicklable(Exception):
    def __init__(self, a: int, b: int) -> None:  # pickling rebuilds it with one argument
        super().__init__(f"{a}/{b}")


def _refuses_oddly() -> tuple[Engine, dict]:
    raise _Unpicklable(1, 2)


def _says_its_threads() -> tuple[Engine, dict]:
    engine, _ = engine_of(tiny_lm(), ENDLESS, ENGINE)
    return engine, {"threads": torch.get_num_threads()}


async def _gather(process: EngineProcess, jobs: list[tuple[list[int], SamplingParams]],
                  *, until: float = 60.0) -> list[tuple[str, str | None, str | None]]:
    """Submit every job; (text, finish reason, error) of each once all ended."""
    loop = asyncio.get_running_loop()
    process.attach(loop)
    texts = [""] * len(jobs)
    ends: list[RequestOutput | None] = [None] * len(jobs)
    done = asyncio.Event()

    def collect(i: int):
        def on_output(out: RequestOutput) -> None:
            texts[i] += out.text
            if out.finished:
                ends[i] = out
                if all(e is not None for e in ends):
                    done.set()
        return on_output

    for i, (ids, params) in enumerate(jobs):
        process.submit(Request(ids, params, collect(i)))
    await asyncio.wait_for(done.wait(), until)
    return [(t, e.finish_reason, e.error) for t, e in zip(texts, ends, strict=True)
            if e is not None]


def _jobs(n: int) -> list[tuple[list[int], SamplingParams]]:
    return [(ENDLESS.encode(p), SamplingParams(max_tokens=k, temperature=0))
            for p, k in prompts(n, seed=3)]


def test_a_crowd_through_the_pipe_gets_what_the_engine_gives_in_process() -> None:
    model = tiny_lm(max_len=96)
    jobs = _jobs(12)
    expected = run_engine(Engine(model, ENDLESS, **ENGINE), jobs)
    process = EngineProcess(engine_of, model, ENDLESS, ENGINE)
    info = process.start()
    try:
        assert (info.limits.vocab_size, info.limits.num_blocks, info.limits.block_size) == (
            ENDLESS.vocab_size, 24, 4)
        got = asyncio.run(_gather(process, jobs))
        assert [text for text, _, _ in got] == expected
        assert {reason for _, reason, _ in got} == {"length"}

        async def metrics() -> str:
            process.attach(asyncio.get_running_loop())
            return await process.metrics_text()

        text = asyncio.run(metrics())
        assert "handformer_kv_blocks_used 0" in text
        tokens = sum(params.max_tokens for _, params in jobs)
        assert f"handformer_generation_tokens_total {tokens}" in text
    finally:
        process.stop(30)
    assert process._process.exitcode == 0  # stopped once its requests were done, and reaped


def test_the_parent_refuses_before_sending_what_the_engine_would_refuse() -> None:
    process = EngineProcess(engine_of, tiny_lm(max_len=96), ENDLESS,
                            dict(num_blocks=8, block_size=4, max_waiting=2))
    process.start(step=False)  # nothing is answered: the queue only fills
    try:
        with pytest.raises(RequestTooLargeError, match="can never fit the KV pool"):
            process.submit(Request([1] * 20, SamplingParams(max_tokens=20)))
        vocab = ENDLESS.vocab_size
        with pytest.raises(ValueError, match=rf"prompt ids must lie in \[0, {vocab}\)"):
            process.submit(Request([99], SamplingParams(max_tokens=2)))
        for _ in range(2):
            process.submit(Request([1, 2], SamplingParams(max_tokens=2)))
        with pytest.raises(QueueFullError, match="2 requests waiting"):
            process.submit(Request([1, 2], SamplingParams(max_tokens=2)))
    finally:
        process.stop(30, drain=False)


def test_a_build_error_is_raised_by_start_as_the_build_raised_it() -> None:
    with pytest.raises(UsageError, match=r"^no such run$"):
        EngineProcess(_refuses, "no such run").start()
    with pytest.raises(RuntimeError, match="_Unpicklable: 1/2"):
        EngineProcess(_refuses_oddly).start()


def test_the_child_runs_on_the_parents_thread_count() -> None:
    torch.set_num_threads(3)  # not what a fresh interpreter takes here (conftest restores it)
    process = EngineProcess(_says_its_threads)
    try:
        assert process.start().extra == {"threads": 3}
    finally:
        process.stop(30)
    assert process.gone == "the engine stopped"  # no event loop read the pipe: stop closed it
    with pytest.raises(EngineGoneError, match="the engine stopped"):
        process.submit(Request([1], SamplingParams(max_tokens=2)))


def test_a_child_that_dies_ends_the_requests_in_flight_with_an_error() -> None:
    process = EngineProcess(engine_of, tiny_lm(max_len=96), ENDLESS, ENGINE)
    process.start()
    pid = process.pid
    assert pid is not None

    async def main() -> list[tuple[str, str | None, str | None]]:
        long = [(ENDLESS.encode("abc"), SamplingParams(max_tokens=100_000, temperature=0))]
        running = asyncio.ensure_future(_gather(process, long))
        await asyncio.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        return await running

    try:
        [(_, reason, error)] = asyncio.run(main())
        assert reason == "error"
        assert error == f"the engine's process exited unexpectedly (code {-signal.SIGKILL})"
        with pytest.raises(EngineGoneError, match="exited unexpectedly"):
            process.submit(Request([1], SamplingParams(max_tokens=2)))
    finally:
        process.stop(5)


def test_a_child_whose_parent_is_gone_stops() -> None:
    process = EngineProcess(engine_of, tiny_lm(), ENDLESS, ENGINE)
    process.start()
    process._conn.close()  # what the parent's death does to the pipe
    deadline = time.monotonic() + 30
    while process._process.is_alive():
        assert time.monotonic() < deadline, "the engine's process outlived its parent"
        time.sleep(0.05)
    assert process._process.exitcode == 0


def test_answered_requests_leave_the_queue_the_parent_counts() -> None:
    process = EngineProcess(engine_of, tiny_lm(max_len=96), ENDLESS,
                            {**ENGINE, "max_waiting": 2})
    process.start()
    try:
        for _ in range(3):  # two at a time, three times: each pair leaves room for the next
            got = asyncio.run(_gather(process, _jobs(2)))
            assert [reason for _, reason, _ in got] == ["length", "length"]
    finally:
        process.stop(30)


def test_a_client_that_leaves_while_the_engine_drains_is_still_cancelled() -> None:
    process = EngineProcess(engine_of, tiny_lm(max_len=96), ENDLESS, ENGINE)
    process.start()

    async def main() -> RequestOutput:
        loop = asyncio.get_running_loop()
        process.attach(loop)
        ended: asyncio.Future[RequestOutput] = loop.create_future()

        def on_output(out: RequestOutput) -> None:
            if out.finished and not ended.done():
                ended.set_result(out)

        request = Request(ENDLESS.encode("abc"), SamplingParams(max_tokens=1_000_000,
                                                                temperature=0), on_output)
        process.submit(request)
        await asyncio.sleep(0.5)
        stopping = asyncio.ensure_future(asyncio.to_thread(process.stop, 20))  # drains
        await asyncio.sleep(0.5)
        process.cancel(request)
        out = await asyncio.wait_for(ended, 30)
        await stopping
        return out

    try:
        out = asyncio.run(main())
    finally:
        process.stop(5)
    assert out.finish_reason == "cancelled"
    assert process._process.exitcode == 0  # it ended by itself, not killed after 20 s


def test_a_bug_in_the_engines_process_is_one_line_and_ends_it(capfd) -> None:
    process = EngineProcess(engine_of, tiny_lm(), ENDLESS, ENGINE)
    process.start()
    process._send(("submit", 1))  # a message the child cannot take apart: a bug
    process._process.join(30)
    assert process._process.exitcode == 1
    err = capfd.readouterr().err
    assert err.splitlines() == ["handformer serve: the engine's process failed (ValueError: "
                                "not enough values to unpack (expected 5, got 2))"]
