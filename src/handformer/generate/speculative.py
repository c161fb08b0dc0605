"""Speculative decoding: a small draft model guesses, the target checks several guesses in
one forward pass.

At batch 1 a decoding step of a large model is bound by reading its weights, not by
arithmetic: feeding it ``k + 1`` tokens costs about as much as feeding it one. So a cheap
draft model proposes ``k`` tokens one by one, the target scores all of them in a single
ordinary ``forward`` over its KV cache, and every proposal the target agrees with is a token
gained for the price of one target read. Both caches are then rolled back
(``DecoderCache.truncate``) to the tokens that were kept.

* Greedy (``temperature == 0``): a proposal is kept while it equals the target's argmax; the
  first disagreement is replaced by the target's own argmax, and when all ``k`` are kept the
  target's next argmax comes for free. The output is the target's plain greedy output.
* Sampling: proposal ``x`` drawn from the draft's ``q`` is kept with probability
  ``min(1, p(x) / q(x))``; the first rejected one is replaced by a sample of
  ``normalize(max(0, p - q))``; when all are kept, one more token comes from ``p``. Every
  token then follows the target's distribution ``p`` exactly (temperature, top-k and top-p
  narrow ``p`` and ``q`` alike, through ``sampling_weights``).
* Batches: rows share one cache length, so a step keeps the proposals that *every* row
  kept (the smallest count, ``n``) and emits one more token per row: the target's
  correction for a row that rejected at ``n``, the row's kept proposal ``n + 1`` otherwise
  (or the bonus token when all rows kept all ``k``). Still exact: a kept proposal is what
  the accept/reject step outputs at that position. Finished rows (``eos_id``) count as
  keeping everything.
* The window: each model slides its own window as plain ``generate`` does. A step never
  lets the target's window move between the tokens it verifies (``k`` shrinks near the
  end of a window), so each verified position sees exactly the context plain decoding
  would give it.

Shape legend: ``B`` batch, ``K`` proposals this step, ``T`` sequence so far, ``V`` vocabulary.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from handformer.generate.plain import (
    GREEDY_TEMPERATURE,
    NonFiniteLogitsError,
    TokenCallback,
    _check_budget,
    _check_finite_logits,
    _check_flags,
    _outside_inference_mode,
    _takes_validate,
    check_request,
    check_sampling,
    sampling_weights,
    slide_window,
    small_op_kernels,
)
from handformer.nn import decode_block
from handformer.nn.kv_cache import DecoderCache

__all__ = ["MAX_SPECULATE", "SpeculationStats", "check_draft", "check_same_tokenizer",
           "speculative_generate"]

# More proposals than this per step only add draft calls that are almost never kept.
MAX_SPECULATE = 32


@dataclass
class SpeculationStats:
    """What speculation bought: proposals made and kept (summed over rows), target and
    draft forward calls. Filled in by ``speculative_generate``."""

    drafted: int = 0
    accepted: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    new_tokens: int = 0  # per row (summed over calls when one object is passed to several)
    per_step_accepted: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Kept proposals / proposals (NaN before the first proposal)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tokens_per_target_call(self) -> float:
        """New tokens per row for each forward of the target (1.0 for plain decoding)."""
        return self.new_tokens / self.target_calls if self.target_calls else float("nan")

    def summary(self) -> str:
        """One line for a user."""
        return (f"speculation: {self.accepted} of {self.drafted} drafted tokens accepted "
                f"({100 * self.acceptance_rate:.1f} %), {self.tokens_per_target_call:.2f} "
                f"tokens per target forward ({self.target_calls} target, {self.draft_calls} "
                "draft forwards)")


def check_same_tokenizer(target_tokenizer: Any, draft_tokenizer: Any) -> None:
    """``ValueError`` unless both tokenizers map text to the same ids: a draft's proposals
    are ids, and they mean nothing to a target that reads ids differently."""
    same = type(target_tokenizer) is type(draft_tokenizer) and (
        target_tokenizer.to_dict() == draft_tokenizer.to_dict())
    if not same:
        raise ValueError(
            f"the draft's tokenizer ({type(draft_tokenizer).__name__}, "
            f"{draft_tokenizer.vocab_size} tokens) is not the target's "
            f"({type(target_tokenizer).__name__}, {target_tokenizer.vocab_size} tokens); a "
            "draft must share its target's tokenizer (train one with `handformer train "
            "--draft-for TARGET_RUN`)")


def check_draft(target: nn.Module, draft: nn.Module) -> None:
    """``ValueError`` unless ``draft`` can propose tokens for ``target``: both decode with a
    KV cache, share the vocabulary size and live on the same device."""
    for name, model in (("target", target), ("draft", draft)):
        if not callable(getattr(model, "make_cache", None)) or not hasattr(model, "config"):
            raise ValueError(f"the {name} must be a decoder LM with a KV cache (make_cache, "
                             f"config); got {type(model).__name__}")
    t_vocab, d_vocab = target.config.vocab_size, draft.config.vocab_size  # type: ignore[union-attr]
    if t_vocab != d_vocab:
        raise ValueError(f"the draft's vocabulary ({d_vocab} tokens) differs from the "
                         f"target's ({t_vocab}); a draft must share its target's tokenizer")
    t_dev, d_dev = next(target.parameters()).device, next(draft.parameters()).device
    if t_dev != d_dev:
        raise ValueError(f"the draft is on {d_dev} but the target on {t_dev}; put both on "
                         "one device")


class _Decoder:
    """One model with its KV cache and window, fed from the shared token buffer.

    The cache holds the keys of ``tokens[start:fed]``; ``feed(upto, need)`` brings it to
    ``upto`` and returns the logits of the last ``need`` fed positions. The window start a
    prediction at length ``j`` uses is ``slide_window(0, j, max_len)`` — the one plain
    ``generate`` uses — and the cache is refilled whenever that start moves.
    """

    def __init__(self, model: nn.Module, batch_size: int, prompt_len: int) -> None:
        self.model = model
        self.max_len: int = model.config.max_len  # type: ignore[union-attr]
        self.cache: DecoderCache = model.make_cache(batch_size)  # type: ignore[operator]
        self.prompt_len = prompt_len
        self.start = 0
        self.fed = 0
        self.cached = False
        self.options: dict[str, Any] = {}  # the first call checks the prompt's ids
        self.unchecked = {"validate": False} if _takes_validate(model) else {}

    def window_start(self, length: int) -> int:
        return slide_window(0, length, self.max_len)

    def feed(self, tokens: Tensor, real: Tensor, upto: int, need: int) -> Tensor:
        """tokens (B, T), real (B, T) → logits (B, need, V) predicting tokens
        [upto - need + 1, upto]; all of them must share the window of length ``upto``."""
        start = self.window_start(upto)
        if not self.cached or start != self.start:
            self.cache.reset()  # first call, or the window moved: refill from the kept tokens
            self.start, begin = start, start
            mask: Tensor | None = real[:, begin:upto]  # (B, n)
            self.cached = True
        else:
            begin = self.fed
            # generated tokens are all real; only the prompt's columns can hold padding
            mask = real[:, begin:upto] if begin < self.prompt_len else None
        logits = self.model(tokens[:, begin:upto], mask, cache=self.cache,
                            **self.options)  # (B, n, V)
        self.options = self.unchecked
        self.fed = upto
        return logits[:, -need:]

    def rollback(self, fed: int) -> None:
        """Forget the tokens from ``fed`` on (they were rejected or replaced)."""
        if fed >= self.fed:
            return
        if fed < self.start:  # the window had slid past them: refill on the next call
            self.cached = False
        else:
            self.cache.truncate(fed - self.start)
        self.fed = fed


def _check_speculate(speculate: int) -> None:
    if (not isinstance(speculate, numbers.Integral) or isinstance(speculate, bool)
            or not 1 <= speculate <= MAX_SPECULATE):
        raise ValueError(f"speculate (draft tokens per step) must be an int in "
                         f"[1, {MAX_SPECULATE}]; got {speculate!r}")


def _accept_greedy(target_logits: Tensor, proposals: Tensor) -> tuple[Tensor, Tensor]:
    """target_logits (B, K+1, V), proposals (B, K) → (each position's output (B, K+1), kept
    (B, K)): the target's argmax everywhere; a proposal is kept when it equals it."""
    best = target_logits.argmax(dim=-1)  # (B, K+1)
    return best, best[:, :-1] == proposals


