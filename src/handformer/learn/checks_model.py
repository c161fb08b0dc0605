"""Checkers for the reader's language model, training step and generation loop.

Shape legend: ``B`` batch, ``T`` tokens, ``V`` vocabulary.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from handformer.config import ModelConfig
from handformer.data import LMWindows
from handformer.learn.checks_attention import shape_problem
from handformer.learn.result import (
    CheckResult,
    ReaderError,
    call_reader,
    fail,
    never_raises,
    passed,
)
from handformer.loss import IGNORE_INDEX, lm_loss
from handformer.models.decoder_lm import DecoderLM

__all__ = ["check_generate", "check_lm", "check_training_loop"]

TRAIN_STEPS = 40
TRAIN_TEXT = ("the cat sat on the mat. the dog sat on the log. a cat and a dog met on a mat. "
              "the log was by the mat, and the cat was on the log. ") * 6
LOSS_MARGIN = 0.35  # how much worse than the library's model a correct one may end


def _windows() -> tuple[int, LMWindows, LMWindows]:
    chars = sorted(set(TRAIN_TEXT))
    ids = torch.tensor([chars.index(c) for c in TRAIN_TEXT])
    cut = int(len(ids) * 0.85)
    return len(chars), LMWindows(ids[:cut], 24), LMWindows(ids[cut:], 24)


def _library_lm(vocab: int, d_model: int, num_heads: int, num_layers: int, d_ff: int,
                max_len: int) -> DecoderLM:
    return DecoderLM(ModelConfig(vocab_size=vocab, d_model=d_model, n_heads=num_heads,
                                 n_layers=num_layers, d_ff=d_ff, max_len=max_len,
                                 positional="sinusoidal", attention="manual",
                                 activation="relu", tie_weights=False))


def _train(name: str, model: nn.Module, train: LMWindows,
           val: LMWindows) -> float:
    """TRAIN_STEPS of AdamW on the same batches for every model; returns the val loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(TRAIN_STEPS):
        b = train.random_batch(8, g)
        loss = lm_loss(call_reader(name, "forward(ids) while training", model, b.ids),
                       b.targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        val_losses = [lm_loss(call_reader(name, "forward(ids)", model, b.ids), b.targets).item()
                      for b in val.fixed_batches(2, 8)]
    return sum(val_losses) / len(val_losses)


@never_raises
def check_lm(cls: Callable[..., nn.Module], d_model: int = 32, num_heads: int = 4,
             num_layers: int = 2, d_ff: int = 64, max_len: int = 32) -> CheckResult:
    """``cls(vocab_size=, d_model=, num_heads=, num_layers=, d_ff=, max_len=)``: a decoder LM
    whose ``forward(ids)``, ids (B, T), applies its own causal mask and returns logits
    (B, T, V). Checked: the shape, causality, that positions reach the output; then it is
    trained for a few dozen steps next to handformer's ``DecoderLM`` of the same shape
    (sinusoidal positions, pre-norm, ReLU) on the same batches, and must end within
    ``LOSS_MARGIN`` nats of it."""
    name = "check_lm"
    vocab, train, val = _windows()
    sizes = dict(d_model=d_model, num_heads=num_heads, num_layers=num_layers, d_ff=d_ff,
                 max_len=max_len)
    torch.manual_seed(0)
    try:
        model = call_reader(name, "cls(vocab_size=..., ...)", cls, vocab_size=vocab, **sizes)
        model.eval()
        ids = val.fixed_batches(1, 2)[0].ids  # (B, T)
        b, t = ids.shape
        with torch.no_grad():
            logits = call_reader(name, "forward(ids)", model, ids)
            problem = shape_problem("forward(ids)", logits, (b, t, vocab))
            if problem is not None:
                return fail(name, problem)
            logits = logits.float()  # a float64 answer is compared too
            changed = ids.clone()
            changed[:, -1] = (changed[:, -1] + 1) % vocab  # a different last token
            moved = (call_reader(name, "forward(ids)", model, changed)[:, :-1]
                     - logits[:, :-1]).abs().max().item()
            if moved > 1e-5:
                first = ids.clone()
                first[:, 0] = (first[:, 0] + 1) % vocab  # does the last position see token 0?
                sees_first = (call_reader(name, "forward(ids)", model, first)[:, -1]
                              - logits[:, -1]).abs().max().item() > 1e-5
                return fail(name, f"changing the last token moved the logits of earlier "
                                  f"positions by up to {moved:.3g}: the future leaks",
                            "mask_missing" if sees_first else "mask_transposed")
            same = torch.full((1, t), int(ids[0, 0]))  # one token, repeated
            rows = call_reader(name, "forward(ids)", model, same)[0]  # (T, V)
            if torch.allclose(rows, rows[:1].expand_as(rows), atol=1e-5):
                return fail(name, "a repeated token gets the same logits at every position",
                            "positions_missing")
        first_loss = lm_loss(logits, val.fixed_batches(1, 2)[0].targets).item()
        mine_val = _train(name, model, train, val)
        torch.manual_seed(0)
        reference = _library_lm(vocab, d_model, num_heads, num_layers, d_ff, max_len)
        theirs_val = _train(name, reference, train, val)
    except ReaderError as err:
        return err.result
    summary = (f"after {TRAIN_STEPS} steps: val loss {mine_val:.3f}, handformer's DecoderLM "
               f"of the same shape {theirs_val:.3f} (first loss {first_loss:.3f}, "
               f"ln V = {math.log(vocab):.3f})")
    if not math.isfinite(mine_val) or mine_val > theirs_val + LOSS_MARGIN:
        return fail(name, f"it trains worse than the library's model: {summary}")
    return passed(name, f"logits (B, T, V), causal, position-aware; {summary}")


def _fresh_lm() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(ModelConfig(vocab_size=12, d_model=16, n_heads=2, n_layers=1, max_len=16))


@never_raises
def check_training_loop(fn: Callable[..., object]) -> CheckResult:
    """``fn(model, optimizer, ids, pad_id)``: one training step on ids (B, T + 1), rows
    right-padded with ``pad_id``. It builds inputs and next-token targets, computes the
    cross-entropy over the real targets only, backpropagates, steps the optimizer and returns
    the loss (a float or a 0-d tensor). ``model(inputs)`` returns logits (B, T, V)."""
    name = "check_training_loop"
    pad = 0
    batches = [torch.tensor([[4, 5, 6, 7, 8, 9, 10], [4, 6, 8, 10, 5, pad, pad]]),
               torch.tensor([[9, 8, 7, 6, 5, 4, 11], [11, 10, 9, pad, pad, pad, pad]])]

    def targets_of(ids: Tensor) -> Tensor:
        return ids.masked_fill(ids == pad, IGNORE_INDEX)

    def loss_variants(model: nn.Module, ids: Tensor) -> dict[str, float]:
        with torch.no_grad():
            return {
                "targets_unshifted": lm_loss(model(ids[:, :-1]), targets_of(ids[:, :-1])).item(),
                "targets_shifted_right": lm_loss(model(ids[:, 1:]),
                                                 targets_of(ids[:, :-1])).item(),
                "loss_counts_padding": lm_loss(model(ids[:, :-1]), ids[:, 1:]).item(),
            }

    model, reference = _fresh_lm(), _fresh_lm()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    accumulated = copy.deepcopy(reference)
    acc_optimizer = torch.optim.SGD(accumulated.parameters(), lr=0.5)
    try:
        for n, ids in enumerate(batches, start=1):
            want = lm_loss(reference(ids[:, :-1]), targets_of(ids[:, 1:]))
            variants = loss_variants(model, ids)
            got = call_reader(name, "fn(model, optimizer, ids, pad_id)", fn,
                              model, optimizer, ids, pad)
            got = float(got.detach()) if isinstance(got, Tensor) else got
            if not isinstance(got, float):
                return fail(name, f"fn returned {type(got).__name__}, expected the loss")
            if abs(got - want.item()) > 1e-4:
                mistake = next((k for k, v in variants.items() if abs(got - v) < 1e-4), None)
                return fail(name, f"step {n}: fn returned loss {got:.4f}, expected "
                                  f"{want.item():.4f} (inputs ids[:, :-1], targets ids[:, 1:], "
                                  "pads ignored)", mistake)
            ref_optimizer.zero_grad()
            want.backward()
            ref_optimizer.step()
            lm_loss(accumulated(ids[:, :-1]), targets_of(ids[:, 1:])).backward()
            acc_optimizer.step()  # the mistake: .grad never reset
            params = zip(model.parameters(), reference.parameters(), strict=True)
            if not all(torch.allclose(p, r, atol=1e-5) for p, r in params):
                unchanged = n == 1 and all(torch.equal(p, q) for p, q in zip(
                    model.parameters(), _fresh_lm().parameters(), strict=True))
                if unchanged:
                    return fail(name, "the weights did not change: call loss.backward() and "
                                      "optimizer.step()")
                stale = all(torch.allclose(p, a, atol=1e-5) for p, a in zip(
                    model.parameters(), accumulated.parameters(), strict=True))
                return fail(name, f"after step {n} the weights differ from one SGD step on "
                                  "this loss", "no_zero_grad" if stale else None)
    except ReaderError as err:
        return err.result
    return passed(name, "two steps: the loss over the shifted, unpadded targets, and the "
                        "weights after each step equal the reference's")


def _greedy(model: nn.Module, ids: Tensor, steps: int, position: int = -1) -> Tensor:
    for _ in range(steps):
        logits = model(ids)  # (B, T, V)
        ids = torch.cat([ids, logits[:, position].argmax(-1, keepdim=True)], dim=1)
    return ids


LOGIT_TOLERANCE = 1e-3  # a cached step and the full recompute differ by rounding, far below


def _recording(model: nn.Module) -> tuple[list[Tensor], Callable[[], None]]:
    """Record the last position's logits (B, V) of every ``model(...)`` call the reader's
    generation makes; returns them and the function that stops the recording."""
    seen: list[Tensor] = []

    def hook(module: nn.Module, args: object, output: object) -> None:
        if isinstance(output, Tensor) and output.dim() == 3:
            seen.append(output[:, -1].detach().float())  # (B, V)

    return seen, model.register_forward_hook(hook).remove


def _first_logits_off(model: nn.Module, got: Tensor, t: int, seen: list[Tensor]) -> int | None:
    """The index of the first new token whose logits, as the reader's generation computed
    them, differ from the full recompute's on the same tokens; None if they all agree, -1 if
    the calls cannot be lined up with the new tokens (fewer calls, other shapes)."""
    steps = got.size(1) - t
    if steps == 0:
        return None
    full = model(got[:, :-1]).float()  # (B, T + steps - 1, V): every step at once, causal
    want = [full[:, t - 1 + k] for k in range(steps)]  # the logits new token k is read from
    if len(seen) not in (steps, steps + 1) or any(s.shape != w.shape
                                                 for s, w in zip(seen, want, strict=False)):
        return -1  # e.g. a generation that calls model.forward directly: tokens only
    for k, (s, w) in enumerate(zip(seen, want, strict=False)):
        if not torch.allclose(s, w, rtol=LOGIT_TOLERANCE, atol=LOGIT_TOLERANCE):
            return k
    return None


@never_raises
def check_generate(fn: Callable[..., object], model: nn.Module | None = None,
                   prompt: Tensor | None = None, max_new_tokens: int = 8) -> CheckResult:
    """``fn(model, ids, max_new_tokens)`` with ids (B, T) returns (B, T + max_new_tokens): the
    prompt, then greedy tokens. Compared with greedy decoding that recomputes the whole
    sequence at every step (``model(ids)`` returning logits (B, T, V)); pass your own model
    (and a cache inside ``fn``) to check a KV cache. Default: a small untrained
    ``DecoderLM``.

    Equal tokens are not enough: a cache that computes wrong logits can still pick the same
    greedy tokens. So the logits ``fn`` gets from each ``model(...)`` call (one call per new
    token, plus at most one unused after the last) are compared with the full recompute's,
    within ``LOGIT_TOLERANCE``."""
    name = "check_generate"
    model = (_fresh_lm() if model is None else model).eval()
    ids = torch.tensor([[4, 5, 6], [7, 8, 9]]) if prompt is None else prompt  # (B, T)
    b, t = ids.shape
    seen, stop_recording = _recording(model)
    try:
        with torch.no_grad():
            try:
                got = call_reader(name, f"fn(model, ids, {max_new_tokens})", fn, model, ids,
                                  max_new_tokens)
            finally:
                stop_recording()
            problem = shape_problem("fn", got, (b, t + max_new_tokens))
            if problem is not None:
                return fail(name, problem)
            want = call_reader(name, "model(ids)", _greedy, model, ids, max_new_tokens)
            if not torch.equal(got[:, :t], ids):
                return fail(name, "the output does not start with the prompt")
            off = call_reader(name, "model(ids)", _first_logits_off, model, got, t, seen)
            if torch.equal(got, want) and off is None:
                return passed(name, f"{max_new_tokens} greedy tokens for {b} prompts and the "
                                    "logits they were picked from, the same as recomputing "
                                    "the whole sequence at every step")
            if torch.equal(got, want) and off == -1:
                return passed(name, f"{max_new_tokens} greedy tokens for {b} prompts, the same "
                                    "as recomputing the whole sequence at every step (the "
                                    "model calls could not be lined up with the tokens, so "
                                    "their logits were not compared)")
            if not torch.equal(got, want) and torch.equal(
                    got, _greedy(model, ids, max_new_tokens, position=0)):
                return fail(name, "the tokens follow the first position's logits",
                            "generate_wrong_position")
    except ReaderError as err:
        return err.result
    if off is not None and off > 0:  # whether or not the greedy tokens differ too
        return fail(name, f"the logits of the first {off} new token(s) agree with the full "
                          f"recompute's, then token {off + 1}'s differ by more than rounding "
                          f"(over {LOGIT_TOLERANCE:g})", "cache_offset")
    if off == 0:
        return fail(name, "the logits of the first new token already differ from the full "
                          "recompute's: the prompt's own pass (the prefill) computes something "
                          "else")
    first = int((got[:, t:] != want[:, t:]).any(0).int().argmax())
    if off == -1 and first > 0:
        return fail(name, f"the first {first} new token(s) agree with the full recompute, "
                          f"then token {first + 1} differs", "cache_offset")
    if off is None:  # the logits are right: the tokens were not picked from them greedily
        return fail(name, f"new token {first + 1} is not the argmax of the last position's "
                          f"logits: {got[:, t + first].tolist()} against "
                          f"{want[:, t + first].tolist()}")
    return fail(name, f"new token {first + 1} already differs: {got[:, t + first].tolist()} "
                      f"against {want[:, t + first].tolist()} (the argmax of the last "
                      "position's logits)")
