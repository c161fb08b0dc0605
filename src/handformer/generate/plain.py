"""Autoregressive generation: one forward pass over the prompt, then one token per step.

* Sampling: greedy (``temperature == 0``), temperature, top-k, top-p (nucleus) and a
  repetition penalty, reproducible with ``seed``.
* The KV cache (``use_cache=True``) keeps every layer's keys and values, so a step costs one
  token's worth of compute instead of the whole context's. A step is the model's own
  ``forward(new_ids, cache=cache)`` — there is no separate decoding copy of the layers — with
  the per-call input checks off (``validate=False``) for the tokens sampled here; the prompt
  is checked once, on the first call. Cached and uncached generation follow the same context
  window and give the same tokens. Greedy decoding of one request whose int8 model the
  token kernel serves (``nn.decode_block``) runs that call and the argmax as one C call
  (``greedy_token``): the same computation and the same tokens, without the tensor ops
  between tokens, which run with cold caches after the weights' stream.
* The window: a model is run on at most ``max_len`` tokens. When the context outgrows it,
  the window slides forward by half its length and the cache is refilled from the kept
  tokens — one refill every ``max_len / 2`` steps instead of one per step.
* Batches of prompts of different lengths are left-padded; position ids count real tokens
  only, so each row generates what it would generate alone. A prompt longer than the window
  is read from its end (the same slide), with one ``DataWarning`` saying how much was cut.
* Numbers are checked before the first forward (``check_sampling``): ``temperature`` is a
  finite number ≥ 0, ``top_p`` lies in (0, 1], ``top_k`` is a positive int and
  ``repetition_penalty`` a finite number > 0; NaN and inf are refused by name.
* Tiny temperatures decode greedily, never overflow: when logits / temperature overflows
  float32, the row's maximum is subtracted first (softmax is unchanged by the shift, and the
  result cannot overflow); below ``GREEDY_TEMPERATURE`` (1e-30, near float32's smallest
  normal number) the temperature itself is unrepresentable and the argmax is taken — the
  limit of sampling as the temperature goes to 0.
* Never a sample from a non-finite distribution: logits holding NaN or ``+inf`` (a model
  with damaged weights, an overflow in half precision), or overflowing once divided by the
  repetition penalty, raise ``NonFiniteLogitsError`` (a ``ValueError``) saying which and at
  which token; ``-inf`` entries (banned tokens) are fine while a row keeps a finite one.

Shape legend: ``B`` batch, ``T`` sequence so far, ``V`` vocabulary.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from handformer.config import ModelConfig
from handformer.data.classification import DataWarning
from handformer.masks import check_padding_mask
from handformer.models.budget import Estimate, check_fits, generation_estimate
from handformer.models.decoder_lm import DecoderLM
from handformer.nn import decode_block
from handformer.nn.kv_cache import DecoderCache

__all__ = ["GREEDY_TEMPERATURE", "NonFiniteLogitsError", "apply_repetition_penalty",
           "check_request", "check_sampling", "generate", "sample_next", "sampling_weights",
           "slide_window", "small_op_kernels"]

# Below this temperature sampling takes the argmax (the T → 0 limit): float32 cannot hold
# the temperature itself much lower (its smallest normal number is ~1.2e-38).
GREEDY_TEMPERATURE = 1e-30

TokenCallback = Callable[[Tensor], bool | None]


def apply_repetition_penalty(logits: Tensor, history: Tensor, history_mask: Tensor | None,
                             penalty: float) -> Tensor:
    """CTRL-style penalty: tokens already present get their logit divided by ``penalty``
    when positive, multiplied when negative. logits (B, V), history (B, T); padding in
    ``history`` (``history_mask`` False) does not count."""
    if penalty == 1.0:
        return logits
    real = torch.ones_like(history) if history_mask is None else history_mask.long()  # (B, T)
    counts = torch.zeros(logits.shape, dtype=torch.long, device=logits.device)  # (B, V)
    counts.scatter_add_(1, history, real)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(counts > 0, penalised, logits)


class NonFiniteLogitsError(ValueError):
    """Logits that cannot be sampled from: NaN, ``+inf``, or a row with no finite entry."""


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_sampling(temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None, repetition_penalty: float = 1.0) -> None:
    """``ValueError`` naming the setting for anything ``sample_next``/``generate`` would
    misuse: a non-number, NaN or inf, or a value out of range."""
    if not _is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 and finite (0 = greedy); got "
                         f"{temperature!r}")
    if top_k is not None and (not isinstance(top_k, numbers.Integral)
                              or isinstance(top_k, bool) or top_k <= 0):
        raise ValueError(f"top_k must be a positive int or None; got {top_k!r}")
    if top_p is not None and (not _is_number(top_p) or not 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must lie in (0, 1] (or be None); got {top_p!r}")
    if (not _is_number(repetition_penalty) or not math.isfinite(repetition_penalty)
            or repetition_penalty <= 0):
        raise ValueError(f"repetition_penalty must be > 0 and finite (1 = off); got "
                         f"{repetition_penalty!r}")


def _all_finite(x: Tensor) -> bool:
    """Whether every entry is finite, in one reduction and one host read: a NaN or an inf
    anywhere makes the sum non-finite (a sum of finite logits cannot overflow float32 in
    practice; if it did, the caller's exact check below would clear it)."""
    return math.isfinite(float(x.sum()))


def _check_finite_logits(logits: Tensor, what: str) -> None:
    """``NonFiniteLogitsError`` unless every entry is finite or ``-inf`` and every row keeps
    a finite one. The common case costs one reduction (``_all_finite``)."""
    if _all_finite(logits):
        return
    nan, pos_inf = torch.isnan(logits), torch.isposinf(logits)
    bad_rows = (nan | pos_inf).any(dim=-1) | ~torch.isfinite(logits).any(dim=-1)  # (B,)
    if bool(bad_rows.any()):
        rows = bad_rows.nonzero().flatten().tolist()
        raise NonFiniteLogitsError(
            f"{what} cannot be sampled from: rows {rows[:5]} hold {int(nan.sum())} NaN and "
            f"{int(pos_inf.sum())} +inf value(s), or no finite value at all")


def sampling_weights(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Tensor:
    """logits (..., V) → the weights ``sample_next`` draws from (..., V): softmax of
    ``logits / temperature``, with the tokens outside ``top_k`` and then outside ``top_p``'s
    nucleus set to 0 (not renormalised: divide by the sum for a distribution). One function,
    so that speculative decoding narrows the draft's and the target's logits exactly as
    plain sampling does. Needs ``temperature >= GREEDY_TEMPERATURE`` (greedy has no weights).
    """
    scaled = logits.float() / temperature  # (..., V)
    if not _all_finite(scaled):  # NaN/inf from the model, an overflow, or banned (-inf) ids
        _check_finite_logits(logits, "the logits")
        shifted = logits.float() - logits.float().amax(dim=-1, keepdim=True)  # (..., V) ≤ 0
        scaled = shifted / temperature  # in [-inf, 0]: exp cannot overflow
    logits = scaled
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (..., V)
    if top_p is not None and top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p.
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # (..., V)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (..., V)
        keep_sorted = mass_before < top_p  # the top token always stays
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
        probs = probs.masked_fill(~keep, 0.0)
    return probs


def sample_next(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """logits (B, V) → next ids (B,). ``temperature == 0`` is greedy (argmax), and so is
    any temperature below ``GREEDY_TEMPERATURE``.

    Settings are checked by ``check_sampling``; logits holding NaN or ``+inf`` raise
    ``NonFiniteLogitsError``, never a sample. A division by a tiny temperature that
    overflows is redone on max-shifted logits (same softmax, no overflow).
    """
    check_sampling(temperature, top_k, top_p)
    if temperature < GREEDY_TEMPERATURE:  # 0 included
        _check_finite_logits(logits, "the logits")
        return logits.argmax(dim=-1)
    probs = sampling_weights(logits, temperature=temperature, top_k=top_k,
                             top_p=top_p)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def slide_window(start: int, length: int, max_len: int) -> int:
    """New window start once ``length - start`` tokens exceed ``max_len``: advance by half a
    window at a time, so a cached model refills once per ``max_len // 2`` tokens."""
    overflow = length - start - max_len
    if overflow <= 0:
        return start
    stride = max(1, max_len // 2)
    return start + stride * -(-overflow // stride)


def _takes_validate(model: nn.Module) -> bool:
    """Whether ``model.forward`` has a ``validate`` keyword (``DecoderLM`` does)."""
    try:
        return "validate" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # no introspectable signature
        return False


@contextmanager
def small_op_kernels(param: Tensor) -> Iterator[None]:
    """Native CPU kernels instead of oneDNN's while decoding an fp32 model on the CPU.

    At batch 1 a decoding step is dozens of tiny ops, and oneDNN's per-call setup dominates
    the ones it takes over: exact GELU on one token's (1, 1, 4·C) activations costs ~5 µs
    through oneDNN and ~1 µs natively (measured here; 4–8 % of a 4-layer × 128 step). In
    fp32 on the CPU nothing else of the model goes through oneDNN (matmuls use BLAS), so
    only those small kernels change. bf16/fp16 models keep oneDNN (their matmuls use it),
    and so does every other device. The switch is torch's process-wide flag, restored on
    exit: code running in another thread meanwhile sees it too.
    """
    if param.device.type != "cpu" or param.dtype != torch.float32:
        yield
        return
    was_enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = was_enabled


def _outside_inference_mode(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """Run ``fn`` under ``torch.inference_mode()`` (no autograd bookkeeping per token) but
    hand back an ordinary tensor: an inference-mode tensor would raise "Inference tensors
    cannot be saved for backward" the moment a user trains on the generated ids."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Tensor:
        with torch.inference_mode():
            out = fn(*args, **kwargs)
        return out.clone()

    return wrapper


def _check_budget(model: nn.Module, shape: torch.Size, max_new_tokens: int,
                  use_cache: bool, param: Tensor) -> None:
    """Refuse (``MemoryBudgetError``) a request whose output tokens and KV cache cannot fit,
    before either is allocated: ``max_new_tokens`` 10¹² would otherwise ask torch for
    terabytes up front."""
    config = getattr(model, "config", None)
    b, length = shape
    if isinstance(config, ModelConfig):
        estimate = generation_estimate(config, b, length, max_new_tokens, use_cache=use_cache,
                                       bytes_per_value=param.element_size())
    else:  # a model of another kind: at least the token buffer it will get
        estimate = Estimate("generating this many tokens",
                            {"output tokens": b * (length + max_new_tokens) * (8 + 1)},
                            hint="ask for fewer new tokens (--max-new-tokens)")
    check_fits(estimate, param.device)


def _check_flags(**flags: object) -> None:
    """``ValueError`` naming the switch unless each is True or False: a promise such as
    ``on_token_keeps_model`` must be made on purpose, not by any truthy value ("no", 1)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False; got {value!r} "
                             f"({type(value).__name__})")


def check_request(who: str, model: nn.Module, ids: Tensor, max_new_tokens: object,
                  padding_mask: Tensor | None, eos_id: int | None) -> None:
    """The checks every decoding entry point (``who``, named in the errors) makes before it
    allocates anything: a non-empty (B, T) prompt, ``max_new_tokens`` an int ≥ 0, a padding
    mask that fits the prompt and leaves each row a real token, an ``eos_id`` in the model's
    vocabulary (finished rows keep feeding it to the model, past the prompt's one check). A
    prompt longer than the model's window gets a ``DataWarning`` (it is read from its end)."""
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"{who} expects a non-empty prompt of shape (B, T); got "
                         f"{tuple(ids.shape)}")
    if (not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens, bool)
            or max_new_tokens < 0):
        raise ValueError(f"max_new_tokens must be >= 0 (an int); got {max_new_tokens!r}")
    if padding_mask is not None:
        check_padding_mask(padding_mask, tuple(ids.shape), who)
        if not bool(padding_mask.any(dim=1).all()):
            raise ValueError("every prompt row needs at least one real (unpadded) token")
    vocab_size = getattr(model.config, "vocab_size", None)  # type: ignore[union-attr]
    if eos_id is not None and vocab_size is not None and not 0 <= eos_id < vocab_size:
        raise ValueError(f"eos_id={eos_id} is not a token id of this model "
                         f"(vocab_size={vocab_size})")
    if max_new_tokens > 0:
        _warn_if_cropped(padding_mask, ids.shape[1],
                         model.config.max_len)  # type: ignore[union-attr]


@_outside_inference_mode
def generate(
    model: nn.Module,
    ids: Tensor,
    max_new_tokens: int,
    *,
    padding_mask: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    eos_id: int | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    on_token: TokenCallback | None = None,
    on_token_keeps_model: bool = False,
) -> Tensor:
    """Extend ``ids`` (B, T) by up to ``max_new_tokens`` tokens; returns (B, T + new).

    ``padding_mask`` (B, T) bool, True on real prompt tokens (prompts of different lengths:
    ``pad_sequences(prompts, pad_id, side="left")`` from ``handformer.data.padding``).
    ``temperature=0`` is greedy; default 1.0 samples from the model's distribution, narrowed by
    ``top_k`` / ``top_p`` if given; ``seed`` makes sampling reproducible. Rows that produced
    ``eos_id`` keep emitting it; generation stops when all rows have. ``on_token(next_ids)`` is
    called after every step; returning True stops generation (streaming, stop strings). It
    may change the model between tokens (add a hook, load weights): the int8 block kernel
    (``nn.decode_block``) then checks the whole model again after every call, which costs
    a visible share of a token. ``on_token_keeps_model=True`` promises that it leaves the
    model, its tensors and hooks as they are (printing, stop strings), so the one check made
    on the first token holds for the whole generation, as it does without ``on_token``.
    ``use_cache=False`` recomputes the context every step (same tokens, slower). Runs under
    ``torch.inference_mode()``; the ids it returns are an ordinary tensor, usable in training
    afterwards. Raises ``ValueError`` for an empty or non-(B, T) prompt, a mask that is not
    bool (B, T) (a float or int one is refused: see ``handformer.masks``) or a row without
    real tokens, negative ``max_new_tokens``, an ``eos_id`` outside the vocabulary, ids the
    model refuses (checked once, on the prompt), or invalid sampling settings
    (``check_sampling``) or switches (``use_cache``, ``on_token_keeps_model``) that are not
    bools; ``NonFiniteLogitsError`` if the model's logits hold NaN or inf (or
    overflow once scaled), naming the step; ``MemoryBudgetError`` (``models.budget``) when
    the output tokens and the KV cache cannot fit in memory, before they are allocated. A
    prompt longer than the model's window is read from its end, with a ``DataWarning``.
    """
    check_sampling(temperature, top_k, top_p, repetition_penalty)
    _check_flags(use_cache=use_cache, on_token_keeps_model=on_token_keeps_model)
    check_request("generate", model, ids, max_new_tokens, padding_mask, eos_id)
    max_len: int = model.config.max_len  # type: ignore[union-attr]
    param = next(model.parameters())
    device = param.device
    _check_budget(model, ids.shape, max_new_tokens, use_cache, param)
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()

    # Room for every token up front: each step writes one column instead of copying the
    # whole sequence into a new tensor. Columns [0, length) hold the sequence so far.
    b, length = ids.shape
    tokens = torch.zeros(b, length + max_new_tokens, dtype=ids.dtype, device=device)
    tokens[:, :length] = ids
    real = torch.ones(b, length + max_new_tokens, dtype=torch.bool, device=device)
    if padding_mask is not None:
        real[:, :length] = padding_mask
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    # The cache holds at most the window, and never more than this call's tokens: a model
    # with a long window asked for a few tokens gets a cache of a few columns.
    capacity = min(max_len, length + max_new_tokens)
    cache: DecoderCache | None = (model.make_cache(b, capacity)  # type: ignore[operator]
                                  if use_cache else None)
    # The prompt is checked once, by the first forward call; every later call feeds ids this
    # loop sampled from the model's own logits (always in range), so a model whose forward
    # offers it skips the per-call checks (for DecoderLM: a host sync on the id range).
    unchecked = {"validate": False} if _takes_validate(model) else {}
    checked: dict[str, Any] = {}  # the first call: validate as usual
    start, cached = 0, False  # window start; whether the cache holds [start, length - 1)
    greedy = _greedy_kernel_may_serve(model, b, temperature, repetition_penalty)
    try:
        # The loop owns the model and cache between its own steps: the block kernel checks
        # the stack once, and again after on_token (the caller's code) ran.
        with small_op_kernels(param), decode_block.checks_held() as hold:
            for _ in range(max_new_tokens):
                new_start = slide_window(start, length, max_len)
                if cache is None:
                    logits = model(tokens[:, new_start:length], real[:, new_start:length],
                                   **checked)[:, -1]  # (B, V)
                elif new_start != start or not cached:
                    cache.reset()  # window moved (or first step): refill from the kept tokens
                    logits = model(tokens[:, new_start:length], real[:, new_start:length],
                                   cache=cache, **checked)[:, -1]  # (B, V)
                    cached = True
                elif greedy and decode_block.greedy_token(model, tokens, length, cache):
                    # The model's call and the argmax below as one C call, which wrote the
                    # token at tokens[0, length]; the rest of the step only where it is used.
                    length += 1
                    if on_token is None and eos_id is None:
                        continue
                    nxt = tokens[:, length - 1].clone()  # (1,) a tensor of its own, as below
                    if eos_id is not None:
                        finished |= nxt == eos_id  # one row: once it ends, the loop stops
                    logits = None
                else:  # the last generated token, always real: no padding mask, no causal mask
                    logits = model(tokens[:, length - 1 : length], cache=cache,
                                   **checked)[:, -1]  # (B, V)
                if logits is not None:
                    checked = unchecked
                    start = new_start
                    scored = logits
                    if repetition_penalty != 1.0:
                        scored = apply_repetition_penalty(logits, tokens[:, start:length],
                                                          real[:, start:length],
                                                          repetition_penalty)  # (B, V)
                    try:
                        nxt = sample_next(scored, temperature=temperature, top_k=top_k,
                                          top_p=top_p, generator=generator)  # (B,)
                    except NonFiniteLogitsError as err:
                        raise _blame(err, logits, length - ids.shape[1], temperature,
                                     repetition_penalty) from None
                    if eos_id is not None:
                        nxt = torch.where(finished, torch.full_like(nxt, eos_id), nxt)
                        finished |= nxt == eos_id
                    tokens[:, length] = nxt
                    length += 1
                stop = None
                if on_token is not None:
                    stop = on_token(nxt)
                    if not on_token_keeps_model:
                        hold.forget()
                if stop or (eos_id is not None and bool(finished.all())):
                    break
    finally:
        model.train(was_training)
    return tokens[:, :length]


def _greedy_kernel_may_serve(model: nn.Module, batch_size: int, temperature: float,
                             repetition_penalty: float) -> bool:
    """Whether ``decode_block.greedy_token`` may stand in for a cached step's model call and
    sampling: greedy decoding of one request, no penalty, a model whose call is
    ``DecoderLM.forward`` (which runs such a token in the same C kernel; a subclass may
    change what its call returns). The kernel checks the rest (hooks, weights, the cache)."""
    return (temperature < GREEDY_TEMPERATURE and repetition_penalty == 1.0
            and batch_size == 1 and type(model).forward is DecoderLM.forward)


def _warn_if_cropped(padding_mask: Tensor | None, length: int, max_len: int) -> None:
    """One ``DataWarning`` when prompts do not fit the window: the first step reads only the
    tokens from ``slide_window``'s start on, as every later step does."""
    start = slide_window(0, length, max_len)
    if start == 0:
        return
    cut = (torch.ones(1, start, dtype=torch.bool) if padding_mask is None
           else padding_mask[:, :start]).any(dim=1)  # (B,) rows losing a real token
    rows = int(cut.sum())
    if rows == 0:
        return
    total = 1 if padding_mask is None else padding_mask.shape[0]
    warnings.warn(f"{rows} of {total} prompt(s) are longer than the model's window "
                  f"(max_len={max_len} tokens; the longest prompt has {length}): generation "
                  f"reads only the last {length - start} tokens, the first {start} are dropped",
                  DataWarning, stacklevel=4)


def _blame(err: NonFiniteLogitsError, raw: Tensor, step: int, temperature: float,
           repetition_penalty: float) -> NonFiniteLogitsError:
    """Say whether the model produced the bad logits or the scaling overflowed them."""
    if not bool(torch.isfinite(raw).all()):
        return NonFiniteLogitsError(
            f"the model returned non-finite logits (NaN or inf) for generated token "
            f"{step + 1}: its weights may be damaged or the computation overflowed (a half-"
            f"precision --dtype? try float32; `handformer doctor --run DIR` checks a run). "
            f"Details: {err}")
    return NonFiniteLogitsError(
        f"repetition_penalty={repetition_penalty} overflowed the logits at generated token "
        f"{step + 1}; use a penalty closer to 1 (1.1-1.3 is usual). Details: {err}")
