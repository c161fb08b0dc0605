"""Text in, text out: encode prompts, generate (plainly or speculatively), decode, stream,
stop at stop strings."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor, nn

from handformer.data.padding import pad_sequences
from handformer.generate.plain import _check_flags, generate
from handformer.generate.speculative import SpeculationStats, speculative_generate

__all__ = ["generate_text", "held_back"]


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could still be the start of a stop string
    (and so must not be streamed yet); the server's streams hold them back too."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def generate_text(
    model: nn.Module,
    tokenizer,
    prompts: str | Sequence[str],
    max_new_tokens: int,
    *,
    stop: Sequence[str] = (),
    stream: Callable[[int, str], None] | None = None,
    stream_keeps_model: bool = False,
    draft: nn.Module | None = None,
    speculate: int = 4,
    stats: SpeculationStats | None = None,
    **sampling,
) -> list[str]:
    """Text in, text out: encode prompts (left-padded as a batch), generate, decode.

    Returns each prompt's continuation, cut before the first stop string (which is never
    streamed, not even in part). ``stream(row, text_piece)`` receives new text as it is
    produced; ``stream_keeps_model=True`` promises that it leaves the model as it is (it
    prints; it adds no hook and loads no weights), so that generation keeps the block
    kernel's one check across tokens (``generate``'s ``on_token_keeps_model``; without
    ``stream`` it always does). Characters the tokenizer does not know become ``<unk>``.
    With ``draft`` (a model sharing the tokenizer) decoding is speculative, ``speculate``
    proposals a step (``speculative_generate``), and ``stats`` if given receives the
    acceptance figures.
    """
    _check_flags(stream_keeps_model=stream_keeps_model)
    keeps_model = stream is None or stream_keeps_model  # no stream: only decoding runs
    prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompt_list or any(p == "" for p in prompt_list):
        raise ValueError("prompts must be non-empty strings")
    if any(s == "" for s in stop):
        raise ValueError("stop strings must be non-empty")
    ids, mask = pad_sequences([tokenizer.encode(p) for p in prompt_list], tokenizer.pad_id,
                              side="left")  # (B, T): every prompt ends in the last column
    texts = [""] * len(prompt_list)
    streamed = [0] * len(prompt_list)
    done = [False] * len(prompt_list)

    def emit(row: int, upto: int) -> None:
        if stream is not None and upto > streamed[row]:
            stream(row, texts[row][streamed[row]:upto])
        streamed[row] = max(streamed[row], upto)

    def on_token(nxt: Tensor) -> bool:
        for row, token in enumerate(nxt.tolist()):
            if done[row]:
                continue
            texts[row] += tokenizer.decode([token])
            hits = [texts[row].find(s) for s in stop if s in texts[row]]
            if hits:
                texts[row] = texts[row][: min(hits)]
                done[row] = True
                emit(row, len(texts[row]))
            else:
                emit(row, len(texts[row]) - held_back(texts[row], stop))
        return all(done)

    if draft is None:
        generate(model, ids, max_new_tokens, padding_mask=mask, on_token=on_token,
                 on_token_keeps_model=keeps_model,
                 eos_id=tokenizer.eos_id, **sampling)
    else:
        if sampling.pop("repetition_penalty", 1.0) != 1.0:
            raise ValueError("speculative decoding does not take a repetition penalty (a "
                             "position's penalty depends on the proposals before it); drop "
                             "it or the draft")
        if not sampling.pop("use_cache", True):
            raise ValueError("speculative decoding needs the KV cache (it verifies the "
                             "proposals with it); drop use_cache=False or the draft")
        speculative_generate(model, draft, ids, max_new_tokens, speculate=speculate,
                             padding_mask=mask, on_token=on_token,
                             on_token_keeps_model=keeps_model,
                             eos_id=tokenizer.eos_id, stats=stats, **sampling)
    for row in range(len(texts)):
        emit(row, len(texts[row]))  # release text held back for a stop that never came
    return texts
