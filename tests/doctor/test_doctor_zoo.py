"""A zoo of broken models: each bug must be caught by the check the tutorial points to.

Every variant is built here, inside the test, by subclassing or wrapping one handformer
module — never by editing the source. For each, the *first* failing check in the report's
tutorial order must be the expected one (so the report sends the user to the right place),
and its hint must name the fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from handformer.data import Batch, collate_sequences
from handformer.doctor import Report, Status, run
from handformer.masks import causal_mask
from handformer.models.decoder_lm import DecoderLM
from handformer.nn.attention import MultiHeadAttention
from handformer.nn.feedforward import FeedForward
from tests.doctor.test_doctor import LR, nan_safe_lm_loss, tiny_model, tiny_tokenizer, tiny_windows


# -- the breakers ---------------------------------------------------------------------------
class TransposedCausal(MultiHeadAttention):
    """Builds its own causal mask — transposed: query i sees keys j ≥ i."""

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | None = None,
                is_causal: bool = False, **kw: Any) -> tuple[Tensor, Tensor | None]:
        if is_causal:
            causal = causal_mask(x.shape[1]).T  # (T, T), upper-triangular
            mask = causal if mask is None else mask & causal
        return super().forward(x, context, mask=mask, is_causal=False, **kw)


class MissingCausal(MultiHeadAttention):
    """Forgets the causal mask altogether."""

    def forward(self, x: Tensor, context: Tensor | None = None, *, is_causal: bool = False,
                **kw: Any) -> tuple[Tensor, Tensor | None]:
        return super().forward(x, context, is_causal=False, **kw)


class InvertedPolarity(MultiHeadAttention):
    """Reads the padding mask with torch's polarity (True = ignore)."""

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | None = None,
                **kw: Any) -> tuple[Tensor, Tensor | None]:
        return super().forward(x, context, mask=None if mask is None else ~mask, **kw)


class Unscaled(MultiHeadAttention):
    """Scores q·kᵀ without the 1/√D: q is pre-multiplied by √D, cancelling the kernel's scale."""

    def _project(self, x: Tensor, context: Tensor | None) -> tuple[Tensor, Tensor]:
        q, kv = super()._project(x, context)
        return q * math.sqrt(self.head_dim), kv


class FusedPathOnlyUnscaled(MultiHeadAttention):
    """A bug only in the fast path: when the fused kernel runs, the scores lose their 1/√D.
    Calls that ask for weights run the readable kernel, which stays correct."""

    def forward(self, x: Tensor, context: Tensor | None = None, *, need_weights: bool = False,
                **kw: Any) -> tuple[Tensor, Tensor | None]:
        self.fast_path = self.attention == "sdpa" and not need_weights
        return super().forward(x, context, need_weights=need_weights, **kw)

    def _project(self, x: Tensor, context: Tensor | None) -> tuple[Tensor, Tensor]:
        q, kv = super()._project(x, context)
        return (q * math.sqrt(self.head_dim) if self.fast_path else q), kv


class DetachedFFN(FeedForward):
    """A layer whose output is cut from the graph: it runs, but never learns."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x).detach()


class PositionsNotAdded(nn.Module):
    """Computes the positional encoding — and then adds nothing of it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, positions: Tensor) -> Tensor:
        return self.inner(positions) * 0.0


def swap_class(model: nn.Module, base: type[nn.Module], broken: type[nn.Module]) -> nn.Module:
    for module in model.modules():
        if type(module) is base:
            module.__class__ = broken
    return model


def drop_positions(model: DecoderLM) -> DecoderLM:
    model.embed.positions = PositionsNotAdded(model.embed.positions)
    return model


