"""Every doctor check against the *smallest* break it claims to detect, and the healthy model.

The zoo (``test_doctor_zoo.py``) breaks models grossly — a transposed mask, no 1/√D at all.
Here each check meets the least wrong version of its bug: one token of leak at one query,
one id out of range, one pad key with 1e-5 of the attention, a scale 6% off, one head
swapped in one kernel, positions one step off in the cache, an update 1% past the ratio
limit. Each must fail (or warn, where the check says it warns), and the healthy
counterpart in the same test must pass — so the check's threshold sits where it says.

Breakers are built here by subclassing or wrapping handformer modules, never by editing the
source.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from handformer.data import Batch
from handformer.doctor import Status, run
from handformer.doctor.checks_learning import check_overfit
from handformer.doctor.subject import Subject
from handformer.loss import IGNORE_INDEX
from handformer.masks import causal_mask
from handformer.models.decoder_lm import DecoderLM
from handformer.nn.attention import MultiHeadAttention
from handformer.nn.kv_cache import DecoderCache
from tests.doctor.test_doctor import LR, nan_safe_lm_loss, tiny_model, tiny_windows
from tests.doctor.test_doctor_zoo import swap_class


def status(model: nn.Module, check: str, data: Any = None, **kwargs: Any) -> Status:
    return report_of(model, data, **kwargs).get(check).status


def report_of(model: nn.Module, data: Any = None, **kwargs: Any):  # type: ignore[no-untyped-def]
    kwargs.setdefault("loss_fn", nan_safe_lm_loss)
    kwargs.setdefault("lr", LR)
    return run(model, tiny_windows() if data is None else data, **kwargs)


def one_batch() -> Batch:
    return tiny_windows().fixed_batches(1, 4)[0]  # (4, 16), no padding


# -- shapes ------------------------------------------------------------------------------------
def test_batch_check_catches_one_id_or_target_out_of_range() -> None:
    model = tiny_model()
    v = model.config.vocab_size
    good = one_batch()
    assert status(model, "batch", good) is Status.PASS
    ids = good.ids.clone()
    ids[2, 7] = v  # one token: the first id past the vocabulary
    check = report_of(model, Batch(ids, good.targets)).get("batch")
    assert check.status is Status.FAIL and f"outside [0, {v})" in check.evidence
    targets = good.targets.clone()
    targets[0, 0] = v
    check = report_of(model, Batch(good.ids, targets)).get("batch")
    assert check.status is Status.FAIL and "targets span" in check.evidence


def test_batch_check_catches_a_mask_of_the_wrong_dtype_or_targets_one_column_short() -> None:
    good = one_batch()
    mask = torch.ones_like(good.ids)  # 0/1 ints, not bool
    check = report_of(tiny_model(), Batch(good.ids, good.targets, mask)).get("batch")
    assert check.status is Status.FAIL and "expected bool" in check.evidence
    check = report_of(tiny_model(), Batch(good.ids, good.targets[:, :-1])).get("batch")
    assert check.status is Status.FAIL and "targets (4, 15) != ids (4, 16)" in check.evidence


class Wrapped(nn.Module):
    """A model around a DecoderLM whose logits pass through ``fn``."""

    def __init__(self, fn: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.inner = tiny_model()
        self.fn = fn

    def forward(self, ids: Tensor) -> Tensor:
        return self.fn(self.inner(ids))


def _one_nan(logits: Tensor) -> Tensor:
    out = logits.clone()
    out[0, 3, 5] = math.nan
    return out


def test_forward_check_catches_one_nan_logit_and_one_extra_vocabulary_column() -> None:
    assert status(Wrapped(lambda x: x), "forward pass") is Status.PASS
    check = report_of(Wrapped(_one_nan)).get("forward pass")
    assert check.status is Status.FAIL and "but 1 values are NaN/Inf" in check.evidence
    extra = Wrapped(lambda x: torch.cat([x, x[..., :1]], dim=-1))  # (B, T, V + 1)
    check = report_of(extra, vocab_size=tiny_model().config.vocab_size).get("forward pass")
    assert check.status is Status.FAIL and "expected (B, T, V)" in check.evidence


# -- masks: the builders and the data ----------------------------------------------------------
def _builder(edit: Callable[[Tensor], None]) -> Callable[..., Tensor]:
    def build(t_q: int, t_k: int | None = None) -> Tensor:
        mask = causal_mask(t_q, t_k).clone()
        edit(mask)
        return mask
    return build


def test_mask_builder_check_catches_one_wrong_entry_and_top_left_alignment() -> None:
    model = tiny_model()

    def builder_status(fn: Callable[..., Tensor]) -> Status:
        return run(model, tiny_windows(), lr=LR, causal_mask_fn=fn).get("mask builders").status

    assert builder_status(_builder(lambda m: None)) is Status.PASS
    assert builder_status(_builder(lambda m: m.__setitem__((0, 1), True))) is Status.FAIL
    assert builder_status(_builder(lambda m: m.__setitem__((5, 5), False))) is Status.FAIL

    def top_left(t_q: int, t_k: int | None = None) -> Tensor:  # torch's is_causal alignment
        t_k = t_q if t_k is None else t_k
        return torch.ones(t_q, t_k, dtype=torch.bool).tril()

    check = run(model, tiny_windows(), lr=LR, causal_mask_fn=top_left).get("mask builders")
    assert check.status is Status.FAIL and "end-aligned" in check.evidence


def _padded_batch() -> Batch:
    from handformer.data import collate_sequences
    from tests.doctor.test_doctor import tiny_tokenizer

    tok = tiny_tokenizer()
    return collate_sequences([tok.encode("the quick brown fox"), tok.encode("lazy dog")],
                             pad_id=tok.pad_id)


def test_data_mask_check_catches_one_token_marked_wrongly_either_way() -> None:
    good = _padded_batch()
    assert status(tiny_model(), "padding mask in the data", good) is Status.PASS
    hides = good.padding_mask.clone()
    hides[0, 2] = False  # one real token marked as padding
    check = report_of(tiny_model(), Batch(good.ids, good.targets, hides)).get(
        "padding mask in the data")
    assert check.status is Status.FAIL and "1 real token(s) marked as padding" in check.evidence
    shows = good.padding_mask.clone()
    shows[1, -1] = True  # one pad token marked as real
    check = report_of(tiny_model(), Batch(good.ids, good.targets, shows)).get(
        "padding mask in the data")
    assert check.status is Status.FAIL and "1 pad token(s) marked as real" in check.evidence


# -- masks: causality --------------------------------------------------------------------------
def leaking(pairs: Iterable[tuple[int, int]]) -> type[MultiHeadAttention]:
    """Attention whose causal mask also lets query i see key j, for each (i, j) given."""
    extra = list(pairs)

    class Leak(MultiHeadAttention):
        def forward(self, x: Tensor, context: Tensor | None = None, *,
                    mask: Tensor | None = None, is_causal: bool = False,
                    **kw: Any) -> tuple[Tensor, Tensor | None]:
            if is_causal:
                t = x.shape[1]
                allowed = causal_mask(t, t).clone()  # (T, T)
                for i, j in extra:
                    if j < t:
                        allowed[i, j] = True
                mask = allowed if mask is None else mask & allowed
            return super().forward(x, context, mask=mask, is_causal=False, **kw)

    return Leak


@pytest.mark.parametrize("pairs", [[(3, 4)], [(7, 8)], [(14, 15)], [(0, 1)],
                                   [(i, i + 1) for i in range(15)]],
                         ids=["query 3 sees key 4", "query 7 sees key 8", "the last pair",
                              "the first pair", "every query sees one ahead"])
def test_causality_probe_catches_one_token_of_leak_at_one_query(
        pairs: list[tuple[int, int]]) -> None:
    assert status(tiny_model(), "causality probe") is Status.PASS
    check = report_of(swap_class(tiny_model(), MultiHeadAttention, leaking(pairs))).get(
        "causality probe")
    assert check.status is Status.FAIL, check.evidence
    assert "sees the future" in check.evidence or "future keys" in check.evidence


def test_causality_probe_reads_a_one_pair_leak_off_the_weights_even_without_a_cut() -> None:
    """A leak of 1e-9 of the weight from query 3 to key 4 moves no logit past the tolerance:
    the weights still show it."""

    class Faint(MultiHeadAttention):
        def forward(self, x: Tensor, context: Tensor | None = None, *,
                    need_weights: bool = False, **kw: Any) -> tuple[Tensor, Tensor | None]:
            out, weights = super().forward(x, context, need_weights=need_weights, **kw)
            if weights is not None and weights.shape[-1] > 4:
                weights = weights.clone()
                weights[..., 3, 4] = 1e-9
            return out, weights

    check = report_of(swap_class(tiny_model(), MultiHeadAttention, Faint)).get(
        "causality probe")
    assert check.status is Status.FAIL
    assert "query 3 → key 4" in check.evidence and "moved no earlier logit" in check.evidence


def test_a_users_module_with_one_pair_of_leak_fails_the_causality_probe() -> None:
    """No handformer attention (no weights to read): the cuts alone find it (T = 16 ≤ 17:
    every cut is probed)."""
    from tests.doctor.test_doctor import UserLM, tiny_tokenizer

    class LeakyUser(UserLM):
        def forward(self, ids: Tensor) -> Tensor:
            t = ids.shape[1]
            x = self.embed(ids) + self.pos[:t]
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
            mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
            mask[9, 10] = True
            x = x + torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
            return self.head(x)

    torch.manual_seed(0)
    check = run(LeakyUser(tiny_tokenizer().vocab_size), tiny_windows(), lr=LR).get(
        "causality probe")
    assert check.status is Status.FAIL and "after position 9" in check.evidence


# -- masks: padding ----------------------------------------------------------------------------
class FirstKeyAlwaysVisible(MultiHeadAttention):
    """Lets every query see key 0 even when the padding mask hides it: one pad key visible."""

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | None = None,
                **kw: Any) -> tuple[Tensor, Tensor | None]:
        if mask is not None:
            mask = mask.clone()
            mask[..., 0] = True
        return super().forward(x, context, mask=mask, **kw)


def test_padding_probe_catches_one_visible_pad_key() -> None:
    assert status(tiny_model(), "padding probe") is Status.PASS
    check = report_of(swap_class(tiny_model(), MultiHeadAttention,
                                 FirstKeyAlwaysVisible)).get("padding probe")
    assert check.status is Status.FAIL and "left padding moved them" in check.evidence


def test_padding_probe_catches_positions_one_step_off_under_padding(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Position ids counted from 1 when a mask is given: one position of offset."""
    import handformer.models.decoder_lm as decoder_lm

    monkeypatch.setattr(decoder_lm, "positions_from_padding",
                        lambda mask: mask.long().cumsum(-1).clamp(min=0))
    check = report_of(tiny_model()).get("padding probe")
    assert check.status is Status.FAIL
    assert set(check.details["moved"]) == {"right", "left"}
    assert all(v > check.details["tolerance"] for v in check.details["moved"].values())


