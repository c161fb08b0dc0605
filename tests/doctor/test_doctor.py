"""The doctor on healthy models: every check passes, nothing is left changed, and a user's
own nn.Module gets the checks that need no handformer internals."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from handformer.config import ModelConfig
from handformer.data import LMWindows, collate_sequences
from handformer.doctor import CHECK_NAMES, Report, Status, run
from handformer.loss import IGNORE_INDEX, lm_loss
from handformer.models.decoder_lm import DecoderLM
from handformer.nn.attention import MultiHeadAttention
from handformer.tokenizers import CharTokenizer

TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen jugs.\n" * 12
LR = 3e-3  # tiny models: fast to overfit, first Adam step well under the 0.5 warning ratio


def tiny_tokenizer() -> CharTokenizer:
    return CharTokenizer.from_text(TEXT)


def tiny_windows(block: int = 16) -> LMWindows:
    tok = tiny_tokenizer()
    return LMWindows(torch.as_tensor(tok.encode_array(TEXT)), block)


def tiny_model(**overrides: object) -> DecoderLM:
    torch.manual_seed(0)
    base: dict[str, object] = dict(vocab_size=tiny_tokenizer().vocab_size, d_model=32,
                                   n_heads=4, n_layers=2, max_len=16)
    base.update(overrides)
    return DecoderLM(ModelConfig(**base))  # type: ignore[arg-type]


def nan_safe_lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """lm_loss, but 0 (with a graph) when no target counts instead of 0/0 = NaN."""
    if not bool((targets != IGNORE_INDEX).any()):
        return logits.sum() * 0.0
    return lm_loss(logits, targets)


def statuses(report: Report) -> dict[str, Status]:
    return {c.name: c.status for c in report.checks}


def not_passing(report: Report) -> dict[str, str]:
    return {c.name: f"{c.status.value}: {c.evidence}" for c in report.checks
            if c.status is not Status.PASS}


# -- healthy handformer models ----------------------------------------------------------------
@pytest.mark.parametrize("overrides", [
    dict(attention="manual", positional="learned"),
    dict(attention="sdpa", positional="sinusoidal", norm="post"),
    dict(attention="sdpa", positional="rope", n_kv_heads=2),
    dict(attention="manual", positional="alibi"),
    dict(attention="sdpa", positional="rope", qk_norm=True, norm_type="rmsnorm",
         activation="swiglu", logit_softcap=30.0),
], ids=["manual-learned", "sdpa-sinusoidal-post", "sdpa-rope-gqa", "manual-alibi",
        "speedrun-levers"])
def test_healthy_model_passes_every_check(overrides: dict[str, object]) -> None:
    report = run(tiny_model(**overrides), tiny_windows(), loss_fn=nan_safe_lm_loss, lr=LR)
    allowed_skip = {"padding mask in the data"}  # fixed-length windows carry no padding
    assert {n: s for n, s in not_passing(report).items() if n not in allowed_skip} == {}
    assert report.get("padding mask in the data").status is Status.SKIP
    assert report.exit_code == 0
    assert [c.name for c in report.checks] == [name for _, name in CHECK_NAMES]


def test_padded_data_gets_the_data_mask_checks() -> None:
    tok = tiny_tokenizer()
    lines = [line for line in TEXT.splitlines() if line][:3]
    batch = collate_sequences([tok.encode(s[: 6 + 4 * i]) for i, s in enumerate(lines)],
                              pad_id=tok.pad_id)
    report = run(tiny_model(), batch, loss_fn=nan_safe_lm_loss, lr=LR)
    assert report.get("padding mask in the data").status is Status.PASS
    assert report.get("targets shifted by one").status is Status.PASS
    assert report.get("padding ignored by the loss").status is Status.PASS


def test_all_padding_batch_lm_loss_passes_and_a_naive_mean_warns() -> None:
    """lm_loss averages as sum / max(count, 1): an all-padding batch gives 0, not NaN.
    A plain F.cross_entropy mean over zero targets is 0/0 = NaN: reported, with the fix."""
    report = run(tiny_model(), tiny_windows(), loss_fn=lm_loss, lr=LR)
    assert report.get("all-padding batch").status is Status.PASS

    def naive_mean(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                 ignore_index=-100)

    report = run(tiny_model(), tiny_windows(), loss_fn=naive_mean, lr=LR)
    check = report.get("all-padding batch")
    assert check.status is Status.WARN, check
    assert check.details["nonfinite_logits"] == 0 and math.isnan(check.details["loss"])
    assert "max(count, 1)" in check.hint
    assert report.exit_code == 0


# -- no side effects --------------------------------------------------------------------------
def test_the_model_is_left_exactly_as_it_was() -> None:
    model = tiny_model(attention="sdpa").train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = run(model, tiny_windows(), loss_fn=nan_safe_lm_loss, lr=LR)
    assert report.get("overfit one batch").status is Status.PASS  # it did train a copy
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.training
    assert all(p.grad is None for p in model.parameters())
    for m in model.modules():
        if isinstance(m, MultiHeadAttention):
            assert m.attention == "sdpa"
            assert "forward" not in m.__dict__


# -- a user's own module ----------------------------------------------------------------------
class UserLM(nn.Module):
    """A hand-written one-layer causal LM with no handformer pieces: forward(ids) → logits."""

    def __init__(self, vocab: int, d: int = 32, max_len: int = 16, *,
                 transpose_mask: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.5)
        self.qkv = nn.Linear(d, 3 * d)
        self.head = nn.Linear(d, vocab)
        nn.init.normal_(self.head.weight, std=0.02)
        self.transpose_mask = transpose_mask

    def forward(self, ids: Tensor) -> Tensor:
        t = ids.shape[1]
        x = self.embed(ids) + self.pos[:t]  # (B, T, C)
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 × (B, T, C)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, T, T)
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
        if self.transpose_mask:
            mask = mask.T
        x = x + torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
        return self.head(x)  # (B, T, V)


def test_users_own_module_gets_the_checks_that_need_no_internals() -> None:
    torch.manual_seed(0)
    model = UserLM(tiny_tokenizer().vocab_size)
    report = run(model, tiny_windows(), loss_fn=nan_safe_lm_loss, lr=LR)
    s = statuses(report)
    needs_internals = {"padding probe", "pad keys get zero attention", "attention scale",
                       "attention kernels agree", "cached vs uncached decoding",
                       "padding mask in the data"}
    assert {n for n, st in s.items() if st is Status.SKIP} == needs_internals
    for name in needs_internals:
        assert report.get(name).evidence  # every SKIP says why
    assert {n: st for n, st in s.items() if n not in needs_internals
            and st is not Status.PASS} == {}, not_passing(report)


def test_users_module_with_a_transposed_mask_fails_the_causality_probe() -> None:
    torch.manual_seed(0)
    model = UserLM(tiny_tokenizer().vocab_size, transpose_mask=True)
    check = run(model, tiny_windows(), lr=LR).get("causality probe")
    assert check.status is Status.FAIL
    assert "transposed" in check.evidence and "tril" in check.hint


def test_a_forward_pass_that_raises_names_the_module_and_skips_the_rest() -> None:
    model = tiny_model()
    model.lm_head = nn.Linear(31, 5)  # wrong input width: fails inside lm_head
    report = run(model, tiny_windows(), lr=LR)
    forward = report.get("forward pass")
    assert forward.status is Status.FAIL
    assert "'lm_head'" in forward.evidence and "RuntimeError" in forward.evidence
    assert all(c.status is Status.SKIP for c in report.checks[2:])
    assert [r.name for r in report.modules][:2] == ["embed", "embed.token"]
    assert report.exit_code == 1


def test_wrong_logits_shape_fails_the_forward_check() -> None:
    class Flat(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, ids: Tensor) -> Tensor:
            return self.inner(ids).flatten(0, 1)  # (B·T, V): flattened too early

    check = run(Flat(tiny_model()), tiny_windows(), lr=LR).get("forward pass")
    assert check.status is Status.FAIL
    assert "expected (B, T, V) = (4, 16, " in check.evidence and "flatten" in check.hint


# -- the report itself --------------------------------------------------------------------------
def test_report_text_and_json_carry_every_check_and_the_module_table() -> None:
    report = run(tiny_model(), tiny_windows(), loss_fn=nan_safe_lm_loss, lr=LR)
    text = report.format_text()
    for _, name in CHECK_NAMES:
        assert f" {name}: " in text
    assert re.search(r"\n  blocks\.0 +TransformerBlock +\(4, 16, 32\) +\(4, 16, 32\)", text)
    table = text.split("  PASS  batch:")[0]
    assert "blocks.0.self_attn" not in table  # deeper rows only with max_module_depth=None
    assert "\n  blocks.0.self_attn.in_proj " in report.format_text(max_module_depth=None)
    assert text.index("1. forward pass") < text.index("2. masks") < text.index("3. loss")
    data = json.loads(report.to_json())
    assert data["ok"] is True and len(data["checks"]) == len(CHECK_NAMES)
    rows = {m["name"]: m for m in data["modules"]}
    v = tiny_tokenizer().vocab_size
    assert rows[""]["output_shape"] == [4, 16, v]
    assert rows["lm_head"]["params"] == 32 * v
    assert rows["blocks.0.self_attn.in_proj"]["params"] == 32 * 96 + 96


def test_accepts_a_batch_function_and_a_token_tensor() -> None:
    windows = tiny_windows()
    by_fn = run(tiny_model(), lambda gen: windows.random_batch(3, gen), lr=LR)
    assert by_fn.subject["batch"] == [3, 16]
    chunk = windows.fixed_batches(1, 2)[0]
    tensor = torch.cat([chunk.ids, chunk.targets[:, -1:]], dim=1)  # (B, T+1)
    by_tensor = run(tiny_model(), tensor, lr=LR)
    assert by_tensor.get("targets shifted by one").status is Status.PASS
    with pytest.raises(ValueError, match="cannot read batches from str"):
        run(tiny_model(), "not data")


def test_loss_that_raises_is_reported_as_a_failure_with_the_error() -> None:
    def wrong_ignore(logits: Tensor, targets: Tensor) -> Tensor:
        # the tutorial's ignore_index=pad_id, with handformer's -100 targets: out of bounds
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=0)

    check = run(tiny_model(), tiny_windows(), loss_fn=wrong_ignore,
                lr=LR).get("padding ignored by the loss")
    assert check.status is Status.FAIL
    assert "raised" in check.evidence and "IGNORE_INDEX" in check.hint


def test_a_budget_too_small_to_judge_warns_instead_of_calling_a_model_stuck() -> None:
    """``--learning-steps 3`` on a healthy model: the loss moved but had no room to fall
    10%; the check says it cannot judge (WARN), not that the model has a bug (FAIL)."""
    from handformer.doctor.checks_learning import MIN_STEPS_TO_JUDGE

    slow = run(tiny_model(), tiny_windows(), lr=1e-4, learning_steps=3).get("overfit one batch")
    assert slow.status is Status.WARN, slow.evidence
    assert slow.evidence.startswith(f"too few steps to judge: 3 < {MIN_STEPS_TO_JUDGE}")
    # A loss that cannot move at all (the optimizer holds none of the model's parameters) is
    # stuck at any budget.
    frozen = run(tiny_model(), tiny_windows(), lr=1e-3, learning_steps=3,
                 optimizer=lambda params, lr: torch.optim.AdamW([nn.Parameter(torch.zeros(1))],
                                                                lr=lr)).get("overfit one batch")
    assert frozen.status is Status.FAIL and "stuck" in frozen.evidence
