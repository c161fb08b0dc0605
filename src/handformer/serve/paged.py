"""The paged KV cache: one preallocated pool of blocks, read through each request's block table.

``KVPool`` is the memory: for every layer, ``num_blocks · block_size`` token slots of keys and
values, (L, N·bs, 2·Hkv, D), keys in heads [0, Hkv) and values after them — the layout
``MultiHeadAttention``'s fused projection produces (``nn.kv_cache.KVCache`` keeps a request's
keys apart from its values instead, each column by column).

``PagedBatchCache`` is what one forward call of the model sees: it speaks the interface of
``nn.kv_cache.DecoderCache`` (``append_tokens``, ``key_positions``, ``has_padding``,
``layers[i].update``, ``commit``), so the model runs its own ``forward`` unchanged — no
second copy of attention. A call packs every request's new tokens into one row: request
``i`` with ``n_i`` cached tokens and ``t_i`` new ones (a prefill chunk, or the one token a
decoding request feeds) is a *segment* of that row, so one call serves a step's prefill
chunks and its decoding requests together — the weights are read once per step, and no
row is padded to another's length. The ids are (1, Σ t_i); the keys and values attention
sees are laid out segment after segment:

    queries   [q_i, q_i + t_i)            segment i's new tokens (q_i = Σ_{j<i} t_j)
    keys      [k_i, k_i + n_i + t_i)      its cached tokens, gathered from its blocks,
                                          then its new ones (k_i = Σ_{j<i} (n_j + t_j))

Each layer's ``update`` scatters the new keys and values into their requests' blocks, then
gathers every column — cached and new — from the pool in one copy, and hands the
(1, Hkv, Σ (n_i + t_i), D) keys and values (views of that copy) to the model's existing
attention kernels. With more than one segment, ``row_spans`` tells attention where each
segment's queries and keys lie, and each segment runs the kernel over them alone: it meets
the shapes it has when it is the only request, so its attention does not depend on the
rest of the batch (``nn.attention._attend_each_row``), and no mask is needed.

Why a gather and not a fused paged kernel: the gather is a readable copy into the kernels the
tests already hold equal to torch's. A fused paged-attention kernel (vLLM's) reads the keys
straight out of the blocks inside the attention loop, which would save (a) the copy itself —
each step reads every cached key twice (gather, then attention) and writes it once in
between; (b) the transient (1, 2·Hkv, Σ (n_i + t_i), D) buffer per layer; and (c) the
per-segment kernel calls, one launch for the whole batch instead.

Positions count from each request's window start: a request's cached tokens have positions
0..n_i - 1 and its new ones n_i..n_i + t_i - 1, as ``generate`` gives them after a (re)fill.

Shape legend: ``L`` layers, ``N`` blocks, ``bs`` block size, ``T`` = Σ t_i new tokens in the
call, ``S`` = Σ (n_i + t_i) key columns, ``P`` = Σ n_i cached ones, ``Hkv`` key/value heads,
``D`` head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from handformer.config import ModelConfig

__all__ = ["KVPool", "PagedBatchCache"]


class KVPool:
    """Every layer's key/value slots, allocated once: ``kv`` (L, N·bs, 2·Hkv, D)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, *,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.n_kv_heads = config.n_kv_heads
        self.kv = torch.zeros((config.n_layers, num_blocks * block_size,
                               2 * config.n_kv_heads, config.head_dim),
                              dtype=dtype, device=device)  # (L, N·bs, 2·Hkv, D)

    def nbytes(self) -> int:
        """Bytes the pool holds (the whole KV memory of the server)."""
        return self.kv.numel() * self.kv.element_size()

    def slots(self, table: Sequence[int], start: int, stop: int) -> list[int]:
        """Pool slot indices of a request's context tokens [start, stop)."""
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, stop)]


