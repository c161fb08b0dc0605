"""Token-by-token generation with the KV cache in view.

A ``GenerationSession`` keeps, server-side, what a decoder keeps between steps: the tokens
so far, the ``DecoderCache`` holding every layer's keys and values, and the logits for the
next token. ``start`` runs the prompt once through the model (filling the cache); each
``step`` draws one token, feeds *only that token* through the model, and records which
cached keys each head of each layer attended to: weights (1, H, 1, S) over all S cached
columns, the new one included.

The window is the cache's capacity (the model's ``max_len``). When it is full, stepping
stops with a message: sliding the window would refill the cache from scratch, which is
what ``handformer.generate`` does and what this view would only hide.

Shape legend: ``H`` heads, ``S`` cached keys, ``V`` vocabulary.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from handformer.capture import AttentionRecord, capture_attention
from handformer.explore.explorer import Explorer
from handformer.explore.payload import InputError
from handformer.explore.prompts import encode_text, token_text
from handformer.explore.tensors_json import weights_to_json
from handformer.generate import sample_next
from handformer.nn.kv_cache import DecoderCache

__all__ = ["TOP_K_BARS", "GenerationSession", "Generator"]

TOP_K_BARS = 10
MAX_SESSIONS = 8


@dataclass
class GenerationSession:
    """One prompt being extended: explicit decoding state, never stored on the model."""

    ids: list[int]
    n_prompt: int
    cache: DecoderCache
    next_logits: Tensor  # (V,) for the token after ids[-1]
    records: list[AttentionRecord]  # last forward: per layer, weights (1, H, T_new, S)
    rng: torch.Generator
    steps: int = 0


class Generator:
    """Generation sessions of one LM run, kept least-recently-used first, at most
    ``MAX_SESSIONS`` (an old page's session expires rather than memory growing)."""

    def __init__(self, explorer: Explorer) -> None:
        self.explorer = explorer
        self._sessions: OrderedDict[str, GenerationSession] = OrderedDict()
        self._sessions_lock = threading.Lock()

    def _check_lm(self) -> None:
        if self.explorer.run.kind != "lm":
            raise InputError("generation needs a language-model run; this is a "
                             f"{self.explorer.run.kind} run")

    def _session(self, session_id: str) -> GenerationSession:
        with self._sessions_lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise InputError("unknown or expired generation session: press Start again")
            self._sessions.move_to_end(session_id)
            return session

    def _top(self, logits: Tensor) -> list[dict[str, Any]]:
        probs = torch.softmax(logits.float(), dim=-1)  # (V,)
        values, indices = probs.topk(min(TOP_K_BARS, probs.shape[-1]))
        tok = self.explorer.run.tokenizer
        return [{"id": int(i), "token": token_text(tok, int(i)), "prob": round(float(p), 6)}
                for p, i in zip(values, indices, strict=True)]

    def _run(self, session: GenerationSession, new_ids: list[int]) -> None:
        """Feed ``new_ids`` through the model, appending to the session's cache."""
        ex = self.explorer
        ids = torch.tensor([new_ids], dtype=torch.long, device=ex.device)  # (1, T_new)
        with ex.lock, torch.inference_mode(), capture_attention(ex.run.model) as rec:
            logits = ex.run.model(ids, cache=session.cache)  # (1, T_new, V)
        session.records = [rec.last(name) for name in ex.layer_names]
        session.next_logits = logits[0, -1].cpu()  # (V,)

    def view(self, session: GenerationSession, session_id: str, layer: int,
             head: int | str) -> dict[str, Any]:
        """The latest query's attention over every cached key, for one layer and head(s)."""
        heads = self.explorer.check_layer_head(layer, head)
        weights = session.records[layer].weights[0, heads, -1]  # (H', S)
        tok = self.explorer.run.tokenizer
        return {
            "session": session_id, "tokens": [token_text(tok, i) for i in session.ids],
            "text": tok.decode(session.ids), "n_prompt": session.n_prompt,
            "steps": session.steps, "layer": layer, "heads": heads,
            "query_index": len(session.ids) - 1,
            "weights": weights_to_json(weights),
            "cache": {"filled": session.cache.length, "capacity": session.cache.capacity},
            "window_full": session.cache.length >= session.cache.capacity,
            "next": self._top(session.next_logits),
        }

    def start(self, prompt: str, layer: int, head: int | str, seed: int = 0) -> dict[str, Any]:
        """Encode the prompt (keeping room for at least one new token), fill the cache."""
        self._check_lm()
        ex = self.explorer
        ex.check_layer_head(layer, head)
        limit = max(1, ex.max_len - 1)
        enc = encode_text(ex.run.tokenizer, prompt, limit=limit)
        with ex.lock, torch.inference_mode():
            cache = ex.run.model.make_cache(1)
        session = GenerationSession(ids=list(enc.ids), n_prompt=len(enc.ids), cache=cache,
                                    next_logits=torch.empty(0), records=[],
                                    rng=torch.Generator().manual_seed(seed))
        self._run(session, enc.ids)
        session_id = secrets.token_hex(8)
        with self._sessions_lock:
            self._sessions[session_id] = session
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return {**self.view(session, session_id, layer, head), "notices": enc.notices}

    def step(self, session_id: str, layer: int, head: int | str, temperature: float,
             top_k: int | None) -> dict[str, Any]:
        """Draw one token from the stored next-token logits, then feed it through the model
        with the cache: its query attends to all cached keys."""
        self._check_lm()
        self.explorer.check_layer_head(layer, head)
        with self.explorer.lock:  # one step of one session at a time, start to finish
            session = self._session(session_id)
            if session.cache.length >= session.cache.capacity:
                raise InputError(f"the window is full: the KV cache holds "
                                 f"{session.cache.capacity} tokens (the model's max_len); "
                                 "press Start to begin again")
            drawn_from = self._top(session.next_logits)
            probs = torch.softmax(session.next_logits.float(), dim=-1)  # (V,)
            next_id = int(sample_next(session.next_logits[None], temperature=temperature,
                                      top_k=top_k, generator=session.rng)[0])
            session.ids.append(next_id)
            session.steps += 1
            self._run(session, [next_id])
            return {**self.view(session, session_id, layer, head),
                    "chosen": {"id": next_id,
                               "token": token_text(self.explorer.run.tokenizer, next_id),
                               "prob": round(float(probs[next_id]), 6)},
                    "drawn_from": drawn_from, "notices": []}

    def show(self, session_id: str, layer: int, head: int | str) -> dict[str, Any]:
        """The same step seen through another layer or head (no model call)."""
        with self.explorer.lock:
            return self.view(self._session(session_id), session_id, layer, head)
