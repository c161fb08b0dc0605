"""The paged KV cache reads and writes what the contiguous cache does: the model's forward
over scattered blocks gives the logits of its forward over one buffer."""

from __future__ import annotations

import pytest
import torch

from handformer.serve.blocks import BlockManager, blocks_for
from handformer.serve.paged import KVPool, PagedBatchCache
from tests.serve.helpers import tiny_lm


def test_block_manager_allocates_frees_and_refuses_without_taking() -> None:
    blocks = BlockManager(4, 8)
    a: list[int] = []
    b: list[int] = []
    assert blocks.allocate(a, 17) and len(a) == 3 and blocks.free == 1
    assert blocks.allocate(a, 24) and len(a) == 3  # 24 slots fit in the same 3 blocks
    assert not blocks.allocate(b, 9) and b == [] and blocks.free == 1
    blocks.release(a)
    assert a == [] and blocks.free == 4 and blocks.allocate(b, 32) and blocks.used == 4
    assert blocks_for(0, 8) == 0 and blocks_for(8, 8) == 1 and blocks_for(9, 8) == 2
    with pytest.raises(ValueError, match="num_blocks > 0"):
        BlockManager(0, 8)


@pytest.mark.parametrize("positional", ["learned", "rope", "alibi", "sinusoidal"])
def test_paged_prefill_and_batched_decode_equal_the_contiguous_cache(positional: str) -> None:
    model = tiny_lm(positional=positional, n_kv_heads=2)
    pool = KVPool(model.config, num_blocks=20, block_size=3, dtype=torch.float32,
                  device="cpu")
    blocks = BlockManager(20, 3)
    torch.manual_seed(1)
    seqs = [torch.randint(4, model.config.vocab_size, (n,)) for n in (5, 1, 9)]
    tables: list[list[int]] = [[], [], []]
    # Interleave allocations so every request's blocks are scattered through the pool.
    for grow in range(1, 4):
        for table in tables:
            assert blocks.allocate(table, grow * 3)
    with torch.inference_mode():
        # Prefill each prompt but its last token, one request per call, in two chunks.
        for seq, table in zip(seqs, tables, strict=True):
            done = 0
            for chunk in (seq[: len(seq) // 2], seq[len(seq) // 2 : -1]):
                if len(chunk):
                    model(chunk[None], cache=PagedBatchCache(pool, [table], [done], len(chunk)))
                    done += len(chunk)
        # One batched step: every request feeds its last token, over different past lengths,
        # packed into one row; each attends over its own keys (query start, queries, key
        # start, keys).
        cache = PagedBatchCache(pool, tables, [len(s) - 1 for s in seqs], 1)
        assert cache.row_spans == [(0, 1, 0, 5), (1, 1, 5, 1), (2, 1, 6, 9)]
        paged = model(torch.cat([s[-1:] for s in seqs])[None], cache=cache)[0]  # (B, V)
        for i, seq in enumerate(seqs):
            contiguous = model.make_cache(1)
            if len(seq) > 1:
                model(seq[None, :-1], cache=contiguous)
            alone = model(seq[None, -1:], cache=contiguous)[:, -1]
            full = model(seq[None])[:, -1]
            torch.testing.assert_close(paged[i : i + 1], alone, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(paged[i : i + 1], full, rtol=1e-4, atol=1e-4)
            # The pool holds exactly the keys/values the contiguous cache holds.
            slots = pool.slots(tables[i], 0, len(seq))
            stored = pool.kv[0, slots].permute(1, 0, 2)  # (2·Hkv, S, D)
            layer = contiguous.layers[0]
            held = torch.cat([layer.k[0], layer.v[0]])[:, : len(seq)]  # (2·Hkv, S, D)
            torch.testing.assert_close(stored, held, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("positional", ["learned", "rope", "alibi"])
def test_prefill_chunks_and_decoding_tokens_in_one_call_equal_one_call_each(
        positional: str) -> None:
    """Requests packed into one row: each one's logits at its last new token, and what it
    writes to the pool, are those of its own call; nothing else is written."""
    model = tiny_lm(positional=positional, n_kv_heads=2)
    torch.manual_seed(2)
    # Request 0 starts from nothing, 2 continues a prefill after 7 cached tokens, 1 and 3
    # decode one token after 4 (the decoding segments share one kernel call, between and
    # after prefill chunks).
    seqs = [torch.randint(4, model.config.vocab_size, (n,)) for n in (6, 5, 9, 5)]
    cached, new = [0, 4, 7, 4], [6, 1, 2, 1]
    pools = [KVPool(model.config, num_blocks=12, block_size=4, dtype=torch.float32,
                    device="cpu") for _ in range(2)]
    tables = [[0, 1], [5, 2], [9, 3, 7], [4, 6]]
    with torch.inference_mode():
        for pool in pools:  # the cached prefixes, one call each
            for seq, table, n in zip(seqs, tables, cached, strict=True):
                if n:
                    model(seq[None, :n], cache=PagedBatchCache(pool, [table], [0], n))
        alone = [model(seq[None, n : n + k], cache=PagedBatchCache(pools[0], [table], [n],
                                                                   k))[0, -1]
                 for seq, table, n, k in zip(seqs, tables, cached, new, strict=True)]
        ids = torch.cat([s[n : n + k] for s, n, k in zip(seqs, cached, new, strict=True)])
        cache = PagedBatchCache(pools[1], tables, cached, new)
        assert cache.row_spans == [(0, 6, 0, 6), (6, 1, 6, 5), (7, 2, 11, 9), (9, 1, 20, 5)]
        assert len(cache.write_slots) == sum(new)
        logits = model(ids[None], cache=cache)[0]  # (10, V)
    for i, last in enumerate(torch.tensor(new).cumsum(0) - 1):
        torch.testing.assert_close(logits[last], alone[i], rtol=1e-4, atol=1e-4)
    # Both pools hold the same keys and values in every slot the requests own (and
    # nothing was written anywhere else: the untouched slots are still zero).
    owned = sorted(slot for table, n, k in zip(tables, cached, new, strict=True)
                   for slot in pools[0].slots(table, 0, n + k))
    torch.testing.assert_close(pools[1].kv[:, owned], pools[0].kv[:, owned],
                               rtol=1e-4, atol=1e-4)
    others = [s for s in range(pools[1].kv.shape[1]) if s not in owned]
    assert torch.count_nonzero(pools[1].kv[:, others]) == 0


@pytest.mark.parametrize("positional", ["learned", "alibi"])
def test_requests_in_one_call_read_only_their_own_slots(positional: str) -> None:
    """Each request of a packed decoding batch attends over its own columns only: NaN in
    every slot no request owns reaches no request, and each one's logits are those it has
    alone."""
    model = tiny_lm(positional=positional, n_kv_heads=2)
    torch.manual_seed(3)
    seqs = [torch.randint(4, model.config.vocab_size, (n,)) for n in (3, 8, 5)]
    tables = [[1, 4], [2, 5, 6], [3, 7]]  # block 0 belongs to nobody
    pool = KVPool(model.config, num_blocks=8, block_size=3, dtype=torch.float32, device="cpu")
    owned = sorted(slot for table, seq in zip(tables, seqs, strict=True)
                   for slot in pool.slots(table, 0, len(seq)))
    unowned = [slot for slot in range(pool.kv.shape[1]) if slot not in owned]
    pool.kv[:, unowned] = float("nan")
    with torch.inference_mode():
        for seq, table in zip(seqs, tables, strict=True):  # every prompt but its last token
            model(seq[None, :-1], cache=PagedBatchCache(pool, [table], [0], len(seq) - 1))
        cached = [len(s) - 1 for s in seqs]
        last = torch.cat([s[-1:] for s in seqs])[None]  # (1, 3)
        cache = PagedBatchCache(pool, tables, cached, 1)
        assert cache.row_spans == [(0, 1, 0, 3), (1, 1, 3, 8), (2, 1, 11, 5)]
        batched = model(last, cache=cache)[0]  # (3, V)
        alone = [model(last[:, i : i + 1], cache=PagedBatchCache(pool, [tables[i]],
                                                                 [cached[i]], 1))[0, -1]
                 for i in range(3)]
    assert torch.isfinite(batched).all()
    for i in range(3):
        torch.testing.assert_close(batched[i], alone[i], rtol=1e-5, atol=1e-5)
    assert pool.kv[:, unowned].isnan().all()  # and nothing was written outside the tables


def test_a_packed_batch_takes_no_mask_and_returns_no_weights() -> None:
    model = tiny_lm(n_kv_heads=2)
    pool = KVPool(model.config, num_blocks=4, block_size=4, dtype=torch.float32, device="cpu")
    cache = PagedBatchCache(pool, [[0], [1]], [2, 0], 1)
    attention = model.blocks[0].self_attn
    x = torch.randn(1, 2, model.config.d_model)
    with pytest.raises(ValueError, match="no mask and returns no weights"):
        attention(x, cache=cache.layers[0], cache_start=cache.past, need_weights=True)


def test_a_paged_cache_refuses_what_it_was_not_built_for() -> None:
    model = tiny_lm()
    pool = KVPool(model.config, 4, 4, dtype=torch.float32, device="cpu")
    cache = PagedBatchCache(pool, [[0, 1]], [0], 2)
    with pytest.raises(ValueError, match="exactly the 2 new tokens it was built for"):
        model(torch.tensor([[5, 6, 7]]), cache=cache)
    two = PagedBatchCache(pool, [[0], [1]], [0, 0], 1)
    with pytest.raises(ValueError, match="in one row"):  # the old (B, 1) layout
        model(torch.tensor([[5], [6]]), cache=two)
    one = PagedBatchCache(pool, [[0]], [0], 1)
    with pytest.raises(ValueError, match=r"one row of ids \(1, 1\); got 2 rows"):
        model(torch.tensor([[5], [6]]), cache=one)
    with pytest.raises(ValueError, match="new tokens ≥ 1"):
        PagedBatchCache(pool, [[0], [1]], [0, 0], [1, 0])
    with pytest.raises(ValueError, match="a block table"):
        PagedBatchCache(pool, [], [], 1)
