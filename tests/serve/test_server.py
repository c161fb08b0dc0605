"""The HTTP server, driven by the official ``openai`` client and by raw requests: a crowd of
concurrent requests each gets what ``generate`` gives it alone, and every fault is answered
with OpenAI's error object and its status — or, for a client that leaves, with its blocks
back in the pool."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import signal
import socket
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from handformer.generate import generate_text  # noqa: E402
from tests.serve.helpers import ENDLESS, prompts, tiny_lm  # noqa: E402
from tests.serve.server import metrics, serving, wait_for  # noqa: E402

KEY = "test-key"
SEEDED = dict(prompt="hello there", max_tokens=25, temperature=0.9, seed=77)


@pytest.fixture(scope="module")
def model():
    return tiny_lm(max_len=96)


@pytest.fixture(scope="module")
def expected(model):
    """Each crowd prompt's greedy text from ``generate_text`` alone, computed before any
    server runs."""
    return [generate_text(model, ENDLESS, p, n, temperature=0)[0]
            for p, n in prompts(36, seed=5)]


@pytest.fixture(scope="module")
def long_case(expected) -> tuple[str, int, str]:
    """A crowd prompt whose greedy text has n ≥ 6 characters (a special token decodes to
    none)."""
    return next((p, n, text) for (p, n), text in zip(prompts(36, seed=5), expected,
                                                     strict=True) if len(text) == n >= 6)


@pytest.fixture(scope="module")
def base(model, expected):
    # 24 blocks × 4 = 96 token slots (one window) for 36 requests of up to 59 tokens:
    # preemption is certain. A small send buffer makes a client that stops reading block the
    # server within kilobytes.
    engine = dict(num_blocks=24, block_size=4, max_batch=12, prefill_chunk=8, step_tokens=16)
    with serving(model, ENDLESS, engine=engine, api_key=KEY, client_timeout=2.0,
                 send_buffer=4096, max_body_bytes=1 << 20) as url:
        yield url


def _client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)


async def _complete(client, *, delay: float = 0.0, stream: bool, **kwargs) -> str:
    await asyncio.sleep(delay)
    if not stream:
        response = await client.completions.create(model="tiny", **kwargs)
        return response.choices[0].text
    text = ""
    async for chunk in await client.completions.create(model="tiny", stream=True, **kwargs):
        text += "".join(choice.text for choice in chunk.choices)
    return text


def test_a_crowd_of_clients_gets_what_each_prompt_generates_alone(base, expected) -> None:
    before = metrics(base)

    async def main() -> tuple[str, list[str], str]:
        async with _client(base) as client:
            alone = await _complete(client, stream=False, **SEEDED)
            rnd = random.Random(0)
            crowd = [_complete(client, delay=rnd.uniform(0, 0.3), stream=i % 2 == 0,
                               prompt=p, max_tokens=n, temperature=0)
                     for i, (p, n) in enumerate(prompts(36, seed=5))]
            seeded = _complete(client, delay=0.1, stream=True, **SEEDED)
            *texts, in_crowd = await asyncio.gather(*crowd, seeded)
            return alone, texts, in_crowd

    alone, texts, in_crowd = asyncio.run(main())
    assert texts == expected
    assert in_crowd == alone
    after = metrics(base)
    assert after["handformer_preemptions_total"] > before["handformer_preemptions_total"]
    assert after["handformer_kv_blocks_used"] == 0 and after["handformer_requests_running"] == 0


def test_completions_answer_usage_and_finish_reasons(base, long_case) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    response = client.completions.create(model="tiny", prompt=["abc", "de"], max_tokens=5,
                                         temperature=0, n=2)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.choices[0].text == response.choices[1].text  # greedy: n copies agree
    assert {c.finish_reason for c in response.choices} == {"length"}
    assert response.usage.prompt_tokens == 2 * (3 + 2)
    assert response.usage.completion_tokens == 20 and response.usage.total_tokens == 30
    assert [m.id for m in client.models.list().data] == ["tiny"]
    prompt, n, full = long_case
    stop = full[3:5]
    cut = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(stop)]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-5", prompt="abc")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()


def test_a_stream_is_server_sent_events_ending_in_done(base, long_case) -> None:
    prompt, n, full = long_case
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": n,
                                   "total_tokens": len(prompt) + n}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == full


BAD_BODIES = [
    ('{"model": "tiny", "prompt": "a", "max_tokens": "ten"}', "max_tokens"),
    ('{"model": "tiny", "prompt": "a", "stream": "yes"}', "stream"),
    ('{"model": "tiny", "prompt": "a", "temperature": NaN}', "temperature"),
    ('{"model": "tiny", "prompt": "a", "temperature": 1e999}', "temperature"),
    ('{"model": "tiny", "prompt": "a", "top_p": 0}', "top_p"),
    ('{"model": "tiny", "prompt": "a", "max_tokens": 1000000000000000000000000000000}',
     "max_tokens"),
    ('{"model": "tiny", "prompt": "a", "seed": 1180591620717411303424}', "seed"),
    ('{"model": "tiny", "prompt": "a", "n": 0}', "n"),
    ('{"model": "tiny", "prompt": 7}', "prompt"),
    ('{"model": "tiny", "prompt": [99999]}', "prompt"),
    ('{"model": "tiny", "prompt": ""}', "prompt"),
    ('{"model": "tiny", "prompt": "a", "logprobs": 2}', "logprobs"),
    ('{"model": "tiny", "prompt": "a", "stop": ["x", ""]}', "stop"),
    ('{"prompt": "a"}', "model"),
    ('{"model": "tiny", "prompt": "a", "max_tokens": 5', None),  # not JSON
    ('[1, 2]', None),
]


@pytest.mark.parametrize(("raw", "param"), BAD_BODIES)
def test_bad_bodies_are_400_naming_the_field(base, raw: str, param: str | None) -> None:
    response = httpx.post(f"{base}/v1/completions", content=raw.encode(),
                          headers={"Authorization": f"Bearer {KEY}",
                                   "Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    if param is not None:
        assert param in error["message"]


def test_unknown_paths_models_and_chat_without_a_template(base) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{base}/v2/nothing").status_code == 404
    assert httpx.get(f"{base}/v1/models/other", headers=auth).status_code == 404
    chat = httpx.post(f"{base}/v1/chat/completions", headers=auth, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "no chat template" in chat.json()["error"]["message"]
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}


def test_bodies_over_the_limit_are_413_with_or_without_a_length(base) -> None:
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    ten_mb = b'{"model": "tiny", "prompt": "' + b"a" * (10 << 20) + b'"}'
    sized = httpx.post(f"{base}/v1/completions", content=ten_mb, headers=auth)
    assert sized.status_code == 413 and sized.json()["error"]["code"] == "request_too_large"

    def chunks():
        for i in range(0, len(ten_mb), 1 << 16):
            yield ten_mb[i : i + (1 << 16)]

    try:
        chunked = httpx.post(f"{base}/v1/completions", content=chunks(), headers=auth)
    except httpx.TransportError:  # the server answered and closed while we were still sending
        return
    assert chunked.status_code == 413


def test_a_client_that_disconnects_mid_stream_gives_its_blocks_back(base) -> None:
    before = metrics(base).get('handformer_requests_finished_total{reason="cancelled"}', 0)
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 20000, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert metrics(base)["handformer_kv_blocks_used"] > 0
    wait_for(lambda: metrics(base).get(
        'handformer_requests_finished_total{reason="cancelled"}', 0) > before, "the cancel")
    wait_for(lambda: metrics(base)["handformer_kv_blocks_used"] == 0, "the blocks")


def _raw_request(base: str, body: bytes, *, send: bytes | None = None) -> socket.socket:
    port = int(base.rsplit(":", 1)[1])
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", port))
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + (body if send is None else send))
    return sock


def test_a_client_that_stops_reading_is_dropped_and_its_blocks_freed(base) -> None:
    before = metrics(base).get('handformer_requests_finished_total{reason="cancelled"}', 0)
    body = json.dumps({"model": "tiny", "prompt": "abc", "max_tokens": 30000,
                       "temperature": 0, "stream": True}).encode()
    sock = _raw_request(base, body)  # ... and never read
    try:
        wait_for(lambda: metrics(base).get(
            'handformer_requests_finished_total{reason="cancelled"}', 0) > before,
            "the stalled client to be dropped", timeout=90)
        wait_for(lambda: metrics(base)["handformer_kv_blocks_used"] == 0, "the blocks")
    finally:
        sock.close()


def test_a_body_that_stops_arriving_is_408(base) -> None:
    sock = _raw_request(base, b"x" * 100, send=b'{"model": ')
    try:
        sock.settimeout(15)
        start = time.monotonic()
        answer = sock.recv(4096).decode()
        assert answer.startswith("HTTP/1.1 408"), answer
        assert time.monotonic() - start < 10
    finally:
        sock.close()


def test_too_large_requests_are_400_and_a_full_queue_429_before_any_work(model) -> None:
    # The engine is not stepped: the first request waits in the queue, the second finds it full.
    with serving(model, ENDLESS, engine=dict(num_blocks=8, block_size=4, max_waiting=1),
                 run_engine=False, client_timeout=5.0) as url:
        # 20 prompt tokens + 20 new ones need up to 39 cached tokens; the pool holds 32.
        huge = httpx.post(f"{url}/v1/completions", json={
            "model": "tiny", "prompt": "a" * 20, "max_tokens": 20})
        assert huge.status_code == 400
        assert huge.json()["error"]["code"] == "context_length_exceeded"
        assert "can never fit" in huge.json()["error"]["message"]

        async def main() -> httpx.Response:
            async with httpx.AsyncClient(timeout=30) as client:
                first = asyncio.ensure_future(client.post(f"{url}/v1/completions", json={
                    "model": "tiny", "prompt": "abc", "max_tokens": 3}))
                await asyncio.sleep(0.3)
                second = await client.post(f"{url}/v1/completions", json={
                    "model": "tiny", "prompt": "abc", "max_tokens": 3})
                first.cancel()
                return second

        second = asyncio.run(main())
        assert second.status_code == 429 and second.headers["retry-after"] == "1"
        assert second.json()["error"]["type"] == "rate_limit_error"
        assert metrics(url)['handformer_requests_rejected_total{cause="queue_full"}'] == 1


def test_metrics_are_prometheus_text(base) -> None:
    httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
               json={"model": "tiny", "prompt": "abc", "max_tokens": 3})
    text = httpx.get(f"{base}/metrics").text
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    assert types["handformer_kv_blocks_used"] == "gauge"
    assert types["handformer_requests_waiting"] == "gauge"
    assert types["handformer_generation_tokens_total"] == "counter"
    assert types["handformer_preemptions_total"] == "counter"
    for name in ("handformer_time_to_first_token_seconds",
                 "handformer_time_per_output_token_seconds"):
        assert types[name] == "histogram"
        buckets = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(f"{name}_bucket")]
        count = metrics(base)[f"{name}_count"]
        assert buckets == sorted(buckets) and buckets[-1] == count > 0


def test_an_engine_that_dies_is_500_and_health_says_so(model) -> None:
    others = {p.pid for p in multiprocessing.active_children()}  # other tests' engines
    with serving(model, ENDLESS, engine=dict(num_blocks=8, block_size=4)) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        [child] = [p for p in multiprocessing.active_children()
                   if p.name == "handformer-engine" and p.pid not in others]
        os.kill(child.pid, signal.SIGKILL)
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 503, "health to fail")
        gone = f"the engine's process exited unexpectedly (code {-signal.SIGKILL})"
        assert httpx.get(f"{url}/health").json()["error"]["message"] == (
            f"the server cannot generate: {gone}")
        answer = httpx.post(f"{url}/v1/completions", json={
            "model": "tiny", "prompt": "abc", "max_tokens": 3})
        assert answer.status_code == 500
        assert answer.json()["error"]["message"] == f"the server cannot generate: {gone}"
        assert httpx.get(f"{url}/metrics").status_code == 500
