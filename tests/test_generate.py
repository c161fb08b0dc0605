"""Generation: the KV cache changes nothing but speed; sampling obeys its contract."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from handformer.data.classification import DataWarning
from handformer.data.padding import pad_sequences
from handformer.generate import (
    GREEDY_TEMPERATURE,
    NonFiniteLogitsError,
    apply_repetition_penalty,
    generate,
    generate_text,
    sample_next,
    speculative_generate,
)
from handformer.models.decoder_lm import DecoderLM
from handformer.tokenizers import CharTokenizer
from tests.conftest import TokenKernelSpy, tiny_config

POSITIONALS = ["sinusoidal", "learned", "rope", "alibi"]
PATHS = ["manual", "sdpa", "tiled"]


def _model(positional: str, path: str, n_kv_heads: int = 4, **kw) -> DecoderLM:
    torch.manual_seed(3)
    model = DecoderLM(tiny_config(positional=positional, attention=path, n_kv_heads=n_kv_heads,
                                  **kw))
    with torch.no_grad():  # sharper logits than at init, so greedy paths are not all ties
        model.embed.token.weight.mul_(20)
    return model.eval()


@pytest.mark.parametrize("positional", POSITIONALS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_cached_logits_equal_full_recompute(positional: str, path: str, n_kv_heads: int,
                                            norm: str) -> None:
    """A prefill, then one token per step through ``forward(..., cache=)`` — what
    ``generate`` runs, per-call checks off as there — against one uncached pass."""
    model = _model(positional, path, n_kv_heads, norm=norm)
    ids = torch.randint(0, 37, (2, 16))
    full = model(ids)  # (B, T, V)
    cache = model.make_cache(2)
    pieces = [model(ids[:, :5], cache=cache)]  # prefill
    pieces += [model(ids[:, t : t + 1], cache=cache, validate=False)  # one by one
               for t in range(5, 16)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-4, atol=1e-5)
    assert cache.length == 16
    assert cache.key_positions[:, :16].tolist() == [list(range(16))] * 2


@pytest.mark.parametrize("positional", POSITIONALS)
@pytest.mark.parametrize("path", PATHS)
def test_steps_after_left_padded_prefill_equal_one_uncached_pass(positional: str,
                                                                  path: str) -> None:
    model = _model(positional, path, 2, max_len=32)
    ids, mask = pad_sequences([[5, 6, 7], [9, 10, 11, 12, 13, 14], [20]], 0, side="left")  # (3, 6)
    nxt = torch.randint(0, 37, (3, 8))
    full = model(torch.cat([ids, nxt], dim=1),
                 torch.cat([mask, torch.ones(3, 8, dtype=torch.bool)], dim=1))  # (3, 14, V)
    cache = model.make_cache(3)
    prefill = model(ids, mask, cache=cache)  # (3, 6, V)
    torch.testing.assert_close(prefill[mask], full[:, :6][mask], rtol=1e-4, atol=1e-5)
    for t in range(8):
        step = model(nxt[:, t : t + 1], cache=cache, validate=False)[:, -1]  # (B, V)
        torch.testing.assert_close(step, full[:, 6 + t], rtol=1e-4, atol=1e-5)
    assert cache.has_padding and cache.key_mask[:, :14].tolist() == [
        [False] * 3 + [True] * 11, [True] * 14, [False] * 5 + [True] * 9]


def test_cached_forward_refuses_a_full_cache_and_bad_ids() -> None:
    model = _model("rope", "sdpa")
    cache = model.make_cache(1, max_len=4)
    model(torch.tensor([[1, 2, 3, 4]]), cache=cache)
    with pytest.raises(ValueError, match="KV cache overflow"):
        model(torch.tensor([[5]]), cache=cache)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 37\)"):
        model(torch.tensor([[37]]), cache=model.make_cache(1))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 37\)"):
        generate(model, torch.tensor([[1, 40]]), 3)  # the prompt is checked, once


def test_generate_checks_the_prompt_once_and_its_own_tokens_never() -> None:
    """Per token, ``generate`` runs forward with ``validate=False``: the id-range check (a
    host sync) runs on the prompt only."""
    model = _model("learned", "sdpa")
    calls: list[bool] = []
    original = model.forward

    @functools.wraps(original)  # keeps forward's signature, which generate reads
    def spy(*args, **kwargs):
        calls.append(kwargs.get("validate", True))
        return original(*args, **kwargs)

    model.forward = spy  # type: ignore[method-assign]
    try:
        generate(model, torch.tensor([[1, 2, 3]]), 5, temperature=0)
        generate(model, torch.tensor([[1, 2, 3]]), 2, temperature=0, use_cache=False)
    finally:
        del model.forward
    assert calls == [True, False, False, False, False, True, False]


@pytest.mark.parametrize("positional", POSITIONALS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n_kv_heads", [4, 1])
def test_cached_and_uncached_generation_identical_past_the_window(
    positional: str, path: str, n_kv_heads: int
) -> None:
    model = _model(positional, path, n_kv_heads)  # max_len 16
    prompt = torch.randint(0, 37, (2, 6))
    greedy = [generate(model, prompt, 45, temperature=0, use_cache=c) for c in (True, False)]
    assert torch.equal(greedy[0], greedy[1])
    sampled = [generate(model, prompt, 45, temperature=1.0, top_k=10, seed=5, use_cache=c)
               for c in (True, False)]
    assert torch.equal(sampled[0], sampled[1])


@pytest.mark.parametrize("positional", POSITIONALS)
@pytest.mark.parametrize("path", PATHS)
def test_batched_left_padded_equals_one_at_a_time(positional: str, path: str) -> None:
    model = _model(positional, path, max_len=32)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16], [20]]
    ids, mask = pad_sequences(prompts, 0, side="left")
    batched = generate(model, ids, 20, padding_mask=mask, temperature=0)
    for row, prompt in enumerate(prompts):
        alone = generate(model, torch.tensor([prompt]), 20, temperature=0)
        assert batched[row, -20:].tolist() == alone[0, -20:].tolist(), f"row {row}"
    uncached = generate(model, ids, 20, padding_mask=mask, temperature=0, use_cache=False)
    assert torch.equal(batched, uncached)


def test_prompt_longer_than_window_is_cropped_with_one_warning_not_a_crash() -> None:
    model = _model("learned", "sdpa")
    with pytest.warns(DataWarning) as caught:
        out = generate(model, torch.randint(0, 37, (1, 40)), 5, temperature=0)
    assert out.shape == (1, 45)
    assert len(caught) == 1  # once per call, not once per sliding step
    message = str(caught[0].message)
    for needle in ("1 of 1 prompt", "max_len=16", "has 40", "last 16", "first 24"):
        assert needle in message, f"{needle!r} missing from: {message}"


def test_only_prompts_that_lose_real_tokens_are_counted_and_short_ones_never_warn() -> None:
    model = _model("learned", "sdpa")
    ids, mask = pad_sequences([list(range(1, 21)), [5, 6]], 0, side="left")  # (2, 20)
    with pytest.warns(DataWarning, match="1 of 2 prompt"):
        generate(model, ids, 2, padding_mask=mask, temperature=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate(model, torch.randint(0, 37, (2, 16)), 3, temperature=0)  # fits: silent


def test_gqa_cache_is_smaller_by_the_group_factor() -> None:
    sizes = {kv: _model("rope", "sdpa", kv).make_cache(2).nbytes() for kv in (4, 2, 1)}
    assert sizes[4] == 2 * sizes[2] == 4 * sizes[1]


def test_top_k_never_samples_outside_the_k_best() -> None:
    logits = torch.randn(4, 50)
    allowed = torch.topk(logits, 5, dim=-1).indices
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        nxt = sample_next(logits, temperature=2.0, top_k=5, generator=g)
        assert all(int(nxt[b]) in allowed[b].tolist() for b in range(4))


def test_top_p_never_samples_outside_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    g = torch.Generator().manual_seed(0)
    seen = {int(sample_next(logits, top_p=0.75, generator=g)) for _ in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3: the nucleus is exactly {0, 1}
    seen = {int(sample_next(logits, top_p=0.85, generator=g)) for _ in range(300)}
    assert seen == {0, 1, 2}
    assert {int(sample_next(logits, top_p=1e-6, generator=g)) for _ in range(50)} == {0}


def test_seed_reproduces_and_temperature_to_zero_is_greedy() -> None:
    model = _model("rope", "sdpa")
    prompt = torch.randint(0, 37, (1, 4))
    a = generate(model, prompt, 20, temperature=1.0, seed=11)
    b = generate(model, prompt, 20, temperature=1.0, seed=11)
    assert torch.equal(a, b)
    greedy = generate(model, prompt, 20, temperature=0)
    assert torch.equal(generate(model, prompt, 20, temperature=1e-6, seed=1), greedy)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    history = torch.tensor([[0, 1, 3]])
    mask = torch.tensor([[True, True, False]])  # token 3 is padding: not penalised
    out = apply_repetition_penalty(logits, history, mask, 2.0)
    torch.testing.assert_close(out, torch.tensor([[1.0, -4.0, 1.0, 0.5]]))


def test_eos_stops_generation() -> None:
    model = _model("learned", "sdpa")
    prompt = torch.randint(4, 37, (1, 3))
    first = int(generate(model, prompt, 1, temperature=0)[0, -1])
    out = generate(model, prompt, 30, temperature=0, eos_id=first)
    assert out.shape[1] == 4 and int(out[0, -1]) == first


class _CyclingLM(torch.nn.Module):
    """A stand-in LM that always predicts the next character of the vocabulary, cycling
    through the non-special ids: deterministic text to test stop strings on."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.config = tiny_config(vocab_size=vocab_size)
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids: torch.Tensor, padding_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        n_special, v = 4, self.config.vocab_size
        nxt = (ids - n_special + 1) % (v - n_special) + n_special  # (B, T)
        return torch.nn.functional.one_hot(nxt, v).float() * 10  # (B, T, V)


