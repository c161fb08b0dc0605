"""A reference decoding loop in onnxruntime over a file written by ``convert --to onnx``.

It needs nothing of handformer's model code: the graph, the config and the tokenizer all
come from the ONNX file (``handformer.interop.onnx_export``). Greedy decoding follows
``handformer.generate`` step for step, so the text equals ``handformer generate
--temperature 0``'s:

* with a cached graph, the prompt is one call with an empty ``past`` (P = 0), then each step
  feeds the last token and the ``present`` it got back;
* without one, each step runs the whole window again;
* the window: the model reads at most ``max_len`` tokens; when the text outgrows it the
  window slides forward by half its length and the cache is refilled from the kept tokens
  (``generate``'s rule, the same function);
* rows that produced ``<eos>`` keep emitting it; decoding stops when every row has.

Prompts in one call share a length (no padding masks in the exported graphs).

Shape legend: ``B`` batch, ``T`` tokens, ``V`` vocabulary, ``L`` layers, ``Hkv`` key/value
heads, ``D`` head dim.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from handformer.config import ModelConfig
from handformer.generate import slide_window
from handformer.interop.gpt2 import ConversionError
from handformer.interop.hf_tokenizer import hf_to_char
from handformer.interop.onnx_export import FORMAT, require_onnx
from handformer.tokenizers import Tokenizer, tokenizer_from_dict

__all__ = ["OnnxLM"]


class OnnxLM:
    """An onnxruntime session over a handformer ONNX file, with its tokenizer and config.

    ``OnnxLM(path, threads=1)``; ``greedy(ids, max_new_tokens)`` → ids (B, T + new);
    ``generate_text(prompt, max_new_tokens)`` → the continuation. ``ConversionError`` for a
    file handformer did not write, ``ImportError`` without onnxruntime.
    """

    def __init__(self, path: str | Path, *, threads: int = 1) -> None:
        require_onnx("onnxruntime")
        import onnxruntime as ort

        path = Path(path)
        if not path.is_file():
            raise ConversionError(f"{path}: no such ONNX file")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        try:
            self.session = ort.InferenceSession(str(path), options,
                                                providers=["CPUExecutionProvider"])
        except Exception as err:  # onnxruntime raises its own types
            raise ConversionError(f"{path}: onnxruntime cannot load it ({err})") from None
        meta = self.session.get_modelmeta().custom_metadata_map
        if meta.get("handformer.format") != FORMAT:
            raise ConversionError(f"{path} was not written by `handformer convert --to onnx` "
                                  f"(metadata handformer.format={meta.get('handformer.format')!r}"
                                  f", expected {FORMAT!r})")
        self.config = ModelConfig(**json.loads(meta["handformer.config"]))
        self.with_cache = meta["handformer.with_cache"] == "1"
        data: dict[str, Any] = json.loads(meta["handformer.tokenizer"])
        self.tokenizer: Tokenizer = hf_to_char(data) or tokenizer_from_dict(data)

    def _run(self, ids: np.ndarray, past: np.ndarray | None
             ) -> tuple[np.ndarray, np.ndarray | None]:
        """One call: logits of the last position (B, V) and, cached, the new ``present``."""
        feeds = {"input_ids": ids}
        if past is None:
            (logits,) = self.session.run(["logits"], feeds)
            return logits[:, -1], None
        logits, present = self.session.run(["logits", "present"], {**feeds, "past": past})
        return logits[:, -1], present

    def _empty_past(self, batch_size: int) -> np.ndarray:
        c = self.config
        return np.zeros((c.n_layers, batch_size, 2 * c.n_kv_heads, 0, c.head_dim),
                        dtype=np.float32)  # (L, B, 2·Hkv, 0, D)

    def greedy(self, ids: np.ndarray, max_new_tokens: int, *,
               eos_id: int | None = None) -> np.ndarray:
        """Extend ``ids`` (B, T) int64 by up to ``max_new_tokens`` argmax tokens."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"expected a non-empty prompt of shape (B, T); got {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}); got min "
                             f"{ids.min()}, max {ids.max()}")
        b, length = ids.shape
        tokens = np.zeros((b, length + max_new_tokens), dtype=np.int64)
        tokens[:, :length] = ids
        finished = np.zeros(b, dtype=bool)
        max_len = self.config.max_len
        start, past = 0, None  # window start; the cache of tokens [start, length - 1)
        for _ in range(max_new_tokens):
            new_start = slide_window(start, length, max_len)
            if not self.with_cache:
                logits, _ = self._run(tokens[:, new_start:length], None)
            elif past is None or new_start != start:  # first step, or the window moved
                logits, past = self._run(tokens[:, new_start:length], self._empty_past(b))
            else:
                logits, past = self._run(tokens[:, length - 1 : length], past)
            start = new_start
            nxt = logits.argmax(axis=-1)  # (B,)
            if eos_id is not None:
                nxt = np.where(finished, eos_id, nxt)
                finished |= nxt == eos_id
            tokens[:, length] = nxt
            length += 1
            if eos_id is not None and finished.all():
                break
        return tokens[:, :length]

    def generate_text(self, prompt: str, max_new_tokens: int) -> str:
        """The greedy continuation of ``prompt`` (without it), stopping at ``<eos>``."""
        if not prompt:
            raise ValueError("the prompt is empty; give at least one character")
        ids = np.asarray([self.tokenizer.encode(prompt)], dtype=np.int64)  # (1, T)
        out = self.greedy(ids, max_new_tokens, eos_id=self.tokenizer.eos_id)
        return self.tokenizer.decode(out[0, ids.shape[1]:].tolist())
