"""Whole Hugging Face model folders ↔ handformer run folders (GPT-2 architecture).

A Hugging Face folder holds ``config.json``, ``model.safetensors`` (or the older
``pytorch_model.bin``) and usually ``tokenizer.json``. Reading never unpickles arbitrary
objects: safetensors, or ``torch.load(weights_only=True)`` for ``.bin`` files.

Both directions write their destination through ``handformer.runs.writing_folder``: a new or
empty folder, or one the same direction wrote before; anything else is refused unless
``overwrite`` (and even then only handformer's own files are removed). The source folder is
never the destination.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from handformer.atomic import atomic_write_text
from handformer.interop.files import read_config, read_weights
from handformer.interop.gpt2 import (
    ConversionError,
    config_to_gpt2,
    from_gpt2_state_dict,
    to_gpt2_state_dict,
)
from handformer.interop.hf_tokenizer import (
    TOKENIZER_FILES,
    read_folder_tokenizer,
    write_folder_tokenizer,
)
from handformer.runs import LM_FOLDER, FolderSpec, check_destination, folder_path, writing_folder
from handformer.runs.guard import remove_if_ours

__all__ = ["HF_FOLDER", "export_gpt2_folder", "import_gpt2_folder"]


# What ``export_gpt2_folder`` writes (the ``.tmp`` is a crash's leftover at most;
# ``handformer_tokenizer.json`` is what folders converted before the Hugging Face tokenizer
# files carried).
HF_FOLDER = FolderSpec("hf", "a Hugging Face model folder", "handformer convert --to hf",
                       ("model.safetensors", "model.safetensors.tmp", "config.json",
                        *TOKENIZER_FILES, "handformer_tokenizer.json"))


def _distinct(src: Path, dst: Path) -> None:
    """Refuse to write a conversion over the folder it reads."""
    if dst.exists() and src.exists() and dst.resolve() == src.resolve():
        raise ConversionError(f"the destination {dst} is the source folder; give a new "
                              "folder to write the converted model to")


def _read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    st, binary = folder / "model.safetensors", folder / "pytorch_model.bin"
    if st.is_file():
        return read_weights(st)
    if binary.is_file():
        try:
            return torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as err:  # pickle refusals and corrupt files surface as many types
            raise ConversionError(f"{binary}: refused or unreadable ({err})") from None
    raise ConversionError(f"{folder} has neither model.safetensors nor pytorch_model.bin")


def import_gpt2_folder(src: str | Path, run_dir: str | Path, *,
                       overwrite: bool = False) -> Path:
    """A ``transformers`` GPT-2 folder → a handformer run folder (weights, config, tokenizer).
    ``run_dir`` is claimed as a language-model run (see the module docstring)."""
    from handformer.runs import save_run

    src, run_dir = Path(src), folder_path(run_dir)
    spec = dataclasses.replace(LM_FOLDER, command="handformer convert --from hf")
    _distinct(src, run_dir)
    check_destination(run_dir, spec, overwrite=overwrite)
    config_path = src / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"{src} has no config.json; expected a Hugging Face model folder")
    hf_config = read_config(config_path)
    if hf_config.get("model_type") != "gpt2":
        raise ConversionError(f"{config_path}: model_type={hf_config.get('model_type')!r}; "
                              "only 'gpt2' decoders convert into a DecoderLM run")
    tokenizer = read_folder_tokenizer(src)
    state = _read_state_dict(src)
    if not any(k.startswith("transformer.") for k in state):  # a bare GPT2Model checkpoint
        state = {f"transformer.{k}": v for k, v in state.items()}
    model = from_gpt2_state_dict(state, hf_config, source=str(src))
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ConversionError(f"{src / 'tokenizer.json'} has {tokenizer.vocab_size} tokens but "
                              f"{config_path} says vocab_size={model.config.vocab_size}")
    with writing_folder(run_dir, spec, overwrite=overwrite):
        return save_run(run_dir, model, tokenizer,
                        extra={"converted_from": str(src.resolve())})


def export_gpt2_folder(run_dir: str | Path, out: str | Path, *,
                       overwrite: bool = False) -> Path:
    """A handformer run folder → a folder that ``transformers`` loads whole:
    ``GPT2LMHeadModel.from_pretrained``, ``AutoTokenizer.from_pretrained`` and
    ``pipeline("text-generation", model=out)``, whose greedy text is ``handformer
    generate``'s. The tokenizer files are ``handformer.interop.hf_tokenizer``'s. ``out`` is
    claimed as ``HF_FOLDER`` (see the module docstring).
    """
    from handformer.runs import load_run

    out = folder_path(out)
    _distinct(Path(run_dir), out)
    check_destination(out, HF_FOLDER, overwrite=overwrite)
    run = load_run(run_dir, kind="lm")
    model, tokenizer = run.model, run.tokenizer
    hf_config = config_to_gpt2(model.config)
    hf_config.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                     pad_token_id=tokenizer.pad_id)
    state = to_gpt2_state_dict(model)
    del state["lm_head.weight"]  # tied to transformer.wte.weight, stored once
    with writing_folder(out, HF_FOLDER, overwrite=overwrite):
        tmp = out / "model.safetensors.tmp"
        save_file(state, str(tmp), metadata={"format": "pt"})
        tmp.replace(out / "model.safetensors")
        atomic_write_text(out / "config.json", json.dumps(hf_config, indent=2))
        write_folder_tokenizer(out, tokenizer, model.config.max_len)
        remove_if_ours(out, "handformer_tokenizer.json")  # an older export's, never the user's
    return out