def faint_pad_attention(leak: float) -> type[MultiHeadAttention]:
    """Attention whose masked keys get score −log(1/leak) instead of −∞: a pad key keeps
    about ``leak`` of a real key's weight (the softmax written out, one forward path)."""

    class Faint(MultiHeadAttention):
        def forward(self, x: Tensor, context: Tensor | None = None, *,
                    mask: Tensor | None = None, is_causal: bool = False,
                    need_weights: bool = False, **kw: Any) -> tuple[Tensor, Tensor | None]:
            b, t, c = x.shape
            h, d = self.n_heads, self.head_dim
            q, k, v = F.linear(x, self.in_proj.weight, self.in_proj.bias).split(c, dim=-1)
            q, k, v = (z.view(b, t, h, d).transpose(1, 2) for z in (q, k, v))  # (B, H, T, D)
            scores = q @ k.transpose(-2, -1) / math.sqrt(d)  # (B, H, T, S)
            if is_causal:
                scores = scores.masked_fill(~causal_mask(t, t), -math.inf)
            if mask is not None:
                scores = scores + torch.where(mask, 0.0, math.log(leak))
            weights = torch.softmax(scores, dim=-1)
            out = (weights @ v).transpose(1, 2).reshape(b, t, c)
            return self.out_proj(out), (weights if need_weights else None)

    return Faint


