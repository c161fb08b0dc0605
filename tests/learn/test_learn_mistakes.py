"""Every row of the mistake table is a test: an implementation with that mistake gets that
diagnosis from its checker, and the correct implementation passes every checker."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from handformer import learn
from handformer.learn import MISTAKES, CheckResult
from tests.learn import readers as r


def _cls(klass, **bug):
    return lambda *args, **kwargs: klass(*args, **kwargs, **bug)


CORRECT = {
    "attention": (learn.check_attention, r.attention),
    "causal mask": (learn.check_causal_mask, r.causal_mask),
    "padding mask": (learn.check_padding_mask, r.padding_mask),
    "multi-head": (learn.check_multi_head, r.MultiHeadAttention),
    "positions": (learn.check_positional_encoding, r.PositionalEncoding),
    "layer norm": (learn.check_layer_norm, r.LayerNorm),
    "feed-forward": (learn.check_feed_forward, r.FeedForward),
    "block": (learn.check_block, r.TransformerBlock),
    "training step": (learn.check_training_loop, r.training_step),
    "generate": (learn.check_generate, r.generate),
}

# mistake key → (checker, the buggy implementation, extra checker arguments)
BUGGY = {
    "unscaled": (learn.check_attention, partial(r.attention, scale=False)),
    "softmax_axis": (learn.check_attention, partial(r.attention, axis=-2)),
    "mask_polarity": (learn.check_causal_mask, partial(r.causal_mask, polarity=False)),
    "mask_transposed": (learn.check_causal_mask, partial(r.causal_mask, transpose=True)),
    "mask_missing": (learn.check_lm, _cls(r.MiniLM, mask="none")),
    "mask_broadcast": (learn.check_padding_mask, partial(r.padding_mask, broadcast=False)),
    "view_contiguous": (learn.check_multi_head, _cls(r.MultiHeadAttention, bug="view_contiguous")),
    "heads_merged": (learn.check_multi_head, _cls(r.MultiHeadAttention, bug="heads_merged")),
    "heads_split": (learn.check_multi_head, _cls(r.MultiHeadAttention, bug="heads_split")),
    "positions_missing": (learn.check_positional_encoding, _cls(r.PositionalEncoding, times=0)),
    "positions_twice": (learn.check_positional_encoding, _cls(r.PositionalEncoding, times=2)),
    "layer_norm_axis": (learn.check_layer_norm, _cls(r.LayerNorm, dim=1)),
    "layer_norm_unbiased": (learn.check_layer_norm, _cls(r.LayerNorm, unbiased=True)),
    "no_residual": (learn.check_block, _cls(r.TransformerBlock, residual=False)),
    "no_activation": (learn.check_feed_forward, _cls(r.FeedForward, activation=False)),
    "targets_unshifted": (learn.check_training_loop,
                          partial(r.training_step, bug="targets_unshifted")),
    "targets_shifted_right": (learn.check_training_loop,
                              partial(r.training_step, bug="targets_shifted_right")),
    "loss_counts_padding": (learn.check_training_loop,
                            partial(r.training_step, bug="loss_counts_padding")),
    "no_zero_grad": (learn.check_training_loop, partial(r.training_step, bug="no_zero_grad")),
    "generate_wrong_position": (learn.check_generate, partial(r.generate, position=0)),
}


# The same mistake seen by another checker: (mistake key, checker, buggy implementation).
ALSO = [
    ("mask_polarity", learn.check_attention, partial(r.attention, polarity=False)),
    ("mask_transposed", learn.check_attention, partial(r.attention, transpose=True)),
    ("unscaled", learn.check_multi_head, _cls(r.MultiHeadAttention, bug="unscaled")),
]


def test_every_row_of_the_table_has_a_test() -> None:
    tested = set(BUGGY) | {"mask_transposed", "positions_missing", "cache_offset"}
    assert tested == set(MISTAKES)


@pytest.mark.parametrize(("key", "checker", "implementation"), ALSO,
                         ids=[f"{k}-{c.__name__}" for k, c, _ in ALSO])
def test_a_mistake_is_named_by_every_checker_that_can_see_it(key, checker,
                                                             implementation) -> None:
    result = checker(implementation)
    assert result.mistake == key, result.message


@pytest.mark.parametrize("piece", CORRECT)
def test_the_correct_implementation_passes(piece: str) -> None:
    checker, implementation = CORRECT[piece]
    result = checker(implementation)
    assert isinstance(result, CheckResult)
    assert result.passed, result.message
    assert result.message.startswith("PASS ") and str(result) == result.message


@pytest.mark.parametrize("key", BUGGY)
def test_each_mistake_gets_its_diagnosis(key: str) -> None:
    checker, implementation = BUGGY[key]
    result = checker(implementation)
    assert not result.passed
    assert result.mistake == key, result.message
    assert result.message.startswith("FAIL ") and MISTAKES[key].fix in result.message


def _tiny_lm(**bug) -> r.MiniLM:
    torch.manual_seed(0)
    return r.MiniLM(12, 16, 2, 1, 32, 32, **bug).eval()


def test_a_cache_that_forgets_the_offset_is_named() -> None:
    result = learn.check_generate(r.generate_forgetting_the_offset, model=_tiny_lm())
    assert result.mistake == "cache_offset", result.message
    assert "the logits of the first 1 new token(s) agree" in result.message
    assert learn.check_generate(r.generate, model=_tiny_lm()).passed


def test_the_forgotten_offset_is_named_even_when_it_picks_the_same_greedy_tokens() -> None:
    """Not luck: a model that always picks token 3 (a huge bias on it) makes the buggy cache
    pick exactly the full recompute's tokens; its logits still give the bug away."""
    model = _tiny_lm()
    with torch.no_grad():
        model.head.bias[3] += 1e3
    tokens = r.generate_forgetting_the_offset(model, torch.tensor([[4, 5, 6], [7, 8, 9]]), 8)
    assert tokens[:, 3:].eq(3).all()  # the same tokens as the full recompute's
    result = learn.check_generate(r.generate_forgetting_the_offset, model=model)
    assert result.mistake == "cache_offset", result.message
    assert learn.check_generate(r.generate, model=model).passed


