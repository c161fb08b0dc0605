"""The length question: does a model trained at length L still work at 2L and 4L?

The tutorial's author saw a model that worked at 128 stop working at 512. Part of that is
position information: a learned table simply has no vectors past L; sinusoidal vectors
exist but the model never saw them; RoPE sees only relative offsets, but larger ones than
in training; ALiBi's distance penalty is the same function at every length. This study
trains the same small character model once per positional type at one length, on the
built-in text, and measures validation loss at 1×, 2× and 4× that length.

Writes ``length_study.md``, ``length_study.json`` and ``length_study.png`` to the output
folder, claimed as ``LENGTH_STUDY_FOLDER`` (``handformer.runs.writing_folder``): new, empty
or one the study wrote before; another tool's folder is refused (before the study starts)
unless ``overwrite``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from handformer.atomic import atomic_write_text
from handformer.config import ModelConfig, TrainConfig
from handformer.data import LMWindows, train_val_split
from handformer.data.corpora import builtin_text
from handformer.models.decoder_lm import DecoderLM
from handformer.nn.positional import POSITIONAL_KINDS
from handformer.runs import FolderSpec, check_destination, folder_path, writing_folder
from handformer.tokenizers import CharTokenizer
from handformer.train.trainer import Trainer

__all__ = ["LENGTH_STUDY_FOLDER", "LengthStudySettings", "run_length_study", "to_markdown"]

LENGTH_STUDY_FOLDER = FolderSpec(
    "length-study", "a length study", "handformer experiment length",
    ("length_study.json", "length_study.md", "length_study.png"))


@dataclass
class LengthStudySettings:
    train_len: int = 128
    multipliers: tuple[int, ...] = (1, 2, 4)
    steps: int = 1500
    batch_size: int = 16
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    eval_tokens: int = 64_000  # validation tokens scored at every length
    seed: int = 1337

    @classmethod
    def quick(cls) -> LengthStudySettings:
        return cls(train_len=64, steps=400, batch_size=16, d_model=64, n_layers=2,
                   eval_tokens=16_000)


@torch.no_grad()
def _val_loss(model: DecoderLM, windows: LMWindows, n_windows: int, batch: int) -> float:
    batches = windows.fixed_batches(max(1, math.ceil(n_windows / batch)), batch)
    total, count = 0.0, 0
    for b in batches:
        logits = model(b.ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b.targets.flatten(),
                                                 reduction="sum")
        total += float(loss)
        count += b.targets.numel()
    return total / count


def run_length_study(
    out_dir: str | Path,
    settings: LengthStudySettings | None = None,
    *,
    positionals: tuple[str, ...] = POSITIONAL_KINDS,
    progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Train and evaluate one model per positional type; write the results to ``out_dir``
    (checked now, claimed when the results are written; see the module docstring)."""
    s = settings or LengthStudySettings()
    out_dir = folder_path(out_dir)
    check_destination(out_dir, LENGTH_STUDY_FOLDER, overwrite=overwrite)
    text = builtin_text()
    tok = CharTokenizer.from_text(text)
    train_ids, val_ids = train_val_split(tok.encode_array(text), 0.1)
    train_windows = LMWindows(train_ids, s.train_len, name="training split")
    lengths = [s.train_len * m for m in s.multipliers]

    results: dict[str, Any] = {"settings": {**s.__dict__, "multipliers": list(s.multipliers)},
                               "lengths": lengths, "rows": []}
    for positional in positionals:
        torch.manual_seed(s.seed)
        cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=s.d_model, n_heads=s.n_heads,
                          n_layers=s.n_layers, max_len=s.train_len, positional=positional,
                          attention="sdpa")
        train_cfg = TrainConfig(batch_size=s.batch_size, block_size=s.train_len,
                                max_steps=s.steps, warmup_steps=max(1, s.steps // 20),
                                eval_interval=s.steps, eval_batches=1, seed=s.seed,
                                device="cpu")
        model = DecoderLM(cfg)
        started = time.perf_counter()
        Trainer(model, train_cfg,
                train_batch=lambda g: train_windows.random_batch(s.batch_size, g),
                progress=progress).fit()
        model.eval()
        row: dict[str, Any] = {"positional": positional,
                               "train_seconds": time.perf_counter() - started, "val_loss": {}}
        for length in lengths:
            try:
                windows = LMWindows(val_ids, length, name="validation split")
                n_windows = max(1, s.eval_tokens // length)
                row["val_loss"][str(length)] = _val_loss(model, windows, n_windows,
                                                         max(1, 4096 // length))
            except ValueError as err:
                row["val_loss"][str(length)] = None
                row.setdefault("cannot_run", {})[str(length)] = str(err).split(". ")[0]
        results["rows"].append(row)
        if progress:
            print(f"{positional:<11} " + "  ".join(
                f"{k}: {'cannot run' if v is None else f'{v:.3f}'}"
                for k, v in row["val_loss"].items()), flush=True)

    with writing_folder(out_dir, LENGTH_STUDY_FOLDER, overwrite=overwrite):
        atomic_write_text(out_dir / "length_study.json", json.dumps(results, indent=2))
        atomic_write_text(out_dir / "length_study.md", to_markdown(results))
        plot(results, out_dir / "length_study.png")
    return results


def to_markdown(results: dict[str, Any]) -> str:
    lengths = results["lengths"]
    s = results["settings"]
    lines = [
        f"Validation loss (nats/char) of a {s['n_layers']}-layer, d_model {s['d_model']} "
        f"character model trained {s['steps']} steps at length {s['train_len']} on the "
        "built-in text, evaluated at longer lengths.",
        "",
        "| positional | " + " | ".join(f"{n} ({n // s['train_len']}×)" for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for row in results["rows"]:
        cells = []
        for n in lengths:
            v = row["val_loss"][str(n)]
            cells.append("cannot run" if v is None else f"{v:.3f}")
        lines.append(f"| {row['positional']} | " + " | ".join(cells) + " |")
    reasons = [(r["positional"], n, why) for r in results["rows"]
               for n, why in r.get("cannot_run", {}).items()]
    if reasons:
        lines.append("")
        lines += [f"- {p} at {n}: {why}." for p, n, why in reasons]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from handformer.train.plots import save_figure

    fig, ax = plt.subplots(figsize=(6, 4))
    lengths = results["lengths"]
    for row in results["rows"]:
        xs = [n for n in lengths if row["val_loss"][str(n)] is not None]
        ax.plot(xs, [row["val_loss"][str(n)] for n in xs], marker="o", label=row["positional"])
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.axvline(results["settings"]["train_len"], color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("validation loss (nats/char)")
    ax.set_title(f"Trained at length {results['settings']['train_len']}: does it extrapolate?")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
