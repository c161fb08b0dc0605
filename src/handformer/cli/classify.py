"""``handformer classify train`` and ``handformer classify predict``: sequence
classification with a Transformer encoder (``handformer.jobs.classify``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from handformer.cli.common import (
    FRACTION,
    UsageError,
    add_overwrite_option,
    add_threads_option,
    add_training_options,
    check_output_file,
    check_recipe,
    device_name,
    folder_arg,
    positive_int,
    reporting,
    training_overrides,
)
from handformer.cli.finetune import add_lora_options, lora_config

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add ``classify`` (with ``train`` and ``predict``) to ``handformer``'s sub-parsers."""
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
    ct.add_argument("--val-fraction", type=FRACTION, default=0.1,
                    help="share held out for validation, in (0, 1) (default 0.1)")
    ct.add_argument("--text-col", default="text")
    ct.add_argument("--label-col", default="label")
    ct.add_argument("--out", type=folder_arg, default=Path("runs/classify"),
                    help="run folder to write: new, empty, or a run folder of `classify "
                         "train` (default: runs/classify)")
    add_overwrite_option(ct, "--out")
    ct.add_argument("--max-len", type=positive_int, default=None,
                    help="tokens per text incl. <bos>; longer texts are truncated with a "
                         "warning (default 256; built-in task: --seq-len + 1)")
    ct.add_argument("--seq-len", type=positive_int, default=None,
                    help="built-in task only: longest generated string (default 64); "
                         "lengths are drawn from [seq_len/2, seq_len]")
    ct.add_argument("--pooling", choices=("cls", "mean", "last"), default=None,
                    help="first token (<bos>), mean over real tokens, or (a decoder --from) "
                         "the last real token (default cls; with --from: mean for an "
                         "encoder, last for a decoder)")
    ct.add_argument("--from", dest="from_", type=folder_arg, default=None,
                    metavar="RUN_OR_HF_FOLDER",
                    help="start from a pretrained model and its tokenizer: an encoder (a "
                         "BERT/MiniLM Hugging Face folder, or its `convert --from hf` run), a "
                         "language-model run (last-token pooling) or a classifier run; a new "
                         "head is trained for --data's labels")
    add_lora_options(ct, "q,v")
    ct.add_argument("--positional", choices=("learned", "sinusoidal", "rope", "alibi"),
                    default=None, help="position scheme (default rope)")
    ct.add_argument("--no-bucket", action="store_true",
                    help="batch in random order instead of grouping similar lengths")
    add_training_options(ct)
    ct.set_defaults(handler=reporting("classify train", _classify_train))

    cp = csub.add_parser("predict", help="classify texts with a trained run folder")
    cp.add_argument("--run", type=Path, required=True, help="folder written by classify train")
    source = cp.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", action="append", help="a text to classify (repeatable)")
    source.add_argument("--data", type=Path, help="CSV/TSV/JSONL file of texts")
    cp.add_argument("--text-col", default="text")
    cp.add_argument("--label-col", default=None,
                    help="with --data: score predictions against this column")
    cp.add_argument("--confusion", type=Path, default=None,
                    help="with --label-col: also draw the confusion matrix to this PNG (a "
                         "new file, unless --overwrite)")
    cp.add_argument("--overwrite", action="store_true",
                    help="let --confusion replace an existing file")
    cp.add_argument("--device", type=device_name, default="cpu")
    add_threads_option(cp)
    cp.set_defaults(handler=reporting("classify predict", _classify_predict))


def _classify_train(args: argparse.Namespace) -> int:
    from handformer.config import CLASSIFY_PRESET
    from handformer.jobs.classify import builtin_brackets_data, file_data, train_classifier

    if args.from_ is not None:
        return _classify_from(args)
    lora_config(args, "q,v")  # LoRA options without --from are refused
    if args.pooling == "last":
        raise UsageError("--pooling last is for a decoder's body: give the LM run with --from")
    args.pooling = args.pooling or "cls"
    model_overrides, train_overrides = training_overrides(args)
    if args.positional is not None:
        model_overrides["positional"] = args.positional
    if args.data is None:
        if args.val is not None:
            raise UsageError("--val needs --data (the built-in task makes its own validation)")
        seq_len = args.seq_len or 64
        check_recipe(CLASSIFY_PRESET, model_overrides, train_overrides,
                     max_len=args.max_len or seq_len + 1)
        data = builtin_brackets_data(seq_len=seq_len, seed=args.seed or 0)
        max_len = args.max_len or seq_len + 1
    else:
        if args.seq_len is not None:
            raise UsageError("--seq-len sets the built-in task's length; with --data use "
                             "--max-len")
        check_recipe(CLASSIFY_PRESET, model_overrides, train_overrides,
                     max_len=args.max_len or 256)
        data = file_data(args.data, val_path=args.val, text_col=args.text_col,
                         label_col=args.label_col, val_fraction=args.val_fraction,
                         seed=args.seed or 0)
        max_len = args.max_len or 256
    print(f"training a classifier on {data.source}: {len(data.train_texts):,} training and "
          f"{len(data.val_texts):,} validation texts, max_len {max_len}", flush=True)
    run = train_classifier(data, out_dir=args.out, max_len=max_len,
                           model_overrides=model_overrides, train_overrides=train_overrides,
                           pooling=args.pooling, bucket=not args.no_bucket,
                           progress=not args.no_progress, overwrite=args.overwrite)
    _report(run)
    return 0


