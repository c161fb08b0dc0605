"""Speculative decoding: greedy output equals the target's plain greedy output token for
token (every positional kind, GQA, left-padded batches, past the window), sampled tokens
follow the target's distribution (chi-square on a 5-token vocabulary, fixed seeds), and
the bad inputs are refused by name."""

from __future__ import annotations

import pytest
import torch

from handformer.data.padding import pad_sequences
from handformer.generate import (
    MAX_SPECULATE,
    SpeculationStats,
    check_same_tokenizer,
    generate,
    generate_text,
    sampling_weights,
    speculative_generate,
)
from handformer.generate.speculative import _accept_sampled
from handformer.models.decoder_lm import DecoderLM
from handformer.tokenizers import CharTokenizer
from tests.conftest import TokenKernelSpy, tiny_config

POSITIONALS = ["sinusoidal", "learned", "rope", "alibi"]


def _target(positional: str = "learned", n_kv_heads: int = 4, **kw) -> DecoderLM:
    torch.manual_seed(3)
    model = DecoderLM(tiny_config(positional=positional, n_kv_heads=n_kv_heads, **kw))
    with torch.no_grad():  # sharper logits than at init, so greedy paths are not all ties
        model.embed.token.weight.mul_(20)
    return model.eval()


def _noisy_copy(model: DecoderLM, noise: float, seed: int = 11, **config) -> DecoderLM:
    """A draft that agrees with ``model`` often but not always (``noise`` on every weight);
    ``config`` changes its shape where the weights still fit (``max_len``)."""
    torch.manual_seed(seed)
    draft = DecoderLM(tiny_config(**{**model.config.to_dict(), **config}))
    state = {k: v + noise * torch.randn_like(v) if v.is_floating_point() else v
             for k, v in model.state_dict().items()}
    if draft.config.max_len != model.config.max_len and "embed.positions.table.weight" in state:
        state["embed.positions.table.weight"] = state["embed.positions.table.weight"][
            : draft.config.max_len]
    draft.load_state_dict(state)
    return draft.eval()


def _stranger(model: DecoderLM, **config) -> DecoderLM:
    """A draft with its own random weights: it rarely agrees."""
    torch.manual_seed(29)
    return DecoderLM(tiny_config(**{**model.config.to_dict(), "n_layers": 1,
                                    **config})).eval()


def _drafts(target: DecoderLM) -> dict[str, DecoderLM]:
    return {"itself": target, "noisy copy": _noisy_copy(target, 0.05),
            "stranger with a short window": _stranger(target, max_len=5)}


@pytest.mark.parametrize("positional", POSITIONALS)
@pytest.mark.parametrize("speculate", [1, 3, 6])
def test_greedy_equals_plain_greedy_past_the_window(positional: str, speculate: int) -> None:
    target = _target(positional)  # max_len 16: 40 new tokens slide the window 4 times
    ids = torch.randint(0, 37, (1, 5))
    want = generate(target, ids, 40, temperature=0)
    for name, draft in _drafts(target).items():
        stats = SpeculationStats()
        got = speculative_generate(target, draft, ids, 40, speculate=speculate, temperature=0,
                                   stats=stats)
        assert torch.equal(got, want), f"{positional}, draft {name}, speculate {speculate}"
        assert stats.new_tokens == 40 and stats.drafted > 0
        if draft is target:
            assert stats.acceptance_rate == 1.0


@pytest.mark.parametrize("positional", ["learned", "rope"])
def test_an_int8_target_speculates_to_its_own_plain_greedy(positional: str) -> None:
    """int8 target + float draft: the verify step's K + 1 rows go through the fused int8
    kernel together, a single decoding step's one row alone; the output is still the int8
    target's own greedy output (its rows do not depend on how many share a call)."""
    from handformer.models.quantize import quantize_int8

    target = quantize_int8(_target(positional))
    ids = torch.randint(0, 37, (1, 5))
    want = generate(target, ids, 40, temperature=0)
    for speculate in (3, 8):
        got = speculative_generate(target, _noisy_copy(_target(positional), 0.05), ids, 40,
                                   speculate=speculate, temperature=0)
        assert torch.equal(got, want), f"{positional}, speculate {speculate}"


