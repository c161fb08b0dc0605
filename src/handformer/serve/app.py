"""The OpenAI-compatible HTTP API over an engine in its own process (``EngineProcess``):
FastAPI routes, nothing of the model.

Needs the ``serve`` extra (FastAPI, uvicorn); nothing else in the package imports this module.

    GET  /health                   {"status": "ok"}, or 503 once the engine is gone
    GET  /metrics                  Prometheus text (serve.metrics)
    GET  /v1/models                the one model this server serves
    POST /v1/completions           OpenAI's completions schema, streaming or not
    POST /v1/chat/completions      for runs with a chat template (imported HF folders)

Every refusal is OpenAI's error object with the status a client expects: 400 for a body
that is not JSON, a wrong type, NaN/inf or a number out of range (naming the field), a
prompt that could never fit the KV pool, or chat on a run without a template; 401 for a
missing or wrong API key; 404 for an unknown model or path; 408 for a body that stops
arriving; 413 for a body over the limit (read no further); 429 with ``Retry-After`` when the
queue is full; 500 only for a failure inside the server, with one line in its log and no
traceback anywhere.

Each request's engine requests are cancelled — their blocks back in the pool before the next
step — when the client disconnects, or stops reading a stream for ``client_timeout``
seconds. Streams are server-sent events, ``data: {chunk}`` lines ending in ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException

from handformer.serve.asgi import (
    ApiError,
    DroppedStreamFilter,
    EventStream,
    Guard,
    sse,
    wait_disconnect,
)
from handformer.serve.chat import ChatTemplate, ChatTemplateError
from handformer.serve.engine import QueueFullError, RequestTooLargeError
from handformer.serve.process import EngineGoneError, EngineProcess
from handformer.serve.protocol import (
    SEED_MAX,
    ChatBody,
    CompletionBody,
    ValidationError,
    error_body,
    validation_message,
)
from handformer.serve.request import Request, RequestOutput, SamplingParams

__all__ = ["ServeSettings", "create_app"]


@dataclass
class ServeSettings:
    """What the HTTP side enforces; the engine's limits live in the ``Engine``."""

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    client_timeout: float = 30.0
    max_tokens_limit: int = 1 << 15
    chat_max_tokens: int = 256  # a chat request's default when it names none
    chat_template: str | None = None
    retry_after_s: int = 1


class _Job:
    """The engine requests behind one HTTP request (prompts × n choices), and the asyncio
    queue their outputs arrive on (``EngineProcess`` hands them over on the event loop)."""

    def __init__(self, engine: EngineProcess) -> None:
        self.engine = engine
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self.requests: list[Request] = []
        self.open = 0

    def _deliver(self, index: int) -> Callable[[RequestOutput], None]:
        def deliver(out: RequestOutput) -> None:
            self.queue.put_nowait((index, out))
        return deliver

    def submit(self, prompts: list[list[int]], params: list[SamplingParams],
               retry_after: int) -> None:
        for prompt, p in zip(prompts, params, strict=True):
            self.engine.check_fits(len(prompt), p.max_tokens)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            request = Request(prompt, p, self._deliver(i))
            try:
                self.engine.submit(request)
            except QueueFullError as err:
                self.close()
                self.engine.reject("queue_full")
                raise ApiError(429, str(err), code="rate_limit_exceeded",
                               headers={"Retry-After": str(retry_after)}) from None
            except EngineGoneError as err:
                self.close()
                raise ApiError(500, f"the server cannot generate: {err}") from None
            self.requests.append(request)
        self.open = len(self.requests)

    async def next(self) -> tuple[int, RequestOutput]:
        index, out = await self.queue.get()
        if out.finished:
            self.open -= 1
        return index, out

    def close(self) -> None:
        """Cancel whatever is still running (a no-op for finished requests)."""
        for request in self.requests:
            if not request.finished:
                self.engine.cancel(request)