def test_pad_key_check_catches_a_pad_key_with_a_hundred_thousandth_of_the_weight() -> None:
    """1e-5 of the attention on a pad key moves the logits by less than the padding probe's
    tolerance; the weight check (> 1e-6) sees it. Below its threshold (1e-8) it passes."""
    assert status(tiny_model(), "pad keys get zero attention") is Status.PASS
    report = report_of(swap_class(tiny_model(), MultiHeadAttention, faint_pad_attention(1e-5)))
    check = report.get("pad keys get zero attention")
    assert check.status is Status.FAIL and "attention on pad keys" in check.evidence
    assert 1e-6 < check.details["max_pad_weight"] < 1e-3
    assert report.get("padding probe").status is Status.PASS  # the weights are the sharper test
    faint = report_of(swap_class(tiny_model(), MultiHeadAttention, faint_pad_attention(1e-9)))
    assert faint.get("pad keys get zero attention").status is Status.PASS


# -- masks: scale and positions ----------------------------------------------------------------
def scaled_queries(factor: float, layers: set[int] | None = None) -> Callable[[], nn.Module]:
    """A model whose queries are multiplied by ``factor`` (in the given layers only): scores
    scaled by factor/√D instead of 1/√D."""

    class Scaled(MultiHeadAttention):
        def _project(self, x: Tensor, context: Tensor | None) -> tuple[Tensor, Tensor]:
            q, kv = super()._project(x, context)
            return q * factor, kv

    def build() -> nn.Module:
        model = tiny_model()
        for i, block in enumerate(model.blocks):
            if layers is None or i in layers:
                block.self_attn.__class__ = Scaled
        return model

    return build