def _accept_sampled(target_weights: Tensor, draft_probs: Tensor, proposals: Tensor,
                    generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """The accept/reject rule. target_weights (B, K+1, V) (unnormalised ``p``), draft_probs
    (B, K, V) (``q``, each row sums to 1), proposals (B, K) drawn from ``q`` → (each
    position's output (B, K+1), kept (B, K)).

    Position i outputs its proposal when kept (probability ``min(1, p/q)``), otherwise a
    sample of ``max(0, p - q)`` renormalised; position K outputs a sample of ``p`` (the bonus
    token). Either way the output at i is distributed as ``p`` given the tokens before it.
    """
    b, k = proposals.shape
    p = target_weights / target_weights.sum(dim=-1, keepdim=True)  # (B, K+1, V)
    bonus = torch.multinomial(p[:, k], 1, generator=generator)  # (B, 1)
    if k == 0:
        return bonus, proposals.new_zeros(b, 0, dtype=torch.bool)
    p_x = p[:, :k].gather(-1, proposals[..., None]).squeeze(-1)  # (B, K)
    q_x = draft_probs.gather(-1, proposals[..., None]).squeeze(-1)  # (B, K), > 0: drawn
    u = torch.rand(b, k, generator=generator, device=p.device)  # (B, K)
    kept = u * q_x < p_x  # u < p/q without dividing
    residual = (p[:, :k] - draft_probs).clamp(min=0)  # (B, K, V)
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # p == q: a rejection cannot happen
    residual = torch.where(empty, p[:, :k], residual)
    fixes = torch.multinomial(residual.reshape(b * k, -1), 1,
                              generator=generator).view(b, k)  # (B, K)
    out = torch.cat([torch.where(kept, proposals, fixes), bonus], dim=1)  # (B, K+1)
    return out, kept


@_outside_inference_mode
def speculative_generate(
    target: nn.Module,
    draft: nn.Module,
    ids: Tensor,
    max_new_tokens: int,
    *,
    speculate: int = 4,
    padding_mask: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    seed: int | None = None,
    on_token: TokenCallback | None = None,
    on_token_keeps_model: bool = False,
    stats: SpeculationStats | None = None,
) -> Tensor:
    """Extend ``ids`` (B, T) by up to ``max_new_tokens`` tokens of ``target``, with
    ``draft`` proposing ``speculate`` tokens per step; returns (B, T + new).

    The arguments mean what they mean for ``generate`` (``padding_mask``: bool (B, T), True
    on real tokens, prompts left-padded; ``temperature=0`` greedy; ``on_token(next_ids)``
    after every emitted token, True stops; ``on_token_keeps_model``: it changes neither
    model, so the int8 token kernel's one check per model holds across steps). Greedy
    output equals ``generate(target, ...)``'s token for token; sampled tokens follow the
    target's distribution (not the same draws as ``generate`` with the same ``seed``).
    ``stats`` (a ``SpeculationStats``), if given, is filled with the proposals made and
    kept. Raises ``ValueError`` for what ``generate``
    refuses, for ``speculate`` outside [1, ``MAX_SPECULATE``], a draft that does not fit
    the target (``check_draft``) and a ``repetition_penalty`` (not supported: the penalty
    of a position depends on the proposals before it); ``NonFiniteLogitsError`` for NaN or
    inf logits of either model.
    """
    _check_speculate(speculate)
    check_sampling(temperature, top_k, top_p)
    check_draft(target, draft)
    _check_flags(on_token_keeps_model=on_token_keeps_model)
    check_request("speculative_generate", target, ids, max_new_tokens, padding_mask, eos_id)
    param = next(target.parameters())
    device = param.device
    _check_budget(target, ids.shape, max_new_tokens, True, param)
    _check_budget(draft, ids.shape, max_new_tokens, True, next(draft.parameters()))
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    greedy = temperature < GREEDY_TEMPERATURE
    stats = stats if stats is not None else SpeculationStats()
    modes = (target.training, draft.training)
    target.eval()
    draft.eval()

    b, prompt_len = ids.shape
    # Room for every token; a step proposes at most one fewer than the tokens still due.
    tokens = torch.zeros(b, prompt_len + max_new_tokens, dtype=ids.dtype, device=device)
    tokens[:, :prompt_len] = ids
    real = torch.ones(tokens.shape, dtype=torch.bool, device=device)
    if padding_mask is not None:
        real[:, :prompt_len] = padding_mask
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    verifier, proposer = _Decoder(target, b, prompt_len), _Decoder(draft, b, prompt_len)
    narrow = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    length = prompt_len
    try:
        # The loop owns both models and caches between its own steps, as generate's does:
        # the block kernel checks each model once, and again after on_token.
        with small_op_kernels(param), decode_block.checks_held() as hold:
            while length - prompt_len < max_new_tokens:
                left = max_new_tokens - (length - prompt_len)
                room = verifier.max_len + verifier.window_start(length) - length
                k = min(speculate, left - 1, room)  # ≥ 0; the target's window stays put
                draft_probs = []
                for i in range(k):  # the draft proposes, one token per call
                    d_logits = proposer.feed(tokens, real, length + i, 1)[:, -1]  # (B, V)
                    _check_finite(d_logits, "the draft", length + i - prompt_len)
                    if greedy:
                        x = d_logits.argmax(dim=-1)  # (B,)
                    else:
                        q = sampling_weights(d_logits, **narrow)  # (B, V)
                        q = q / q.sum(dim=-1, keepdim=True)
                        x = torch.multinomial(q, 1, generator=generator).squeeze(-1)
                        draft_probs.append(q)
                    tokens[:, length + i] = x
                stats.draft_calls += k
                # The target scores the last token and every proposal in one forward.
                t_logits = verifier.feed(tokens, real, length + k, k + 1)  # (B, K+1, V)
                _check_finite(t_logits, "the target", length - prompt_len)
                stats.target_calls += 1
                proposals = tokens[:, length : length + k]  # (B, K)
                if greedy:
                    out, kept = _accept_greedy(t_logits, proposals)
                else:
                    weights = sampling_weights(t_logits, **narrow)  # (B, K+1, V)
                    q_all = torch.stack(draft_probs, dim=1) if k else weights[:, :0]
                    out, kept = _accept_sampled(weights, q_all, proposals, generator)
                kept = kept | finished[:, None]  # a finished row holds nobody back
                n = int(kept.long().cumprod(dim=1).sum(dim=1).min()) if k else 0
                out = out[:, : n + 1].clone()  # (B, n+1) what every row emits this step
                if eos_id is not None:
                    out, finished = _after_eos(out, finished, eos_id)
                stats.drafted += b * k
                stats.accepted += b * n
                stats.per_step_accepted.append(n)
                verifier.rollback(length + n)  # keep the prefix every row agreed on
                proposer.rollback(length + n)
                stop = False
                for j in range(n + 1):  # n + 1 <= k + 1 <= left
                    tokens[:, length] = out[:, j]
                    length += 1
                    stats.new_tokens += 1
                    if on_token is not None and on_token(out[:, j]):
                        stop = True
                        break
                if on_token is not None and not on_token_keeps_model:
                    hold.forget()
                if stop or (eos_id is not None and bool(finished.all())):
                    break
    finally:
        target.train(modes[0])
        draft.train(modes[1])
    return tokens[:, :length]


def _check_finite(logits: Tensor, which: str, step: int) -> None:
    try:
        _check_finite_logits(logits.reshape(-1, logits.shape[-1]), f"{which}'s logits")
    except NonFiniteLogitsError as err:
        raise NonFiniteLogitsError(f"{which} returned non-finite logits (NaN or inf) around "
                                   f"generated token {step + 1}: {err}") from None


def _after_eos(out: Tensor, finished: Tensor, eos_id: int) -> tuple[Tensor, Tensor]:
    """out (B, N) → the same with every token after a row's first ``eos_id`` (or all of a
    row already finished) replaced by ``eos_id``, and the rows finished now."""
    is_eos = out == eos_id  # (B, N)
    before = is_eos.long().cumsum(dim=1) - is_eos.long()  # eos strictly earlier in the row
    done = finished[:, None] | (before > 0)  # (B, N)
    return out.masked_fill(done, eos_id), finished | is_eos.any(dim=1)