def _load_base(folder: Path) -> tuple[Any, Any, str]:
    """(model, tokenizer, kind) of a pretrained model: a handformer run folder (lm,
    classifier or encoder) or a Hugging Face BERT folder (kind ``hf-bert``)."""
    from handformer.interop.bert import load_bert_folder
    from handformer.interop.files import read_config
    from handformer.runs import RunFolderError, load_run, run_kind
    from handformer.runs.files import read_json

    config_path = folder / "config.json"
    if not config_path.is_file():
        raise RunFolderError(f"--from {folder} is not a model folder: it has no config.json "
                             "(give a handformer run folder or a Hugging Face BERT folder)")
    config = read_json(config_path)
    if any(isinstance(config.get(k), dict) for k in ("model", "classifier", "seq2seq",
                                                     "encoder")):
        if "lora" in config:
            raise RunFolderError(f"--from {folder} is itself a LoRA run; merge it first "
                                 f"(handformer convert --merge-lora {folder} DST)")
        run_kind(config, config_path)
        run = load_run(folder, kind=("lm", "classifier", "encoder"))
        return run.model, run.tokenizer, run.kind
    model_type = read_config(config_path).get("model_type")
    if model_type != "bert":
        raise RunFolderError(f"--from {folder}: a Hugging Face {model_type!r} folder; import it "
                             f"first (handformer convert --from hf {folder} DIR) and give DIR")
    model, tokenizer = load_bert_folder(folder)
    return model, tokenizer, "hf-bert"


def _classify_from(args: argparse.Namespace) -> int:
    """``classify train --from``: a pretrained trunk, its tokenizer and a new head."""
    from handformer.jobs.classify import file_data, finetune_classifier

    given = [f"--{n.replace('_', '-')}" for n in ("positional", "seq_len", "norm", "d_model",
                                                  "n_layers") if getattr(args, n) is not None]
    if given:
        raise UsageError(f"--from takes the model from the pretrained folder; drop {given}")
    if args.data is None:
        raise UsageError("--from needs --data, the labelled rows to fine-tune on")
    lora = lora_config(args, "q,v")
    _, train_overrides = training_overrides(args)
    data = file_data(args.data, val_path=args.val, text_col=args.text_col,
                     label_col=args.label_col, val_fraction=args.val_fraction,
                     seed=args.seed or 0)
    model, tokenizer, kind = _load_base(args.from_)
    how = "full fine-tuning" if lora is None else f"LoRA r={lora.r} on {','.join(lora.targets)}"
    print(f"fine-tuning a classifier from {args.from_} ({kind}) on {data.source}: "
          f"{len(data.train_texts):,} training and {len(data.val_texts):,} validation texts, "
          f"{how}", flush=True)
    run = finetune_classifier(data, model, tokenizer, base_dir=args.from_, base_kind=kind,
                              out_dir=args.out, max_len=args.max_len, lora=lora,
                              pooling=args.pooling, train_overrides=train_overrides,
                              bucket=not args.no_bucket, progress=not args.no_progress,
                              overwrite=args.overwrite)
    _report(run)
    return 0


def _report(run: Any) -> None:
    s = run.summary
    print(f"\nparameters: {s['parameters']:,}   steps: {run.result.steps}   "
          f"time: {s['seconds']:.1f}s")
    print(f"validation accuracy: {s['val_accuracy']:.4f}   macro-F1: {s['val_macro_f1']:.4f}   "
          f"(chance {s['chance']:.3f}, majority class {s['majority_baseline']:.3f})")
    print("confusion matrix (rows: true, columns: predicted; order "
          f"{', '.join(run.labels.labels)}):")
    for row in s["confusion"]:
        print("  " + " ".join(f"{n:>6}" for n in row))
    if s["trainable_parameters"] != s["parameters"]:
        print(f"trained {s['trainable_parameters']:,} of {s['parameters']:,} parameters")
    print(f"run folder: {run.run_dir}")


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
        raise UsageError("--confusion needs --data and --label-col (the true labels)")
    if args.confusion is not None:  # before predicting: never replace a file it did not write
        check_output_file(args.confusion, "--confusion", overwrite=args.overwrite)
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
