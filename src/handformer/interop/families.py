"""Which Hugging Face family a ``ModelConfig`` is, field by field.

A handformer language model leaves as one of three ``transformers`` classes, each an exact
twin of some ``ModelConfig`` settings:

* ``gpt2`` (``GPT2LMHeadModel``): learned positions, LayerNorm (ε 1e-5), a GELU or ReLU MLP,
  tied head, plain multi-head attention; a model without biases leaves with zero biases;
* ``llama`` (``LlamaForCausalLM``): RoPE (optionally scaled), RMSNorm, SwiGLU, no biases,
  grouped-query attention allowed, tied or untied head;
* ``qwen3`` (``Qwen3ForCausalLM``): Llama plus per-head RMSNorm on queries and keys before
  RoPE (``qk_norm``).

``mismatches(cfg, family)`` lists every field that keeps ``cfg`` from its twin in that family;
``pick_family`` returns the one with none, or refuses naming the closest family and each field
that does not map. Fields that only change training (dropout, init, the attention kernel)
never keep a model from leaving.
"""

from __future__ import annotations

from collections.abc import Callable

from handformer.config import ModelConfig
from handformer.interop.errors import ConversionError

__all__ = ["FAMILIES", "FAMILY_ARCHITECTURE", "mismatches", "pick_family"]

FAMILIES: tuple[str, ...] = ("gpt2", "llama", "qwen3")

# The ``ModelConfig`` fields that make a model of any size an exact twin in each family
# (``handformer train --family``); sizes, window and training levers stay the recipe's.
_ROPE_TWIN: dict[str, object] = dict(positional="rope", norm="pre", norm_type="rmsnorm",
                                     activation="swiglu", bias=False, embedding_norm=False,
                                     logit_softcap=0.0)
FAMILY_ARCHITECTURE: dict[str, dict[str, object]] = {
    "gpt2": dict(positional="learned", norm="pre", norm_type="layernorm",
                 activation="gelu_tanh", bias=True, tie_weights=True, qk_norm=False,
                 embedding_norm=False, logit_softcap=0.0, layer_norm_eps=1e-5),
    "llama": {**_ROPE_TWIN, "qk_norm": False},
    "qwen3": {**_ROPE_TWIN, "qk_norm": True, "rope_scaling": "none"},
}

Check = tuple[str, Callable[[ModelConfig], bool], str]  # (field, holds?, what the family needs)

_COMMON: list[Check] = [
    ("norm", lambda c: c.norm == "pre", "'pre'"),
    ("embedding_norm", lambda c: not c.embedding_norm, "False"),
    ("type_vocab_size", lambda c: c.type_vocab_size == 0, "0 (no segment embeddings)"),
    ("logit_softcap", lambda c: c.logit_softcap == 0.0, "0 (no soft-capping)"),
]
_ROPE_FAMILY: list[Check] = [
    ("positional", lambda c: c.positional == "rope", "'rope'"),
    ("norm_type", lambda c: c.norm_type == "rmsnorm", "'rmsnorm'"),
    ("activation", lambda c: c.activation == "swiglu", "'swiglu'"),
    ("bias", lambda c: not c.bias, "False"),
]
_CHECKS: dict[str, list[Check]] = {
    "gpt2": [
        ("positional", lambda c: c.positional == "learned", "'learned'"),
        ("norm_type", lambda c: c.norm_type == "layernorm", "'layernorm'"),
        ("activation", lambda c: c.activation in ("gelu", "gelu_tanh", "relu"),
         "'gelu', 'gelu_tanh' or 'relu'"),
        ("tie_weights", lambda c: c.tie_weights, "True"),
        ("n_kv_heads", lambda c: c.n_kv_heads == c.n_heads, "n_heads (no grouped-query)"),
        ("head_dim", lambda c: c.head_dim * c.n_heads == c.d_model, "d_model / n_heads"),
        ("qk_norm", lambda c: not c.qk_norm, "False"),
        ("layer_norm_eps", lambda c: abs(c.layer_norm_eps - 1e-5) <= 1e-12, "1e-5"),
    ],
    "llama": [
        *_ROPE_FAMILY,
        ("qk_norm", lambda c: not c.qk_norm, "False (True is Qwen3)"),
        # transformers' LlamaConfig insists that the heads divide the width.
        ("d_model", lambda c: c.d_model % c.n_heads == 0, "a multiple of n_heads"),
    ],
    "qwen3": [
        *_ROPE_FAMILY,
        ("qk_norm", lambda c: c.qk_norm, "True"),
        ("rope_scaling", lambda c: c.rope_scaling == "none", "'none'"),
    ],
}


def mismatches(cfg: ModelConfig, family: str) -> list[str]:
    """Every field of ``cfg`` that ``family`` cannot express, as ``field=value (needs …)``."""
    if family not in _CHECKS:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return [f"{name}={getattr(cfg, name)!r} ({family} needs {need})"
            for name, holds, need in _COMMON + _CHECKS[family] if not holds(cfg)]


def pick_family(cfg: ModelConfig) -> str:
    """The family ``cfg`` is an exact twin in, or ``ConversionError`` naming the closest one
    and every field that keeps it from there."""
    found = {family: mismatches(cfg, family) for family in FAMILIES}
    for family, problems in found.items():
        if not problems:
            return family
    closest = min(FAMILIES, key=lambda f: len(found[f]))
    raise ConversionError(f"this model maps onto no Hugging Face family ({', '.join(FAMILIES)}); "
                          f"closest is {closest}, which differs in: "
                          + "; ".join(found[closest]))
