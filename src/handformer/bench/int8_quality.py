"""What int8 weights cost in quality, on a *trained* language-model run.

Random weights say nothing about quality (their logits are near-uniform), so this reads a run
folder written by ``handformer train`` and compares, on that run's own validation split
(the text recorded in its ``config.json``, split as training split it):

* **validation loss** over every non-overlapping window of the validation split: float32,
  int8 (every linear layer, the head included), int8 with a float head, and bfloat16;
* **greedy agreement** on 8 prompts taken from the validation text, 256 new tokens each:
  - *free-running*: both models generate on their own; the share of positions where the
    tokens are equal (once they differ the texts part ways, so this is the strict one), and
    where the first difference falls;
  - *per token*: at every position of float32's greedy continuation, given the same context
    (the last ``max_len`` tokens), does the other model pick the same next token?
  - where a continuation parts, how far float32's own choice led its runner-up there (a
    near tie, against the median lead over its continuations).

    python benchmarks/int8_quality.py --run runs/default
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from handformer.data import train_val_split
from handformer.generate import generate, slide_window
from handformer.jobs.lm import load_recorded_text
from handformer.loss import lm_loss
from handformer.machine import describe_machine, machine_line
from handformer.models.quantize import quantize_int8
from handformer.runs import load_run

__all__ = ["greedy_agreement", "main", "next_token_agreement", "quality", "validation_loss"]

PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 8, 32, 256


def validation_loss(model: nn.Module, val_ids: Tensor, block: int, batch: int = 32) -> float:
    """Mean next-token cross-entropy over every non-overlapping (block + 1)-token window of
    ``val_ids`` (1-D)."""
    n = (len(val_ids) - 1) // block
    windows = val_ids[: n * block + 1].unfold(0, block + 1, block)  # (n, block + 1)
    total, count = 0.0, 0
    with torch.inference_mode():
        for i in range(0, n, batch):
            chunk = windows[i : i + batch]  # (b, block + 1)
            logits = model(chunk[:, :-1])  # (b, block, V)
            total += float(lm_loss(logits, chunk[:, 1:])) * chunk[:, 1:].numel()
            count += chunk[:, 1:].numel()
    return total / count


def greedy_agreement(reference: Tensor, other: Tensor, prompt_len: int) -> tuple[float, int]:
    """(share of generated positions where two greedy outputs (1, T) agree, index of the
    first generated token where they differ — the length if never)."""
    a, b = reference[0, prompt_len:], other[0, prompt_len:]
    differs = (a != b).nonzero()
    return float((a == b).float().mean()), int(differs[0]) if len(differs) else len(a)


def next_token_agreement(reference: nn.Module, other: nn.Module, sequence: Tensor,
                         prompt_len: int, window: int) -> float:
    """Share of the positions after the prompt where both models' argmax next token agree,
    each given the same context: the last ``window`` tokens of ``sequence`` (1, T)."""
    same = 0
    with torch.inference_mode():
        for p in range(prompt_len, sequence.shape[1]):
            context = sequence[:, max(0, p - window) : p]  # (1, ≤ window)
            same += int(reference(context)[0, -1].argmax() == other(context)[0, -1].argmax())
    return same / (sequence.shape[1] - prompt_len)


def top_two_gap(model: nn.Module, sequence: Tensor, position: int, window: int) -> float:
    """How far the model's best next token at ``position`` of ``sequence`` (1, T) leads its
    second best, in log-probability (nats), given the context ``generate`` gives it there
    (its window of ``window`` tokens slides half a window at a time): near 0 is a near tie,
    which any rounding of the logits may flip."""
    context = sequence[:, slide_window(0, position, window) : position]  # (1, ≤ window)
    with torch.inference_mode():
        top = torch.log_softmax(model(context)[0, -1].float(), dim=-1).topk(2).values  # (2,)
    return float(top[0] - top[1])


def quality(run_dir: Path, prompts: int = PROMPTS, new_tokens: int = NEW_TOKENS,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every figure of the module docstring for the run at ``run_dir``."""
    run = load_run(run_dir, kind="lm")
    fp32 = run.model
    text = load_recorded_text(run.config.get("data"), run.run_dir)
    train_cfg = run.config.get("train") or {}
    _, val_ids = train_val_split(run.tokenizer.encode_array(text),
                                 train_cfg.get("val_fraction", 0.1))
    block = fp32.config.max_len
    models = {"float32": fp32, "int8": quantize_int8(fp32),
              "int8, float head": quantize_int8(fp32, include_head=False),
              "bfloat16": copy.deepcopy(fp32).to(torch.bfloat16)}
    rows: dict[str, dict[str, Any]] = {name: {} for name in models}
    for name, model in models.items():
        rows[name]["val_loss"] = validation_loss(model, val_ids, block)
        log(f"{name:<18} validation loss {rows[name]['val_loss']:.4f}")
    starts = torch.linspace(0, len(val_ids) - PROMPT_TOKENS - 1, prompts).long().tolist()
    outputs: dict[str, list[Tensor]] = {name: [] for name in models}
    for start in starts:
        prompt = val_ids[start : start + PROMPT_TOKENS][None]  # (1, PROMPT_TOKENS)
        for name, model in models.items():
            outputs[name].append(generate(model, prompt, new_tokens, temperature=0))
    base = rows["float32"]["val_loss"]
    for name, model in models.items():
        row = rows[name]
        row["val_loss_change_pct"] = 100 * (row["val_loss"] / base - 1)
        pairs = [greedy_agreement(ref, out, PROMPT_TOKENS)
                 for ref, out in zip(outputs["float32"], outputs[name], strict=True)]
        row["free_running_agreement"] = sum(p[0] for p in pairs) / len(pairs)
        row["first_difference"] = [p[1] for p in pairs]
        # Where a continuation parts from float32's: float32's own lead of its choice there.
        row["gap_at_first_difference"] = [
            top_two_gap(fp32, ref, PROMPT_TOKENS + first, block)
            for ref, (_, first) in zip(outputs["float32"], pairs, strict=True)
            if first < new_tokens]
        row["next_token_agreement"] = 1.0 if name == "float32" else sum(
            next_token_agreement(fp32, model, ref, PROMPT_TOKENS, block)
            for ref in outputs["float32"]) / len(starts)
        log(f"{name:<18} loss {row['val_loss_change_pct']:+.2f} %, free-running agreement "
            f"{100 * row['free_running_agreement']:.1f} %, per-token "
            f"{100 * row['next_token_agreement']:.1f} %, first difference at "
            f"{row['first_difference']}" + (
                f" (float32's top-two gap there: "
                f"{', '.join(f'{g:.3f}' for g in row['gap_at_first_difference'])} nats)"
                if row["gap_at_first_difference"] else ""))
    typical = [top_two_gap(fp32, ref, PROMPT_TOKENS + i, block)
               for ref in outputs["float32"] for i in range(0, new_tokens, 16)]
    log(f"float32's top-two gap over its own continuations (every 16th token): median "
        f"{statistics.median(typical):.2f} nats")
    return {"run": str(run_dir), "validation_tokens": len(val_ids), "prompts": prompts,
            "prompt_tokens": PROMPT_TOKENS, "new_tokens": new_tokens,
            "model": fp32.config.to_dict(), "rows": rows,
            "median_top_two_gap": statistics.median(typical)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True,
                        help="a language-model run folder written by `handformer train`")
    parser.add_argument("--prompts", type=int, default=PROMPTS)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path,
                        default=Path("benchmarks/results/int8_quality.json"))
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.new_tokens < 1 or args.threads < 1:
        parser.error("--prompts, --new-tokens and --threads must be positive")
    torch.set_num_threads(args.threads)
    print(machine_line())
    result = {"machine": describe_machine(), **quality(args.run, args.prompts, args.new_tokens)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
