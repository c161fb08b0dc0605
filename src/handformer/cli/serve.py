"""``handformer serve``: an OpenAI-compatible server for a language-model run, many users at
once (continuous batching over a paged KV cache: ``handformer.serve``)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
from pathlib import Path
from typing import Any

from handformer.cli.common import (
    POSITIVE,
    UsageError,
    add_threads_option,
    device_name,
    port_number,
    positive_int,
    reporting,
)

__all__ = ["build_engine", "register", "run_serve"]


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve a run over the OpenAI HTTP API, many requests "
                       "at once")
    p.add_argument("--run", type=Path, required=True, help="language-model run folder")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; any other needs --api-key)")
    p.add_argument("--port", type=port_number, default=8000, help="TCP port (default 8000)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1 routes")
    p.add_argument("--model-name", default=None,
                   help="the model id clients send (default: the run folder's name)")
    p.add_argument("--kv-blocks", type=positive_int, default=None,
                   help="KV blocks in the pool, allocated at start (default: one full window "
                   "for each of --max-batch requests, within a quarter of the free memory)")
    p.add_argument("--block-size", type=positive_int, default=16,
                   help="token slots per KV block (default 16)")
    p.add_argument("--max-batch", type=positive_int, default=32,
                   help="requests decoded together at most (default 32)")
    p.add_argument("--max-waiting", type=positive_int, default=256,
                   help="requests waiting for their first token at most (queued, or their "
                   "prompt being read); more are answered 429 (default 256)")
    p.add_argument("--prefill-chunk", type=positive_int, default=64,
                   help="prompt tokens read per request per step (default 64)")
    p.add_argument("--step-tokens", type=positive_int, default=256,
                   help="prompt tokens read per step for all requests together (default 256)")
    p.add_argument("--max-body-bytes", type=positive_int, default=1 << 20,
                   help="larger request bodies are answered 413 (default 1 MiB)")
    p.add_argument("--client-timeout", type=POSITIVE, default=30.0,
                   help="seconds a client may take to send its body or to read the next "
                   "streamed event before it is dropped and its blocks freed (default 30)")
    p.add_argument("--shutdown-timeout", type=POSITIVE, default=60.0,
                   help="on SIGTERM or Ctrl-C, seconds to let requests in flight finish "
                   "(default 60)")
    p.add_argument("--device", type=device_name, default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="cast the model for inference (bfloat16: faster for many users on a "
                   "CPU that multiplies it natively; each request's attention runs as it runs "
                   "alone, but whether the matrix products round a row alike at every batch "
                   "size is up to the CPU's kernels, so a greedy text can differ from the same "
                   "request alone; float32, the default, is what the tests hold equal in a "
                   "crowd and alone)")
    p.add_argument("--quantize", choices=["int8"], default=None,
                   help="int8 weights (the dequantizing kernel: any batch size, no compiling)")
    p.add_argument("--matmul", choices=["auto", "blas", "onednn"], default="auto",
                   help="the library that multiplies float32 weights on the CPU: BLAS "
                   "(torch's own), oneDNN over weights reordered once at start, or auto "
                   "(default: both timed here at start on the model's own layers, at 1 and "
                   "--max-batch rows; oneDNN only where it is clearly faster)")
    add_threads_option(p)
    p.set_defaults(handler=reporting("serve", run_serve))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_engine(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """In the engine's process (``serve.process``, which runs it on the ``--threads`` the
    command set): the run loaded as ``--dtype``, ``--quantize`` and ``--matmul`` ask, and its
    ``Engine``; with what the HTTP side needs of the run (its chat template)."""
    from handformer.serve.engine import Engine

    model, tokenizer, config = _load(args)
    engine = Engine(model, tokenizer, num_blocks=args.kv_blocks, block_size=args.block_size,
                    max_batch=args.max_batch, max_waiting=args.max_waiting,
                    step_tokens=args.step_tokens, prefill_chunk=args.prefill_chunk)
    return engine, {"chat_template": config.get("chat_template")}


def _load(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    from handformer.runs import load_run

    run = load_run(args.run, device=args.device, kind="lm")
    model = run.model
    if args.dtype != "float32":
        import torch

        model = model.to(getattr(torch, args.dtype))
    from handformer.models.quantize import is_quantized, quantize_int8, set_int8_kernel

    if args.quantize is not None and not is_quantized(model):
        model = quantize_int8(model, inplace=True)
    if is_quantized(model):
        # Batches change size every step: the fused kernel would compile for each new size.
        set_int8_kernel(model, "dequantized")
    _pick_matmul(model, args)
    return model, run.tokenizer, run.config


def _pick_matmul(model: Any, args: argparse.Namespace) -> None:
    """Pack the float32 weights for oneDNN where ``--matmul`` asks or the probe says so (see
    ``handformer.models.packing``); print the choice and its figures."""
    from handformer.models.packing import MatmulChoice, choose_matmul, pack_linears
    from handformer.models.quantize import is_quantized

    float_cpu = (args.dtype == "float32" and not is_quantized(model)
                 and next(model.parameters()).device.type == "cpu")
    if not float_cpu:
        if args.matmul == "onednn":
            raise UsageError("--matmul onednn is for float32 weights on the CPU; got "
                             f"--dtype {args.dtype}, --device {args.device}"
                             f"{', int8 weights' if is_quantized(model) else ''}")
        return
    if args.matmul == "auto":
        choice = choose_matmul(model, args.max_batch)
    else:
        choice = MatmulChoice(args.matmul, "--matmul " + args.matmul)
    if choice.matmul == "onednn":
        try:
            pack_linears(model)
        except ValueError as err:
            raise UsageError(str(err)) from None
    print(f"handformer serve: {choice.line()}", file=sys.stderr, flush=True)


def event_loop_and_http() -> tuple[str, str]:
    """uvicorn's event loop and HTTP parser: its C ones, ``uvloop`` and ``httptools``
    (installed with ``handformer[serve]``), where they import; else the standard library's
    ``asyncio`` and the pure-Python ``h11``. The serving loop shares the GIL with the engine's
    thread, so every microsecond it spends per streamed token is taken from decoding. Chosen
    here, as uvicorn's "auto" would, so that the startup line can say which one serves."""
    try:
        import uvloop  # noqa: F401
        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    try:
        import httptools  # noqa: F401
        http = "httptools"
    except ImportError:
        http = "h11"
    return loop, http


