"""Hugging Face Llama and Qwen3 ↔ handformer ``DecoderLM``, both directions, no download.

A Llama-family checkpoint (Llama 2/3.x, SmolLM2, TinyLlama, Mistral without a sliding window)
is a ``DecoderLM`` with ``positional="rope", norm_type="rmsnorm", activation="swiglu",
bias=False``; Qwen3 adds ``qk_norm=True`` (RMSNorm over each head's queries and keys, before
RoPE). What the mapping has to get right:

* **RoPE pairing.** transformers rotates channel i of a head with channel i + D/2 ("rotate
  half"); handformer's ``RotaryEmbedding`` rotates neighbours (2i, 2i+1). Both give pair i
  the frequency θ_i, so permuting each query/key head's rows — Hugging Face row i goes to
  our row 2i, row i + D/2 to 2i + 1 — makes the two the same function (q·k is unchanged when
  q and k are permuted alike; values are not touched). QK-norm's per-feature gains move with
  their rows.
* **Projections.** ``q_proj``, ``k_proj``, ``v_proj`` stack into ``in_proj`` (H·D + 2·Hkv·D
  rows), ``gate_proj`` and ``up_proj`` into SwiGLU's ``fc_in`` (gate first).
* **Config.** ``head_dim`` when published apart from hidden / heads; ``rope_theta`` and
  ``rope_scaling`` (or transformers 5's ``rope_parameters``), of which ``linear`` and
  ``llama3`` are implemented and anything else is refused by name; ``rms_norm_eps``;
  ``tie_word_embeddings``.

Shape legend: ``H`` query heads, ``Hkv`` key/value heads, ``D`` head dim, ``C`` model dim,
``F`` FFN hidden width.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from handformer.config import ModelConfig
from handformer.interop.errors import ConversionError
from handformer.interop.families import mismatches

__all__ = ["LLAMA_MODEL_TYPES", "config_from_llama", "config_to_llama",
           "from_llama_state_dict", "llama_key_map", "to_llama_state_dict"]

# model_type → the family handformer reads it as (Mistral is Llama without a sliding window).
LLAMA_MODEL_TYPES: dict[str, str] = {"llama": "llama", "mistral": "llama", "qwen3": "qwen3"}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(θ, scaling dict or None) from a published config (``rope_theta`` + ``rope_scaling``)
    or a transformers-5 one (``rope_parameters``)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default"))
        return float(theta), None if kind == "default" else {**params, "rope_type": kind}
    scaling = hf.get("rope_scaling")
    theta = float(hf.get("rope_theta", 10000.0))
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return theta, None if kind == "default" else {**scaling, "rope_type": kind}


def config_from_llama(hf: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
    """A Llama / Mistral / Qwen3 ``config.json`` (as a dict) → ``ModelConfig``; every field
    that handformer does not implement is named in one ``ConversionError``."""
    model_type = hf.get("model_type")
    family = LLAMA_MODEL_TYPES.get(str(model_type))
    if family is None:
        raise ConversionError(f"{source}: model_type={model_type!r} is not a Llama-family "
                              f"model ({sorted(LLAMA_MODEL_TYPES)})")
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (only 'silu': SwiGLU)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            problems.append(f"{flag}=True (handformer's Llama family has no biases)")
    if hf.get("use_sliding_window") or (model_type == "mistral" and hf.get("sliding_window")):
        problems.append(f"sliding_window={hf.get('sliding_window')!r} (sliding-window "
                        "attention is not implemented)")
    if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append(f"partial_rotary_factor={hf['partial_rotary_factor']} (RoPE on the "
                        "whole head only)")
    theta, scaling = _rope(hf)
    rope: dict[str, Any] = {}
    if scaling is not None:
        kind = scaling["rope_type"]
        if kind == "linear":
            rope = dict(rope_scaling="linear", rope_factor=float(scaling["factor"]))
        elif kind == "llama3":
            rope = dict(rope_scaling="llama3", rope_factor=float(scaling["factor"]),
                        rope_low_freq_factor=float(scaling["low_freq_factor"]),
                        rope_high_freq_factor=float(scaling["high_freq_factor"]),
                        rope_original_max_len=int(scaling["original_max_position_embeddings"]))
        else:
            problems.append(f"rope_scaling type {kind!r} (implemented: 'linear', 'llama3')")
    if problems:
        raise ConversionError(f"{source}: this {model_type} config does not map onto "
                              "DecoderLM: " + "; ".join(problems))
    try:
        n_heads = int(hf["num_attention_heads"])
        cfg = ModelConfig(
            vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            n_layers=hf["num_hidden_layers"], d_ff=hf["intermediate_size"],
            max_len=hf.get("max_position_embeddings", 2048), dropout=0.0, positional="rope",
            norm="pre", norm_type="rmsnorm", activation="swiglu", attention="sdpa",
            bias=False, tie_weights=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=family == "qwen3", rope_base=theta,
            layer_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), **rope,
        )
    except KeyError as err:
        raise ConversionError(f"{source}: the {model_type} config lacks {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise ConversionError(f"{source}: {err}") from None
    return cfg


def config_to_llama(cfg: ModelConfig, family: str) -> dict[str, Any]:
    """``ModelConfig`` → a ``config.json`` dict for ``family`` ("llama" or "qwen3"), in the
    published form (``rope_theta`` and ``rope_scaling``: what transformers, vLLM and
    llama.cpp's converter read)."""
    problems = mismatches(cfg, family)
    if problems:
        raise ConversionError(f"this model has no {family} equivalent: " + "; ".join(problems))
    scaling: dict[str, Any] | None = None
    if cfg.rope_scaling == "linear":
        scaling = {"rope_type": "linear", "factor": cfg.rope_factor}
    elif cfg.rope_scaling == "llama3":
        spec = cfg.rope_scaling_spec
        assert spec is not None
        scaling = {"rope_type": "llama3", "factor": spec.factor,
                   "low_freq_factor": spec.low_freq_factor,
                   "high_freq_factor": spec.high_freq_factor,
                   "original_max_position_embeddings": spec.original_max_len}
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[family]], "model_type": family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.max_len,
        "rms_norm_eps": cfg.layer_norm_eps, "rope_theta": cfg.rope_base, "rope_scaling": scaling,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_weights, "torch_dtype": "float32", "use_cache": True,
    }
    if family == "qwen3":
        out.update(use_sliding_window=False, sliding_window=None)
    return out


