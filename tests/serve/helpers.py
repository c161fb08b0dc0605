"""What the serving tests share: a tiny model whose greedy choices are clear-cut, prompts of
mixed lengths, and an engine driven step by step (no thread, no HTTP)."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from handformer.config import ModelConfig
from handformer.models.decoder_lm import DecoderLM
from handformer.serve.engine import Engine
from handformer.serve.request import Request, RequestOutput, SamplingParams
from handformer.tokenizers import CharTokenizer

TOKENIZER = CharTokenizer("abcdefghijklmnopqrstuvwxyz .,")


class EndlessTokenizer(CharTokenizer):
    """The same characters with no end-of-text id: every request runs to its max_tokens
    (a random model would otherwise end some texts early, at random)."""

    eos_id = None  # type: ignore[assignment]


ENDLESS = EndlessTokenizer(TOKENIZER.chars)


def tiny_lm(seed: int = 0, **overrides) -> DecoderLM:
    """A 2-layer model with its weights scaled up: random init gives nearly flat logits,
    where batching's last-bit rounding differences could swap two near-tied tokens; scaled,
    the greedy choice is clear-cut, so equal outputs test the engine, not the luck."""
    torch.manual_seed(seed)
    base = dict(vocab_size=TOKENIZER.vocab_size, d_model=32, n_heads=4, n_layers=2,
                max_len=24, dropout=0.0)
    model = DecoderLM(ModelConfig(**{**base, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    return model


def prompts(n: int, seed: int = 0, longest: int = 30) -> list[tuple[str, int]]:
    """``n`` (prompt, max_tokens) pairs of mixed lengths."""
    rnd = random.Random(seed)
    return [("".join(rnd.choice("abcdefgh ") for _ in range(rnd.randint(1, longest))),
             rnd.randint(1, 30)) for _ in range(n)]


def run_engine(engine: Engine, jobs: list[tuple[list[int], SamplingParams]], *,
               every: int = 2, hook: Callable[[Engine], None] | None = None) -> list[str]:
    """Submit one job every ``every`` steps (staggered arrivals), step until all end;
    returns each job's text."""
    texts = [""] * len(jobs)
    done = [False] * len(jobs)

    def collect(i: int) -> Callable[[RequestOutput], None]:
        def on_output(out: RequestOutput) -> None:
            texts[i] += out.text
            done[i] = done[i] or out.finished
        return on_output

    requests = [Request(ids, p, collect(i)) for i, (ids, p) in enumerate(jobs)]
    pending, step = list(requests), 0
    with torch.inference_mode():
        while pending or engine.has_work():
            if pending and step % every == 0:
                engine.submit(pending.pop(0))
            engine.step()
            if hook is not None:
                hook(engine)
            step += 1
            assert step < 10_000, "the engine stopped making progress"
    assert all(done)
    return texts
