"""Load on ``handformer serve``: C concurrent clients × N requests each, against one client
alone on the same server and against transformers' static batching.

The server is the real command (``handformer serve`` in a process of its own, on loopback),
the clients are asyncio tasks streaming over HTTP (server-sent events), each request a
mixed prompt length and ``max_tokens``, greedy. Scenarios, alternated (one of each per
repeat, so the machine's noise hits them alike), each the median of ``--repeats`` runs:

* ``1 client``: the same requests one after another on the idle server — time to first
  token on an idle server, and the tokens/s one user gets;
* ``C clients``: C clients at once, each sending its N requests back to back — p50/p99 time
  to first token and per-token latency (a request's (last − first token time) / (tokens −
  1)), aggregate decode tokens/s, errors, and responses lost or mixed up (a text that
  differs from what the same request gave alone), the most KV blocks held at once (the
  server's own high-water mark, from ``/metrics``) against the pool, and the server's peak
  resident memory;
* ``static batch (transformers)``: the same requests in arrival order, C at a time, left-
  padded into one batch that runs until its longest request ends — transformers'
  ``generate`` on the model converted to GPT-2 (``interop.gpt2``; the ``medium`` preset is
  learned positions + GELU, so it converts). Tokens/s counts the tokens requests asked for.

``--dtype bfloat16`` serves (and runs transformers) in bfloat16 instead of float32. The
table's caption line names the CPU, torch's ISA level, the threads and the dtype.

Without ``--run`` the model is the ``--preset``'s, randomly initialised (speed does not
depend on what the weights learned), saved to a temporary run folder with a character
vocabulary. ``--quick`` runs the ``tiny`` preset with 4 clients × 2 requests, in seconds:
a check that the script works, not a measurement.

    python benchmarks/serve_load.py --preset medium --clients 16 --requests 4
    python benchmarks/serve_load.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from handformer.config import PRESETS

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Job:
    prompt: str
    max_tokens: int


@dataclass
class Result:
    ttft: float | None
    per_token: float | None
    tokens: int
    text: str
    error: str | None = None


def _jobs(n: int, seed: int, max_len: int, *, quick: bool) -> list[Job]:
    rnd = random.Random(seed)
    # Prompt + new tokens stay within one window: transformers' GPT-2 has no positions past
    # it (handformer would slide the window; the two would not do the same work).
    longest_prompt = max(2, min(48, max_len // 2))
    longest_new = max(2, min(12 if quick else 96, max_len - longest_prompt))
    return [Job("".join(rnd.choice(string.ascii_lowercase + " ") for _ in
                        range(rnd.randint(2, longest_prompt))),
                rnd.randint(max(2, longest_new // 4), longest_new)) for _ in range(n)]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _one(client: Any, base: str, model: str, job: Job) -> Result:
    body = {"model": model, "prompt": job.prompt, "max_tokens": job.max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times: list[float] = []
    text, generated = "", 0
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return Result(None, None, 0, "", f"HTTP {response.status_code}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(None, None, 0, text, chunk["error"]["message"])
                if chunk.get("usage"):
                    generated = chunk["usage"]["completion_tokens"]
                piece = "".join(c.get("text", "") for c in chunk["choices"])
                if piece:
                    times.append(time.perf_counter())
                    text += piece
    except Exception as err:  # a transport failure counts as an error of the load run
        return Result(None, None, 0, text, f"{type(err).__name__}: {err}")
    ttft = times[0] - start if times else None
    # Pieces of text arrive about one per token (a held-back stop prefix or a half
    # character joins the next); the token count is the server's own usage figure.
    per_token = (times[-1] - times[0]) / (generated - 1) if generated > 1 and times else None
    return Result(ttft, per_token, generated, text)


async def _scenario(base: str, model: str, clients: list[list[Job]]) -> dict[str, Any]:
    import httpx

    async def run_client(client: Any, jobs: list[Job]) -> list[Result]:
        return [await _one(client, base, model, job) for job in jobs]

    limits = httpx.Limits(max_connections=len(clients) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        per_client = await asyncio.gather(*(run_client(client, jobs) for jobs in clients))
        wall = time.perf_counter() - start
        # The server's own high-water mark of blocks held, since it started (so only the
        # first one-client run, before any crowd, tells that scenario's own peak).
        gauges = {line.split()[0]: int(float(line.split()[1]))
                  for line in (await client.get(f"{base}/metrics")).text.splitlines()
                  if line.startswith(("handformer_kv_blocks_peak ",
                                      "handformer_kv_blocks_used ",
                                      "handformer_kv_blocks_free "))}
    results = [r for rs in per_client for r in rs]
    return {"wall_s": wall, "results": results,
            "peak_blocks": gauges["handformer_kv_blocks_peak"],
            "pool_blocks": gauges["handformer_kv_blocks_used"]
            + gauges["handformer_kv_blocks_free"]}


def _summary(name: str, runs: list[dict[str, Any]], reference: list[str] | None,
             order: list[int]) -> dict[str, Any]:
    """Medians over runs of each figure; errors and mismatches summed over runs."""
    def median(values: list[float | None]) -> float | None:
        kept = [v for v in values if v is not None]
        return statistics.median(kept) if kept else None

    rows = []
    for run in runs:
        results = run["results"]
        ok = [r for r in results if r.error is None]
        tokens = sum(r.tokens for r in ok)
        mixed = 0
        if reference is not None:
            mixed = sum(r.error is None and r.text != reference[i]
                        for i, r in zip(order, results, strict=True))
        rows.append({
            "tokens_per_s": tokens / run["wall_s"],
            "ttft_p50_s": _percentile([r.ttft for r in ok if r.ttft is not None], 0.5),
            "ttft_p99_s": _percentile([r.ttft for r in ok if r.ttft is not None], 0.99),
            "per_token_p50_s": _percentile([r.per_token for r in ok if r.per_token], 0.5),
            "per_token_p99_s": _percentile([r.per_token for r in ok if r.per_token], 0.99),
            "errors": len(results) - len(ok), "mixed_up": mixed,
            "peak_kv_blocks": run["peak_blocks"], "requests": len(results)})
    keys = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "per_token_p50_s", "per_token_p99_s",
            "peak_kv_blocks")
    out: dict[str, Any] = {"scenario": name, "requests": rows[0]["requests"]}
    out.update({k: median([row[k] for row in rows]) for k in keys})
    out["errors"] = sum(row["errors"] for row in rows)
    out["mixed_up"] = sum(row["mixed_up"] for row in rows)
    return out


def _static_batch(run_dir: Path, jobs: list[Job], batch: int, threads: int,
                  dtype: str) -> float | str:
    """Wall seconds of transformers' ``generate`` with static batching on the model
    converted to GPT-2 (after one untimed warm-up group); a string says why it did not run.
    Greedy, and no end-of-text stop: each group runs until its longest request ends."""
    try:
        import transformers
    except ImportError:
        return "transformers is not installed"
    from handformer.interop.errors import ConversionError
    from handformer.interop.gpt2 import config_to_gpt2, to_gpt2_state_dict
    from handformer.runs import load_run

    run = load_run(run_dir, kind="lm")
    try:
        hf_config = transformers.GPT2Config(**config_to_gpt2(run.model.config))
    except ConversionError as err:
        return str(err)
    model = transformers.GPT2LMHeadModel(hf_config).eval()
    model.load_state_dict(to_gpt2_state_dict(run.model), strict=True)
    model = model.to(getattr(torch, dtype))
    tokenizer, pad = run.tokenizer, run.tokenizer.pad_id
    torch.set_num_threads(threads)

    def group_run(group: list[Job]) -> None:
        ids = [tokenizer.encode(j.prompt) for j in group]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        with torch.inference_mode():
            model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                           max_new_tokens=max(j.max_tokens for j in group),
                           pad_token_id=pad, eos_token_id=None)

    group_run(jobs[:batch])  # warm-up: the server's first requests warmed it up alike
    start = time.perf_counter()
    for i in range(0, len(jobs), batch):
        group_run(jobs[i : i + batch])
    return time.perf_counter() - start


def _static_summary(walls: list[float | str], jobs: list[Job],
                    batch: int) -> dict[str, Any] | str | None:
    """The static-batching row (tokens/s counts the tokens the requests asked for), the
    reason it did not run, or None when it was not asked for."""
    if not walls:
        return None
    if isinstance(walls[0], str):
        return walls[0]
    wanted = sum(j.max_tokens for j in jobs)
    return {"scenario": f"static batch of {batch} (transformers)", "requests": len(jobs),
            "tokens_per_s": wanted / statistics.median(walls), "errors": 0, "mixed_up": 0}  # type: ignore[arg-type]


def _settle_load_shape(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--quick``'s tiny shape, and one usage line for a count below 1 (both load scripts)."""
    if args.quick:
        args.preset, args.clients, args.requests, args.repeats = "tiny", 4, 2, 1
    for name in ("clients", "requests", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1; got {getattr(args, name)}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _peak_rss_mib(pid: int) -> float | None:
    """The server's peak resident memory: its own and its engine process's (``VmHWM`` of
    each, summed: an upper bound, as the two peaks need not coincide)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    peaks = [_own_peak_mib(p) for p in (pid, *map(int, children))]
    return None if peaks[0] is None else sum(p or 0.0 for p in peaks)


def _own_peak_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _make_run(preset: str, folder: Path) -> Path:
    from handformer.config import ModelConfig, get_preset
    from handformer.models.decoder_lm import DecoderLM
    from handformer.runs import save_run
    from handformer.tokenizers import CharTokenizer

    tokenizer = CharTokenizer(sorted(set(string.printable)))
    config = ModelConfig.from_dict({**get_preset(preset).model,
                                    "vocab_size": tokenizer.vocab_size})
    torch.manual_seed(0)
    return save_run(folder / preset, DecoderLM(config).eval(), tokenizer)


def _start_server(run_dir: Path, port: int, args: argparse.Namespace) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep +
           os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, "-m", "handformer", "serve", "--run", str(run_dir), "--port",
               str(port), "--threads", str(args.threads), "--max-batch", str(args.clients),
               "--block-size", str(args.block_size), "--dtype", args.dtype,
               "--matmul", args.matmul]
    if args.kv_blocks is not None:
        command += ["--kv-blocks", str(args.kv_blocks)]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _wait_up(server: subprocess.Popen, base: str) -> None:
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited: {server.stderr.read()}")  # type: ignore[union-attr]
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not come up within 120 s")


def _print_table(rows: list[dict[str, Any]]) -> None:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    print(f"{'scenario':34} {'tok/s':>8} {'TTFT p50':>9} {'p99':>8} {'tok p50':>8} "
          f"{'p99':>7} {'errors':>6} {'mixed':>5} {'peak KV':>7}")
    for r in rows:
        print(f"{r['scenario']:34} {r['tokens_per_s']:8.1f} {ms(r.get('ttft_p50_s')):>9} "
              f"{ms(r.get('ttft_p99_s')):>8} {ms(r.get('per_token_p50_s')):>8} "
              f"{ms(r.get('per_token_p99_s')):>7} {r['errors']:>6} {r['mixed_up']:>5} "
              f"{r.get('peak_kv_blocks', '-')!s:>7}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=None, help="a language-model run folder "
                        "(default: the --preset, randomly initialised)")
    parser.add_argument("--preset", default="medium", choices=sorted(PRESETS))
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4, help="requests per client")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (server and "
                        "the transformers baseline alike)")
    parser.add_argument("--kv-blocks", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the server's weights and cache, and transformers' model")
    parser.add_argument("--matmul", choices=["auto", "blas", "onednn"], default="auto",
                        help="the server's float32 products (handformer serve --matmul)")
    parser.add_argument("--no-static", action="store_true",
                        help="skip the transformers static-batching comparison")
    parser.add_argument("--quick", action="store_true",
                        help="tiny preset, 4 clients × 2 requests, 1 repeat: seconds")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/serve_load.json")
    args = parser.parse_args(argv)
    _settle_load_shape(parser, args)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run or _make_run(args.preset, Path(tmp))
        from handformer.runs import RunFolderError, load_run

        try:
            max_len = load_run(run_dir, kind="lm").model.config.max_len
        except RunFolderError as err:
            parser.error(str(err).splitlines()[0])
        jobs = _jobs(args.clients * args.requests, args.seed, max_len, quick=args.quick)
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        server = _start_server(run_dir, port, args)
        try:
            _wait_up(server, base)
            model = Path(run_dir).resolve().name
            # Client c sends jobs c, c + C, c + 2C, ...: the same requests, now concurrent.
            split = [list(range(c, len(jobs), args.clients)) for c in range(args.clients)]
            order = [i for idx in split for i in idx]
            alone, crowd, static_walls = [], [], []
            for _ in range(args.repeats):  # alternated, so machine noise hits all alike
                alone.append(asyncio.run(_scenario(base, model, [jobs])))
                crowd.append(asyncio.run(_scenario(base, model, [[jobs[i] for i in idx]
                                                                 for idx in split])))
                if not args.no_static:
                    static_walls.append(_static_batch(Path(run_dir), jobs, args.clients,
                                                      args.threads, args.dtype))
            reference = [r.text for r in alone[0]["results"]]
            rows = [_summary("1 client", alone, reference, list(range(len(jobs)))),
                    _summary(f"{args.clients} clients", crowd, reference, order)]
            rows[0]["peak_kv_blocks"] = alone[0]["peak_blocks"]  # the later ones saw a crowd
        finally:
            peak_rss = _peak_rss_mib(server.pid)
            server.send_signal(signal.SIGTERM)
            server.wait(120)
            matmul = next((line.split(": ", 1)[1] for line in server.stderr.read().splitlines()  # type: ignore[union-attr]
                           if "float32 matrix products:" in line), None)
        static = _static_summary(static_walls, jobs, args.clients)
        if isinstance(static, dict):
            rows.append(static)
    from handformer.machine import describe_machine, machine_line

    machine = {**describe_machine(), "threads": args.threads}  # the server's and the peer's
    print(f"{machine_line(machine)} · {args.dtype}")
    if matmul:
        print(f"server: {matmul}")
    _print_table(rows)
    speedup = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    print(f"{args.clients} clients / 1 client: {speedup:.2f}x aggregate tokens/s; peak KV "
          f"blocks {rows[1]['peak_kv_blocks']} of the pool's {crowd[0]['pool_blocks']}; "
          f"server peak RSS {peak_rss or 0:.0f} MiB")
    if isinstance(static, dict):
        print(f"{args.clients} clients / static batch: "
              f"{rows[1]['tokens_per_s'] / static['tokens_per_s']:.2f}x")
    elif static is not None:
        print(f"static batching not measured: {static}")
    ttft_ratio = (rows[1]["ttft_p99_s"] / rows[0]["ttft_p99_s"]
                  if rows[0]["ttft_p99_s"] and rows[1]["ttft_p99_s"] else None)
    report = {"command": "python benchmarks/serve_load.py " + " ".join(argv or sys.argv[1:]),
              "preset": None if args.run else args.preset,
              "run": None if args.run is None else str(args.run), "clients": args.clients,
              "requests_per_client": args.requests, "repeats": args.repeats,
              "threads": args.threads, "dtype": args.dtype, "machine": machine, "rows": rows,
              "speedup_vs_one_client": speedup,
              "ttft_p99_load_over_idle": ttft_ratio, "server_peak_rss_mib": peak_rss,
              "kv_pool_blocks": crowd[0]["pool_blocks"],
              "server_matmul": matmul,
              "static_batch_note": static if isinstance(static, str) else None}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    errors = sum(r["errors"] + r["mixed_up"] for r in rows)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