def test_a_real_kv_cache_passes_and_the_same_cache_forgetting_its_offset_is_named() -> None:
    """The cached generation of the build track (prefill, then one token per call), with and
    without the offset, checked on the model it runs."""
    model = _tiny_lm()
    cached = learn.check_generate(partial(r.generate_cached, offset=True), model=model)
    assert cached.passed, cached.message
    assert "and the logits they were picked from" in cached.message
    forgetful = learn.check_generate(partial(r.generate_cached, offset=False), model=model)
    assert forgetful.mistake == "cache_offset", forgetful.message


def test_tokens_not_read_greedily_from_right_logits_are_told_so() -> None:
    def second_best(model, ids, max_new_tokens):
        for _ in range(max_new_tokens):
            logits = model(ids)  # (B, T, V)
            ids = torch.cat([ids, logits[:, -1].topk(2).indices[:, 1:]], dim=1)
        return ids

    result = learn.check_generate(second_best, model=_tiny_lm())
    assert not result.passed and result.mistake is None
    assert "new token 1 is not the argmax of the last position's logits" in result.message


def test_the_correct_lm_trains_like_the_library_and_the_broken_ones_are_named() -> None:
    """check_lm trains the reader's model and the library's a few dozen steps each."""
    good = learn.check_lm(r.MiniLM)
    assert good.passed, good.message
    assert "val loss" in good.message
    assert learn.check_lm(_cls(r.MiniLM, mask="transposed")).mistake == "mask_transposed"
    assert learn.check_lm(_cls(r.MiniLM, positions=False)).mistake == "positions_missing"


def test_a_traceback_in_the_readers_code_is_reported_with_their_line() -> None:
    def attention_with_a_typo(q, k, v, mask=None):
        scores = q @ k.transpose(-2, -1)
        return scores @ v.transpose(-2, -1)  # the reader's bug: shapes do not multiply

    result = learn.check_attention(attention_with_a_typo)
    assert not result.passed
    assert "raised RuntimeError at test_learn_mistakes.py:" in result.message
    assert "in attention_with_a_typo: return scores @ v.transpose(-2, -1)" in result.message


def test_a_class_that_does_not_take_the_contract_s_arguments_is_told_so() -> None:
    class TwoArgumentLM(torch.nn.Module):
        def __init__(self, vocab_size, d_model):
            super().__init__()

    result = learn.check_lm(TwoArgumentLM)
    assert not result.passed
    first, second = result.message.splitlines()[:2]
    assert first == "FAIL check_lm: cls(vocab_size=..., ...) raised TypeError"
    assert "unexpected keyword argument 'num_heads'" in second


def test_a_wrong_shape_is_reported_with_both_shapes() -> None:
    result = learn.check_attention(lambda q, k, v, mask=None: q.sum(1))
    assert not result.passed
    assert "returned shape (2, 5, 8), expected (2, 3, 5, 8)" in result.message
    result = learn.check_causal_mask(lambda t: torch.tril(torch.ones(t, t)))
    assert "expected torch.bool" in result.message


def test_whatever_the_code_hands_back_the_checker_returns_a_result() -> None:
    """Not a module, another dtype, a backward that fails: a FAIL or a PASS, never a raise."""
    not_a_module = learn.check_multi_head(lambda d_model, num_heads: "a layer")
    assert not not_a_module.passed and "AttributeError" in not_a_module.message
    in_float64 = learn.check_attention(
        lambda q, k, v, mask=None: r.attention(q.double(), k.double(), v.double(),
                                               None if mask is None else mask))
    assert in_float64.passed, in_float64.message

    def step_with_a_broken_backward(model, optimizer, ids, pad_id):
        loss = model(ids[:, :-1]).sum()
        loss.backward()
        loss.backward()  # the second backward through a freed graph raises
        return loss.item()

    broken = learn.check_training_loop(step_with_a_broken_backward)
    assert not broken.passed and "RuntimeError" in broken.message
    assert "in step_with_a_broken_backward: loss.backward()" in broken.message
