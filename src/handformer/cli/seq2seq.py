"""``handformer seq2seq train`` and ``handformer seq2seq predict``: the original
encoder-decoder Transformer on a built-in task (``handformer.jobs.seq2seq``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from handformer.cli.common import (
    UsageError,
    add_overwrite_option,
    add_threads_option,
    add_training_options,
    check_recipe,
    device_name,
    folder_arg,
    positive_int,
    reporting,
    training_overrides,
)

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add ``seq2seq`` (with ``train`` and ``predict``) to ``handformer``'s sub-parsers."""
    from handformer.data.tasks import SEQ2SEQ_TASKS

    seq = subparsers.add_parser("seq2seq", help="the original encoder-decoder Transformer")
    ssub = seq.add_subparsers(dest="action", required=True)
    st = ssub.add_parser("train", help="train on a built-in task")
    st.add_argument("--task", choices=sorted(SEQ2SEQ_TASKS), default="reverse")
    st.add_argument("--out", type=folder_arg, default=None,
                    help="run folder to write: new, empty, or a run folder of `seq2seq "
                         "train` (default runs/seq2seq-TASK)")
    add_overwrite_option(st, "--out")
    st.add_argument("--min-len", type=positive_int, default=None)
    st.add_argument("--max-len", type=positive_int, default=None,
                    help="longest input (digits; for add: digits per number)")
    add_training_options(st)
    st.set_defaults(handler=reporting("seq2seq train", _seq2seq_train))

    sp = ssub.add_parser("predict", help="decode inputs greedily with a trained run folder")
    sp.add_argument("--run", type=Path, required=True, help="folder written by seq2seq train")
    sp.add_argument("--text", action="append", required=True,
                    help="an input such as 12345 or 57+968 (repeatable)")
    sp.add_argument("--device", type=device_name, default="cpu")
    add_threads_option(sp)
    sp.set_defaults(handler=reporting("seq2seq predict", _seq2seq_predict))


def _seq2seq_train(args: argparse.Namespace) -> int:
    from handformer.config import SEQ2SEQ_PRESET
    from handformer.data.tasks import SEQ2SEQ_TASKS
    from handformer.jobs.seq2seq import train_seq2seq

    out = args.out or Path(f"runs/seq2seq-{args.task}")
    model_overrides, train_overrides = training_overrides(args)
    spec = SEQ2SEQ_TASKS[args.task]
    lo, hi = args.min_len or spec.default_min_len, args.max_len or spec.default_max_len
    if lo > hi:
        raise UsageError(f"need --min-len <= --max-len; got {lo} > {hi}")
    check_recipe(SEQ2SEQ_PRESET, model_overrides, train_overrides, max_len=hi)
    print(f"training an encoder-decoder on the built-in {args.task!r} task", flush=True)
    run = train_seq2seq(args.task, out_dir=out, min_len=args.min_len, max_len=args.max_len,
                        model_overrides=model_overrides, train_overrides=train_overrides,
                        progress=not args.no_progress, overwrite=args.overwrite)
    s = run.summary
    print(f"\nparameters: {s['parameters']:,}   steps: {run.result.steps}   "
          f"time: {s['seconds']:.1f}s")
    print(f"held-out exact match: {s['val_exact_match']:.4f} on {s['num_val']} unseen inputs "
          f"(greedy decoding)")
    for ex in s["examples"]:
        print(f"  {ex['source']} → {ex['output']}   (expected {ex['target']})")
    print(f"run folder: {run.run_dir}")
    return 0


def _seq2seq_predict(args: argparse.Namespace) -> int:
    from handformer.jobs.seq2seq import load_seq2seq_run, translate

    loaded = load_seq2seq_run(args.run, device=args.device)
    for source, output in zip(args.text, translate(loaded.model, loaded.tokenizer, args.text),
                              strict=True):
        print(f"{source}\t{output}")
    return 0
