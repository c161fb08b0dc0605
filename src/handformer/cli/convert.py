"""``handformer convert``: run folders ↔ Hugging Face ``transformers`` folders, and a run
folder → its int8 copy (``--quantize int8``). The destination is new, empty, or one the same
direction wrote before; anything else is refused unless ``--overwrite``
(``handformer.interop.hf_folder``, ``handformer.runs.quantized``)."""

from __future__ import annotations

import argparse
from typing import Any

from handformer.cli.common import add_overwrite_option, folder_arg

__all__ = ["register"]


def register(sub: Any) -> None:
    conv = sub.add_parser("convert", help="convert between run folders and transformers folders")
    direction = conv.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to", choices=["hf"], help="run folder → transformers folder")
    direction.add_argument("--from", dest="from_", choices=["hf"],
                           help="transformers folder → run folder")
    direction.add_argument("--quantize", choices=["int8"],
                           help="run folder → run folder with int8 weights and their scales "
                           "(loads without quantizing again)")
    conv.add_argument("src", type=folder_arg, help="the folder to read")
    conv.add_argument("dst", type=folder_arg,
                      help="the folder to write: new, empty, or one this direction wrote")
    add_overwrite_option(conv, "DST")
    conv.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from handformer.interop.hf_folder import export_gpt2_folder, import_gpt2_folder

    if args.quantize is not None:
        from handformer.runs.quantized import write_quantized_run

        out = write_quantized_run(args.src, args.dst, overwrite=args.overwrite)
        print(f"wrote int8 run folder {out} (try: handformer generate --run {out})")
        return 0
    if args.to == "hf":
        out = export_gpt2_folder(args.src, args.dst, overwrite=args.overwrite)
        print(f"wrote {out} (load it with transformers.GPT2LMHeadModel.from_pretrained)")
    else:
        out = import_gpt2_folder(args.src, args.dst, overwrite=args.overwrite)
        print(f"wrote run folder {out} (try: handformer generate --run {out})")
    return 0