class _Server:
    """uvicorn's server with handformer's exits. A signal (SIGTERM, Ctrl-C) stops it
    gracefully and the command exits 0 — uvicorn would re-raise the signal once shut down,
    ending the command as killed after a clean stop. A second Ctrl-C quits at once (exit
    130): the engine is stopped and the requests in flight are dropped, without the
    cancelled tasks' tracebacks that uvicorn's own forced exit prints."""

    @staticmethod
    def make(config: Any, engine: Any) -> Any:
        import contextlib
        import os
        import signal

        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # type: ignore[no-untyped-def]
                with super().capture_signals():
                    try:
                        yield
                    finally:
                        self._captured_signals.clear()

            def handle_exit(self, sig: int, frame: Any) -> None:
                if self.should_exit and sig == signal.SIGINT:
                    engine.kill()
                    print("handformer serve: interrupted; requests in flight were dropped",
                          file=sys.stderr, flush=True)
                    os._exit(130)
                super().handle_exit(sig, frame)

        return Server(config)


def run_serve(args: argparse.Namespace) -> int:
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key is empty")
    if not _is_loopback(args.host) and args.api_key is None:
        raise UsageError(f"--host {args.host} is reachable from other machines: give "
                         "--api-key KEY (clients send `Authorization: Bearer KEY`)")
    try:
        import uvicorn

        from handformer.serve.app import ServeSettings, create_app
    except ImportError as err:
        raise ImportError(f"handformer serve needs FastAPI and uvicorn: pip install "
                          f"'handformer[serve]' ({err})") from None
    from handformer.serve.process import EngineProcess

    # The options only (the handler is a closure): they travel to the engine's process.
    options = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "handler"})
    engine = EngineProcess(build_engine, options)
    info = engine.start()
    try:
        name = args.model_name or Path(args.run).resolve().name
        settings = ServeSettings(model_name=name, api_key=args.api_key,
                                 max_body_bytes=args.max_body_bytes,
                                 client_timeout=args.client_timeout,
                                 chat_template=info.extra.get("chat_template"))
        app = create_app(engine, settings)
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
        loop, http = event_loop_and_http()
        print(f"handformer serve: {name} on http://{args.host}:{args.port} — KV pool "
              f"{info.limits.num_blocks} blocks × {info.limits.block_size} tokens "
              f"({info.pool_bytes / 2**20:.1f} MiB), up to {args.max_batch} requests at "
              f"once{'; chat on' if settings.chat_template else ''}; {loop} + {http}",
              file=sys.stderr, flush=True)
        server = _Server.make(uvicorn.Config(
            app, host=args.host, port=args.port, loop=loop, http=http, log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=max(1, round(args.shutdown_timeout)), lifespan="on"),
            engine)
        server.run()
    finally:
        # A second Ctrl-C skips uvicorn's shutdown (and so the app's): stop the engine here.
        engine.stop(30, drain=False)
    print("handformer serve: stopped", file=sys.stderr, flush=True)
    return 0