def test_generate_text_stop_strings_and_streaming() -> None:
    tok = CharTokenizer.from_text("abcdefgh")
    model = _CyclingLM(tok.vocab_size)
    full = generate_text(model, tok, "a", 20, temperature=0, use_cache=False)[0]
    assert full == "bcdefghabcdefghabcde"
    pieces: list[str] = []
    cut = generate_text(model, tok, "a", 20, temperature=0, use_cache=False, stop=["gha", "x"],
                        stream=lambda row, piece: pieces.append(piece))[0]
    assert cut == "bcdef"
    assert pieces == ["b", "c", "d", "e", "f"]  # "g" was held back, then dropped with the stop
    never = generate_text(model, tok, "a", 5, temperature=0, use_cache=False, stop=["fx"],
                          stream=lambda row, piece: pieces.append(piece))[0]
    assert never == "bcdef" and pieces[-1] == "f"  # held back "f" released at the end
    batch = generate_text(model, tok, ["a", "gh"], 4, temperature=0, use_cache=False,
                          stop=["d"])
    assert batch == ["bc", "abc"]


@pytest.mark.parametrize("stream, keeps", [(False, False), (True, False), (True, True)])
def test_generate_text_keeps_the_kernels_one_check_unless_its_stream_may_change_the_model(
        monkeypatch: pytest.MonkeyPatch, stream: bool, keeps: bool) -> None:
    """An int8 model's token kernel (``nn.decode_block``) is checked once per generation when
    nothing but generate_text's own code runs between tokens (no ``stream``, or one that
    promises ``stream_keeps_model``), and again at every token after a ``stream`` that may
    change the model. The same text either way."""
    from handformer.models.quantize import quantize_int8

    tok = CharTokenizer.from_text("abcdefgh")
    model = quantize_int8(DecoderLM(tiny_config(vocab_size=tok.vocab_size, max_len=32)).eval())
    expected = generate_text(model, tok, "ab", 8, temperature=0)[0]
    spy = TokenKernelSpy(monkeypatch)
    pieces: list[str] = []
    out = generate_text(model, tok, "ab", 8, temperature=0, stream_keeps_model=keeps,
                        stream=(lambda row, piece: pieces.append(piece)) if stream else None)[0]
    assert out == expected and "".join(pieces) == (out if stream else "")
    assert spy.calls >= 2  # one-token steps after the prompt's, each through the kernel
    assert len(spy.checks) == (spy.calls if stream and not keeps else 1)