@pytest.mark.parametrize(("factor", "layers", "expected"), [
    (1.0, None, Status.PASS), (1.06, None, Status.FAIL), (0.94, None, Status.FAIL),
    (1.06, {1}, Status.FAIL), (1.02, None, Status.PASS),
], ids=["healthy", "6% high", "6% low", "6% high in the second layer only", "2%: within 5%"])
def test_attention_scale_check_catches_a_scale_six_percent_off(
        factor: float, layers: set[int] | None, expected: Status) -> None:
    check = report_of(scaled_queries(factor, layers)()).get("attention scale")
    assert check.status is expected, check.evidence
    if expected is Status.FAIL:
        assert f"scaled by {factor:.3g}× the expected 1/√D" in check.evidence


def test_position_probe_fails_when_rope_or_alibi_carries_no_position() -> None:
    """RoPE with zero frequencies and ALiBi with zero slopes add nothing: no position."""
    for positional in ("rope", "alibi"):
        healthy = tiny_model(positional=positional)
        assert status(healthy, "position probe") is Status.PASS
        broken = tiny_model(positional=positional)
        for block in broken.blocks:
            attn = block.self_attn
            if positional == "rope":
                attn.rotary.inv_freq.zero_()
            else:
                attn.alibi_slopes.zero_()
        check = report_of(broken).get("position probe")
        assert check.status is Status.FAIL, (positional, check.evidence)


def test_position_probe_passes_when_a_single_position_differs() -> None:
    """Learned positions all equal but the last one: position information reaches the output,
    and the probe says so (its smallest signal is one position)."""
    model = tiny_model()
    with torch.no_grad():
        table = model.embed.positions.table.weight
        table.copy_(table[0].expand_as(table).clone())
        table[15].add_(torch.randn(table.shape[1]) * 0.1)  # (not a constant: LN removes that)
    assert status(model, "position probe") is Status.PASS
    with torch.no_grad():
        table[15].copy_(table[0])
    assert status(model, "position probe") is Status.FAIL


# -- loss --------------------------------------------------------------------------------------
class FixedLogits(nn.Module):
    """Logits 0 everywhere but ``a`` on the pad id 0 (never a target): the first loss is
    exactly ln(V − 1 + e^a), a gap over ln V that ``a`` sets."""

    def __init__(self, vocab: int, gap: float) -> None:
        super().__init__()
        self.vocab = vocab
        self.a = math.log(vocab * math.exp(gap) - vocab + 1)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, ids: Tensor) -> Tensor:
        logits = torch.zeros(*ids.shape, self.vocab)
        logits[..., 0] = self.a
        return logits * self.scale