@pytest.mark.parametrize("on_token, keeps", [(False, False), (True, False), (True, True)])
def test_an_int8_draft_is_checked_once_unless_on_token_may_change_it(
        monkeypatch: pytest.MonkeyPatch, on_token: bool, keeps: bool) -> None:
    """The loop holds the int8 token kernel's checks (``nn.decode_block``) as ``generate``'s
    does: an int8 draft's one-token steps are checked once per generation, and again after
    each step's ``on_token`` unless it promises to keep the model. Same tokens either way,
    and they are the target's plain greedy ones."""
    from handformer.models.quantize import quantize_int8

    target = _target()
    draft = quantize_int8(_noisy_copy(target, 0.05))
    ids = torch.randint(0, 37, (1, 5))
    want = generate(target, ids, 12, temperature=0)
    spy = TokenKernelSpy(monkeypatch)
    stats = SpeculationStats()
    emitted: list[int] = []
    got = speculative_generate(target, draft, ids, 12, speculate=3, temperature=0,
                               stats=stats, on_token_keeps_model=keeps,
                               on_token=(lambda x: emitted.append(int(x))) if on_token else None)
    assert torch.equal(got, want) and len(emitted) == (12 if on_token else 0)
    drafted = [m for m in spy.checks if m is draft]
    if on_token and not keeps:
        assert 1 < len(drafted) <= stats.target_calls  # once per step, after its on_token
    else:
        assert len(drafted) == 1


@pytest.mark.parametrize("n_kv_heads", [2, 1])
@pytest.mark.parametrize("positional", ["rope", "alibi"])
def test_greedy_equals_plain_greedy_with_grouped_query_attention(n_kv_heads: int,
                                                                 positional: str) -> None:
    target = _target(positional, n_kv_heads=n_kv_heads)
    ids = torch.randint(0, 37, (2, 4))
    want = generate(target, ids, 30, temperature=0)
    for draft in _drafts(target).values():
        got = speculative_generate(target, draft, ids, 30, speculate=4, temperature=0)
        assert torch.equal(got, want)


@pytest.mark.parametrize("positional", POSITIONALS)
def test_greedy_equals_plain_greedy_on_a_left_padded_batch(positional: str) -> None:
    target = _target(positional)
    prompts = [torch.randint(0, 37, (n,)).tolist() for n in (2, 7, 4)]
    ids, mask = pad_sequences(prompts, 0, side="left")
    want = generate(target, ids, 35, padding_mask=mask, temperature=0)
    for name, draft in _drafts(target).items():
        got = speculative_generate(target, draft, ids, 35, speculate=3, padding_mask=mask,
                                   temperature=0)
        assert torch.equal(got, want), f"{positional}, draft {name}"


def test_a_prompt_longer_than_the_window_is_read_from_its_end_like_plain() -> None:
    target = _target("rope")
    ids = torch.randint(0, 37, (1, 23))
    with pytest.warns(Warning, match="longer than the model's window"):
        want = generate(target, ids, 12, temperature=0)
    with pytest.warns(Warning, match="longer than the model's window"):
        got = speculative_generate(target, _noisy_copy(target, 0.05), ids, 12, speculate=5,
                                   temperature=0)
    assert torch.equal(got, want)


def test_eos_and_on_token_behave_like_plain() -> None:
    target = _target("learned")
    ids = torch.randint(0, 37, (3, 3))
    plain = generate(target, ids, 30, temperature=0)
    eos = int(plain[0, 10])  # a token row 0 emits: it finishes there
    want = generate(target, ids, 30, temperature=0, eos_id=eos)
    got = speculative_generate(target, _noisy_copy(target, 0.05), ids, 30, speculate=4,
                               temperature=0, eos_id=eos)
    assert torch.equal(got, want)
    seen: list[torch.Tensor] = []
    stopped = speculative_generate(target, target, ids, 30, speculate=4, temperature=0,
                                   on_token=lambda nxt: seen.append(nxt) or len(seen) == 7)
    assert stopped.shape[1] == 3 + 7 and torch.equal(stopped, plain[:, :10])
    assert torch.equal(torch.stack(seen, dim=1), plain[:, 3:10])