def test_unknown_prompt_characters_become_unk() -> None:
    """"€" is not in the vocabulary: the model must read a, <unk>, b — not a, b (a dropped
    character) nor a crash."""
    tok = CharTokenizer.from_text("abc")
    model = _model("learned", "sdpa", vocab_size=tok.vocab_size)
    prompts: list[list[int]] = []
    original = model.forward

    @functools.wraps(original)
    def spy(ids, *args, **kwargs):
        if not prompts:  # the first call reads the whole prompt
            prompts.append(ids[0].tolist())
        return original(ids, *args, **kwargs)

    model.forward = spy  # type: ignore[method-assign]
    try:
        out = generate_text(model, tok, "a€b", 5, temperature=0)
    finally:
        del model.forward
    assert len(out) == 1 and isinstance(out[0], str)
    a, b = tok.encode("a") + tok.encode("b")
    assert prompts == [[a, tok.unk_id, b]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_new_tokens=-1), "max_new_tokens must be >= 0"),
        (dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must lie in \(0, 1\]"),
        (dict(top_k=0), "top_k must be a positive int"),
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        # non-finite and mistyped numbers are refused by name, before any forward
        (dict(temperature=float("nan")), "temperature must be >= 0 and finite.*nan"),
        (dict(temperature=float("inf")), "temperature must be >= 0 and finite.*inf"),
        (dict(temperature="0.7"), "temperature must be >= 0 and finite"),
        (dict(temperature=True), "temperature must be >= 0 and finite"),
        (dict(top_p=float("nan")), r"top_p must lie in \(0, 1\].*nan"),
        (dict(top_k=2.5), "top_k must be a positive int.*2.5"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty must be > 0 and finite"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty must be > 0 and finite"),
        (dict(max_new_tokens=2.0), "max_new_tokens must be >= 0"),
        # a promise is made on purpose: a truthy string or number is not one
        (dict(on_token_keeps_model="no"), r"on_token_keeps_model must be True or False.*'no'"),
        (dict(on_token_keeps_model=1), "on_token_keeps_model must be True or False.*int"),
        (dict(use_cache=None), "use_cache must be True or False.*None"),
    ],
)
def test_bad_generation_arguments(kwargs: dict, message: str) -> None:
    model = _model("learned", "sdpa")
    args = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate(model, torch.tensor([[5, 6]]), **args)


