"""A language-model run → one ONNX file that onnxruntime (or any ONNX runtime) executes.

Two graphs, both with dynamic batch and sequence axes:

* plain: ``input_ids`` (B, T) int64 → ``logits`` (B, T, V) float32 — the model's own
  ``forward``, traced by torch's exporter (``torch.onnx.export(..., dynamo=True)``);
* ``with_cache``: ``input_ids`` (B, T) and ``past`` (L, B, 2·Hkv, P, D) → ``logits`` and
  ``present`` (L, B, 2·Hkv, P + T, D), so a runtime decodes token by token
  (``handformer.interop.onnx_cache``; a reference loop is ``handformer.interop.onnx_decode``).

The file carries what a runtime needs besides the graph, as ONNX metadata: the model config,
the tokenizer as a Hugging Face ``tokenizer.json`` (``handformer.interop.hf_tokenizer``) and
whether the graph takes a cache. Every positional kind exports (learned, sinusoidal, RoPE,
ALiBi) with every head layout; the ``tiled`` attention kernel, a Python loop over key tiles
whose count depends on the sequence length, is exported as ``sdpa`` — the same function
(tests hold the kernels equal), one fused op. Weights are exported in float32. A model the
exporter still cannot trace is refused with a ``ConversionError`` naming it.

The graph is traced with T = 3 new tokens after P = 2 cached ones, so the general path is
recorded (an end-aligned causal mask); it is also exact for T = 1 and P = 0.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from handformer.interop.gpt2 import ConversionError
from handformer.interop.hf_tokenizer import char_to_hf
from handformer.interop.onnx_cache import CachedStep
from handformer.models.decoder_lm import DecoderLM
from handformer.tokenizers import CharTokenizer, HFTokenizer, Tokenizer

__all__ = ["FORMAT", "export_onnx", "is_handformer_onnx", "require_onnx"]

FORMAT = "handformer-decoder-lm/1"  # metadata "handformer.format": what wrote the file
_EXAMPLE_B, _EXAMPLE_T, _EXAMPLE_P = 2, 3, 2


def require_onnx(*modules: str) -> None:
    """``ImportError`` saying how to install the ONNX extra when a module is missing."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"{', '.join(missing)} is not installed; ONNX export and decoding "
                          "need the onnx extra: pip install 'handformer[onnx]' (onnx, "
                          "onnxruntime, onnxscript)")


def tokenizer_json(tok: Tokenizer) -> str:
    """The run's tokenizer as a Hugging Face ``tokenizer.json`` string."""
    if isinstance(tok, CharTokenizer):
        return char_to_hf(tok).to_str(pretty=False)
    if isinstance(tok, HFTokenizer):
        return tok.backend.to_str(pretty=False)
    raise ConversionError(f"cannot store a {type(tok).__name__} in an ONNX file")


def is_handformer_onnx(path: Path) -> bool:
    """Whether ``path`` is an ONNX file this module wrote (its metadata says so)."""
    try:
        import onnx

        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # not ONNX, unreadable, or onnx missing: not provably ours
        return False
    return any(p.key == "handformer.format" and p.value == FORMAT
               for p in model.metadata_props)


def _check_destination(out: Path, overwrite: bool) -> None:
    if out.suffix != ".onnx":
        raise ConversionError(f"{out}: an ONNX file name ends in .onnx")
    if out.is_dir():
        raise ConversionError(f"{out} is a folder; give the path of a .onnx file to write")
    if out.exists() and not overwrite and not is_handformer_onnx(out):
        raise ConversionError(f"{out} exists and handformer did not write it; give a new "
                              "file, or pass --overwrite to replace it")


def _exportable(model: DecoderLM) -> DecoderLM:
    """A float32 eval copy whose attention kernels torch's exporter can trace."""
    model = copy.deepcopy(model).float().eval()
    for block in model.blocks:
        if block.self_attn.attention == "tiled":
            block.self_attn.attention = "sdpa"
    return model


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silence the exporter's log lines (e.g. "torchvision is not installed. Skipping ...",
    about operators this model never uses): a command prints one line per outcome."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _trace(model: DecoderLM, with_cache: bool) -> Any:
    """torch's dynamo exporter over the plain or the cached graph → an ``ONNXProgram``."""
    c = model.config
    ids = torch.randint(0, c.vocab_size, (_EXAMPLE_B, _EXAMPLE_T))
    if with_cache:
        past = torch.zeros(c.n_layers, _EXAMPLE_B, 2 * c.n_kv_heads, _EXAMPLE_P, c.head_dim)
        module: torch.nn.Module = CachedStep(model)
        args: tuple[torch.Tensor, ...] = (ids, past)
        dynamic: Any = ({0: "batch", 1: "sequence"}, {1: "batch", 3: "past_sequence"})
        names = (["input_ids", "past"], ["logits", "present"])
    else:
        module, args = model, (ids,)
        dynamic = ({0: "batch", 1: "sequence"},)
        names = (["input_ids"], ["logits"])
    try:
        with warnings.catch_warnings(), _quiet_exporter():
            warnings.simplefilter("ignore")  # the exporter's own chatter
            return torch.onnx.export(module, args, dynamo=True, dynamic_shapes=dynamic,
                                     input_names=names[0], output_names=names[1],
                                     verbose=False)
    except Exception as err:  # the exporter raises many types; keep its first line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConversionError(
            f"torch's ONNX exporter cannot trace this model (positional={c.positional!r}, "
            f"attention={c.attention!r}, norm={c.norm!r}): {first}") from None


def export_onnx(run_dir: str | Path, out: str | Path, *, with_cache: bool = False,
                overwrite: bool = False) -> Path:
    """Write a language-model run as the ONNX file ``out`` (see the module docstring).

    ``out`` must end in ``.onnx``; an existing file is replaced only if this function wrote
    it or ``overwrite`` is set. The file appears whole or not at all.
    """
    from handformer.runs import load_run

    require_onnx("onnx", "onnxscript")
    out = Path(out)
    _check_destination(out, overwrite)
    run = load_run(run_dir, kind="lm")
    model = _exportable(run.model)
    program = _trace(model, with_cache)
    c = model.config
    metadata = {"handformer.format": FORMAT, "handformer.with_cache": str(int(with_cache)),
                "handformer.config": json.dumps(dataclasses.asdict(c)),
                "handformer.tokenizer": tokenizer_json(run.tokenizer)}
    for key, value in metadata.items():
        program.model.metadata_props[key] = value
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    try:
        program.save(tmp, external_data=False)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 → an ordinary file's mode
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out