@pytest.mark.parametrize(("gap", "expected"), [(0.0, Status.PASS), (0.2, Status.PASS),
                                               (0.3, Status.WARN), (0.9, Status.WARN),
                                               (1.1, Status.FAIL)])
def test_first_loss_bands(gap: float, expected: Status) -> None:
    v = tiny_model().config.vocab_size
    check = report_of(FixedLogits(v, gap), vocab_size=v).get("first loss")
    assert check.details["loss"] == pytest.approx(math.log(v) + gap, abs=1e-5)
    assert check.status is expected, check.evidence


def test_targets_check_catches_a_shift_of_two_and_one_wrong_target_in_sixty() -> None:
    good = one_batch()  # 4 × 16: 60 (target t, id t + 1) pairs
    assert status(tiny_model(), "targets shifted by one", good) is Status.PASS
    chunk = torch.cat([good.ids, good.targets[:, -1:]], dim=1)  # (4, 17)
    by_two = Batch(chunk[:, :-2], chunk[:, 2:])  # targets two ahead: one position of offset
    check = report_of(tiny_model(), by_two).get("targets shifted by one")
    assert check.status is Status.FAIL and "do not match" in check.evidence
    back = Batch(good.ids[:, 1:], good.ids[:, :-1])  # targets one behind
    check = report_of(tiny_model(), back).get("targets shifted by one")
    assert check.status is Status.FAIL and "wrong way" in check.evidence
    targets = good.targets.clone()
    targets[1, 4] = (targets[1, 4] + 1) % tiny_model().config.vocab_size  # 1 of 60: 98.3%
    check = report_of(tiny_model(), Batch(good.ids, targets)).get("targets shifted by one")
    assert check.status is Status.FAIL


def test_padding_loss_check_catches_one_pad_position_with_a_real_target() -> None:
    good = _padded_batch()
    assert status(tiny_model(), "padding ignored by the loss", good) is Status.PASS
    targets = good.targets.clone()
    pad_at = (~good.padding_mask).nonzero()[0]
    targets[pad_at[0], pad_at[1]] = 1
    check = report_of(tiny_model(), Batch(good.ids, targets, good.padding_mask)).get(
        "padding ignored by the loss")
    assert check.status is Status.FAIL and "1 padded position(s)" in check.evidence


def test_padding_loss_check_catches_a_loss_that_averages_over_every_position() -> None:
    def over_all(logits: Tensor, targets: Tensor) -> Tensor:
        total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                ignore_index=IGNORE_INDEX, reduction="sum")
        return total / targets.numel()  # pad positions counted in the mean

    check = report_of(tiny_model(), loss_fn=over_all).get("padding ignored by the loss")
    assert check.status is Status.FAIL and "changed the loss" in check.evidence


class NanOnEmptyRows(MultiHeadAttention):
    """Masks with −∞ and no guard: a query with no visible key gets softmax(−∞, …) = NaN."""

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | None = None,
                is_causal: bool = False, **kw: Any) -> tuple[Tensor, Tensor | None]:
        b, t, c = x.shape
        h, d = self.n_heads, self.head_dim
        q, k, v = F.linear(x, self.in_proj.weight, self.in_proj.bias).split(c, dim=-1)
        q, k, v = (z.view(b, t, h, d).transpose(1, 2) for z in (q, k, v))  # (B, H, T, D)
        allowed = causal_mask(t, t) if mask is None else mask & causal_mask(t, t)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(d)).masked_fill(~allowed, -math.inf)
        out = torch.softmax(scores, dim=-1) @ v  # (B, H, T, D)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, c)), None


def test_all_padding_check_catches_nan_from_an_empty_row() -> None:
    assert status(tiny_model(), "all-padding batch") is Status.PASS
    report = report_of(swap_class(tiny_model(), MultiHeadAttention, NanOnEmptyRows))
    check = report.get("all-padding batch")
    assert check.status is Status.FAIL and "NaN/Inf logits" in check.evidence
    assert report.get("forward pass").status is Status.PASS  # real rows are finite