def test_generate_text_and_speculation_refuse_a_promise_that_is_not_a_bool() -> None:
    model, tok = _model("learned", "sdpa"), CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match=r"stream_keeps_model must be True or False.*'yes'"):
        generate_text(model, tok, "ab", 3, stream=lambda row, piece: None,
                      stream_keeps_model="yes")
    with pytest.raises(ValueError, match="on_token_keeps_model must be True or False"):
        speculative_generate(model, model, torch.tensor([[5, 6]]), 3,
                             on_token_keeps_model="yes")


def test_empty_prompts_are_rejected() -> None:
    model = _model("learned", "sdpa")
    with pytest.raises(ValueError, match="non-empty prompt"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 3)
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match="non-empty strings"):
        generate_text(model, tok, "", 3)
    with pytest.raises(ValueError, match="are empty"):
        pad_sequences([[1, 2], []], 0, side="left")


@pytest.mark.parametrize("positional", POSITIONALS)
@pytest.mark.parametrize("path", PATHS)
def test_bfloat16_generation_runs_and_agrees_with_float32(positional: str, path: str) -> None:
    """bf16 keeps 8 bits of mantissa, so logits move in the 2nd–3rd digit and a near tie
    may flip: the claim is agreement on most greedy choices, not equality. Measured on
    these models: every choice agrees, logits within 0.07; asserted: ≥ 90 % and 0.25."""
    model = _model(positional, path, 2)  # max_len 16: 30 new tokens slide the window
    prompt = torch.randint(0, 37, (2, 6))
    ref = generate(model, prompt, 30, temperature=0)  # float32
    half = _model(positional, path, 2).to(torch.bfloat16)
    out = generate(half, prompt, 30, temperature=0)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    window = ref[:, -16:]  # teacher-forced: both models read the same float32 text
    with torch.inference_mode():
        full, low = model(window), half(window).float()
    assert (low.argmax(-1) == full.argmax(-1)).float().mean() >= 0.9
    torch.testing.assert_close(low, full, rtol=0, atol=0.25)
    assert (out[:, 6:] == ref[:, 6:]).float().mean() >= 0.9


