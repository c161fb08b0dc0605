"""Command line for the encoder models: ``handformer classify …`` and ``handformer seq2seq …``.

    handformer classify train [--data FILE [--val FILE] [--text-col C] [--label-col C]]
    handformer classify predict --run DIR (--text TEXT … | --data FILE)
    handformer seq2seq train [--task {copy,reverse,sort,add}]
    handformer seq2seq predict --run DIR --text DIGITS …

``add_subcommands(subparsers)`` registers both on ``handformer``'s parser; every leaf sets
``handler`` so the main entry point can dispatch with ``args.handler(args)``. ``main`` runs
them stand-alone (``python -m handformer.cli.encoders classify train``).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["add_subcommands", "main"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text}")
    return value


def _add_training_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-steps", type=_positive_int, default=None)
    p.add_argument("--batch-size", type=_positive_int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="linear warm-up steps (0 = none)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, mps")
    p.add_argument("--norm", choices=("pre", "post"), default=None,
                   help="block norm placement (default: pre)")
    p.add_argument("--d-model", type=_positive_int, default=None)
    p.add_argument("--n-layers", type=_positive_int, default=None)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    _add_threads_option(p)


def _add_threads_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=_positive_int, default=1,
                   help="torch intra-op threads (default 1: these models are small, and on a "
                        "busy machine more threads make each step several times slower)")


def _overrides(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model overrides, train overrides) from the options actually given."""
    train = {k: v for k, v in {
        "max_steps": args.max_steps, "batch_size": args.batch_size, "lr": args.lr,
        "warmup_steps": args.warmup_steps, "seed": args.seed, "device": args.device,
    }.items() if v is not None}
    if args.max_steps is not None:  # keep evaluations inside short runs
        train.setdefault("eval_interval", max(1, args.max_steps // 6))
        train.setdefault("log_interval", max(1, min(50, args.max_steps // 6)))
    model = {k: v for k, v in {"norm": args.norm, "d_model": args.d_model,
                                "n_layers": args.n_layers}.items() if v is not None}
    return model, train


@contextmanager
def _reported_warnings(prefix: str) -> Iterator[None]:
    """Show warnings (truncation, skipped rows) as they happen, one plain line each."""

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        print(f"{prefix}: warning: {message}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = show
        yield


Handler = Callable[[argparse.Namespace], int]


def _reporting(command: str, fn: Handler) -> Handler:
    """``fn`` run with ``--threads`` torch threads (restored afterwards) and its warnings
    printed as ``handformer COMMAND: warning: …``."""

    def run(args: argparse.Namespace) -> int:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(args.threads)
        try:
            with _reported_warnings(f"handformer {command}"):
                return fn(args)
        finally:
            torch.set_num_threads(threads)

    return run


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``classify`` and ``seq2seq`` (each with ``train`` and ``predict``)."""
    from handformer.data.tasks import SEQ2SEQ_TASKS

    classify = subparsers.add_parser(
        "classify", help="sequence classification with a Transformer encoder")
    csub = classify.add_subparsers(dest="action", required=True)
    ct = csub.add_parser(
        "train", help="train a classifier (no --data: the built-in balanced-brackets task, "
                      "chance level 50%%)")
    ct.add_argument("--data", type=Path, default=None,
                    help="CSV/TSV/JSONL with a text and a label column")
    ct.add_argument("--val", type=Path, default=None,
                    help="validation file (default: hold out --val-fraction of --data)")
    ct.add_argument("--val-fraction", type=float, default=0.1)
    ct.add_argument("--text-col", default="text")
    ct.add_argument("--label-col", default="label")
    ct.add_argument("--out", type=Path, default=Path("runs/classify"))
    ct.add_argument("--max-len", type=_positive_int, default=None,
                    help="tokens per text incl. <bos>; longer texts are truncated with a "
                         "warning (default 256; built-in task: --seq-len + 1)")
    ct.add_argument("--seq-len", type=_positive_int, default=None,
                    help="built-in task only: longest generated string (default 64); "
                         "lengths are drawn from [seq_len/2, seq_len]")
    ct.add_argument("--pooling", choices=("cls", "mean"), default="cls",
                    help="first token (<bos>) or mean over real tokens (default cls)")
    ct.add_argument("--positional", choices=("learned", "sinusoidal", "rope", "alibi"),
                    default=None, help="position scheme (default rope)")
    ct.add_argument("--no-bucket", action="store_true",
                    help="batch in random order instead of grouping similar lengths")
    _add_training_options(ct)
    ct.set_defaults(handler=_reporting("classify train", _classify_train))

    cp = csub.add_parser("predict", help="classify texts with a trained run folder")
    cp.add_argument("--run", type=Path, required=True, help="folder written by classify train")
    source = cp.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", action="append", help="a text to classify (repeatable)")
    source.add_argument("--data", type=Path, help="CSV/TSV/JSONL file of texts")
    cp.add_argument("--text-col", default="text")
    cp.add_argument("--label-col", default=None,
                    help="with --data: score predictions against this column")
    cp.add_argument("--confusion", type=Path, default=None,
                    help="with --label-col: also draw the confusion matrix to this PNG")
    cp.add_argument("--device", default="cpu")
    _add_threads_option(cp)
    cp.set_defaults(handler=_reporting("classify predict", _classify_predict))

    seq = subparsers.add_parser("seq2seq", help="the original encoder-decoder Transformer")
    ssub = seq.add_subparsers(dest="action", required=True)
    st = ssub.add_parser("train", help="train on a built-in task")
    st.add_argument("--task", choices=sorted(SEQ2SEQ_TASKS), default="reverse")
    st.add_argument("--out", type=Path, default=None,
                    help="run folder (default runs/seq2seq-TASK)")
    st.add_argument("--min-len", type=_positive_int, default=None)
    st.add_argument("--max-len", type=_positive_int, default=None,
                    help="longest input (digits; for add: digits per number)")
    _add_training_options(st)
    st.set_defaults(handler=_reporting("seq2seq train", _seq2seq_train))

    sp = ssub.add_parser("predict", help="decode inputs greedily with a trained run folder")
    sp.add_argument("--run", type=Path, required=True, help="folder written by seq2seq train")
    sp.add_argument("--text", action="append", required=True,
                    help="an input such as 12345 or 57+968 (repeatable)")
    sp.add_argument("--device", default="cpu")
    _add_threads_option(sp)
    sp.set_defaults(handler=_reporting("seq2seq predict", _seq2seq_predict))


def _classify_train(args: argparse.Namespace) -> int:
    from handformer.jobs.classify import builtin_brackets_data, file_data, train_classifier

    if args.data is None:
        if args.val is not None:
            raise ValueError("--val needs --data (the built-in task makes its own validation)")
        seq_len = args.seq_len or 64
        data = builtin_brackets_data(seq_len=seq_len, seed=args.seed or 0)
        max_len = args.max_len or seq_len + 1
    else:
        if args.seq_len is not None:
            raise ValueError("--seq-len sets the built-in task's length; with --data use "
                             "--max-len")
        data = file_data(args.data, val_path=args.val, text_col=args.text_col,
                         label_col=args.label_col, val_fraction=args.val_fraction,
                         seed=args.seed or 0)
        max_len = args.max_len or 256
    model_overrides, train_overrides = _overrides(args)
    if args.positional is not None:
        model_overrides["positional"] = args.positional
    print(f"training a classifier on {data.source}: {len(data.train_texts):,} training and "
          f"{len(data.val_texts):,} validation texts, max_len {max_len}", flush=True)
    run = train_classifier(data, out_dir=args.out, max_len=max_len,
                           model_overrides=model_overrides, train_overrides=train_overrides,
                           pooling=args.pooling, bucket=not args.no_bucket,
                           progress=not args.no_progress)
    s = run.summary
    print(f"\nparameters: {s['parameters']:,}   steps: {run.result.steps}   "
          f"time: {s['seconds']:.1f}s")
    print(f"validation accuracy: {s['val_accuracy']:.4f}   macro-F1: {s['val_macro_f1']:.4f}   "
          f"(chance {s['chance']:.3f}, majority class {s['majority_baseline']:.3f})")
    print("confusion matrix (rows: true, columns: predicted; order "
          f"{', '.join(run.labels.labels)}):")
    for row in s["confusion"]:
        print("  " + " ".join(f"{n:>6}" for n in row))
    print(f"run folder: {run.run_dir}")
    return 0


def _classify_predict(args: argparse.Namespace) -> int:
    from handformer.data.classification import read_examples
    from handformer.jobs.classify import (
        confusion_matrix,
        load_classifier_run,
        plot_confusion,
        predict_texts,
        scores_from_confusion,
    )

    if args.confusion is not None and args.label_col is None:
        raise ValueError("--confusion needs --data and --label-col (the true labels)")
    loaded = load_classifier_run(args.run, device=args.device)
    if args.text is not None:
        texts, truth = list(args.text), None
    else:
        texts, truth = read_examples(args.data, text_col=args.text_col,
                                     label_col=args.label_col)
    if truth is not None:  # fail on an unknown label before predicting anything
        truth_ids = loaded.labels.encode(truth, source=str(args.data))
    predictions = predict_texts(loaded, texts)
    for text, p in zip(texts, predictions, strict=True):
        shown = text if len(text) <= 60 else text[:57] + "..."
        print(f"{p.label}\t{p.confidence:.3f}\t{shown}")
    if truth is not None:
        import torch

        predicted = loaded.labels.encode([p.label for p in predictions])
        cm = confusion_matrix(torch.tensor(truth_ids), torch.tensor(predicted),
                              len(loaded.labels))
        scores = scores_from_confusion(cm)
        print(f"accuracy: {scores['accuracy']:.4f}   macro-F1: {scores['macro_f1']:.4f}   "
              f"({len(texts)} texts)")
        if args.confusion is not None:
            plot_confusion(cm.tolist(), loaded.labels.labels, args.confusion,
                           title=f"{args.data.name} ({len(texts)} texts)\naccuracy "
                                 f"{scores['accuracy']:.3f}, macro-F1 {scores['macro_f1']:.3f}")
            print(f"confusion matrix: {args.confusion}")
    return 0


def _seq2seq_train(args: argparse.Namespace) -> int:
    from handformer.jobs.seq2seq import train_seq2seq

    out = args.out or Path(f"runs/seq2seq-{args.task}")
    model_overrides, train_overrides = _overrides(args)
    print(f"training an encoder-decoder on the built-in {args.task!r} task", flush=True)
    run = train_seq2seq(args.task, out_dir=out, min_len=args.min_len, max_len=args.max_len,
                        model_overrides=model_overrides, train_overrides=train_overrides,
                        progress=not args.no_progress)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point with the same error contract as ``handformer.cli.main``."""
    parser = argparse.ArgumentParser(prog="handformer")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, OSError) as err:
        print(f"handformer {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
