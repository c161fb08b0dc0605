"""Whole Hugging Face model folders ↔ handformer run folders: GPT-2, Llama and Qwen3.

A Hugging Face folder holds ``config.json``, the weights (``model.safetensors``, shards
listed by ``model.safetensors.index.json``, or the older ``pytorch_model.bin``) and usually
``tokenizer.json``. Reading never unpickles arbitrary objects: safetensors, or
``torch.load(weights_only=True)`` for ``.bin`` files. bf16 checkpoints are widened to fp32.

``import_hf_folder`` reads the family from ``model_type`` (``gpt2``; ``llama`` and
``mistral`` without a sliding window; ``qwen3``; ``bert``, written as an encoder run),
checks the model against the memory budget before a byte of weights is read, checks every
tensor's name, shape and dtype, and writes a run folder with the folder's own tokenizer and
its special ids. ``export_hf_folder`` picks
the family a run's config is an exact twin in (``interop.families``) and writes a folder
``transformers`` loads with its own class — the folder vLLM serves and llama.cpp's
converter reads.

Both directions write their destination through ``handformer.runs.writing_folder``: a new or
empty folder, or one the same direction wrote before; anything else is refused unless
``overwrite`` (and even then only handformer's own files are removed). The source folder is
never the destination.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from handformer.atomic import atomic_write_text
from handformer.config import ModelConfig
from handformer.interop.errors import ConversionError, check_float_tensors
from handformer.interop.families import pick_family
from handformer.interop.files import read_config, read_folder_weights
from handformer.interop.gpt2 import config_to_gpt2, from_gpt2_state_dict, to_gpt2_state_dict
from handformer.interop.hf_tokenizer import (
    TOKENIZER_FILES,
    read_folder_tokenizer,
    write_folder_tokenizer,
)
from handformer.interop.llama import (
    LLAMA_MODEL_TYPES,
    config_from_llama,
    config_to_llama,
    from_llama_state_dict,
    llama_key_map,
    to_llama_state_dict,
)
from handformer.models.budget import check_model_fits
from handformer.models.decoder_lm import DecoderLM
from handformer.nn.init import skip_init
from handformer.nn.lora import merge_lora
from handformer.runs import LM_FOLDER, FolderSpec, check_destination, folder_path, writing_folder
from handformer.runs.guard import ENCODER_FOLDER, remove_if_ours
from handformer.tokenizers import HFTokenizer, Tokenizer

__all__ = ["HF_FOLDER", "SUPPORTED_MODEL_TYPES", "export_hf_folder", "import_hf_folder"]


# What ``export_hf_folder`` writes (the ``.tmp`` is a crash's leftover at most;
# ``handformer_tokenizer.json`` is what folders converted before the Hugging Face tokenizer
# files carried).
HF_FOLDER = FolderSpec("hf", "a Hugging Face model folder", "handformer convert --to hf",
                       ("model.safetensors", "model.safetensors.tmp", "config.json",
                        *TOKENIZER_FILES, "handformer_tokenizer.json"))
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("gpt2", *LLAMA_MODEL_TYPES, "bert")


def _distinct(src: Path, dst: Path) -> None:
    """Refuse to write a conversion over the folder it reads."""
    if dst.exists() and src.exists() and dst.resolve() == src.resolve():
        raise ConversionError(f"the destination {dst} is the source folder; give a new "
                              "folder to write the converted model to")


def _special_ids(src: Path, hf_config: dict[str, Any], tokenizer: Tokenizer) -> dict[str, int]:
    """The bos / eos / pad ids the folder states (``generation_config.json`` first, then
    ``config.json``; a list of eos ids gives its first), each checked against the tokenizer."""
    stated: dict[str, Any] = {}
    generation = src / "generation_config.json"
    sources = [hf_config] + ([read_config(generation, "the generation config")]
                             if generation.is_file() else [])
    for data in sources:  # the later source wins
        for role in ("bos", "eos", "pad"):
            value = data.get(f"{role}_token_id")
            if isinstance(value, list):
                value = value[0] if value else None
            if value is not None:
                stated[role] = value
    ids: dict[str, int] = {}
    for role, value in stated.items():
        if not isinstance(value, int) or not 0 <= value < tokenizer.vocab_size:
            raise ConversionError(f"{src}: {role}_token_id={value!r} is not an id of its "
                                  f"tokenizer.json (0..{tokenizer.vocab_size - 1})")
        ids[role] = value
    return ids


def _llama_model(src: Path, hf_config: dict[str, Any]) -> DecoderLM:
    cfg = config_from_llama(hf_config, source=str(src / "config.json"))
    check_model_fits(cfg, "DecoderLM")  # before a byte of weights is read
    state = read_folder_weights(src)
    expected = llama_key_map(cfg)
    missing = [k for k in expected if k not in state]
    if cfg.tie_weights and "lm_head.weight" in state:  # some tied exports store it anyway
        if not torch.equal(state["lm_head.weight"], state.get("model.embed_tokens.weight",
                                                              state["lm_head.weight"])):
            raise ConversionError(f"{src}: tie_word_embeddings=true but lm_head.weight differs "
                                  "from model.embed_tokens.weight")
        del state["lm_head.weight"]
    unexpected = sorted(k for k in state if k not in set(expected)
                        and not k.endswith("rotary_emb.inv_freq"))
    if missing or unexpected:
        raise ConversionError(f"{src}: the weights do not match config.json: missing "
                              f"{missing[:6]}{'…' if len(missing) > 6 else ''}, unexpected "
                              f"{unexpected[:6]}{'…' if len(unexpected) > 6 else ''}")
    check_float_tensors(state, expected, str(src))
    ours = from_llama_state_dict(state, cfg)
    with skip_init():  # every weight is loaded below, strictly
        model = DecoderLM(cfg)
    wanted = model.state_dict()
    for key, tensor in ours.items():
        if tuple(tensor.shape) != tuple(wanted[key].shape):
            raise ConversionError(f"{src}: a tensor for {key} has shape {tuple(tensor.shape)}; "
                                  f"config.json makes it {tuple(wanted[key].shape)}")
    model.load_state_dict(ours, strict=True)
    return model.eval()


def _gpt2_model(src: Path, hf_config: dict[str, Any]) -> DecoderLM:
    state = read_folder_weights(src)
    if not any(k.startswith("transformer.") for k in state):  # a bare GPT2Model checkpoint
        state = {f"transformer.{k}": v for k, v in state.items()}
    return from_gpt2_state_dict(state, hf_config, source=str(src))


def import_hf_folder(src: str | Path, run_dir: str | Path, *,
                     overwrite: bool = False) -> Path:
    """A ``transformers`` GPT-2, Llama(-family) or Qwen3 folder → a handformer run folder
    (weights, config, tokenizer and its special ids). ``run_dir`` is claimed as a
    language-model run (see the module docstring)."""
    from handformer.runs import save_run

    src, run_dir = Path(src), folder_path(run_dir)
    spec = dataclasses.replace(LM_FOLDER, command="handformer convert --from hf")
    _distinct(src, run_dir)
    config_path = src / "config.json"
    if config_path.is_file() and read_config(config_path).get("model_type") == "bert":
        return _import_bert(src, run_dir, overwrite=overwrite)  # an encoder (MiniLM)
    check_destination(run_dir, spec, overwrite=overwrite)
    if not config_path.is_file():
        raise ConversionError(f"{src} has no config.json; expected a Hugging Face model folder")
    hf_config = read_config(config_path)
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(f"{config_path}: model_type={model_type!r} is not supported; "
                              "handformer reads the gpt2, llama (also mistral without a "
                              "sliding window) and qwen3 families")
    tokenizer = read_folder_tokenizer(src)
    special = _special_ids(src, hf_config, tokenizer) if isinstance(tokenizer, HFTokenizer) else {}
    if special:
        tokenizer = type(tokenizer)(tokenizer.backend, special_ids=special)  # type: ignore[union-attr]
    vocab = hf_config.get("vocab_size")
    if isinstance(vocab, int) and tokenizer.vocab_size > vocab:  # before reading weights
        raise ConversionError(f"{src / 'tokenizer.json'} has {tokenizer.vocab_size} tokens but "
                              f"{config_path} says vocab_size={vocab}: the tokenizer belongs to "
                              "another model")
    model = (_gpt2_model(src, hf_config) if model_type == "gpt2"
             else _llama_model(src, hf_config))
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ConversionError(f"{src / 'tokenizer.json'} has {tokenizer.vocab_size} tokens but "
                              f"{config_path} says vocab_size={model.config.vocab_size}")
    extra: dict[str, Any] = {"converted_from": str(src.resolve()), "hf_model_type": model_type}
    chat_template = _chat_template(src)
    if chat_template is not None:
        extra["chat_template"] = chat_template
    with writing_folder(run_dir, spec, overwrite=overwrite):
        return save_run(run_dir, model, tokenizer, extra=extra)


def _import_bert(src: Path, run_dir: Path, *, overwrite: bool) -> Path:
    """A BERT folder → an encoder run folder (weights, config, its WordPiece tokenizer)."""
    from handformer.interop.bert import load_bert_folder
    from handformer.runs import save_run

    spec = ENCODER_FOLDER
    check_destination(run_dir, spec, overwrite=overwrite)
    model, tokenizer = load_bert_folder(src)
    extra = {"converted_from": str(src.resolve()), "hf_model_type": "bert"}
    with writing_folder(run_dir, spec, overwrite=overwrite):
        return save_run(run_dir, model, tokenizer, extra=extra)


def _chat_template(src: Path) -> str | None:
    """The folder's chat template (``tokenizer_config.json``), kept for chat serving."""
    path = src / "tokenizer_config.json"
    if not path.is_file():
        return None
    template = read_config(path, "the tokenizer config").get("chat_template")
    return template if isinstance(template, str) else None


