"""What the page asks the model, answered as JSON-ready dicts: run info, the attention of a
prompt, and a padded batch. (Token-by-token generation lives in ``generation.py``.)

One ``Explorer`` wraps one loaded run. Every model call holds ``self.lock``, so the threaded
server can take several requests at once while the model runs one at a time. Captured
weights of recent prompts are kept (a few, least recently used dropped first) so switching
layer or head does not run the model again.

Shape legend: ``B`` batch, ``L`` layers, ``H`` heads, ``T`` query length, ``S`` key length,
``K`` classes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

from handformer.capture import AttentionRecord, capture_attention, self_attention_names
from handformer.explore.payload import InputError
from handformer.explore.prompts import EncodedText, encode_text, token_text
from handformer.explore.run import ExploreRun
from handformer.explore.tensors_json import finite_json, mask_to_json, weights_to_json

__all__ = ["MAX_BATCH", "Explorer"]

MAX_BATCH = 8  # sentences in the padded-batch view
_CACHED_PROMPTS = 4


class Explorer:
    """Attention views of one run, safe to call from several threads."""

    def __init__(self, run: ExploreRun) -> None:
        self.run = run
        self.lock = threading.RLock()  # re-entrant: a generation step holds it around a forward
        self.layer_names = self_attention_names(run.model)
        if not self.layer_names:
            raise ValueError(f"{run.run_dir}: the model has no self-attention layers to show")
        cfg = run.model_config
        self.n_layers: int = len(self.layer_names)
        self.n_heads: int = cfg.n_heads
        self.max_len: int = cfg.max_len
        self.device = next(run.model.parameters()).device
        self._recent: OrderedDict[tuple[int, ...], list[AttentionRecord]] = OrderedDict()

    # -- helpers --------------------------------------------------------------------------
    @property
    def add_bos(self) -> bool:
        """A classifier was trained on ``<bos>`` + text (its summary slot for ``cls``
        pooling), so the explorer feeds it the same."""
        return self.run.kind == "classifier"

    @property
    def keep(self) -> str:
        """Which end of a too-long text to keep: a classifier was trained on the start of
        each text; a language model continues from the end."""
        return "first" if self.run.kind == "classifier" else "last"

    def check_layer_head(self, layer: int, head: int | str) -> list[int]:
        """Validate a layer index and a head (an index or ``"all"``); returns the heads."""
        if not 0 <= layer < self.n_layers:
            raise InputError(f"layer must lie in [0, {self.n_layers - 1}]; got {layer}")
        if head == "all":
            return list(range(self.n_heads))
        if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < self.n_heads:
            raise InputError(f"head must be 'all' or lie in [0, {self.n_heads - 1}]; "
                             f"got {head!r}")
        return [head]

    def _forward(self, ids: Tensor, padding_mask: Tensor | None) -> tuple[Tensor,
                                                                          list[AttentionRecord]]:
        """One captured forward pass: logits and one record per self-attention layer."""
        with self.lock, torch.inference_mode(), capture_attention(self.run.model) as rec:
            logits = self.run.model(ids.to(self.device), padding_mask=(
                None if padding_mask is None else padding_mask.to(self.device)))
        return logits, [rec.last(name) for name in self.layer_names]

    def mask_kind(self) -> str:
        return "causal" if self.run.kind == "lm" else "none (bidirectional)"

    # -- views ----------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """Everything the page needs before its first request."""
        run, cfg = self.run, self.run.model_config
        attention = getattr(cfg, "attention", "manual")
        return {
            "run": run.run_dir.name,
            "kind": run.kind,
            "model": {
                "n_layers": self.n_layers, "n_heads": self.n_heads,
                "n_kv_heads": getattr(cfg, "n_kv_heads", self.n_heads),
                "d_model": cfg.d_model, "max_len": self.max_len, "vocab_size": cfg.vocab_size,
                "attention": attention, "positional": cfg.positional, "norm": cfg.norm,
                "parameters": sum(p.numel() for p in run.model.parameters()),
            },
            "kernel_note": (
                "attention weights come from the manual reference kernel"
                + ("" if attention == "manual" else
                   f" (the run uses attention={attention!r}, which never forms the weights: "
                   "each request re-runs attention with the manual kernel)")),
            "mask_kind": self.mask_kind(),
            "labels": run.labels,
            "pooling": run.pooling,
            "config": finite_json(run.config),  # a diverged run's NaN → null: strict JSON
            "summary": finite_json(run.summary),
            "loss_curve": run.loss_curve.to_json(),
        }

    def attention(self, prompt: str, layer: int, head: int | str) -> dict[str, Any]:
        """The (T, T) attention of ``prompt`` at one layer, for one head or all of them,
        with the mask the layer applied."""
        heads = self.check_layer_head(layer, head)
        enc = encode_text(self.run.tokenizer, prompt, limit=self.max_len, add_bos=self.add_bos,
                          keep=self.keep)
        records = self._records_for(enc)
        record = records[layer]
        weights = record.weights[0, heads]  # (H', T, T)
        allowed = record.allowed[0, heads[0]]  # (T, T): one mask for every head
        return {
            "tokens": enc.tokens, "ids": enc.ids, "notices": enc.notices,
            "layer": layer, "layer_name": self.layer_names[layer], "heads": heads,
            "weights": weights_to_json(weights), "allowed": mask_to_json(allowed),
            "mask_kind": self.mask_kind(),
        }

    def _records_for(self, enc: EncodedText) -> list[AttentionRecord]:
        key = tuple(enc.ids)
        with self.lock:
            if key in self._recent:
                self._recent.move_to_end(key)
                return self._recent[key]
        ids = torch.tensor([enc.ids], dtype=torch.long)  # (1, T)
        _, records = self._forward(ids, None)
        with self.lock:
            self._recent[key] = records
            while len(self._recent) > _CACHED_PROMPTS:
                self._recent.popitem(last=False)
        return records

    def batch(self, sentences: list[str], layer: int, head: int | str,
              pad_side: str = "right") -> dict[str, Any]:
        """Sentences of different lengths padded into one batch: each row's attention and
        padding mask, and the largest weight any query gave a padded key (over all layers
        and heads) — zero when padding is handled right."""
        heads = self.check_layer_head(layer, head)
        if pad_side not in ("left", "right"):
            raise InputError(f"pad_side must be 'left' or 'right'; got {pad_side!r}")
        if not 1 <= len(sentences) <= MAX_BATCH:
            raise InputError(f"give between 1 and {MAX_BATCH} sentences; got {len(sentences)}")
        notices: list[str] = []
        encoded = []
        for i, text in enumerate(sentences):
            try:
                enc = encode_text(self.run.tokenizer, text, limit=self.max_len,
                                  what=f"sentence {i + 1}", add_bos=self.add_bos,
                                  keep=self.keep)
            except InputError as err:
                raise InputError(f"{err} (remove empty lines from the batch)") from None
            notices.extend(enc.notices)
            encoded.append(enc)
        pad_id = int(getattr(self.run.tokenizer, "pad_id", 0))
        t = max(len(e.ids) for e in encoded)
        ids = torch.full((len(encoded), t), pad_id, dtype=torch.long)  # (B, T)
        real = torch.zeros((len(encoded), t), dtype=torch.bool)  # (B, T)
        for row, enc in enumerate(encoded):
            cols = slice(0, len(enc.ids)) if pad_side == "right" else slice(t - len(enc.ids), t)
            ids[row, cols] = torch.tensor(enc.ids)
            real[row, cols] = True
        logits, records = self._forward(ids, real)
        # The claim the view makes, checked over every layer and head, not only the shown one.
        padded_keys = ~real[:, None, None, :]  # (B, 1, 1, S)
        max_on_pad = max(float((r.weights.cpu() * padded_keys).abs().max()) for r in records)
        record = records[layer]
        if self.run.kind == "lm":
            notices.insert(0, "not a classifier run: this decoder LM also applies its causal "
                              "mask, so each query sees only earlier real keys")
        payload: dict[str, Any] = {
            "rows": [{"tokens": [token_text(self.run.tokenizer, int(i)) for i in row_ids],
                      "real": mask_to_json(row_real)}
                     for row_ids, row_real in zip(ids, real, strict=True)],
            "notices": notices, "layer": layer, "heads": heads, "pad_side": pad_side,
            "weights": weights_to_json(record.weights[:, heads]),  # (B, H', T, T)
            "allowed": mask_to_json(record.allowed[:, heads[0]]),  # (B, T, T)
            "max_weight_on_padded_keys": max_on_pad,
            "mask_kind": self.mask_kind(),
        }
        if self.run.kind == "classifier":
            probs = torch.softmax(logits.float(), dim=-1).cpu()  # (B, K)
            payload["predictions"] = [
                {"label": self.run.labels[int(p.argmax())], "probs": weights_to_json(p)}
                for p in probs]
            payload["labels"] = self.run.labels
        return payload
