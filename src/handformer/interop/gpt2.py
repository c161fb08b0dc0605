"""Hugging Face GPT-2 ↔ handformer ``DecoderLM``, both directions, no download.

GPT-2 is a pre-norm decoder with learned positions, biases everywhere, GELU (tanh
approximation) and a head tied to the token embedding — exactly a ``DecoderLM`` with
``positional="learned", norm="pre", activation="gelu_tanh", tie_weights=True``. The one
layout difference: GPT-2 stores its projections as ``Conv1D`` weights of shape (in, out),
the transpose of ``nn.Linear``'s (out, in).

The mapping reads and writes plain state dicts and ``config.json`` dicts, so
``transformers`` itself is only needed to *run* the Hugging Face side.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from handformer.config import ModelConfig
from handformer.interop.errors import ConversionError, check_float_tensors
from handformer.interop.families import mismatches
from handformer.models.decoder_lm import DecoderLM
from handformer.nn.init import skip_init

__all__ = ["ConversionError", "check_float_tensors", "config_from_gpt2", "config_to_gpt2",
           "from_gpt2_state_dict", "to_gpt2_state_dict"]

_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                "relu": "relu"}


def config_from_gpt2(hf: dict[str, Any]) -> ModelConfig:
    """Hugging Face GPT-2 ``config.json`` (as a dict) → ``ModelConfig``."""
    act = hf.get("activation_function", "gelu_new")
    problems = []
    if act not in _ACTIVATIONS:
        problems.append(f"activation_function={act!r} (supported: {sorted(_ACTIVATIONS)})")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
                 "add_cross_attention"):
        if hf.get(flag):
            problems.append(f"{flag}=True")
    if not hf.get("scale_attn_weights", True):
        problems.append("scale_attn_weights=False")
    if abs(hf.get("layer_norm_epsilon", 1e-5) - 1e-5) > 1e-12:
        problems.append(f"layer_norm_epsilon={hf['layer_norm_epsilon']} (handformer uses 1e-5)")
    if not hf.get("tie_word_embeddings", True):
        problems.append("tie_word_embeddings=False")
    if problems:
        raise ConversionError("GPT-2 config does not map onto DecoderLM: " + "; ".join(problems))
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"], d_model=hf["n_embd"], n_heads=hf["n_head"],
            n_layers=hf["n_layer"], d_ff=hf.get("n_inner") or 4 * hf["n_embd"],
            max_len=hf["n_positions"], dropout=0.0, positional="learned", norm="pre",
            attention="sdpa", activation=_ACTIVATIONS[act], tie_weights=True, bias=True,
        )
    except KeyError as err:
        raise ConversionError(f"GPT-2 config lacks {err.args[0]!r}") from None


def config_to_gpt2(cfg: ModelConfig) -> dict[str, Any]:
    """``ModelConfig`` → a GPT-2 ``config.json`` dict (only for configs GPT-2 can express)."""
    problems = mismatches(cfg, "gpt2")
    inverse = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
    if problems:
        raise ConversionError("this model has no GPT-2 equivalent: " + "; ".join(problems))
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_embd": cfg.d_model, "n_head": cfg.n_heads,
        "n_layer": cfg.n_layers, "n_inner": cfg.d_ff, "n_positions": cfg.max_len,
        "activation_function": inverse[cfg.activation], "layer_norm_epsilon": 1e-5,
        "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
        "tie_word_embeddings": True, "scale_attn_weights": True,
        "bos_token_id": None, "eos_token_id": None,
    }


def _layer_map(i: int) -> list[tuple[str, str, bool]]:
    """(GPT-2 key, handformer key, transpose?) for layer ``i``."""
    h, b = f"transformer.h.{i}.", f"blocks.{i}."
    return [
        (h + "ln_1.weight", b + "norm1.weight", False), (h + "ln_1.bias", b + "norm1.bias", False),
        (h + "attn.c_attn.weight", b + "self_attn.in_proj.weight", True),
        (h + "attn.c_attn.bias", b + "self_attn.in_proj.bias", False),
        (h + "attn.c_proj.weight", b + "self_attn.out_proj.weight", True),
        (h + "attn.c_proj.bias", b + "self_attn.out_proj.bias", False),
        (h + "ln_2.weight", b + "norm2.weight", False), (h + "ln_2.bias", b + "norm2.bias", False),
        (h + "mlp.c_fc.weight", b + "ffn.fc_in.weight", True),
        (h + "mlp.c_fc.bias", b + "ffn.fc_in.bias", False),
        (h + "mlp.c_proj.weight", b + "ffn.fc_out.weight", True),
        (h + "mlp.c_proj.bias", b + "ffn.fc_out.bias", False),
    ]


def _key_map(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    pairs = [("transformer.wte.weight", "embed.token.weight", False),
             ("transformer.wpe.weight", "embed.positions.table.weight", False),
             ("transformer.ln_f.weight", "final_norm.weight", False),
             ("transformer.ln_f.bias", "final_norm.bias", False)]
    for i in range(cfg.n_layers):
        pairs += _layer_map(i)
    return pairs


def from_gpt2_state_dict(state: dict[str, Tensor], hf_config: dict[str, Any], *,
                         source: str = "GPT-2 state dict") -> DecoderLM:
    """Build a ``DecoderLM`` holding a GPT-2 checkpoint's weights (``source`` names the file
    in errors)."""
    cfg = config_from_gpt2(hf_config)
    with skip_init():  # every weight is loaded below, strictly
        model = DecoderLM(cfg)
    ours = model.state_dict()
    pairs = _key_map(cfg)
    missing = [k for k, _, _ in pairs if k not in state]
    known = {k for k, _, _ in pairs} | {"lm_head.weight"}
    unexpected = sorted(k for k in state if k not in known and not k.endswith(".attn.bias")
                        and not k.endswith(".attn.masked_bias"))
    if missing or unexpected:
        raise ConversionError(f"GPT-2 state dict does not match its config: missing "
                              f"{missing[:8]}{'…' if len(missing) > 8 else ''}, "
                              f"unexpected {unexpected[:8]}")
    check_float_tensors(state, [k for k, _, _ in pairs], source)
    new_state = {}
    for hf_key, our_key, transpose in pairs:
        tensor = state[hf_key].t() if transpose else state[hf_key]
        if tensor.shape != ours[our_key].shape:
            raise ConversionError(f"{hf_key}: shape {tuple(state[hf_key].shape)} does not fit "
                                  f"{our_key} {tuple(ours[our_key].shape)}")
        new_state[our_key] = tensor
    new_state["lm_head.weight"] = new_state["embed.token.weight"]  # tied
    model.load_state_dict(new_state, strict=True)
    return model.eval()


def to_gpt2_state_dict(model: DecoderLM) -> dict[str, Tensor]:
    """A ``DecoderLM``'s weights under GPT-2's names and layouts (ready for
    ``GPT2LMHeadModel.load_state_dict``)."""
    config_to_gpt2(model.config)  # raises if the architecture has no GPT-2 twin
    ours = dict(model.state_dict())
    if not model.config.bias:  # GPT-2 has biases everywhere: zeros are the same function
        biased = ("norm1.weight", "norm2.weight", "final_norm.weight", "in_proj.weight",
                  "out_proj.weight", "fc_in.weight", "fc_out.weight")
        for name, weight in list(ours.items()):
            if name.endswith(biased):
                ours[name.removesuffix("weight") + "bias"] = weight.new_zeros(weight.shape[0])
    state = {hf_key: (ours[our_key].t() if transpose else ours[our_key]).contiguous().clone()
             for hf_key, our_key, transpose in _key_map(model.config)}
    state["lm_head.weight"] = state["transformer.wte.weight"]
    return state