def test_generate_text_speculates_with_a_draft_and_reports_it() -> None:
    tok = CharTokenizer.from_text("abcdefghij klmnopqrstuvwxyz.,ABCDEFGHIJ")
    target = _target("rope")
    stats = SpeculationStats()
    plain = generate_text(target, tok, ["ab", "kl mn"], 20, temperature=0)
    fast = generate_text(target, tok, ["ab", "kl mn"], 20, temperature=0,
                         draft=_noisy_copy(target, 0.05), speculate=3, stats=stats)
    assert fast == plain
    assert 0 <= stats.acceptance_rate <= 1 and stats.target_calls < 20
    assert "drafted tokens accepted" in stats.summary()
    with pytest.raises(ValueError, match="repetition penalty"):
        generate_text(target, tok, "ab", 5, draft=target, repetition_penalty=1.2)


# -- sampling: the tokens follow the target's distribution ----------------------------------

V = 5
Z_9999 = 3.719  # the standard normal's 0.9999 quantile


def _chi2_limit(df: int) -> float:
    """The chi-square distribution's 0.9999 quantile (Wilson–Hilferty; within 1 % of
    scipy's for df ≥ 3): a correct sampler fails a check once in 10⁴, and fixed seeds make
    every run give the same outcome."""
    return df * (1 - 2 / (9 * df) + Z_9999 * (2 / (9 * df)) ** 0.5) ** 3


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic for groups of counts (G, V) against their distributions (G, V)
    (each group its own total), and the degrees of freedom. A count in a cell of
    probability 0 is a token outside the target's support and fails at once."""
    counts, probs = counts.reshape(-1, probs.shape[-1]), probs.reshape(-1, probs.shape[-1])
    possible = probs > 0
    assert int(counts[~possible].sum()) == 0, "a token outside the target's support"
    totals = counts.sum(dim=-1, keepdim=True)  # (G, 1)
    used = totals.squeeze(-1) > 0
    expected = (totals * probs)[used]  # (G', V)
    ok = possible[used]
    stat = ((counts[used] - expected)[ok] ** 2 / expected[ok]).sum()
    return float(stat), int(ok.sum()) - int(used.sum())


def _table(shape: tuple[int, ...], generator: torch.Generator, zeros: bool) -> torch.Tensor:
    """Random distributions over V tokens (..., V); ``zeros`` bans the least likely one
    of each (what top-k does)."""
    w = torch.rand(*shape, V, generator=generator) ** 3 + 1e-3  # (..., V)
    if zeros:
        w = w.masked_fill(w == w.amin(dim=-1, keepdim=True), 0.0)
    return w / w.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("zeros", [False, True], ids=["full-support", "top-k-zeros"])
def test_accept_reject_rule_outputs_follow_the_targets_distribution(zeros: bool) -> None:
    """The rule alone, on 200 000 rows at once: the target's conditional tables p1 (V),
    p2 (V, V), p3 (V, V, V), the draft's q1, q2; two proposals a row. The first output
    follows p1; where the first proposal was kept, the second output follows p2(· | first);
    where both were, the bonus follows p3(· | first, second)."""
    gen = torch.Generator().manual_seed(0)
    p1, p2, p3 = _table((), gen, zeros), _table((V,), gen, zeros), _table((V, V), gen, zeros)
    q1, q2 = _table((), gen, False), _table((V,), gen, False)
    rows = 200_000
    x1 = torch.multinomial(q1, rows, replacement=True, generator=gen)  # (N,)
    x2 = torch.multinomial(q2[x1], 1, generator=gen).squeeze(-1)  # (N,)
    p = torch.stack([p1.expand(rows, V), p2[x1], p3[x1, x2]], dim=1)  # (N, 3, V)
    q = torch.stack([q1.expand(rows, V), q2[x1]], dim=1)  # (N, 2, V)
    out, kept = _accept_sampled(p * 7.0, q, torch.stack([x1, x2], dim=1), gen)  # unnormalised
    n = kept.long().cumprod(dim=1).sum(dim=1)  # (N,) proposals kept per row
    assert 0.2 < float(kept[:, 0].float().mean()) < 0.9  # both branches ran many times

    def counts(groups: torch.Tensor, tokens: torch.Tensor, n_groups: int) -> torch.Tensor:
        c = torch.zeros(n_groups * V)
        c.index_put_((groups * V + tokens,), torch.ones(len(tokens)), accumulate=True)
        return c.view(n_groups, V)

    y = out
    checks = {
        "first": (counts(torch.zeros_like(y[:, 0]), y[:, 0], 1), p1[None]),
        "second": (counts(y[n >= 1, 0], y[n >= 1, 1], V), p2),
        "bonus": (counts(y[n >= 2, 0] * V + y[n >= 2, 1], y[n >= 2, 2], V * V),
                  p3.reshape(V * V, V)),
    }
    for name, (observed, probs) in checks.items():
        stat, df = _chi_square(observed, probs)
        assert stat < _chi2_limit(df), f"{name}: chi2 {stat:.1f} with {df} dof"
    # The check has power: the draft's first-token distribution would fail it.
    wrong, df = _chi_square(checks["first"][0], q1[None])
    assert wrong > 10 * _chi2_limit(df)