# -- gradients ---------------------------------------------------------------------------------
class DetachedBiasNorm(nn.LayerNorm):
    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias.detach(), self.eps)


class ZeroedBiasNorm(nn.LayerNorm):
    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias * 0.0, self.eps)


def test_gradient_flow_catches_one_bias_cut_off_or_dead() -> None:
    assert status(tiny_model(), "gradient flow") is Status.PASS
    model = tiny_model()
    model.blocks[1].norm2.__class__ = DetachedBiasNorm
    check = report_of(model).get("gradient flow")
    assert check.status is Status.FAIL
    assert check.details["no_grad"] == ["blocks.1.norm2.bias"] and not check.details["zero_grad"]
    model = tiny_model()
    model.blocks[0].norm1.__class__ = ZeroedBiasNorm
    check = report_of(model).get("gradient flow")
    assert check.status is Status.FAIL and check.details["zero_grad"] == ["blocks.0.norm1.bias"]


def small_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """The loss / 1000: every gradient 1000× smaller, so a layer 1500× the median stays
    under the total-norm limit of 100 and only the 1000×-the-median rule can flag it."""
    return nan_safe_lm_loss(logits, targets) / 1000.0


def test_gradient_values_catch_one_nan_element_and_one_layer_past_a_thousand_medians() -> None:
    healthy = report_of(tiny_model(), loss_fn=small_loss).get("gradient values")
    assert healthy.status is Status.PASS
    norms, median = healthy.details["layer_norms"], healthy.details["median_layer_norm"]
    top = max(norms, key=lambda k: norms[k])  # scaling the largest keeps the median

    def with_hook(fn: Callable[[Tensor], Tensor], layer: str) -> DecoderLM:
        model = tiny_model()
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[0] == layer:
                p.register_hook(fn)
        return model

    def one_nan(g: Tensor) -> Tensor:
        g = g.clone()
        g.view(-1)[0] = math.nan
        return g

    check = report_of(with_hook(one_nan, "blocks.0.ffn.fc_in")).get("gradient values")
    assert check.status is Status.FAIL and "in 2 tensor(s)" in check.evidence  # weight, bias
    for times, expected in ((1500.0, Status.WARN), (700.0, Status.PASS)):
        factor = times * median / norms[top]
        model = with_hook(lambda g, f=factor: g * f, top)
        check = report_of(model, loss_fn=small_loss).get("gradient values")
        assert check.status is expected, (times, check.evidence)
        assert check.details["total_norm"] < 100  # the 1000× rule, not the total-norm one


