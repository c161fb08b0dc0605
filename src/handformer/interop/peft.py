"""handformer LoRA ↔ PEFT adapter folders (``adapter_config.json`` + ``adapter_model.safetensors``).

A PEFT LoRA adapter names each pair by the Hugging Face module it sits on
(``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``); handformer names it by
its block, stacked layer and target (``blocks.3.self_attn.in_proj.adapters.q.lora_A``). The
two hold the same numbers with two exceptions, both inherited from the base converters:

* **Llama / Qwen3 q and k.** The converter permutes each query/key head's rows from rotate-half
  order to neighbour pairs (``interop.llama``); ``lora_B`` holds output rows, so it is permuted
  the same way. ``lora_A`` acts on the input side and is untouched.
* **GPT-2.** Its ``c_attn`` is one module for q, k and v, so PEFT has one pair for all three:
  handformer's ``qkv`` target. Separate ``q`` / ``k`` / ``v`` pairs have no GPT-2 PEFT twin and
  are refused by name.

The adapter folder is written so that ``PeftModel.from_pretrained(base, folder)`` loads it onto
the base converted by ``handformer convert --to hf`` (or onto BERT for the MiniLM encoder), and
``read_adapter_folder`` reads such a folder (also one PEFT wrote) back onto a handformer model.
``peft`` itself is never imported here.

Shape legend: ``H`` query heads, ``Hkv`` key/value heads, ``D`` head dim, ``r`` rank.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from handformer.atomic import atomic_write_text
from handformer.config import ModelConfig
from handformer.interop.errors import ConversionError
from handformer.interop.families import pick_family
from handformer.interop.llama import _half_to_pairs, _pairs_to_half
from handformer.nn.lora import LoRAConfig, LoRAError, apply_lora, lora_layers

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PEFT_MODULES", "lora_family",
           "peft_target_modules", "read_adapter_folder", "to_peft_state_dict",
           "write_adapter_folder"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# family → handformer target → the Hugging Face module of block {i} it sits on.
PEFT_MODULES: dict[str, dict[str, str]] = {
    "llama": {"q": "model.layers.{i}.self_attn.q_proj", "k": "model.layers.{i}.self_attn.k_proj",
              "v": "model.layers.{i}.self_attn.v_proj", "o": "model.layers.{i}.self_attn.o_proj",
              "gate": "model.layers.{i}.mlp.gate_proj", "up": "model.layers.{i}.mlp.up_proj",
              "down": "model.layers.{i}.mlp.down_proj"},
    "gpt2": {"qkv": "transformer.h.{i}.attn.c_attn", "o": "transformer.h.{i}.attn.c_proj",
             "up": "transformer.h.{i}.mlp.c_fc", "down": "transformer.h.{i}.mlp.c_proj"},
    "bert": {"q": "encoder.layer.{i}.attention.self.query",
             "k": "encoder.layer.{i}.attention.self.key",
             "v": "encoder.layer.{i}.attention.self.value",
             "o": "encoder.layer.{i}.attention.output.dense",
             "up": "encoder.layer.{i}.intermediate.dense",
             "down": "encoder.layer.{i}.output.dense"},
}
PEFT_MODULES["qwen3"] = PEFT_MODULES["llama"]
_TASK_TYPES = {"llama": "CAUSAL_LM", "qwen3": "CAUSAL_LM", "gpt2": "CAUSAL_LM",
               "bert": "FEATURE_EXTRACTION"}
# Our name of an adapter pair: [prefix.]blocks.<i>.<self_attn|ffn>.<layer>.adapters.<target>
_OURS = re.compile(r"^(?P<prefix>.*?)blocks\.(?P<i>\d+)\.(?:self_attn|ffn)\.\w+\.adapters\."
                   r"(?P<target>\w+)\.(?P<which>lora_[AB])$")


def lora_family(model: nn.Module) -> str:
    """The Hugging Face family whose PEFT names this model's adapters take: its decoder's
    twin (``interop.families``), or ``bert`` for an encoder (MiniLM and its kin)."""
    config = getattr(model, "config", None)
    encoder = getattr(model, "encoder", None)
    if encoder is not None and isinstance(getattr(encoder, "config", None), ModelConfig):
        config = encoder.config
    if not isinstance(config, ModelConfig):
        raise ConversionError(f"a {type(model).__name__} has no Hugging Face twin for PEFT")
    if config.norm == "post" and config.embedding_norm:
        return "bert"
    return pick_family(config)


def _module_template(family: str, target: str) -> str:
    modules = PEFT_MODULES[family]
    if target not in modules:
        hint = (" (GPT-2 keeps q, k and v in one c_attn: use the target qkv)"
                if family == "gpt2" and target in ("q", "k", "v") else "")
        raise ConversionError(f"LoRA target {target!r} has no PEFT module in the {family} "
                              f"family (it has {', '.join(modules)}){hint}")
    return modules[target]


def _heads(cfg: ModelConfig, target: str) -> int:
    return cfg.n_heads if target == "q" else cfg.n_kv_heads


def _base_config(model: nn.Module) -> ModelConfig:
    encoder = getattr(model, "encoder", None)
    return encoder.config if encoder is not None else model.config  # type: ignore[return-value]


def to_peft_state_dict(model: nn.Module) -> tuple[dict[str, Tensor], list[str], str]:
    """(PEFT's tensors, the Hugging Face modules they sit on, the family) for a model with
    LoRA adapters."""
    family = lora_family(model)
    cfg = _base_config(model)
    state: dict[str, Tensor] = {}
    targets: list[str] = []
    for name, tensor in model.state_dict().items():
        m = _OURS.match(name)
        if m is None:
            continue
        target = m["target"]
        module = _module_template(family, target).format(i=m["i"])
        if m["which"] == "lora_B" and family in ("llama", "qwen3") and target in ("q", "k"):
            tensor = _pairs_to_half(tensor, _heads(cfg, target), cfg.head_dim)  # (heads·D, r)
        state[f"base_model.model.{module}.{m['which']}.weight"] = tensor.detach().contiguous()
        if _module_template(family, target) not in targets:
            targets.append(_module_template(family, target))
    if not state:
        raise ConversionError("this model has no LoRA adapters to write")
    return {k: v.clone() for k, v in state.items()}, targets, family


def peft_target_modules(templates: list[str]) -> str:
    """PEFT's ``target_modules`` as one regex (PEFT full-matches it against each module's
    name): suffix names such as ``output.dense`` would also catch ``attention.output.dense``."""
    parts = [re.escape(t).replace(re.escape("{i}"), r"\d+") for t in templates]
    return r"(?:.*\.)?(?:" + "|".join(parts) + ")"


def write_adapter_folder(model: nn.Module, out: str | Path, config: LoRAConfig, *,
                         base: str = "", overwrite: bool = False) -> Path:
    """Write ``model``'s adapters as a PEFT LoRA folder in ``out``: a new or empty folder, or
    (``overwrite``) an adapter folder whose two files are replaced; a folder holding any other
    file is refused either way. ``base`` is recorded as ``base_model_name_or_path``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConversionError(f"{out} is a file; give a folder for the adapter")
    if out.is_dir():
        names = sorted(p.name for p in out.iterdir())
        foreign = [n for n in names if n not in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)]
        if foreign or (names and not overwrite):
            raise ConversionError(f"{out} is not empty ({names[:5]}); give a new or empty "
                                  "folder" + ("" if foreign else ", or --overwrite to replace "
                                              "the adapter there"))
    state, templates, family = to_peft_state_dict(model)
    peft_config: dict[str, Any] = {
        "peft_type": "LORA", "task_type": _TASK_TYPES[family], "r": config.r,
        "lora_alpha": config.r if config.alpha is None else config.alpha,
        "lora_dropout": config.dropout, "target_modules": peft_target_modules(templates),
        "fan_in_fan_out": family == "gpt2", "bias": "none", "use_rslora": False,
        "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "base_model_name_or_path": base or None,
    }
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (ADAPTER_WEIGHTS + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / ADAPTER_WEIGHTS)
    atomic_write_text(out / ADAPTER_CONFIG, json.dumps(peft_config, indent=2))
    return out


