"""handformer on a CUDA GPU, against its physical floors and against Hugging Face GPT-2.

What it measures, all on one GPU, each figure beside the ceiling it is a share of:

* the ceilings themselves, measured here: a device-to-device copy (bytes read + written per
  second: the bandwidth floor of decoding) and an n×n×n matrix product in bf16 and in fp32
  with TF32 off (the FLOP floor of training);
* a training step (forward, next-token loss, backward, fused AdamW) at GPT-2 small's shape
  under bf16 autocast: handformer's SDPA and manual kernels, ``torch.compile`` of the SDPA
  model (``--compile``), and ``transformers``' ``GPT2LMHeadModel`` of the same shape —
  tokens/s and MFU (model FLOPs per second over the measured bf16 peak);
* greedy decoding at batch 1 (fp32 and bf16): handformer's ``generate`` with its KV cache
  against ``GPT2LMHeadModel.generate`` — ms/token and the share of the bandwidth floor (the
  weights and the cache read once per token);
* the whole command a user runs, ``handformer train --device cuda`` on the built-in text
  (start-up, evaluations, checkpoints and the sample included): wall seconds and the
  validation loss it prints.

Contenders alternate within a round and the median of ``--repeats`` rounds is reported.
Prints a table and writes JSON (``--out``). Without a GPU it says so and exits 0.

    python benchmarks/cuda_speed.py               # the figures README quotes
    python benchmarks/cuda_speed.py --quick       # tiny shapes: checks that it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from handformer.bench.flops import model_flops_per_token
from handformer.config import ModelConfig
from handformer.generate import generate
from handformer.loss import lm_loss
from handformer.models.decoder_lm import DecoderLM

SHAPES = {  # GPT-2 small's shape (vocab padded to a multiple of 64, as nanoGPT pads it)
    "full": dict(n_layers=12, n_heads=12, d_model=768, vocab=50304, window=1024, batch=16,
                 prompt=16, new_tokens=256, copy_mib=2048, matmul_n=8192),
    "quick": dict(n_layers=2, n_heads=2, d_model=64, vocab=512, window=64, batch=4,
                  prompt=4, new_tokens=16, copy_mib=64, matmul_n=1024),
}


def _timed(fn: Callable[[], Any]) -> float:
    """Seconds of one call, the GPU's queue drained before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def gpu_name() -> str:
    p = torch.cuda.get_device_properties(0)
    return (f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, "
            f"capability {p.major}.{p.minor}), torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}")


def measure_ceilings(shape: dict[str, Any], repeats: int) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and matmul FLOP/s, medians."""
    n_bytes = shape["copy_mib"] << 20
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    copy = [_timed(lambda: dst.copy_(src)) for _ in range(repeats + 2)][2:]
    out = {"copy_bytes_per_s": 2 * n_bytes / statistics.median(copy)}
    n = shape["matmul_n"]
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        times = [_timed(lambda a=a, b=b: [a @ b for _ in range(5)]) / 5
                 for _ in range(repeats + 1)][1:]
        out[f"matmul_{str(dtype).removeprefix('torch.')}_flops"] = 2 * n**3 / statistics.median(
            times)
    return out


def _config(shape: dict[str, Any], attention: str) -> ModelConfig:
    return ModelConfig(vocab_size=shape["vocab"], d_model=shape["d_model"],
                       n_heads=shape["n_heads"], n_layers=shape["n_layers"],
                       max_len=shape["window"], dropout=0.0, positional="learned",
                       attention=attention, activation="gelu", norm_type="layernorm")


def _hf_model(shape: dict[str, Any]) -> torch.nn.Module | None:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    cfg = GPT2Config(vocab_size=shape["vocab"], n_positions=shape["window"],
                     n_embd=shape["d_model"], n_layer=shape["n_layers"],
                     n_head=shape["n_heads"], resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                     attn_implementation="sdpa")
    return GPT2LMHeadModel(cfg)


def training_rows(shape: dict[str, Any], repeats: int, compile_: bool,
                  peak_bf16: float) -> list[dict[str, Any]]:
    """Steps per contender per round: 2 warm-up rounds (compilation, autotuning), then
    ``repeats`` timed rounds of 5 steps each, contenders alternating."""
    b, t = shape["batch"], shape["window"]
    ids = torch.randint(0, shape["vocab"], (b, t + 1), device="cuda")
    x, y = ids[:, :-1], ids[:, 1:]
    contenders: dict[str, Callable[[], None]] = {}

    def add(name: str, model: torch.nn.Module, forward: Callable[[torch.nn.Module], Any]) -> None:
        model.to("cuda").train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = lm_loss(forward(model), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        contenders[name] = step

    for attention in ("sdpa", "manual"):
        add(f"handformer {attention}", DecoderLM(_config(shape, attention)), lambda m: m(x))
    if compile_:
        add("handformer sdpa, torch.compile", torch.compile(DecoderLM(_config(shape, "sdpa"))),
            lambda m: m(x))
    hf = _hf_model(shape)
    if hf is not None:
        add("transformers GPT2LMHeadModel (sdpa)", hf, lambda m: m(input_ids=x).logits)
    with torch.device("meta"):  # every contender has this shape: count its FLOPs once
        flops = model_flops_per_token(DecoderLM(_config(shape, "sdpa")), t)
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for round_ in range(repeats + 2):
        for name, step in contenders.items():
            seconds = _timed(lambda step=step: [step() for _ in range(5)]) / 5
            if round_ >= 2:
                times[name].append(seconds)
    rows = []
    for name, ts in times.items():
        s = statistics.median(ts)
        tokens = b * t / s
        rows.append({"contender": name, "ms_per_step": s * 1e3, "tokens_per_s": tokens,
                     "mfu_bf16": tokens * flops / peak_bf16})
    return rows


def decoding_rows(shape: dict[str, Any], repeats: int, bandwidth: float) -> list[dict[str, Any]]:
    """Greedy, batch 1: ms/token of the new tokens, and the bandwidth floor's share."""
    new, prompt = shape["new_tokens"], shape["prompt"]
    ids = torch.randint(0, shape["vocab"], (1, prompt), device="cuda")
    contenders: dict[str, Callable[[], Any]] = {}
    floors: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        tag = str(dtype).removeprefix("torch.")
        mine = DecoderLM(_config(shape, "sdpa")).to("cuda", dtype).eval()
        contenders[f"handformer generate, {tag}"] = (
            lambda m=mine: generate(m, ids, new, temperature=0))
        # Every weight is read once a token — the token table too, as the tied head — but
        # for the positions' table, of which a token reads one row.
        weight_bytes = sum(p.numel() * p.element_size() for n, p in mine.named_parameters()
                           if "positions" not in n)
        cache_bytes = (2 * shape["n_layers"] * shape["d_model"] * (prompt + new / 2)
                       * mine.embed.token.weight.element_size())
        floors[f"handformer generate, {tag}"] = (weight_bytes + cache_bytes) / bandwidth
        hf = _hf_model(shape)
        if hf is not None:
            hf = hf.to("cuda", dtype).eval()
            name = f"transformers generate, {tag}"
            contenders[name] = (lambda m=hf: m.generate(
                ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                pad_token_id=0, attention_mask=torch.ones_like(ids)))
            floors[name] = floors[f"handformer generate, {tag}"]
    times: dict[str, list[float]] = {k: [] for k in contenders}
    with torch.inference_mode():
        for round_ in range(repeats + 1):
            for name, fn in contenders.items():
                seconds = _timed(fn) / new
                if round_ >= 1:
                    times[name].append(seconds)
    rows = []
    for name, ts in times.items():
        s = statistics.median(ts)
        rows.append({"contender": name, "ms_per_token": s * 1e3, "tokens_per_s": 1 / s,
                     "floor_ms_per_token": floors[name] * 1e3,
                     "share_of_floor": floors[name] / s})
    torch.cuda.empty_cache()
    return rows


