"""What each part of a Transformer buys: the build track's progression, measured.

What it measures
    The build track (docs/build.md) adds one part at a time to a character LM. This script
    trains each stage on the built-in text with the same data, steps and seed, and reports
    its validation loss (nats per character):

    bigram          token embedding → output head: the next character from the current one
    + attention     one causal attention head over the embeddings (no residual: its output
                    replaces them)
    + heads         the same width split into several heads
    + FFN           a feed-forward network after the attention
    + residual      x + sublayer(x) around both
    + LayerNorm     pre-norm: x + sublayer(LN(x)), and a final LayerNorm
    + positions     sinusoidal positions added to the embeddings (the whole model of the
                    build track)

    Every stage is built from handformer's own layers (MultiHeadAttention, FeedForward,
    nn.LayerNorm, SinusoidalPositions): the model the build track's reader writes by hand,
    one switch per part. Validation loss does not depend on machine load, so the figures are
    comparable across machines up to floating-point noise; the time per run is not recorded.

Usage
    python benchmarks/build_progression.py                 # ~2 min on one core
    python benchmarks/build_progression.py --out DIR       # JSON + PNG elsewhere
    python benchmarks/build_progression.py --steps 100     # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import Tensor, nn

from handformer.data import LMWindows
from handformer.data.corpora import builtin_text
from handformer.loss import lm_loss
from handformer.machine import describe_machine, machine_line
from handformer.masks import causal_mask
from handformer.nn.attention import MultiHeadAttention
from handformer.nn.feedforward import FeedForward
from handformer.nn.positional import SinusoidalPositions

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Stage:
    label: str
    attention: bool = False
    heads: int = 1
    ffn: bool = False
    residual: bool = False
    layer_norm: bool = False
    positions: bool = False


STAGES = (
    Stage("bigram"),
    Stage("+ attention", attention=True),
    Stage("+ heads", attention=True, heads=4),
    Stage("+ FFN", attention=True, heads=4, ffn=True),
    Stage("+ residual", attention=True, heads=4, ffn=True, residual=True),
    Stage("+ LayerNorm", attention=True, heads=4, ffn=True, residual=True, layer_norm=True),
    Stage("+ positions", attention=True, heads=4, ffn=True, residual=True, layer_norm=True,
          positions=True),
)


class StageModel(nn.Module):
    """One stage of the build track's model (see the module docstring); ids (B, T) → logits
    (B, T, V)."""

    def __init__(self, stage: Stage, vocab: int, d_model: int, n_layers: int) -> None:
        super().__init__()
        self.stage = stage
        self.embed = nn.Embedding(vocab, d_model)
        self.positions = SinusoidalPositions(d_model) if stage.positions else None
        layers = n_layers if stage.attention else 0
        self.attn = nn.ModuleList(MultiHeadAttention(d_model, stage.heads, attention="manual")
                                  for _ in range(layers))
        self.ffn = nn.ModuleList(FeedForward(d_model, 4 * d_model, activation="relu")
                                 for _ in range(layers if stage.ffn else 0))
        norms = 2 * layers + 1 if stage.layer_norm else 0
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(norms))
        self.head = nn.Linear(d_model, vocab)

    def _norm(self, i: int, x: Tensor) -> Tensor:
        return self.norms[i](x) if self.stage.layer_norm else x

    def forward(self, ids: Tensor) -> Tensor:
        t = ids.shape[1]
        x = self.embed(ids)  # (B, T, C)
        if self.positions is not None:
            x = x + self.positions(torch.arange(t))  # (T, C) broadcast over B
        mask = causal_mask(t)  # (T, T)
        for i, attn in enumerate(self.attn):
            h, _ = attn(self._norm(2 * i, x), mask=mask)  # (B, T, C)
            x = x + h if self.stage.residual else h
            if self.stage.ffn:
                h = self.ffn[i](self._norm(2 * i + 1, x))  # (B, T, C)
                x = x + h if self.stage.residual else h
        return self.head(self._norm(len(self.norms) - 1, x) if self.norms else x)  # (B, T, V)


def run_stage(stage: Stage, args: argparse.Namespace, train: LMWindows, val: LMWindows,
              vocab: int) -> dict:
    torch.manual_seed(args.seed)
    model = StageModel(stage, vocab, args.d_model, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed)
    for step in range(args.steps):
        for group in optimizer.param_groups:  # linear warm-up, then constant
            group["lr"] = args.lr * min(1.0, (step + 1) / args.warmup)
        b = train.random_batch(args.batch_size, g)
        loss = lm_loss(model(b.ids), b.targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        val_loss = sum(lm_loss(model(b.ids), b.targets).item()
                       for b in val.fixed_batches(args.val_batches, args.batch_size))
    return {**asdict(stage), "parameters": sum(p.numel() for p in model.parameters()),
            "final_train_loss": loss.item(), "val_loss": val_loss / args.val_batches}


def plot(results: list[dict], path: Path, ln_vocab: float) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from handformer.train.plots import save_figure

    fig = Figure(figsize=(7.5, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    labels = [r["label"] for r in results]
    losses = [r["val_loss"] for r in results]
    bars = ax.bar(range(len(labels)), losses, color="tab:blue")
    ax.bar_label(bars, [f"{v:.2f}" for v in losses], fontsize=8)
    ax.axhline(ln_vocab, color="grey", lw=0.8, ls=":",
               label=f"uniform guess, ln V = {ln_vocab:.2f}")
    ax.set_xticks(range(len(labels)), labels, fontsize=9)
    ax.set(ylabel="validation loss (nats/char)", ylim=(0, ln_vocab * 1.08),
           title="what each part buys: the build track's stages on the built-in text")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--chars", type=int, default=200_000,
                        help="how much of the built-in text to use (train 90 %%, val 10 %%)")
    parser.add_argument("--val-batches", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    text = builtin_text()[: args.chars]
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text])
    cut = int(len(ids) * 0.9)
    train, val = LMWindows(ids[:cut], args.block_size), LMWindows(ids[cut:], args.block_size)
    machine = describe_machine()
    print(machine_line(machine))
    results = []
    for stage in STAGES:
        r = run_stage(stage, args, train, val, len(chars))
        print(f"{stage.label:<14} val loss {r['val_loss']:.3f}  ({r['parameters']} parameters)",
              flush=True)
        results.append(r)
    report = {"benchmark": "build_progression", "settings": vars(args) | {"out": str(args.out)},
              "vocab_size": len(chars), "stages": results,
              "machine": {**machine, "python": sys.version.split()[0],
                          "platform": platform.platform()},
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "build_progression.json").write_text(json.dumps(report, indent=2),
                                                     encoding="utf-8")
    plot(results, args.out / "build-progression.png", math.log(len(chars)))
    print(f"JSON: {args.out / 'build_progression.json'}")
    print(f"PNG:  {args.out / 'build-progression.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