def create_app(engine: EngineProcess, settings: ServeSettings) -> Any:
    """The FastAPI app serving ``engine`` (started: its tokenizer is known); the app's
    lifespan reads the engine's outputs on the server's event loop and, at its end, stops the
    engine once the requests in flight are done."""
    uvicorn_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, DroppedStreamFilter) for f in uvicorn_log.filters):
        uvicorn_log.addFilter(DroppedStreamFilter())
    template = None
    if settings.chat_template is not None:
        template = ChatTemplate.for_tokenizer(settings.chat_template, engine.tokenizer)
    tokenizer = engine.tokenizer

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        engine.attach(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    app = FastAPI(title="handformer", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)

    def answer(err: ApiError) -> JSONResponse:
        return JSONResponse(json.loads(err.body()), status_code=err.status,
                            headers=err.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: HttpRequest, exc: HTTPException) -> JSONResponse:
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not "
                   f"allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return answer(ApiError(exc.status_code, message))

    @app.exception_handler(Exception)
    async def server_error(request: HttpRequest, exc: Exception) -> JSONResponse:
        return answer(ApiError(500, "the server failed on this request"))  # Guard logs it

    def check_key(request: HttpRequest) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "")
        expected = f"Bearer {settings.api_key}"
        if not secrets.compare_digest(given.encode(), expected.encode()):
            raise ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                           code="invalid_api_key")

    async def read_body(request: HttpRequest, model: type[Any]) -> Any:
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(400, f"the body is not valid JSON: {err}") from None
        except RecursionError:
            raise ApiError(400, "the body is JSON nested too deeply to read") from None
        if not isinstance(data, dict):
            raise ApiError(400, f"the body must be a JSON object; got {type(data).__name__}")
        try:
            body = model.model_validate(data)
        except ValidationError as err:
            message, param = validation_message(err.errors())
            raise ApiError(400, message, param=param) from None
        if body.model != settings.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                           f"{settings.model_name!r}", param="model", code="model_not_found")
        unsupported = body.unsupported()
        if unsupported is not None:
            raise ApiError(400, f"{unsupported} is not supported by this server",
                           param=unsupported)
        return body

    def sampling(body: Any, max_tokens: int, choices: int) -> list[SamplingParams]:
        if max_tokens > settings.max_tokens_limit:
            raise ApiError(400, f"max_tokens: {max_tokens} is over this server's limit of "
                           f"{settings.max_tokens_limit}", param="max_tokens")
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = None if body.top_p in (None, 1.0) else body.top_p
        out = []
        for j in range(choices):
            seed = None if body.seed is None else (body.seed + j) % (SEED_MAX + 1)
            out.append(SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                      top_p=top_p, seed=seed, stop=body.stops()))
        return out

    async def run_job(request: HttpRequest, prompts: list[list[int]],
                      params: list[SamplingParams], *, n: int, stream: bool, usage: bool,
                      kind: str) -> Any:
        job = _Job(engine)
        every_prompt = [p for p in prompts for _ in range(n)]
        every_param = [p for _ in prompts for p in params]
        try:
            job.submit(every_prompt, every_param, settings.retry_after_s)
        except RequestTooLargeError as err:
            engine.reject("too_large")
            raise ApiError(400, str(err), param="max_tokens",
                           code="context_length_exceeded") from None
        meta = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
                "created": int(time.time()), "model": settings.model_name}
        prompt_tokens = sum(len(p) for p in every_prompt)
        if stream:
            return EventStream(_stream_events(job, meta, kind, prompt_tokens, usage),
                                settings.client_timeout)
        return await _collect(job, request, meta, kind, prompt_tokens)

    async def _collect(job: _Job, request: HttpRequest, meta: dict[str, Any], kind: str,
                       prompt_tokens: int) -> Any:
        texts = [""] * len(job.requests)
        reasons: list[str | None] = [None] * len(job.requests)
        counts = [0] * len(job.requests)
        watching = asyncio.ensure_future(wait_disconnect(request.receive))
        try:
            while job.open:
                getting = asyncio.ensure_future(job.next())
                await asyncio.wait({getting, watching}, return_when=asyncio.FIRST_COMPLETED)
                if not getting.done():  # the client went away
                    getting.cancel()
                    return PlainTextResponse("", status_code=499)
                index, out = getting.result()
                texts[index] += out.text
                counts[index] = out.completion_tokens
                if out.finished:
                    if out.finish_reason == "error":
                        raise ApiError(500, out.error or "generation failed")
                    reasons[index] = out.finish_reason
        finally:
            watching.cancel()
            job.close()
        completion = sum(counts)
        choices = [(_chat_choice if kind == "chat" else _text_choice)(i, text, reason)
                   for i, (text, reason) in enumerate(zip(texts, reasons, strict=True))]
        return JSONResponse({**meta, "object": "chat.completion" if kind == "chat"
                             else "text_completion", "choices": choices,
                             "usage": _usage(prompt_tokens, completion)})

    @app.get("/health")
    async def health() -> Any:
        if engine.gone is not None:  # a load balancer should stop sending here
            return answer(ApiError(503, f"the server cannot generate: {engine.gone}"))
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Any:
        try:
            text = await engine.metrics_text()
        except (EngineGoneError, TimeoutError) as err:
            return answer(ApiError(500, f"the engine did not answer: {err}"))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: HttpRequest) -> Any:
        try:
            check_key(request)
        except ApiError as err:
            return answer(err)
        return {"object": "list", "data": [_model_card(settings.model_name)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: HttpRequest) -> Any:
        try:
            check_key(request)
            if name != settings.model_name:
                raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                               f"{settings.model_name!r}", param="model",
                               code="model_not_found")
        except ApiError as err:
            return answer(err)
        return _model_card(settings.model_name)

    @app.post("/v1/completions")
    async def completions(request: HttpRequest) -> Any:
        try:
            check_key(request)
            body: CompletionBody = await read_body(request, CompletionBody)
            prompts = _prompt_ids(body.prompt, tokenizer, engine.vocab_size)
            params = sampling(body, body.max_tokens or 16, body.n)
            return await run_job(request, prompts, params, n=body.n, stream=body.stream,
                                 usage=bool(body.stream_options and
                                            body.stream_options.include_usage),
                                 kind="text")
        except ApiError as err:
            return answer(err)

    @app.post("/v1/chat/completions")
    async def chat(request: HttpRequest) -> Any:
        try:
            check_key(request)
            body: ChatBody = await read_body(request, ChatBody)
            if template is None:
                raise ApiError(400, "this run has no chat template (a run imported with "
                               "`handformer convert --from hf` from a chat model has one); "
                               "use /v1/completions", param="messages")
            try:
                text = template.render([{"role": m.role, "content": m.text()}
                                        for m in body.messages])
            except ChatTemplateError as err:
                raise ApiError(400, str(err), param="messages") from None
            prompt = tokenizer.encode(text)
            if not prompt:
                raise ApiError(400, "the chat template rendered these messages as no tokens",
                               param="messages")
            max_tokens = body.max_completion_tokens or body.max_tokens or \
                settings.chat_max_tokens
            params = sampling(body, max_tokens, body.n)
            return await run_job(request, [prompt], params, n=body.n, stream=body.stream,
                                 usage=bool(body.stream_options and
                                            body.stream_options.include_usage),
                                 kind="chat")
        except ApiError as err:
            return answer(err)

    return Guard(app, settings.max_body_bytes, settings.client_timeout)