class ScaleBy(torch.optim.Optimizer):
    """A step that multiplies every weight by 1 + lr: ‖Δw‖/‖w‖ = lr for every tensor."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.mul_(1 + group["lr"])


@pytest.mark.parametrize(("ratio", "expected"), [
    (1.01, Status.FAIL), (0.99, Status.WARN), (0.51, Status.WARN), (0.49, Status.PASS),
    (1e-3, Status.PASS), (0.0, Status.WARN),
])
def test_update_ratio_bands(ratio: float, expected: Status) -> None:
    check = report_of(tiny_model(), lr=ratio, optimizer=ScaleBy).get("update/weight ratio")
    assert check.status is expected, check.evidence
    if ratio:
        assert check.details["median"] == pytest.approx(ratio, rel=1e-3)  # fp32 rounding


# -- learning ----------------------------------------------------------------------------------
def _overfit_with(losses: list[float], factor: float = 2.0) -> Status:
    """The overfitting check on a loss that follows ``losses`` step by step (a graph through
    one parameter, so backward and the optimizer run)."""
    model = tiny_model()
    calls = {"n": 0}

    def scripted(logits: Tensor, targets: Tensor) -> Tensor:
        value = losses[min(calls["n"], len(losses) - 1)]
        calls["n"] += 1
        return logits.sum() * 0.0 + value

    subject = Subject(model, [one_batch()], scripted, lr=LR)
    return check_overfit(subject, steps=len(losses) - 1, factor=factor).status


def test_overfit_check_bands() -> None:
    """Stuck: not 10% down at the end of a budget that can judge (FAIL); between that and
    ÷factor: slow (WARN); ÷factor reached: PASS. Below MIN_STEPS_TO_JUDGE steps a loss that
    moved is only WARN (too few steps), one that never moved still FAILs."""
    from handformer.doctor.checks_learning import MIN_STEPS_TO_JUDGE

    flat = [4.0] * MIN_STEPS_TO_JUDGE  # with the last loss: a budget of MIN_STEPS_TO_JUDGE steps
    assert _overfit_with([*flat, 3.7]) is Status.FAIL  # 7.5% down
    assert _overfit_with([*flat, 3.5]) is Status.WARN  # 12.5% down
    assert _overfit_with([4.0, 3.0, 2.0]) is Status.PASS  # ÷2
    assert _overfit_with([4.0, 3.9, 3.7]) is Status.WARN  # 7.5% down, but in 2 steps
    assert _overfit_with([4.0, 4.0, 4.0]) is Status.FAIL  # never moved: stuck at any budget
    assert _overfit_with([4.0, math.nan]) is Status.FAIL


# -- paths -------------------------------------------------------------------------------------
class FusedSwapsTwoHeads(MultiHeadAttention):
    """A bug only in the fast path: the fused kernel reads query heads 0 and 1 swapped."""

    def forward(self, x: Tensor, context: Tensor | None = None, *, need_weights: bool = False,
                **kw: Any) -> tuple[Tensor, Tensor | None]:
        self.fast_path = self.attention == "sdpa" and not need_weights
        return super().forward(x, context, need_weights=need_weights, **kw)

    def _project(self, x: Tensor, context: Tensor | None) -> tuple[Tensor, Tensor]:
        q, kv = super()._project(x, context)
        if self.fast_path:
            q = q[:, [1, 0, *range(2, q.shape[1])]]  # (B, H, T, D), heads 0 and 1 swapped
        return q, kv


class FusedDropsPadding(MultiHeadAttention):
    """A bug only in the fast path and only with padding: the fused kernel drops the mask."""

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | None = None,
                need_weights: bool = False, **kw: Any) -> tuple[Tensor, Tensor | None]:
        if self.attention == "sdpa" and not need_weights:
            mask = None
        return super().forward(x, context, mask=mask, need_weights=need_weights, **kw)


def test_kernel_check_catches_one_head_swap_and_a_mask_dropped_only_under_padding() -> None:
    assert status(tiny_model(attention="sdpa"), "attention kernels agree") is Status.PASS
    check = report_of(swap_class(tiny_model(attention="sdpa"), MultiHeadAttention,
                                 FusedSwapsTwoHeads)).get("attention kernels agree")
    assert check.status is Status.FAIL and "sdpa vs manual, no padding" in check.evidence
    check = report_of(swap_class(tiny_model(attention="sdpa"), MultiHeadAttention,
                                 FusedDropsPadding)).get("attention kernels agree")
    assert check.status is Status.FAIL
    assert "sdpa vs manual, left padding" in check.evidence
    assert "no padding: logits differ" not in check.evidence


class StepsOneAhead(DecoderCache):
    """A cache whose single-token steps get the position after the right one."""

    def append_tokens(self, new_mask: Tensor | None, t: int | None = None
                      ) -> tuple[Tensor, int]:
        positions, start = super().append_tokens(new_mask, t)
        return (positions + 1 if (t == 1 and new_mask is None) else positions), start


class OffByOneCacheLM(DecoderLM):
    def make_cache(self, batch_size: int, max_len: int | None = None) -> DecoderCache:
        cache = super().make_cache(batch_size, max_len)
        cache.__class__ = StepsOneAhead
        return cache


def test_cache_check_catches_decoding_steps_one_position_off() -> None:
    assert status(tiny_model(positional="rope"), "cached vs uncached decoding") is Status.PASS
    model = OffByOneCacheLM(tiny_model(positional="rope").config)
    check = report_of(model).get("cached vs uncached decoding")
    assert check.status is Status.FAIL and "single-token steps: logits differ" in check.evidence
