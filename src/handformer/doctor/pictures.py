"""Pictures for the eye: attention heatmaps per layer and head, and the mask matrices.

A transposed mask is obvious in a picture long before it is obvious in a loss curve, so
the doctor draws, for one sample:

* ``attention_<layer>.png`` — one heatmap per head, queries down, keys across;
* ``masks.png`` — the causal mask builder's matrix, a left-padded sample's padding mask,
  their combination, and the mask each attention layer actually used on that sample (where
  its weights are non-zero).

matplotlib runs with the Agg backend: no display needed. The folder is claimed as
``PICTURES_FOLDER`` (``handformer.runs.writing_folder``): new, empty or one the doctor drew
into before; another tool's folder is refused unless ``overwrite``.

Shape legend: ``H`` heads, ``T`` queries, ``S`` keys.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from handformer.doctor.checks_masks import effective_masks, padded_inputs
from handformer.doctor.subject import Subject
from handformer.masks import causal_mask, combine_masks
from handformer.runs import FolderSpec, writing_folder

__all__ = ["PICTURES_FOLDER", "write_pictures"]

PICTURES_FOLDER = FolderSpec("doctor-pictures", "the doctor's pictures",
                             "handformer doctor --pictures", ("attention_*.png", "masks.png"))

MAX_T = 32  # longer samples make unreadable heatmaps


def _plt():  # matplotlib's pyplot module
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _labels(ids: Tensor, decode: Callable[[int], str] | None) -> list[str] | None:
    if decode is None or len(ids) > MAX_T:
        return None
    return [repr(decode(int(i)))[1:-1] or "·" for i in ids]


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name) or "model"


def _save(fig, path: Path) -> str:  # fig: a matplotlib Figure
    plt = _plt()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def write_pictures(subject: Subject, out_dir: str | Path, *,
                   overwrite: bool = False) -> list[str]:
    """Draw the pictures into ``out_dir`` (created if needed; claimed and locked while
    drawing, see the module docstring); returns the written paths."""
    with writing_folder(out_dir, PICTURES_FOLDER, overwrite=overwrite) as out:
        return _draw(subject, out)


def _draw(subject: Subject, out: Path) -> list[str]:
    plt = _plt()
    written: list[str] = []
    sample = subject.probe.ids[:1, :MAX_T]  # (1, T)
    labels = _labels(sample[0], subject.decode)

    if subject.attention:
        _, records = subject.captured_forward(sample)
        for r in records:
            w = r.weights[0].float().cpu()  # (H, T, S)
            heads = w.shape[0]
            cols = min(heads, 4)
            rows = -(-heads // cols)
            side = 4.2 if labels else 3.2  # room for one readable tick label per token
            fig, axes = plt.subplots(rows, cols, figsize=(side * cols, side * rows), squeeze=False)
            for h in range(rows * cols):
                ax = axes[h // cols][h % cols]
                if h >= heads:
                    ax.axis("off")
                    continue
                ax.imshow(w[h].numpy(), cmap="viridis", vmin=0.0, vmax=float(w[h].max()) or 1.0)
                ax.set_title(f"head {h}", fontsize=9)
                if labels:
                    ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=90)
                    ax.set_yticks(range(len(labels)), labels, fontsize=7)
                else:
                    ax.set_xlabel("key", fontsize=8)
                    ax.set_ylabel("query", fontsize=8)
            fig.suptitle(f"{r.name}: attention weights (query ↓, key →)", fontsize=10)
            written.append(_save(fig, out / f"attention_{_safe(r.name)}.png"))

    panels: list[tuple[str, Tensor]] = []
    t = int(sample.shape[1])
    panels.append((f"causal_mask({t})", causal_mask(t)))
    if subject.accepts_padding_mask:
        _, padded = padded_inputs(subject)
        ids, pad = padded["left"]
        pad, ids = pad[:, :MAX_T], ids[:, :MAX_T]
        tp = int(ids.shape[1])
        panels.append(("padding mask (left-padded)", pad.cpu()))
        combined = combine_masks(pad.cpu(), causal_mask(tp))  # (1, 1, T, S)
        panels.append(("combined (B=0)", combined[0, 0]))
        if subject.attention:
            _, records = subject.captured_forward(ids, pad)
            for name, used in effective_masks(records).items():
                panels.append((f"used by {name}", used))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.0 * len(panels), 3.2), squeeze=False)
    for ax, (title, mask) in zip(axes[0], panels, strict=True):
        ax.imshow(mask.to(torch.float32).cpu().numpy(), cmap="Greys", vmin=0.0, vmax=1.0,
                  aspect="auto" if mask.shape[0] == 1 else "equal")
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("key", fontsize=7)
        if mask.shape[0] > 1:
            ax.set_ylabel("query", fontsize=7)
        else:
            ax.set_yticks([])
    fig.suptitle("masks: black = may attend", fontsize=10)
    written.append(_save(fig, out / "masks.png"))
    return written
