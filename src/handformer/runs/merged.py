"""A LoRA run folder → a plain run folder with the adapters folded into the weights
(``handformer convert --merge-lora``).

The new folder stands alone: ``model.safetensors`` holds every weight (W + (alpha / r)·B·A for
each adapted projection), ``config.json`` no ``lora`` record, so it loads without its base and
can be the base of another run, be quantized or leave for Hugging Face. It records what it was
merged from. The source is only read.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from handformer.nn.lora import merge_lora
from handformer.runs.base import BASE_KEY, LORA_KEY
from handformer.runs.files import RunFolderError
from handformer.runs.folder import RUN_KINDS, load_run, save_run
from handformer.runs.guard import RUN_FOLDERS, check_destination, folder_path, writing_folder

__all__ = ["write_merged_run"]


def write_merged_run(src: str | Path, dst: str | Path, *, overwrite: bool = False) -> Path:
    """Merge the LoRA run at ``src`` into a plain run folder at ``dst`` (new, empty, or a run
    folder of the same kind that handformer wrote; anything else only with ``overwrite``).
    ``RunFolderError`` for a source without LoRA, or one that is the destination."""
    src, dst = Path(src), folder_path(dst)
    if dst.exists() and src.exists() and dst.resolve() == src.resolve():
        raise RunFolderError(f"the destination {dst} is the source run; give a new folder for "
                             "the merged copy")
    run = load_run(src, kind=("lm", "classifier"))
    if LORA_KEY not in run.config:
        raise RunFolderError(f"{src} has no LoRA adapters to merge (its config.json has no "
                             f"{LORA_KEY!r} record)")
    spec = dataclasses.replace(RUN_FOLDERS[run.kind], command="handformer convert --merge-lora",
                               checkpoints=None, resume=None)
    check_destination(dst, spec, overwrite=overwrite)
    model = merge_lora(run.model)
    extra = {k: v for k, v in run.config.items()
             if k not in (RUN_KINDS[run.kind][0], "train", LORA_KEY,
                          BASE_KEY)}
    extra["merged_from"] = {"path": str(src.resolve()), LORA_KEY: run.config[LORA_KEY],
                            BASE_KEY: run.config[BASE_KEY]}
    with writing_folder(dst, spec, overwrite=overwrite):
        save_run(dst, model, run.tokenizer, labels=run.labels,
                 extra={"train": run.config.get("train"), **extra})
    return dst