def _inverse(family: str) -> list[tuple[re.Pattern[str], str]]:
    return [(re.compile(r"(?:.*\.)?" + re.escape(t).replace(re.escape("{i}"), r"(\d+)") + r"$"),
             target) for target, t in PEFT_MODULES[family].items()]


def read_adapter_folder(model: nn.Module, folder: str | Path) -> LoRAConfig:
    """Put the adapters of a PEFT LoRA folder onto ``model`` (a handformer model without LoRA,
    converted from the folder's base): LoRA is applied with the folder's rank, alpha, dropout
    and modules, then its tensors are loaded. Returns the ``LoRAConfig``."""
    folder = Path(folder)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (folder / name).is_file():
            raise ConversionError(f"{folder} has no {name}; expected a PEFT LoRA adapter folder")
    try:
        peft_config = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConversionError(f"{folder / ADAPTER_CONFIG}: not JSON ({err})") from None
    if peft_config.get("peft_type") != "LORA":
        raise ConversionError(f"{folder / ADAPTER_CONFIG}: peft_type="
                              f"{peft_config.get('peft_type')!r}; only LORA adapters are read")
    for flag in ("use_rslora", "use_dora"):
        if peft_config.get(flag):
            raise ConversionError(f"{folder / ADAPTER_CONFIG}: {flag}=true is not implemented")
    if peft_config.get("bias", "none") != "none":
        raise ConversionError(f"{folder / ADAPTER_CONFIG}: bias={peft_config['bias']!r}; only "
                              "'none' (no trained biases) is read")
    family = lora_family(model)
    cfg = _base_config(model)
    patterns = _inverse(family)
    tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    ours: dict[str, Tensor] = {}
    targets: list[str] = []
    prefix = next((n.split("blocks.")[0] for n, _ in model.named_modules()
                   if n.endswith("blocks.0")), "")
    for key, tensor in tensors.items():
        m = re.match(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<which>lora_[AB])"
                     r"(?:\.\w+)?\.weight$", key)
        hit = None if m is None else next(
            ((p.match(m["module"]), target) for p, target in patterns if p.match(m["module"])),
            None)
        if m is None or hit is None:
            raise ConversionError(f"{folder / ADAPTER_WEIGHTS}: {key} is not a LoRA tensor of a "
                                  f"{family} module handformer adapts")
        match, target = hit
        i = int(match.group(1))  # type: ignore[union-attr]
        if target in ("q", "k") and m["which"] == "lora_B" and family in ("llama", "qwen3"):
            tensor = _half_to_pairs(tensor, _heads(cfg, target), cfg.head_dim)
        layer = {"q": "self_attn.in_proj", "k": "self_attn.in_proj", "v": "self_attn.in_proj",
                 "qkv": "self_attn.in_proj", "o": "self_attn.out_proj", "gate": "ffn.fc_in",
                 "up": "ffn.fc_in", "down": "ffn.fc_out"}[target]
        ours[f"{prefix}blocks.{i}.{layer}.adapters.{target}.{m['which']}"] = tensor
        if target not in targets:
            targets.append(target)
    alpha = peft_config.get("lora_alpha", 8)
    lora = LoRAConfig(r=int(peft_config["r"]), alpha=float(alpha),
                      dropout=float(peft_config.get("lora_dropout", 0.0)),
                      targets=tuple(t for t in ("q", "k", "v", "qkv", "o", "gate", "up", "down")
                                    if t in targets))
    try:
        apply_lora(model, lora)
    except LoRAError as err:
        raise ConversionError(f"{folder}: {err}") from None
    expected = {n for n in model.state_dict() if ".adapters." in n}
    if set(ours) != expected:
        missing = sorted(expected - set(ours))[:4]
        raise ConversionError(f"{folder / ADAPTER_WEIGHTS} does not cover every adapted layer "
                              f"of the model (missing {missing}); it belongs to another base")
    for name, layer in lora_layers(model):
        for target, adapter in layer.adapters.items():
            for which in ("lora_A", "lora_B"):
                tensor = ours[f"{name}.adapters.{target}.{which}"]
                param = getattr(adapter, which)
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ConversionError(f"{folder / ADAPTER_WEIGHTS}: {name} {target} "
                                          f"{which} is {tuple(tensor.shape)}, the model needs "
                                          f"{tuple(param.shape)}")
                with torch.no_grad():
                    param.copy_(tensor)
    return lora