class _PagedLayer:
    """One layer's view for one forward call: ``update`` as ``KVCache.update`` does it."""

    def __init__(self, pool_kv: Tensor, batch: PagedBatchCache) -> None:
        # pool_kv (N·bs, 2·Hkv, D) seen as one row per token: torch copies whole rows of a
        # 2-D tensor faster than (2·Hkv, D) slices of a 3-D one, in both directions.
        self.pool_rows = pool_kv.view(pool_kv.shape[0], -1)  # (N·bs, 2·Hkv·D)
        self.batch = batch
        self.row_spans = batch.row_spans  # per segment (query start, queries, key start, keys)

    def update(self, kv_new: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """kv_new (1, 2·Hkv, T, D), the call's new tokens (``start`` = P, the cached
        columns); returns keys and values (1, Hkv, S, D) each, segment after segment."""
        batch, h = self.batch, self.batch.n_kv_heads
        _, _, t, d = kv_new.shape
        if start != batch.past:
            raise ValueError(f"a paged cache writes its new tokens after its {batch.past} "
                             f"cached columns; got offset {start}")
        if kv_new.shape[0] != 1:
            raise ValueError("a paged cache takes its requests packed into one row of ids "
                             f"(1, {batch.new_tokens}); got {kv_new.shape[0]} rows")
        # The new keys/values into their requests' blocks (token-major, as the pool is).
        rows = kv_new[0].permute(1, 0, 2).reshape(t, 2 * h * d)  # (T, 2·Hkv·D)
        self.pool_rows.index_copy_(0, batch.write_slots, rows)
        if batch.past == 0:
            full = kv_new  # (1, 2·Hkv, T, D): nothing cached, the columns are the new tokens
        else:
            # One gather of every column, the new ones included (just written): no second
            # copy to append them. Token-major, so the heads are a strided view.
            full = self.pool_rows.index_select(0, batch.read_slots)  # (S, 2·Hkv·D)
            full = full.view(1, -1, 2 * h, d).permute(0, 2, 1, 3)  # (1, 2·Hkv, S, D)
        return full[:, :h], full[:, h:]  # (1, Hkv, S, D) each


class PagedBatchCache:
    """A ``DecoderCache`` look-alike over the pool for one forward call of a batch of
    requests, packed into one row of ids (1, Σ new tokens), request after request.

    ``tables[i]`` is request i's block table, ``cached[i]`` how many of its context tokens
    the pool holds already, and it feeds ``new_tokens`` new ones — one count for every
    request, or one per request (prefill chunks and decoding requests in one call); the
    caller reads request i's logits at its last new token, ``Σ_{j≤i} new[j] - 1``. Each
    table must already hold ``cached[i] + new[i]`` slots (the scheduler allocated them).
    Used once: the engine builds a new one for every call.
    """

    def __init__(self, pool: KVPool, tables: Sequence[Sequence[int]], cached: Sequence[int],
                 new_tokens: int | Sequence[int]) -> None:
        device = pool.kv.device
        b, bs = len(tables), pool.block_size
        new = [new_tokens] * b if isinstance(new_tokens, int) else list(new_tokens)
        if not b or len(cached) != b or len(new) != b or min(new) < 1 or min(cached) < 0:
            raise ValueError(f"a paged batch needs, for each of its requests, a block table, "
                             f"cached tokens ≥ 0 and new tokens ≥ 1; got {b} tables, cached "
                             f"{list(cached)}, new {new}")
        self.n_kv_heads = pool.n_kv_heads
        self.new_tokens = sum(new)  # T
        self.past = sum(cached)  # P: the columns that are not this call's new tokens
        self.capacity = self.past + self.new_tokens  # S
        self.length = self.past  # the filled columns, as DecoderCache counts them
        widest = max(len(table) for table in tables)
        padded = torch.tensor([list(table) + [0] * (widest - len(table)) for table in tables],
                              dtype=torch.long)  # (B, blocks)
        # Segment i: (query start, queries, key start, keys) — its new tokens among the
        # call's, and its cached-then-new columns among the keys.
        spans, q, k = [], 0, 0
        for c, t in zip(cached, new, strict=True):
            spans.append((q, t, k, c + t))
            q, k = q + t, k + c + t
        n = torch.tensor(list(cached), dtype=torch.long)  # (B,)
        width = torch.tensor([keys for *_, keys in spans], dtype=torch.long)  # (B,)
        first = torch.tensor([start for _, _, start, _ in spans], dtype=torch.long)  # (B,)
        segment = torch.repeat_interleave(torch.arange(b), width)  # (S,) whose column it is
        position = torch.arange(self.capacity) - first[segment]  # (S,) context position
        # The pool slot of each column: block table[p // bs] of its request, offset p % bs.
        slots = padded[segment, position // bs] * bs + position % bs  # (S,)
        is_new = position >= n[segment]  # (S,) True on the call's new tokens, in query order
        self.read_slots = slots.to(device)  # (S,)
        self.write_slots = slots[is_new].to(device)  # (T,)
        self.key_positions = position[None].to(device)  # (1, S)
        self.query_positions = position[is_new][None].to(device)  # (1, T)
        # More than one request: each segment's attention runs over its own columns only
        # (``nn.attention._attend_each_row``), the shapes it has alone.
        self.row_spans = spans if b > 1 else None
        self.has_padding = False
        self.layers = [_PagedLayer(pool.kv[i], self) for i in range(pool.kv.shape[0])]

    def append_tokens(self, new_mask: Tensor | None, t: int | None = None
                      ) -> tuple[Tensor, int]:
        """The new tokens' positions (1, T) and the write offset P (``new_mask`` must be
        None: the new tokens were fixed when the cache was built)."""
        if new_mask is not None or t != self.new_tokens:
            raise ValueError(f"a paged cache takes exactly the {self.new_tokens} new tokens "
                             "it was built for, in one row, with no padding mask")
        return self.query_positions, self.past  # (1, T)

    def commit(self, t: int) -> None:
        self.length += t