def _hf_config_and_state(model: DecoderLM, family: str) -> tuple[dict[str, Any],
                                                                  dict[str, torch.Tensor]]:
    cfg: ModelConfig = model.config
    if family == "gpt2":
        state = to_gpt2_state_dict(model)
        del state["lm_head.weight"]  # tied to transformer.wte.weight, stored once
        return config_to_gpt2(cfg), state
    return config_to_llama(cfg, family), to_llama_state_dict(model.state_dict(), cfg)


def export_hf_folder(run_dir: str | Path, out: str | Path, *,
                     overwrite: bool = False) -> tuple[Path, str]:
    """A handformer run folder → a folder that ``transformers`` loads whole with its own
    class (``GPT2LMHeadModel``, ``LlamaForCausalLM`` or ``Qwen3ForCausalLM``, whichever the
    run's config is a twin of; no ``trust_remote_code``), ``AutoTokenizer`` and
    ``pipeline("text-generation", model=out)``, whose greedy text is ``handformer
    generate``'s. Returns ``(out, family)``. ``out`` is claimed as ``HF_FOLDER`` (see the
    module docstring).
    """
    from handformer.runs import load_run

    out = folder_path(out)
    _distinct(Path(run_dir), out)
    check_destination(out, HF_FOLDER, overwrite=overwrite)
    run = load_run(run_dir, kind="lm")
    model, tokenizer = run.model, run.tokenizer
    if "quantization" in run.config:
        raise ConversionError(f"{run_dir} holds int8 weights (written by convert --quantize); "
                              "Hugging Face folders are written from the fp32 run it was "
                              f"quantized from ({run.config.get('quantized_from', 'its source')})")
    if "lora" in run.config:  # a LoRA run leaves as the merged model (W + scale·B·A)
        model = merge_lora(model)  # type: ignore[assignment]
    family = pick_family(model.config)
    hf_config, state = _hf_config_and_state(model, family)
    has_pad = not isinstance(tokenizer, HFTokenizer) or tokenizer.pad_token_id is not None
    hf_config.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                     pad_token_id=tokenizer.pad_id if has_pad else None)  # none: not id 0
    with writing_folder(out, HF_FOLDER, overwrite=overwrite):
        tmp = out / "model.safetensors.tmp"
        save_file(state, str(tmp), metadata={"format": "pt"})
        tmp.replace(out / "model.safetensors")
        atomic_write_text(out / "config.json", json.dumps(hf_config, indent=2))
        write_folder_tokenizer(out, tokenizer, model.config.max_len,
                               chat_template=run.config.get("chat_template"))
        remove_if_ours(out, "handformer_tokenizer.json")  # an older export's, never the user's
    return out, family