def _prompt_ids(prompt: Any, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """OpenAI's four prompt shapes → one list of ids per prompt, checked."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt: an empty list", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    out: list[list[int]] = []
    for i, p in enumerate(prompt):
        ids = tokenizer.encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise ApiError(400, f"prompt[{i}] is empty; give at least one token",
                           param="prompt")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ApiError(400, f"prompt[{i}] holds token ids outside [0, {vocab_size}): "
                           f"{bad[:5]}", param="prompt")
        out.append(ids)
    return out


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "handformer"}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _text_choice(index: int, text: str, reason: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}


def _chat_choice(index: int, text: str, reason: str | None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": None, "finish_reason": reason}


async def _stream_events(job: _Job, meta: dict[str, Any], kind: str, prompt_tokens: int,
                         usage: bool) -> AsyncIterator[str]:
    """The SSE events of one streamed job; closing it early cancels the engine work."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(index: int, text: str | None, reason: str | None) -> dict[str, Any]:
        if kind == "chat":
            delta: dict[str, Any] = {} if text is None else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = _text_choice(index, text or "", reason)
        return {**meta, "object": obj, "choices": [choice]}

    counts = [0] * len(job.requests)
    try:
        if kind == "chat":
            for i in range(len(job.requests)):
                yield sse({**meta, "object": obj, "choices": [{
                    "index": i, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}]})
        while job.open:
            index, out = await job.next()
            counts[index] = out.completion_tokens
            if out.finished and out.finish_reason == "error":
                yield sse(error_body(out.error or "generation failed", "server_error"))
                continue
            if out.text:
                yield sse(chunk(index, out.text, None))
            if out.finished:
                yield sse(chunk(index, None, out.finish_reason))
        if usage:
            yield sse({**meta, "object": obj, "choices": [],
                        "usage": _usage(prompt_tokens, sum(counts))})
        yield sse("[DONE]")
    finally:
        job.close()
