"""Int8 weight-only quantization of a whole decoder LM, and how a run folder records it.

``quantize_int8(model)`` replaces every ``nn.Linear`` of a ``DecoderLM`` — attention's fused
``in_proj`` and ``out_proj``, the FFN's ``fc_in`` and ``fc_out``, and the vocabulary head —
by an ``Int8Linear`` (``handformer.nn.quantized``): int8 weights, one fp32 scale per output
feature, activations in floating point. The result is still a ``DecoderLM``: ``generate``,
the explorer, ``doctor`` and ``save_run`` take it as they take any other.

What stays floating point, and why:

* the token embedding: a step reads one row of it, not the whole table, so int8 would save
  nothing per token. A tied head (``tie_weights``) is quantized as its own int8 copy — the
  head *is* read whole at every step (V × C: the largest matrix of a BPE model) — so the
  embedding keeps its float table and the head stops being tied to it;
* LayerNorms, biases and learned positions: vectors, a rounding error of the weights' bytes.

``include_head=False`` keeps the head in float (``bench.int8_quality`` measures both: with
the default run's 107-token vocabulary the head's rounding changes nothing measurable).

A quantized model is recognised by ``is_quantized``; ``quantization_info`` is what a run
folder's ``config.json`` records under ``QUANTIZATION_KEY``, and ``apply_int8_layout``
rebuilds that layout (empty int8 layers) so the stored int8 weights and scales load as they
are, without quantizing again.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from handformer.models.decoder_lm import DecoderLM
from handformer.nn import huge_pages
from handformer.nn.quantized import (
    Int8Kernel,
    Int8Linear,
    compile_seconds,
    fused_kernel_status,
)

__all__ = ["INT8_FORMAT", "QUANTIZATION_KEY", "QUANTIZE_CHOICES", "QuantizationError",
           "apply_int8_layout", "int8_layers", "is_quantized", "quantization_info",
           "quantize_int8", "set_int8_kernel", "warm_up_int8"]

QUANTIZATION_KEY = "quantization"  # config.json's key for a quantized run
INT8_FORMAT = "int8-weight-only"
QUANTIZE_CHOICES: tuple[str, ...] = ("int8",)  # what `--quantize` accepts
_HEAD = "lm_head"


class QuantizationError(ValueError):
    """A model that cannot be quantized (another kind, already quantized, damaged weights)
    or a recorded layout that does not fit the model."""


def _check_decoder(model: nn.Module) -> None:
    if not isinstance(model, DecoderLM):
        raise QuantizationError(
            f"int8 quantization is for decoder language models (DecoderLM, a run written by "
            f"`handformer train`), whose decoding is bound by reading the weights; got "
            f"{type(model).__name__}")


def int8_layers(model: nn.Module) -> list[str]:
    """Names of the model's ``Int8Linear`` layers, in module order."""
    return [name for name, m in model.named_modules() if isinstance(m, Int8Linear)]


def is_quantized(model: nn.Module) -> bool:
    """True when any layer of ``model`` holds int8 weights."""
    return any(isinstance(m, Int8Linear) for m in model.modules())


def _eligible(model: nn.Module, include_head: bool) -> list[str]:
    return [name for name, m in model.named_modules()
            if type(m) is nn.Linear and (include_head or name != _HEAD)]


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def quantize_int8(model: nn.Module, *, include_head: bool = True, inplace: bool = False,
                  kernel: Int8Kernel = "auto") -> nn.Module:
    """A ``DecoderLM`` whose every ``nn.Linear`` holds int8 weights (see the module
    docstring); the head too unless ``include_head=False``. ``inplace=False`` (default)
    leaves ``model`` untouched and returns a quantized copy; ``inplace=True`` converts
    ``model`` itself (no second float copy in memory) and returns it. ``kernel`` picks the
    int8 kernel (``Int8Linear``; ``"auto"`` for use).

    ``QuantizationError`` for a model that is not a ``DecoderLM``, one already quantized, or
    a weight holding NaN/inf (named by its layer).
    """
    _check_decoder(model)
    if is_quantized(model):
        raise QuantizationError(f"the model is already quantized (int8 layers: "
                                f"{int8_layers(model)[:3]}…); quantize its float original")
    target = model if inplace else copy.deepcopy(model)
    for name in _eligible(target, include_head):
        linear = target.get_submodule(name)
        try:
            layer = Int8Linear.from_linear(linear, f"{name}.weight", kernel=kernel)  # type: ignore[arg-type]
        except ValueError as err:
            raise QuantizationError(str(err)) from None
        _replace(target, name, layer.train(linear.training))
    _pack_int8_weights(target)
    return target


