"""``DecoderCache``'s bookkeeping: rolling a cache back (``truncate``) is exact — the state,
and every logit after it, equal those of a cache that never saw the dropped tokens — and
tokens counted by ``add_decoded_token`` read as appended ones."""

from __future__ import annotations

import pytest
import torch

from handformer.models.decoder_lm import DecoderLM
from handformer.nn.kv_cache import DecoderCache, KVCache
from tests.conftest import tiny_config

POSITIONALS = ["sinusoidal", "learned", "rope", "alibi"]


def _model(positional: str, n_kv_heads: int = 4) -> DecoderLM:
    torch.manual_seed(5)
    return DecoderLM(tiny_config(positional=positional, n_kv_heads=n_kv_heads)).eval()


def _state(cache: DecoderCache) -> tuple:
    n = cache.length
    return (n, cache.has_padding, cache.next_position.tolist(),
            cache.key_mask[:, :n].tolist(), cache.key_positions[:, :n].tolist(),
            [layer.buffer[:, :, :n].clone() for layer in cache.layers])


def _assert_same_state(a: DecoderCache, b: DecoderCache, atol: float = 0.0) -> None:
    """Bookkeeping equal exactly; keys and values within ``atol`` (0: bit for bit)."""
    sa, sb = _state(a), _state(b)
    assert sa[:5] == sb[:5]
    for ka, kb in zip(sa[5], sb[5], strict=True):
        torch.testing.assert_close(ka, kb, rtol=0, atol=atol)


@pytest.mark.parametrize("positional", POSITIONALS)
@pytest.mark.parametrize("n_kv_heads", [4, 1])
def test_truncate_equals_never_having_appended(positional: str, n_kv_heads: int) -> None:
    model = _model(positional, n_kv_heads)
    prompt = torch.randint(0, 37, (2, 6))
    mask = torch.tensor([[False, False, True, True, True, True], [True] * 6])  # left padding
    extra, after = torch.randint(0, 37, (2, 4)), torch.randint(0, 37, (2, 3))
    rolled, clean = model.make_cache(2), model.make_cache(2)
    with torch.no_grad():
        model(prompt, mask, cache=rolled)
        model(extra[:, :1], cache=rolled)
        model(extra, cache=rolled)  # 4 tokens that get rejected
        rolled.truncate(7)
        model(prompt, mask, cache=clean)
        model(extra[:, :1], cache=clean)
        _assert_same_state(rolled, clean)
        got, want = model(after, cache=rolled), model(after, cache=clean)  # (B, 3, V)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    _assert_same_state(rolled, clean)


def test_truncate_to_zero_and_into_the_padding_forgets_the_padding() -> None:
    model = _model("alibi")
    mask = torch.tensor([[False, True, True], [True, True, True]])
    cache = model.make_cache(2)
    with torch.no_grad():
        model(torch.randint(0, 37, (2, 3)), mask, cache=cache)
    cache.truncate(1)
    assert cache.has_padding and cache.next_position.tolist() == [0, 1]
    cache.truncate(0)
    assert cache.length == 0 and not cache.has_padding
    assert cache.next_position.tolist() == [0, 0]


def test_truncate_after_a_sliding_refill_is_exact() -> None:
    """Positions restart at the refill (``reset``); truncating after it counts from there."""
    model = _model("learned")
    ids = torch.randint(0, 37, (1, 30))
    rolled, clean = model.make_cache(1), model.make_cache(1)
    with torch.no_grad():
        model(ids[:, :16], cache=rolled)
        rolled.reset()  # the window slid: refill with the kept half, then go on
        model(ids[:, 8:16], cache=rolled)
        model(ids[:, 16:20], cache=rolled)
        rolled.truncate(9)
        model(ids[:, 8:17], cache=clean)
    # token 16 went in with 3 others on one side, with 8 on the other: float rounding only
    _assert_same_state(rolled, clean, atol=1e-5)
    assert rolled.next_position.tolist() == [9]


@pytest.mark.parametrize("length", [-1, 4])
def test_truncate_refuses_lengths_outside_the_filled_part(length: int) -> None:
    model = _model("rope")
    cache = model.make_cache(1)
    with torch.no_grad():
        model(torch.randint(0, 37, (1, 3)), cache=cache)
    with pytest.raises(ValueError, match=r"0 <= length <= 3"):
        cache.truncate(length)


def _bookkeeping(cache: DecoderCache) -> tuple:
    n = cache.length
    return (n, cache.has_padding, cache.next_position.tolist(),
            cache.key_mask[:, :n].tolist(), cache.key_positions[:, :n].tolist())


@pytest.mark.parametrize("seed", range(6))
def test_decoded_tokens_read_as_appended_ones(seed: int) -> None:
    """``add_decoded_token`` writes its run's bookkeeping only when something reads it:
    after every step of a random script of decoded tokens, padded and plain chunks,
    truncations and resets, the two caches read alike, and the chunks get the same
    positions."""
    gen = torch.Generator().manual_seed(seed)
    lazy, eager = (DecoderCache(1, 2, 1, 64, 4) for _ in range(2))

    def draw(n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=gen))

    for _ in range(40):
        op = draw(10)
        room = eager.capacity - eager.length
        if op < 6 and room >= 1:
            lazy.add_decoded_token()
            eager.append_tokens(None, 1)
            eager.commit(1)
        elif op < 8 and room >= 3:
            mask = torch.rand(2, 3, generator=gen) < 0.7 if draw(2) else None
            got = lazy.append_tokens(mask, 3)
            want = eager.append_tokens(mask, 3)
            assert got[1] == want[1] and torch.equal(got[0], want[0])
            lazy.commit(3)
            eager.commit(3)
        elif op == 8:
            length = draw(eager.length + 1)
            lazy.truncate(length)
            eager.truncate(length)
        else:
            lazy.reset()
            eager.reset()
        if draw(3) == 0:  # reads in the middle of a run settle it; the run then goes on
            assert _bookkeeping(lazy) == _bookkeeping(eager)
    assert _bookkeeping(lazy) == _bookkeeping(eager)