def test_generated_ids_can_be_trained_on() -> None:
    """generate works under inference_mode but returns an ordinary tensor: feeding its ids
    to a model that is training must not raise "Inference tensors cannot be saved"."""
    from handformer import DecoderLM, generate
    from handformer.loss import lm_loss

    torch.manual_seed(0)
    model = DecoderLM(tiny_config())
    out = generate(model, torch.tensor([[1, 2, 3]]), 5, temperature=0)
    assert not out.is_inference()
    model.train()
    loss = lm_loss(model(out[:, :-1]), out[:, 1:])
    loss.backward()
    assert model.embed.token.weight.grad is not None


# -- never a sample from a non-finite distribution ----------------------------------------
@pytest.mark.parametrize("temperature", [1e-6, 1e-20, 1e-29, 1e-40, 5e-324])
def test_a_tiny_temperature_is_greedy_and_never_overflows(temperature: float) -> None:
    """Down to GREEDY_TEMPERATURE a sample is drawn (and is the argmax, logits / T being
    huge); below it the argmax is taken directly: both are the T → 0 limit."""
    model = _model("rope", "sdpa")
    prompt = torch.randint(0, 37, (2, 4))
    greedy = generate(model, prompt, 12, temperature=0)
    assert torch.equal(generate(model, prompt, 12, temperature=temperature, seed=3), greedy)


def test_sample_next_shifts_logits_that_would_overflow_and_keeps_banned_tokens_out() -> None:
    logits = torch.tensor([[1.0e10, -1.0e10, float("-inf"), 0.99e10]])
    assert GREEDY_TEMPERATURE < 1e-29
    assert not torch.isfinite(logits / 1e-29).all()  # the plain division overflows
    assert sample_next(logits, temperature=1e-29).tolist() == [0]
    draws = {int(sample_next(logits, temperature=1e11,
                             generator=torch.Generator().manual_seed(s))) for s in range(50)}
    assert 2 not in draws and len(draws) > 1  # -inf stays banned at any temperature


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sample_next_refuses_nan_or_inf_logits(bad: float, temperature: float) -> None:
    logits = torch.tensor([[1.0, bad, 0.5], [0.1, 0.2, 0.3]])
    with pytest.raises(NonFiniteLogitsError, match=r"rows \[0\]"):
        sample_next(logits, temperature=temperature)
    with pytest.raises(NonFiniteLogitsError, match="no finite value"):
        sample_next(torch.full((1, 3), float("-inf")), temperature=temperature)


def test_a_model_that_returns_nan_logits_is_a_clear_error() -> None:
    model = _model("learned", "sdpa")
    with torch.no_grad():
        model.final_norm.weight[0] = float("nan")
    for temperature in (0.0, 1.0):
        with pytest.raises(NonFiniteLogitsError,
                           match=r"the model returned non-finite logits.*generated token 1"):
            generate(model, torch.tensor([[5, 6]]), 3, temperature=temperature)


def test_a_repetition_penalty_that_overflows_the_logits_is_blamed_by_name() -> None:
    model = _model("learned", "sdpa")
    with pytest.raises(NonFiniteLogitsError, match="repetition_penalty=1e-40 overflowed"):
        generate(model, torch.tensor([[5, 6, 7, 8]]), 3, temperature=0.8,
                 repetition_penalty=1e-40)