def _half_to_pairs(w: Tensor, heads: int, head_dim: int) -> Tensor:
    """Rows of ``heads`` heads in rotate-half order → neighbour pairs (see module docstring).
    (heads·D, …) → (heads·D, …)."""
    rest = w.shape[1:]
    w = w.reshape(heads, 2, head_dim // 2, *rest)  # [h, half a, i] = HF row h·D + a·D/2 + i
    return w.transpose(1, 2).reshape(heads * head_dim, *rest)  # our row h·D + 2i + a


def _pairs_to_half(w: Tensor, heads: int, head_dim: int) -> Tensor:
    """The inverse of ``_half_to_pairs``."""
    rest = w.shape[1:]
    w = w.reshape(heads, head_dim // 2, 2, *rest)  # [h, i, a] = our row h·D + 2i + a
    return w.transpose(1, 2).reshape(heads * head_dim, *rest)


def llama_key_map(cfg: ModelConfig) -> list[str]:
    """Every tensor name a checkpoint of this config holds, in Hugging Face's naming (the
    head's ``lm_head.weight`` only when untied)."""
    keys = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        keys += [p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                 "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                 "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                 "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                 "mlp.down_proj.weight")]
        if cfg.qk_norm:
            keys += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    if not cfg.tie_weights:
        keys.append("lm_head.weight")
    return keys


def from_llama_state_dict(hf: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Hugging Face tensors (names as ``llama_key_map``) → a ``DecoderLM`` state dict."""
    h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    ours = {"embed.token.weight": hf["model.embed_tokens.weight"],
            "final_norm.weight": hf["model.norm.weight"]}
    for i in range(cfg.n_layers):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        q = _half_to_pairs(hf[p + "self_attn.q_proj.weight"], h, d)  # (H·D, C)
        k = _half_to_pairs(hf[p + "self_attn.k_proj.weight"], hkv, d)  # (Hkv·D, C)
        ours[b + "self_attn.in_proj.weight"] = torch.cat([q, k, hf[p + "self_attn.v_proj.weight"]])
        ours[b + "self_attn.out_proj.weight"] = hf[p + "self_attn.o_proj.weight"]  # (C, H·D)
        if cfg.qk_norm:
            for name in ("q_norm", "k_norm"):
                ours[b + f"self_attn.{name}.weight"] = _half_to_pairs(
                    hf[p + f"self_attn.{name}.weight"], 1, d)  # (D,)
        ours[b + "ffn.fc_in.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"],
                                                  hf[p + "mlp.up_proj.weight"]])  # (2F, C)
        ours[b + "ffn.fc_out.weight"] = hf[p + "mlp.down_proj.weight"]  # (C, F)
        ours[b + "norm1.weight"] = hf[p + "input_layernorm.weight"]
        ours[b + "norm2.weight"] = hf[p + "post_attention_layernorm.weight"]
    ours["lm_head.weight"] = (ours["embed.token.weight"] if cfg.tie_weights
                              else hf["lm_head.weight"])
    return ours


def to_llama_state_dict(ours: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """A ``DecoderLM`` state dict → Hugging Face tensors (``lm_head.weight`` only when
    untied), each contiguous and its own storage (safetensors refuses shared ones)."""
    h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    hf = {"model.embed_tokens.weight": ours["embed.token.weight"],
          "model.norm.weight": ours["final_norm.weight"]}
    for i in range(cfg.n_layers):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        q, k, v = ours[b + "self_attn.in_proj.weight"].split([h * d, hkv * d, hkv * d])
        hf[p + "self_attn.q_proj.weight"] = _pairs_to_half(q, h, d)
        hf[p + "self_attn.k_proj.weight"] = _pairs_to_half(k, hkv, d)
        hf[p + "self_attn.v_proj.weight"] = v
        hf[p + "self_attn.o_proj.weight"] = ours[b + "self_attn.out_proj.weight"]
        if cfg.qk_norm:
            for name in ("q_norm", "k_norm"):
                hf[p + f"self_attn.{name}.weight"] = _pairs_to_half(
                    ours[b + f"self_attn.{name}.weight"], 1, d)
        gate, up = ours[b + "ffn.fc_in.weight"].chunk(2)  # (F, C) each
        hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"] = gate, up
        hf[p + "mlp.down_proj.weight"] = ours[b + "ffn.fc_out.weight"]
        hf[p + "input_layernorm.weight"] = ours[b + "norm1.weight"]
        hf[p + "post_attention_layernorm.weight"] = ours[b + "norm2.weight"]
    if not cfg.tie_weights:
        hf["lm_head.weight"] = ours["lm_head.weight"]
    return {k: v.detach().contiguous().clone() for k, v in hf.items()}