def test_a_decoded_token_past_the_capacity_is_an_overflow() -> None:
    cache = DecoderCache(1, 1, 1, 2, 4)
    cache.add_decoded_token()
    cache.add_decoded_token()
    with pytest.raises(ValueError, match=r"KV cache overflow: 2 cached \+ 1 new token > "
                                         r"capacity 2"):
        cache.add_decoded_token()
    assert cache.length == 2 and cache.key_positions[0].tolist() == [0, 1]


@pytest.mark.parametrize("made_in_inference_mode", [True, False])
def test_decoded_tokens_read_outside_the_mode_they_were_decoded_in(
        made_in_inference_mode: bool) -> None:
    """Tokens decoded under ``torch.inference_mode`` are read back (and written, on that
    read) outside it, whichever mode made the cache; a later chunk outside works too."""
    with torch.inference_mode(made_in_inference_mode):
        cache = DecoderCache(1, 1, 1, 8, 4)
    with torch.inference_mode():
        cache.add_decoded_token()
        cache.add_decoded_token()
    assert cache.key_positions[0, :2].tolist() == [0, 1]
    assert cache.next_position.tolist() == [2] and cache.key_mask[0, :2].all()
    with torch.inference_mode():
        cache.add_decoded_token()
    if made_in_inference_mode:
        with torch.inference_mode():
            positions, start = cache.append_tokens(None, 2)
    else:
        positions, start = cache.append_tokens(None, 2)
    assert start == 3 and positions.tolist() == [[3, 4]]


def test_the_filled_keys_and_values_are_one_run_of_memory_each() -> None:
    """Column by column: whatever the fill, a step's keys (every head) are the buffer's first
    S·Hkv·D floats and its values the first of the second half, each in column order — so a
    decoding step streams two runs, not one per head; ``update`` writes what it was given."""
    cache = KVCache(2, 3, 10, 4)  # B 2, Hkv 3, L 10, D 4
    torch.manual_seed(0)
    first, more = torch.randn(2, 6, 5, 4), torch.randn(2, 6, 2, 4)  # (B, 2·Hkv, T, D)
    cache.update(first, 0)
    k, v = cache.update(more, 5)  # (B, Hkv, 7, D) each
    written = torch.cat([first, more], dim=2)  # (B, 2·Hkv, 7, D)
    assert torch.equal(k, written[:, :3]) and torch.equal(v, written[:, 3:])
    assert k.stride()[1:] == (4, 3 * 4, 1) and v.stride() == k.stride()  # (Hkv, S, D) strides
    assert k.data_ptr() == cache.buffer.data_ptr()
    assert v.data_ptr() - k.data_ptr() == 10 * 3 * 4 * k.element_size()  # after all L columns
    assert torch.equal(cache.buffer[:, 0, :7], written[:, :3].transpose(1, 2))  # (B, S, Hkv, D)
    assert torch.count_nonzero(cache.buffer[:, :, 7:]) == 0  # nothing past the written columns


def test_a_cache_torch_reads_stays_head_by_head() -> None:
    """bf16 (torch's attention reads it, one head at a time): each head's keys side by side,
    (B, 2, Hkv, L, D); written and read back the same way as a float32 cache."""
    cache = KVCache(1, 2, 6, 4, dtype=torch.bfloat16)
    assert not cache.by_column and tuple(cache.buffer.shape) == (1, 2, 2, 6, 4)
    new = torch.randn(1, 4, 3, 4).to(torch.bfloat16)  # (B, 2·Hkv, T, D)
    k, v = cache.update(new, 1)  # (B, Hkv, 4, D) each
    assert torch.equal(k[:, :, 1:], new[:, :2]) and torch.equal(v[:, :, 1:], new[:, 2:])
    assert k.stride()[1:] == (6 * 4, 4, 1)  # a head's columns side by side
    assert torch.count_nonzero(k[:, :, 0]) == 0
    assert torch.count_nonzero(cache.buffer) == 2 * 2 * 3 * 4  # only the written columns


@pytest.mark.parametrize("shape", [(1, 4, 2), (1, 4, 2, 5), (2, 4, 2, 4), (1, 6, 2, 4)])
def test_keys_and_values_of_another_shape_are_refused_by_name(shape: tuple[int, ...]) -> None:
    """Not (B, 2·Hkv, T, D) of this cache (a 3-D tensor, another D, B or head count): one
    ``ValueError`` naming both shapes, nothing written."""
    cache = KVCache(1, 2, 6, 4)
    want = r"do not fit the cache \(B, 2·Hkv, T, D\) = \(1, 4, T, 4\)"
    with pytest.raises(ValueError, match=want):
        cache.update(torch.ones(shape), 0)
    assert torch.count_nonzero(cache.buffer) == 0
