"""Draw the pictures of the tour and the build track (docs/img/) with handformer's own code.

    python docs/make_pictures.py                     # the quick ones: minutes on 2 CPU cores
    python docs/make_pictures.py positions masks     # only these (names below)
    python docs/make_pictures.py length-convergence  # the 128 → 512 study: ~12 min, one core
    python docs/make_pictures.py build-progression   # the build track's stages: ~2 min, 1 core
    python docs/make_pictures.py --out /tmp/pics     # somewhere else (default: docs/img)

Nothing here draws a picture twice: the masks and attention maps are the doctor's
(``handformer.doctor.run(..., pictures=DIR)``, the same as ``handformer doctor --pictures``),
the loss curve is the trainer's ``plot_loss_curve``, the length plots are the ones
``handformer experiment length`` and ``benchmarks/length_convergence.py`` write. Only the
positional-encoding figure is drawn here, from the values ``SinusoidalPositions`` and
``RotaryEmbedding`` compute. Models that must be trained are trained here, small and seeded;
nothing is read from outside the repository and nothing is downloaded.

``PICTURES`` (file name → how it is made) is what ``tests/test_tour.py`` checks the tours
against: every picture a tour shows must be listed here and exist.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import string
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
IMG = ROOT / "docs" / "img"
COMMAND = "python docs/make_pictures.py"


@dataclass(frozen=True)
class Picture:
    name: str  # what to pass on the command line
    files: tuple[str, ...]  # what it writes into the output folder
    draw: Callable[[Path], None]
    quick: bool = True  # drawn by a plain `python docs/make_pictures.py`
    what: str = ""


# -- the data and the small models ----------------------------------------------------------
def _builtin_windows(block: int):
    from handformer import CharTokenizer
    from handformer.data import LMWindows
    from handformer.data.corpora import builtin_text

    text = builtin_text()
    tok = CharTokenizer.from_text(text)
    return tok, LMWindows(torch.as_tensor(tok.encode_array(text)), block)


def _prose_windows(block: int):
    """The built-in text's windows from its first line of plain prose on: the doctor draws
    its pictures for the first window, and a line of words reads better than markup."""
    from handformer import CharTokenizer
    from handformer.data import LMWindows
    from handformer.data.corpora import builtin_text

    text = builtin_text()
    tok = CharTokenizer.from_text(text)
    words = set(string.ascii_letters + " ,.'")
    start = 0
    for line in text.splitlines(keepends=True):
        if len(line) > block + 1 and line[0].isupper() and set(line.strip()) <= words:
            break
        start += len(line)
    return LMWindows(torch.as_tensor(tok.encode_array(text[start:])), block)


def _tiny_model(vocab_size: int):
    from handformer import DecoderLM
    from handformer.config import ModelConfig, get_preset

    torch.manual_seed(0)
    return DecoderLM(ModelConfig(vocab_size=vocab_size, **get_preset("tiny").model))


def _doctor_pictures(model, windows, decode, out: Path, *, initial: bool = True) -> Path:
    """What ``handformer doctor --pictures`` draws for ``model``, in a fresh folder under
    ``out``; returns that folder."""
    from handformer import doctor

    folder = out / "doctor"
    report = doctor.run(model, windows, lr=3e-3, learning_steps=5, initial=initial,
                        pictures=folder, decode=lambda i: decode([i]))
    if not (folder / "masks.png").is_file():  # the doctor turns a drawing error into a WARN
        raise RuntimeError(f"the doctor drew no pictures: {report.get('pictures').evidence}")
    return folder


# -- the pictures ---------------------------------------------------------------------------
def draw_masks(out: Path) -> None:
    tok, windows = _builtin_windows(32)
    with tempfile.TemporaryDirectory() as tmp:
        folder = _doctor_pictures(_tiny_model(tok.vocab_size), windows, tok.decode, Path(tmp))
        shutil.copyfile(folder / "masks.png", out / "doctor-masks.png")


def draw_masks_transposed(out: Path) -> None:
    sys.path.insert(0, str(ROOT))  # the doctor's zoo of broken models lives in the tests
    from handformer.nn.attention import MultiHeadAttention
    from tests.doctor.test_doctor_zoo import TransposedCausal, swap_class

    tok, windows = _builtin_windows(32)
    broken = swap_class(_tiny_model(tok.vocab_size), MultiHeadAttention, TransposedCausal)
    with tempfile.TemporaryDirectory() as tmp:
        folder = _doctor_pictures(broken, windows, tok.decode, Path(tmp))
        shutil.copyfile(folder / "masks.png", out / "doctor-masks-transposed.png")


def draw_positions(out: Path) -> None:
    """Left: sinusoidal encodings of 64 positions (a few dimensions as curves). Right: RoPE
    turns one (x, y) pair of a query by an angle proportional to its position, and the score
    q·k of two rotated vectors depends on the signed offset m − n only."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from handformer.nn.positional import RotaryEmbedding, SinusoidalPositions
    from handformer.train.plots import save_figure

    c, n = 32, 64
    pe = SinusoidalPositions(c)(torch.arange(n))  # (T, C)
    fig = Figure(figsize=(12, 3.6), dpi=90)
    FigureCanvasAgg(fig)
    curves, image, circle, scores = (fig.add_subplot(1, 4, i) for i in range(1, 5))
    for dim in (2, 8, 16, 24):
        curves.plot(pe[:, dim].numpy(), label=f"dim {dim}", linewidth=1)
    curves.set(title="sinusoidal: some dimensions", xlabel="position")
    curves.legend(fontsize=7, loc="lower left")
    shown = image.imshow(pe.T.numpy(), aspect="auto", cmap="RdBu", vmin=-1, vmax=1)
    image.set(title=f"sinusoidal, all C = {c} dims", xlabel="position", ylabel="dimension")
    fig.colorbar(shown, ax=image, fraction=0.046, pad=0.04)

    d = 8
    rope = RotaryEmbedding(head_dim=d)
    q = torch.zeros(1, 1, 1, d)  # (B, H, T, D)
    q[..., 0] = 1.0
    for m in range(6):  # the first pair turns by 1 radian per position
        r = rope(q, torch.tensor([m]))[0, 0, 0]  # (D,): pairs (0, 1), (2, 3), … interleaved
        x, y = float(r[0]), float(r[1])
        circle.annotate("", xy=(x, y), xytext=(0, 0),
                        arrowprops=dict(arrowstyle="->", color=(m / 6, 0.2, 1 - m / 6)))
        circle.text(1.12 * x, 1.12 * y, str(m), fontsize=7, ha="center", va="center")
    circle.set(xlim=(-1.3, 1.3), ylim=(-1.3, 1.3), aspect="equal",
               title="RoPE: q's first pair at positions 0–5")
    torch.manual_seed(0)
    qv, kv = torch.randn(2, 1, 1, 1, d).unbind(0)
    grid = torch.tensor([[float((rope(qv, torch.tensor([m])) * rope(kv, torch.tensor([k]))).sum())
                          for k in range(16)] for m in range(16)])  # (query pos, key pos)
    shown = scores.imshow(grid.numpy(), cmap="viridis")
    scores.set(title="RoPE: q·k at (m, n)", xlabel="key position n", ylabel="query position m")
    fig.colorbar(shown, ax=scores, fraction=0.046, pad=0.04, label="q·k")
    fig.tight_layout()
    save_figure(fig, out / "positions.png")


