"""The serving engine alone: ``serve_load.py``'s requests from 1 or C simulated clients, in
one process, no HTTP — and what a thread holding the GIL beside it costs.

``handformer serve`` runs its engine in a thread of the server's process, beside uvicorn's
event loop: every torch op the engine calls releases the GIL and takes it back, so whenever
the loop holds it then, the engine waits. This script measures the engine without the loop,
then with ``--gil-noise``: a thread that holds the GIL in bursts of ``BURST_US`` µs for a
``SHARE`` of the time (an event loop's pattern, without sockets), so the two can be told apart
from ``serve_load.py``'s figures. The model is loaded as the server loads it (``--matmul``
probe included); each client submits its next request when its last one ends, as
``serve_load.py``'s clients do. Scenarios alternate, ``--repeats`` times; medians.

    python benchmarks/serve_engine.py --preset medium --clients 16 --gil-noise 0.05:100
    python benchmarks/serve_engine.py --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from handformer.config import PRESETS

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import _jobs, _make_run, _settle_load_shape  # noqa: E402  (the same requests and model)


class GilNoise:
    """A thread that spins in Python (holding the GIL) for ``burst`` s, then sleeps (without
    it) so that the spinning is ``share`` of the time."""

    def __init__(self, share: float, burst: float) -> None:
        if not 0 < share < 1 or burst <= 0:
            raise ValueError(f"--gil-noise wants SHARE:BURST_US with 0 < SHARE < 1 and "
                             f"BURST_US > 0; got {share}:{burst * 1e6:g}")
        self.share, self.burst = share, burst
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        pause = self.burst * (1 - self.share) / self.share
        while not self._stop.is_set():
            end = time.perf_counter() + self.burst
            while time.perf_counter() < end:
                pass
            time.sleep(pause)

    def __enter__(self) -> GilNoise:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _scenario(engine: Any, tokenizer: Any, clients: list[list[Any]]) -> dict[str, float]:
    """Every client's jobs, each submitted when the client's previous one ended; returns
    tokens/s, steps, and the median time of steps that only decode, at the batch's size."""
    from handformer.generate.plain import small_op_kernels
    from handformer.serve.request import Request, SamplingParams

    queues = [list(jobs) for jobs in clients]
    open_requests, tokens = [0], [0]

    def submit(c: int) -> None:
        if not queues[c]:
            return
        job = queues[c].pop(0)

        def on_output(out: Any) -> None:
            if out.finished:
                open_requests[0] -= 1
                tokens[0] += out.completion_tokens
                submit(c)

        open_requests[0] += 1
        engine.submit(Request(tokenizer.encode(job.prompt),
                              SamplingParams(job.max_tokens, temperature=0.0), on_output))

    decode_steps: list[float] = []
    for c in range(len(clients)):
        submit(c)
    steps = 0
    start = time.perf_counter()
    with torch.inference_mode(), small_op_kernels(next(engine.model.parameters())):
        while open_requests[0] or engine.has_work():
            running = engine.scheduler.running
            full = (len(running) == len(clients) and engine.queued == 0
                    and all(r.to_compute == 1 for r in running))  # decoding only, full batch
            t = time.perf_counter()
            engine.step()
            if full:
                decode_steps.append(time.perf_counter() - t)
            steps += 1
    wall = time.perf_counter() - start
    return {"tokens_per_s": tokens[0] / wall, "steps": steps,
            "full_decode_step_ms": (statistics.median(decode_steps) * 1e3
                                    if decode_steps else None)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="medium", choices=sorted(PRESETS))
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4, help="requests per client")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--matmul", choices=["auto", "blas", "onednn"], default="auto")
    parser.add_argument("--gil-noise", default=None, metavar="SHARE:BURST_US",
                        help="also run the crowd beside a thread holding the GIL, e.g. 0.05:100")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="tiny preset, 4 clients × 2 requests, 1 repeat: seconds")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "benchmarks/results/serve_engine.json")
    args = parser.parse_args(argv)
    _settle_load_shape(parser, args)
    noise = None
    if args.gil_noise is not None:
        try:
            share, burst_us = (float(v) for v in args.gil_noise.split(":"))
            noise = (share, burst_us * 1e-6)
            GilNoise(*noise)  # checks the numbers before any work
        except ValueError as err:
            parser.error(f"--gil-noise wants SHARE:BURST_US (e.g. 0.05:100), 0 < SHARE < 1, "
                         f"BURST_US > 0; got {args.gil_noise!r}" if "SHARE" not in str(err)
                         else str(err))
    torch.set_num_threads(1)
    from handformer.cli.serve import _load
    from handformer.serve.engine import Engine

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = _make_run(args.preset, Path(tmp))
        load_args = argparse.Namespace(run=run_dir, device="cpu", dtype="float32",
                                       quantize=None, matmul=args.matmul,
                                       max_batch=args.clients)
        model, tokenizer, _ = _load(load_args)
    jobs = _jobs(args.clients * args.requests, args.seed, model.config.max_len,
                 quick=args.quick)
    crowd = [jobs[c::args.clients] for c in range(args.clients)]
    names = ["1 client", f"{args.clients} clients"] + (
        [f"{args.clients} clients + GIL noise {args.gil_noise}"] if noise else [])
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for _ in range(args.repeats):  # alternated, so machine noise hits all alike
        for name in names:
            engine = Engine(model, tokenizer, max_batch=args.clients)
            if name.endswith(str(args.gil_noise)) and noise is not None:
                with GilNoise(*noise):
                    runs[name].append(_scenario(engine, tokenizer, crowd))
            else:
                runs[name].append(_scenario(engine, tokenizer,
                                            [jobs] if name == "1 client" else crowd))
    rows = []
    for name in names:
        steps = [r["full_decode_step_ms"] for r in runs[name] if r["full_decode_step_ms"]]
        rows.append({"scenario": name,
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs[name]),
                     "steps": statistics.median(r["steps"] for r in runs[name]),
                     "full_decode_step_ms": statistics.median(steps) if steps else None})
    from handformer.machine import describe_machine, machine_line

    machine = {**describe_machine(), "threads": 1}
    print(f"{machine_line(machine)} · float32 · engine alone, no HTTP")
    print(f"{'scenario':40} {'tok/s':>8} {'steps':>6} {'full decoding step ms':>22}")
    for r in rows:
        step = "-" if r["full_decode_step_ms"] is None else f"{r['full_decode_step_ms']:.2f}"
        print(f"{r['scenario']:40} {r['tokens_per_s']:8.1f} {r['steps']:6.0f} {step:>22}")
    ratios = {row["scenario"]: row["tokens_per_s"] / rows[0]["tokens_per_s"] for row in rows[1:]}
    for name, ratio in ratios.items():
        print(f"{name} / 1 client: {ratio:.2f}x aggregate tokens/s")
    report = {"command": "python benchmarks/serve_engine.py " + " ".join(argv or sys.argv[1:]),
              "preset": args.preset, "clients": args.clients,
              "requests_per_client": args.requests, "repeats": args.repeats,
              "machine": machine, "rows": rows, "ratios_vs_one_client": ratios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