def train_command_row(max_steps: int | None) -> dict[str, Any]:
    """``handformer train --device cuda`` whole, as a user runs it, into a scratch folder."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "handformer", "train", "--device", "cuda",
                   "--out", str(Path(tmp) / "run"), "--no-progress"]
        if max_steps is not None:
            command += ["--max-steps", str(max_steps)]
        t0 = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            return {"command": " ".join(command[1:]), "error": done.stderr.strip()[-2000:]}
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
    return {"command": "handformer train --device cuda", "wall_s": wall,
            "final_val_loss": summary["final_val_loss"], "steps": summary["steps"],
            "median_step_ms": summary["median_step_ms"], "precision": summary["precision"]}


def print_report(result: dict[str, Any]) -> None:
    c = result["ceilings"]
    print(result["gpu"])
    print(f"measured ceilings: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write); "
          f"matmul bf16 {c['matmul_bfloat16_flops'] / 1e12:.0f} TFLOP/s, fp32 (TF32 off) "
          f"{c['matmul_float32_flops'] / 1e12:.1f} TFLOP/s")
    print("\ntraining step, bf16 autocast, fused AdamW "
          f"({result['shape']['batch']} × {result['shape']['window']} tokens)")
    print(f"{'contender':<40} {'ms/step':>9} {'tokens/s':>11} {'MFU (bf16)':>11}")
    for r in result["training"]:
        print(f"{r['contender']:<40} {r['ms_per_step']:>9.1f} {r['tokens_per_s']:>11,.0f} "
              f"{r['mfu_bf16']:>10.1%}")
    print(f"\ngreedy decoding, batch 1, {result['shape']['prompt']}-token prompt + "
          f"{result['shape']['new_tokens']} new")
    print(f"{'contender':<40} {'ms/token':>9} {'floor ms':>9} {'of floor':>9}")
    for r in result["decoding"]:
        print(f"{r['contender']:<40} {r['ms_per_token']:>9.3f} {r['floor_ms_per_token']:>9.3f} "
              f"{r['share_of_floor']:>8.1%}")
    cmd = result.get("train_command")
    if cmd:
        if "error" in cmd:
            print(f"\n{cmd['command']}: FAILED\n{cmd['error']}")
        else:
            print(f"\n{cmd['command']} (whole command): {cmd['wall_s']:.1f} s, "
                  f"{cmd['steps']} steps, median step {cmd['median_step_ms']:.1f} ms, "
                  f"val {cmd['final_val_loss']:.4f}, precision {cmd['precision']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="add a torch.compile row")
    parser.add_argument("--no-command", action="store_true",
                        help="skip timing the whole `handformer train --device cuda`")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cuda_speed.json"))
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be at least 1; got {args.repeats}")
    if not torch.cuda.is_available():
        print("cuda_speed: no CUDA GPU visible here (torch.cuda.is_available() is False); "
              "nothing measured")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 in every row
    shape = SHAPES["quick" if args.quick else "full"]
    repeats = args.repeats or (1 if args.quick else 3)
    ceilings = measure_ceilings(shape, repeats)
    result: dict[str, Any] = {"gpu": gpu_name(), "shape": shape, "repeats": repeats,
                              "ceilings": ceilings}
    result["training"] = training_rows(shape, repeats, args.compile,
                                       ceilings["matmul_bfloat16_flops"])
    result["decoding"] = decoding_rows(shape, repeats, ceilings["copy_bytes_per_s"])
    if not args.no_command:
        result["train_command"] = train_command_row(20 if args.quick else None)
    print_report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {args.out}")
    return 0