def pads_counted(logits: Tensor, targets: Tensor) -> Tensor:
    """A loss that counts padding: IGNORE_INDEX targets become the pad id 0."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten().clamp(min=0))


def unshifted_batch() -> Batch:
    windows = tiny_windows()
    b = windows.fixed_batches(1, 4)[0]
    return Batch(ids=b.ids, targets=b.ids.clone())  # targets not shifted


def pad_targets_batch() -> Batch:
    """Padded data whose pad positions carry the pad id as target, not IGNORE_INDEX."""
    tok = tiny_tokenizer()
    b = collate_sequences([tok.encode("the quick brown fox"), tok.encode("lazy dog")],
                          pad_id=tok.pad_id)
    targets = b.targets.clone()
    targets[~b.padding_mask] = tok.pad_id
    return Batch(b.ids, targets, b.padding_mask)


def inverted_data_mask_batch() -> Batch:
    tok = tiny_tokenizer()
    b = collate_sequences([tok.encode("the quick brown fox"), tok.encode("lazy dog")],
                          pad_id=tok.pad_id)
    return Batch(b.ids, b.targets, ~b.padding_mask)


@dataclass
class Case:
    build: Callable[[], nn.Module]
    expected: str  # the check the tutorial would point to: must be the first FAIL
    evidence: tuple[str, ...]  # words the evidence must contain
    hint: tuple[str, ...]  # words the hint must contain (the fix)
    run_kwargs: dict[str, Any] = field(default_factory=dict)
    also_fail: frozenset[str] = frozenset()  # later checks that may fail as a consequence


ZOO: dict[str, Case] = {
    "causal mask transposed": Case(
        lambda: swap_class(tiny_model(), MultiHeadAttention, TransposedCausal),
        "causality probe", ("transposed", "upper-triangular"), ("tril", "not its transpose"),
        also_fail=frozenset({"cached vs uncached decoding"})),
    "causal mask missing": Case(
        lambda: swap_class(tiny_model(), MultiHeadAttention, MissingCausal),
        "causality probe", ("missing", "all ones"), ("tril", "not left out"),
        also_fail=frozenset({"cached vs uncached decoding"})),
    "mask polarity inverted": Case(
        lambda: swap_class(tiny_model(), MultiHeadAttention, InvertedPolarity),
        "padding probe", ("pad tokens changed the logits",), ("True on real tokens",),
        also_fail=frozenset({"pad keys get zero attention"})),
    "no 1/sqrt(d) scaling": Case(
        lambda: swap_class(tiny_model(), MultiHeadAttention, Unscaled),
        "attention scale", ("not divided by √D",), ("math.sqrt(D)",)),
    "a bug only in the fused kernel": Case(
        lambda: swap_class(tiny_model(attention="sdpa"), MultiHeadAttention,
                           FusedPathOnlyUnscaled),
        "attention kernels agree", ("sdpa vs manual",), ("same mask and scale",)),
    "positional encoding not added": Case(
        lambda: drop_positions(tiny_model()),
        "position probe", ("identical logits at every position", "uniform attention"),
        ("x = embed(ids) + pos(positions)",),
        also_fail=frozenset({"gradient flow"})),  # the zeroed table gets zero gradient
    "targets not shifted": Case(
        tiny_model, "targets shifted by one", ("not shifted", "targets == ids at 100.0%"),
        ("targets[:, t] = ids[:, t + 1]",), {"data": unshifted_batch()}),
    "padding not ignored in the loss": Case(
        tiny_model, "padding ignored by the loss", ("changed the loss",),
        ("ignore_index=IGNORE_INDEX",), {"loss_fn": pads_counted}),
    "pad positions carry the pad id as target": Case(
        tiny_model, "padding ignored by the loss", ("real target instead of IGNORE_INDEX",),
        ("IGNORE_INDEX = -100",), {"data": pad_targets_batch()}),
    "padding mask inverted in the data": Case(
        tiny_model, "padding mask in the data", ("inverted",), ("True on real tokens",),
        {"data": inverted_data_mask_batch()},
        # consequences: the "real" tokens it hides have no keys left to attend to, so
        # attention gets no gradient, and the shift/ignore checks read the wrong positions
        also_fail=frozenset({"targets shifted by one", "padding ignored by the loss",
                             "gradient flow"})),
    "layer output detached": Case(
        lambda: swap_class(tiny_model(), FeedForward, DetachedFFN),
        "gradient flow", ("no gradient at all", "blocks.0.ffn.fc_in"), (".detach()",)),
    "learning rate too high": Case(
        tiny_model, "update/weight ratio", ("as large as the weights",),
        ("lower the learning rate",), {"lr": 100.0},
        also_fail=frozenset({"overfit one batch"})),
    "optimizer not given the model's parameters": Case(
        tiny_model, "overfit one batch", ("stuck",), ("hold the model's parameters",),
        {"optimizer": lambda params, lr: torch.optim.AdamW([nn.Parameter(torch.zeros(1))],
                                                           lr=lr)}),
}


def run_case(case: Case) -> Report:
    kwargs = {"loss_fn": nan_safe_lm_loss, "lr": LR, **case.run_kwargs}
    data = kwargs.pop("data", tiny_windows())
    return run(case.build(), data, **kwargs)


@pytest.mark.parametrize("bug", list(ZOO))
def test_each_bug_is_caught_first_by_the_check_the_tutorial_points_to(bug: str) -> None:
    case = ZOO[bug]
    report = run_case(case)
    failed = [c.name for c in report.failed]
    assert failed and failed[0] == case.expected, {c.name: c.evidence for c in report.failed}
    assert set(failed) <= {case.expected} | case.also_fail, failed
    check = report.get(case.expected)
    for word in case.evidence:
        assert word in check.evidence, (word, check.evidence)
    for word in case.hint:
        assert word in check.hint, (word, check.hint)
    assert report.exit_code == 1


def test_lr_blow_up_is_named_by_the_learning_check_too() -> None:
    # Whether lr = 100 overflows to NaN or only climbs to a huge finite loss depends on the
    # CPU's kernels; either way the learning check must name the blow-up and the learning rate.
    check = run_case(ZOO["learning rate too high"]).get("overfit one batch")
    assert check.status is Status.FAIL
    assert "blew up at step" in check.evidence and "lr / 10" in check.hint


class _Scripted(torch.optim.Optimizer):
    """An 'optimizer' whose every step applies ``update`` to the weights: a divergence on
    demand, the same on every CPU."""

    def __init__(self, params: Any, update: Callable[[Tensor], None]) -> None:
        super().__init__(params, {})
        self.update = update

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                self.update(p)


@pytest.mark.parametrize(("update", "how"), [
    (lambda p: p.mul_(100.0), "rose to"),  # huge but finite logits
    (lambda p: p.fill_(float("nan")), "went non-finite"),
])
def test_a_finite_blow_up_and_an_overflow_get_the_same_diagnosis(
        update: Callable[[Tensor], None], how: str) -> None:
    check = run(tiny_model(), tiny_windows(), lr=LR, loss_fn=nan_safe_lm_loss,
                optimizer=lambda params, lr: _Scripted(params, update)).get("overfit one batch")
    assert check.status is Status.FAIL
    assert "blew up at step 1" in check.evidence and how in check.evidence, check.evidence
    assert "lr / 10" in check.hint


def test_a_users_transposed_mask_builder_fails_the_builder_check() -> None:
    def transposed_builder(t_q: int, t_k: int | None = None) -> Tensor:
        return causal_mask(t_q, t_k).T

    def torch_polarity_builder(t: int) -> Tensor:
        return ~torch.tril(torch.ones(t, t, dtype=torch.bool))  # True = ignore

    def additive_builder(t: int) -> Tensor:  # the float convention: 0 keep, -inf drop
        return torch.full((t, t), float("-inf")).triu(1)

    check = run(tiny_model(), tiny_windows(), lr=LR,
                causal_mask_fn=transposed_builder).get("mask builders")
    assert check.status is Status.FAIL and "transposed" in check.evidence
    check = run(tiny_model(), tiny_windows(), lr=LR,
                causal_mask_fn=torch_polarity_builder).get("mask builders")
    assert check.status is Status.FAIL and "inverted polarity" in check.evidence
    check = run(tiny_model(), tiny_windows(), lr=LR,
                causal_mask_fn=additive_builder).get("mask builders")
    assert check.status is Status.PASS and "end alignment not checked" in check.evidence