def _pack_int8_weights(model: nn.Module) -> None:
    """Every CPU ``Int8Linear``'s int8 weight moved into one region of 2 MiB pages, in
    module order — the order a decoding step reads them (``nn.huge_pages``); unchanged where
    the system has no huge pages to ask for."""
    layers = [m for m in model.modules()
              if isinstance(m, Int8Linear) and m.qweight.device.type == "cpu"]
    copies = huge_pages.pack([m.qweight for m in layers])
    for layer, q in zip(layers, copies or [], strict=False):
        layer.qweight = q


def quantization_info(model: nn.Module) -> dict[str, Any] | None:
    """What a run folder records about a quantized model (None for a float one): the format
    and the int8 layers by name, so the layout is rebuilt exactly on load."""
    layers = int8_layers(model)
    if not layers:
        return None
    return {"format": INT8_FORMAT, "granularity": "per-output-channel", "symmetric": True,
            "layers": layers}


def apply_int8_layout(model: nn.Module, info: Any) -> nn.Module:
    """Replace, in place, the layers ``info`` (``quantization_info``'s record) names by empty
    ``Int8Linear``s on the same device, ready for ``load_state_dict`` of stored int8 weights
    and scales. ``QuantizationError`` for a record of another format, or naming a layer the
    model has not as a float ``nn.Linear``."""
    _check_decoder(model)
    if not isinstance(info, dict) or info.get("format") != INT8_FORMAT:
        found = info.get("format") if isinstance(info, dict) else type(info).__name__
        raise QuantizationError(f"unknown quantization record: expected format "
                                f"{INT8_FORMAT!r}; got {found!r}")
    layers = info.get("layers")
    if not isinstance(layers, list) or not all(isinstance(n, str) for n in layers):
        raise QuantizationError(f"the quantization record's 'layers' must be a list of layer "
                                f"names; got {layers!r}")
    modules = dict(model.named_modules())
    wrong = [n for n in layers if type(modules.get(n)) is not nn.Linear]
    if wrong:
        raise QuantizationError(f"the quantization record names layers the model has no float "
                                f"linear layer for: {wrong[:5]}")
    for name in layers:
        linear = modules[name]
        layer = Int8Linear(linear.in_features, linear.out_features,  # type: ignore[arg-type]
                           linear.bias is not None, device=linear.weight.device)
        _replace(model, name, layer.train(linear.training))
    _pack_int8_weights(model)
    return model


def set_int8_kernel(model: nn.Module, kernel: Int8Kernel) -> nn.Module:
    """Make every ``Int8Linear`` of ``model`` use ``kernel`` (in place; returns ``model``).

    Decoding without the KV cache feeds the whole prefix at every step, so each step has a
    new row count: the fused kernel, compiled once per row count, would compile again at
    every new length (seconds each). The dequantizing kernel serves any row count at once —
    what such a pass wants."""
    for layer in model.modules():
        if isinstance(layer, Int8Linear):
            if kernel not in ("auto", "native", "fused", "dequantized"):
                raise ValueError(f"unknown int8 kernel {kernel!r}")
            layer.kernel = kernel
    return model


def warm_up_int8(model: nn.Module, batch_size: int = 1,
                 positions: tuple[int, ...] = (1,)) -> tuple[float, str | None]:
    """Make ready the int8 kernel of every layer shape a decoding step of ``batch_size`` rows
    meets — one new position per row, and each count in ``positions`` (a speculative step of
    K proposals verifies K + 1) — before the first token, so a user waits once, knowingly,
    not mid-stream: the C loop is built once per machine, the fused one (bfloat16, or where
    the C loop cannot be built) compiled per shape. Returns (seconds spent compiling, None)
    or, where no kernel compiles here, (seconds, the reason: the model then runs on the
    slower dequantizing kernel)."""
    before = compile_seconds()
    with torch.inference_mode():
        for layer in model.modules():
            if isinstance(layer, Int8Linear):
                for t in sorted(set(positions)):
                    layer(torch.zeros(batch_size, t, layer.in_features, dtype=layer.scale.dtype,
                                      device=layer.qweight.device))
    broken = fused_kernel_status()
    note = None if broken is None else (f"the fused kernel cannot compile here ({broken}); "
                                        "using the dequantizing kernel, slower than float32")
    return compile_seconds() - before, note
