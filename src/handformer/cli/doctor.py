"""``handformer doctor``: run the checklist on a preset, a config file or a trained run.

    handformer doctor                       # the default preset, freshly initialised
    handformer doctor --preset tiny --json
    handformer doctor --config model.json --pictures doctor_pics/
    handformer doctor --run runs/default --data my_text.txt

Data come from the built-in text (or ``--data FILE``), tokenised with a character tokenizer
built from that text — or, for ``--run``, with the run's own tokenizer. Exit code: 0 when no
check FAILs, 1 when one does or when the subject cannot be built (a missing or bad file, a
model too large for memory), 2 for a wrong command line.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from handformer.cli.common import POSITIVE, add_overwrite_option, folder_arg, seed_int

__all__ = ["build_subject", "register", "run_doctor"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text}")
    return value


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``doctor`` on an ``add_subparsers()`` object; its handler is ``args.handler``."""
    from handformer.config import PRESETS

    doc = subparsers.add_parser(
        "doctor", help="run the debugging checklist (shapes, masks, loss, gradients, ...)",
        description="Run the tutorial's debugging checklist on a model and report PASS / WARN "
        "/ FAIL per check with the evidence and a hint. Exit code 0 if nothing FAILs, 1 if "
        "something does or the model cannot be built, 2 for a wrong command line.")
    source = doc.add_mutually_exclusive_group()
    source.add_argument("--run", type=Path, metavar="DIR", help="a trained run folder")
    source.add_argument("--config", type=Path, metavar="FILE",
                        help="a ModelConfig JSON file (or a run's config.json)")
    source.add_argument("--preset", choices=sorted(PRESETS),
                        help="a built-in recipe, freshly initialised (default: default)")
    doc.add_argument("--data", type=Path, default=None,
                     help="UTF-8 text for the probe batches (default: the built-in text)")
    doc.add_argument("--json", action="store_true", help="print the report as JSON")
    doc.add_argument("--pictures", type=folder_arg, default=None, metavar="DIR",
                     help="write attention heatmaps and mask matrices (PNG) to DIR: new, "
                     "empty, or one the doctor drew into")
    add_overwrite_option(doc, "--pictures DIR")
    doc.add_argument("--batch-size", type=_positive_int, default=4,
                     help="rows in the probe batch (default 4)")
    doc.add_argument("--block-size", type=_positive_int, default=None,
                     help="tokens per row (default: the recipe's block size, ≤ max_len)")
    doc.add_argument("--lr", type=POSITIVE, default=None,
                     help="learning rate for the update-ratio and overfit checks (default: the "
                     "recipe's)")
    doc.add_argument("--learning-steps", type=_positive_int, default=60,
                     help="step budget for overfitting one batch (default 60)")
    doc.add_argument("--seed", type=seed_int, default=0)
    doc.add_argument("--threads", type=_positive_int, default=1,
                     help="torch intra-op threads (default 1: the probe batches are tiny, and "
                     "on a busy machine more threads make them several times slower)")
    doc.add_argument("--verbose", action="store_true",
                     help="show every module in the shape table")
    doc.set_defaults(handler=run_doctor)
    return doc


@dataclass
class DoctorSubject:
    """What the CLI hands to ``handformer.doctor.run``."""

    model: Any
    windows: Any
    tokenizer: Any
    lr: float
    initial: bool
    source: str


def _text(data: Path | None) -> tuple[str, str]:
    from handformer.data.corpora import builtin_text, read_text_file

    if data is None:
        return builtin_text(), "the built-in text"
    return read_text_file(data), str(data)


def _read_config(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ModelConfig JSON, or a run's ``{"model": …, "train": …}`` → (model, train) dicts."""
    if not path.is_file():
        raise ValueError(f"config file not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object (a ModelConfig)")
    if isinstance(data.get("model"), dict):
        return dict(data["model"]), dict(data.get("train") or {})
    return data, {}


def build_subject(args: argparse.Namespace) -> DoctorSubject:
    """Model, probe windows, tokenizer, learning rate and 'fresh or trained' from the args."""
    import torch

    from handformer.config import ModelConfig, get_preset
    from handformer.data import LMWindows
    from handformer.models.decoder_lm import DecoderLM
    from handformer.tokenizers import CharTokenizer

    text, where = _text(args.data)
    train: dict[str, Any]
    if args.run is not None:
        from handformer.runs import load_run

        run = load_run(args.run, kind="lm")
        model, tokenizer = run.model, run.tokenizer
        train = dict(run.config.get("train") or {})
        initial, source = False, f"run {args.run} (trained) on {where}"
    else:
        tokenizer = CharTokenizer.from_text(text)
        if args.config is not None:
            model_dict, train = _read_config(args.config)
            model_dict.setdefault("vocab_size", tokenizer.vocab_size)
            if model_dict["vocab_size"] < tokenizer.vocab_size:
                raise ValueError(
                    f"{args.config}: vocab_size={model_dict['vocab_size']} is smaller than the "
                    f"{tokenizer.vocab_size} characters (+ specials) of {where}; raise it or "
                    "leave it out to take the tokenizer's")
            cfg = ModelConfig.from_dict(model_dict)
            source = f"config {args.config} (fresh) on {where}"
        else:
            name = args.preset or "default"
            preset = get_preset(name)
            cfg = ModelConfig(vocab_size=tokenizer.vocab_size, **preset.model)
            train = dict(preset.train)
            source = f"preset {name!r} (fresh) on {where}"
        torch.manual_seed(args.seed)
        model = DecoderLM(cfg)
        initial = True
    max_len = model.config.max_len
    block = min(args.block_size or int(train.get("block_size", max_len)), max_len)
    tokens = torch.as_tensor(tokenizer.encode_array(text), dtype=torch.long)
    windows = LMWindows(tokens, block, name=where)
    lr = args.lr if args.lr is not None else float(train.get("lr", 1e-3))
    # The probes train the model on batch_size × block windows (gradients, AdamW, activations).
    from handformer.models.budget import check_training

    check_training(model.config, args.batch_size, block,
                   hint="use a smaller --batch-size or --block-size, or a smaller model")
    return DoctorSubject(model, windows, tokenizer, lr, initial, source)


def run_doctor(args: argparse.Namespace) -> int:
    """The ``doctor`` handler: build the subject, run the checklist, print, return 0/1/2
    (an error: its one line on stderr, exit 1, or 2 for a usage error)."""
    import torch

    from handformer.cli.errors import EXPECTED
    from handformer.cli.errors import report as report_error
    from handformer.doctor.pictures import PICTURES_FOLDER
    from handformer.doctor.runner import run
    from handformer.runs import check_destination

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        if args.pictures is not None:  # refused now, not after the whole checklist
            check_destination(args.pictures, PICTURES_FOLDER, overwrite=args.overwrite)
        s = build_subject(args)
        tok = s.tokenizer
        report = run(s.model, s.windows, lr=s.lr, initial=s.initial, pad_id=tok.pad_id,
                     vocab_size=s.model.config.vocab_size, batch_size=args.batch_size,
                     learning_steps=args.learning_steps, seed=args.seed,
                     pictures=args.pictures, overwrite=args.overwrite,
                     decode=lambda i: tok.decode([i], skip_special=False))
    except EXPECTED as err:
        return report_error("doctor", err)
    finally:
        torch.set_num_threads(threads)
    report.subject["source"] = s.source
    if args.json:
        print(report.to_json())
    else:
        print(report.format_text(max_module_depth=None if args.verbose else 2))
    return report.exit_code
