"""A language-model run folder → the same run with int8 weights (``handformer convert
--quantize int8``).

The new folder is an ordinary LM run folder (``runs.folder``): ``model.safetensors`` holds the
int8 weights and their scales, ``config.json`` the model config, the source's training recipe
and the ``"quantization"`` record, so ``load_run`` loads it without quantizing again. It is
claimed through ``writing_folder`` like every folder a command writes; the source is only
read.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from handformer.models.quantize import QuantizationError, is_quantized, quantize_int8
from handformer.runs.files import RunFolderError
from handformer.runs.folder import load_run, save_run
from handformer.runs.guard import LM_FOLDER, check_destination, folder_path, writing_folder

__all__ = ["QUANTIZED_FOLDER", "write_quantized_run"]

QUANTIZED_FOLDER = dataclasses.replace(LM_FOLDER, command="handformer convert --quantize int8",
                                       checkpoints=None, resume=None)


def write_quantized_run(src: str | Path, dst: str | Path, *, include_head: bool = True,
                        overwrite: bool = False) -> Path:
    """Quantize the LM run at ``src`` to int8 (``models.quantize.quantize_int8``) and save
    it as a run folder at ``dst`` (new, empty, or a run folder handformer wrote; anything
    else only with ``overwrite``). Returns ``dst``. ``RunFolderError`` for a source that is
    not an LM run, is already quantized, or is the destination itself."""
    src, dst = Path(src), folder_path(dst)
    if dst.exists() and src.exists() and dst.resolve() == src.resolve():
        raise RunFolderError(f"the destination {dst} is the source run; give a new folder for "
                             "the int8 copy")
    check_destination(dst, QUANTIZED_FOLDER, overwrite=overwrite)  # before the work
    run = load_run(src, kind="lm")
    if "lora" in run.config:
        raise RunFolderError(f"{src} is a LoRA run (adapters beside a frozen base); merge it "
                             "first with handformer convert --merge-lora, then quantize that")
    if is_quantized(run.model):
        raise RunFolderError(f"{src} is already quantized ({run.config.get('quantization')})")
    try:
        model = quantize_int8(run.model, include_head=include_head, inplace=True)
    except QuantizationError as err:
        raise RunFolderError(f"{src}: {err}") from None
    extra = {k: v for k, v in run.config.items() if k not in ("model", "train")}
    extra["quantized_from"] = str(src.resolve())
    with writing_folder(dst, QUANTIZED_FOLDER, overwrite=overwrite):
        save_run(dst, model, run.tokenizer, extra={"train": run.config.get("train"), **extra})
    return dst
