"""``handformer convert``: run folders ↔ Hugging Face ``transformers`` folders (GPT-2, Llama,
Qwen3), a run → one
ONNX file, and a run folder → its int8 copy (``--quantize int8``). A destination folder is new,
empty, or one the same direction wrote before; anything else is refused unless ``--overwrite``
(``handformer.interop.hf_folder``, ``handformer.runs.quantized``); an ONNX file likewise
(``handformer.interop.onnx_export``)."""

from __future__ import annotations

import argparse
from typing import Any

from handformer.cli.common import UsageError, add_overwrite_option, folder_arg

__all__ = ["register"]


def register(sub: Any) -> None:
    conv = sub.add_parser("convert", help="convert a run to a transformers folder or ONNX, "
                                          "or a transformers folder to a run")
    direction = conv.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to", choices=["hf", "onnx", "peft"],
                           help="run folder → transformers folder (hf), one .onnx file, or "
                           "(peft) a LoRA run's adapters as a PEFT adapter folder for its "
                           "base's transformers folder")
    direction.add_argument("--from", dest="from_", choices=["hf"],
                           help="transformers folder → run folder")
    direction.add_argument("--quantize", choices=["int8"],
                           help="run folder → run folder with int8 weights and their scales "
                           "(loads without quantizing again)")
    direction.add_argument("--merge-lora", action="store_true",
                           help="LoRA run folder → plain run folder with the adapters folded "
                           "into the weights (loads without its base)")
    conv.add_argument("src", type=folder_arg, help="the folder to read")
    conv.add_argument("dst", type=folder_arg,
                      help="the folder (or, with --to onnx, the .onnx file) to write: new, "
                           "empty, or one this direction wrote")
    conv.add_argument("--with-cache", action="store_true",
                      help="--to onnx: a graph that takes and returns past keys/values "
                           "(past → present), for token-by-token decoding")
    add_overwrite_option(conv, "DST")
    conv.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    if args.with_cache and args.to != "onnx":
        raise UsageError("--with-cache applies to --to onnx only")
    if args.to == "onnx":
        from handformer.interop.onnx_export import export_onnx

        if args.dst.suffix != ".onnx":
            raise UsageError(f"--to onnx writes one file; DST must end in .onnx, got {args.dst}")
        out = export_onnx(args.src, args.dst, with_cache=args.with_cache,
                          overwrite=args.overwrite)
        print(f"wrote {out} (run it with onnxruntime.InferenceSession; "
              "handformer.interop.onnx_decode.OnnxLM decodes with it)")
        return 0
    from handformer.interop.hf_folder import export_hf_folder, import_hf_folder

    if args.to == "peft":
        return _to_peft(args)
    if args.merge_lora:
        from handformer.runs.merged import write_merged_run

        out = write_merged_run(args.src, args.dst, overwrite=args.overwrite)
        print(f"wrote merged run folder {out} (the adapters folded into the weights)")
        return 0
    if args.quantize is not None:
        from handformer.runs.quantized import write_quantized_run

        out = write_quantized_run(args.src, args.dst, overwrite=args.overwrite)
        print(f"wrote int8 run folder {out} (try: handformer generate --run {out})")
        return 0
    if args.to == "hf":
        out, family = export_hf_folder(args.src, args.dst, overwrite=args.overwrite)
        cls = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}[family]
        print(f"wrote {out}, a {family} folder (load it with transformers: "
              f"pipeline('text-generation', model='{out}'), AutoTokenizer / "
              f"{cls}.from_pretrained; vLLM serves it: vllm serve {out})")
    else:
        out = import_hf_folder(args.src, args.dst, overwrite=args.overwrite)
        if (out / "config.json").is_file() and '"encoder"' in (out / "config.json").read_text(
                encoding="utf-8"):
            print(f"wrote encoder run folder {out} (try: handformer classify train --from "
                  f"{out} --data rows.csv --lora 8)")
        else:
            print(f"wrote run folder {out} (try: handformer generate --run {out})")
    return 0


def _to_peft(args: argparse.Namespace) -> int:
    """A LoRA language-model run → a PEFT adapter folder (``interop.peft``)."""
    from handformer.interop.peft import write_adapter_folder
    from handformer.runs import RunFolderError, load_run
    from handformer.runs.base import lora_from_config

    run = load_run(args.src, kind="lm")
    if "lora" not in run.config:
        raise RunFolderError(f"{args.src} has no LoRA adapters (its config.json has no 'lora' "
                             "record); --to peft writes a LoRA run's adapters")
    lora, _ = lora_from_config(run.config, args.src / "config.json")
    out = write_adapter_folder(run.model, args.dst, lora, base=run.config["base"]["path"],
                               overwrite=args.overwrite)
    print(f"wrote PEFT adapter folder {out} (PeftModel.from_pretrained(base, '{out}') with the "
          f"base exported by: handformer convert --to hf {run.config['base']['path']} DIR)")
    return 0