def _small_target() -> DecoderLM:
    torch.manual_seed(7)
    model = DecoderLM(tiny_config(vocab_size=V, d_model=16, n_layers=1, max_len=8)).eval()
    with torch.no_grad():
        model.embed.token.weight.mul_(8)
    return model


def _exact_pairs(target: DecoderLM, prompt: torch.Tensor, narrow: dict
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's p(first) (V,) and p(second | first) (V, V) after ``prompt`` (1, T)."""
    def dist(ids: torch.Tensor) -> torch.Tensor:
        w = sampling_weights(target(ids)[:, -1], **narrow)  # (N, V)
        return w / w.sum(dim=-1, keepdim=True)

    with torch.no_grad():
        first = dist(prompt)[0]  # (V,)
        second = dist(torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], dim=1))
    return first, second


@pytest.mark.parametrize("narrow", [dict(temperature=1.0),
                                    dict(temperature=0.7, top_k=4, top_p=0.9)],
                         ids=["plain", "temperature-top_k-top_p"])
def test_speculative_samples_follow_the_targets_distribution(narrow: dict) -> None:
    """End to end through the models and caches, batches of 4 rows (a step keeps what all
    rows kept): the first two new tokens against the target's exact p(first) and
    p(second | first)."""
    target = _small_target()
    draft = _noisy_copy(target, 0.2, seed=2)  # TV(p, q) ≈ 0.34 on the first token
    prompt = torch.tensor([[1, 3, 0]])
    first, second = _exact_pairs(target, prompt, narrow)
    rows, calls = 4, 500
    pairs = torch.zeros(V, V)
    stats = SpeculationStats()
    for call in range(calls):
        out = speculative_generate(target, draft, prompt.expand(rows, -1), 3, speculate=2,
                                   seed=call, stats=stats, **narrow)[:, 3:5]  # (rows, 2)
        pairs.index_put_((out[:, 0], out[:, 1]), torch.ones(rows), accumulate=True)
    assert stats.accepted > 0 and stats.accepted < stats.drafted
    for name, observed, probs in (("first", pairs.sum(1)[None], first[None]),
                                  ("second | first", pairs, second)):
        stat, df = _chi_square(observed, probs)
        assert stat < _chi2_limit(df), f"{name}: chi2 {stat:.1f} with {df} dof"


# -- refusals -------------------------------------------------------------------------------

@pytest.mark.parametrize("speculate", [0, MAX_SPECULATE + 1, 2.0, True])
def test_speculate_out_of_range_is_refused(speculate: object) -> None:
    target = _target()
    with pytest.raises(ValueError, match=r"speculate .* \[1, 32\]"):
        speculative_generate(target, target, torch.zeros(1, 2, dtype=torch.long), 3,
                             speculate=speculate)  # type: ignore[arg-type]


def test_a_draft_with_another_vocabulary_is_refused() -> None:
    target = _target()
    draft = DecoderLM(tiny_config(vocab_size=40)).eval()
    with pytest.raises(ValueError, match=r"draft's vocabulary \(40 tokens\) differs"):
        speculative_generate(target, draft, torch.zeros(1, 2, dtype=torch.long), 3)


def test_tokenizers_must_be_identical() -> None:
    a, b = CharTokenizer.from_text("abc"), CharTokenizer.from_text("abd")
    check_same_tokenizer(a, CharTokenizer.from_text("cab"))
    with pytest.raises(ValueError, match="not the target's"):
        check_same_tokenizer(a, b)