def _default_style_run(tmp: Path):
    """The default preset's model and recipe on the built-in text, with fewer steps."""
    from handformer.data.corpora import builtin_text
    from handformer.jobs.lm import BUILTIN_SOURCE, train_lm

    torch.set_num_threads(1)
    return train_lm(builtin_text(), out_dir=tmp / "run", preset="default",
                    train_overrides={"max_steps": 1000, "eval_interval": 100,
                                     "eval_batches": 20, "device": "cpu"},
                    progress=False, data_source=BUILTIN_SOURCE)


def draw_trained(out: Path) -> None:
    from handformer.train.plots import plot_loss_curve, read_metrics

    windows = _prose_windows(32)
    with tempfile.TemporaryDirectory() as tmp:
        run = _default_style_run(Path(tmp))
        plot_loss_curve(read_metrics(run.run_dir / "metrics.jsonl"), out / "loss-curve.png",
                        title="the default recipe, 1000 of its steps (built-in text)")
        folder = _doctor_pictures(run.model, windows, run.tokenizer.decode, Path(tmp),
                                  initial=False)
        last = len(run.model.blocks) - 1
        shutil.copyfile(folder / f"attention_blocks_{last}_self_attn.png",
                        out / "attention-trained.png")


def draw_length_study(out: Path) -> None:
    from handformer.bench.length_study import LengthStudySettings, run_length_study

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        run_length_study(Path(tmp) / "study", LengthStudySettings.quick(), progress=False)
        shutil.copyfile(Path(tmp) / "study" / "length_study.png", out / "length-study.png")


def draw_length_convergence(out: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "length_convergence", ROOT / "benchmarks" / "length_convergence.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--out", str(out)])


def draw_build_progression(out: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "build_progression", ROOT / "benchmarks" / "build_progression.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--out", str(out)])


PICTURES: tuple[Picture, ...] = (
    Picture("masks", ("doctor-masks.png",), draw_masks,
            what="the doctor's mask pictures for a fresh `tiny` model"),
    Picture("masks-transposed", ("doctor-masks-transposed.png",), draw_masks_transposed,
            what="the same for the zoo's transposed causal mask"),
    Picture("positions", ("positions.png",), draw_positions,
            what="sinusoidal curves and the RoPE rotation"),
    Picture("trained", ("loss-curve.png", "attention-trained.png"), draw_trained,
            what="a short default-recipe run: its loss curve and last layer's attention"),
    Picture("length-study", ("length-study.png",), draw_length_study,
            what="`handformer experiment length --quick`'s plot"),
    Picture("length-convergence", ("length_convergence.png", "length_convergence.json"),
            draw_length_convergence, quick=False,
            what="benchmarks/length_convergence.py: training at 128 and 512"),
    Picture("build-progression", ("build-progression.png", "build_progression.json"),
            draw_build_progression, quick=False,
            what="benchmarks/build_progression.py: the build track's stages, val loss each"),
)


def main(argv: list[str] | None = None) -> int:
    names = [p.name for p in PICTURES]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"pictures to draw (default: every quick one): {', '.join(names)}")
    parser.add_argument("--out", type=Path, default=IMG)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(names))
    if unknown:
        parser.error(f"unknown picture(s) {unknown}; expected some of {names}")
    chosen = [p for p in PICTURES if (p.name in args.names if args.names else p.quick)]
    args.out.mkdir(parents=True, exist_ok=True)
    for p in chosen:
        print(f"drawing {p.name}: {p.what} …", flush=True)
        p.draw(args.out)
        for f in p.files:
            print(f"  {args.out / f} ({(args.out / f).stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))  # run from a checkout without installing
    raise SystemExit(main())
