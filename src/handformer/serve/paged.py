"""The paged KV cache: one preallocated pool of blocks, read through each request's block table.

``KVPool`` is the memory: for every layer, ``num_blocks · block_size`` token slots of keys and
values, (L, N·bs, 2·Hkv, D), keys in heads [0, Hkv) and values after them — the layout
``MultiHeadAttention``'s fused projection produces, as in ``nn.kv_cache.KVCache``.

``PagedBatchCache`` is what one forward call of the model sees: it speaks the interface of
``nn.kv_cache.DecoderCache`` (``append_tokens``, ``key_mask``, ``key_positions``,
``has_padding``, ``layers[i].update``, ``commit``), so the model runs its own ``forward``
unchanged — no second copy of attention. For a batch of requests, row ``i`` with ``n_i``
cached tokens and ``T`` new ones, it lays the rows out as a left-padded contiguous cache:

    columns   [0, P - n_i)      padding (masked out; P = max n_i)
              [P - n_i, P)      row i's cached keys/values, gathered from its blocks
              [P, P + T)        the T new tokens, computed by this call

Each layer's ``update`` scatters the new keys and values into their requests' blocks, then
gathers every column — cached and new — from the pool in one copy, and hands the
(B, Hkv, P + T, D) keys and values (views of that copy) to the model's existing attention
kernels.

Why a gather and not a fused paged kernel: the gather is a readable copy into the kernels the
tests already hold equal to torch's. A fused paged-attention kernel (vLLM's) reads the keys
straight out of the blocks inside the attention loop, which would save (a) the copy itself —
each step reads every cached key twice (gather, then attention) and writes it once in
between; (b) the transient (B, 2·Hkv, P + T, D) buffer per layer; and (c) the padding: rows
of different lengths cost the longest row's work here, while a ragged kernel visits each
row's own blocks only.

Positions count from each request's window start: a request's cached tokens have positions
0..n_i - 1 and its new ones n_i..n_i + T - 1, as ``generate`` gives them after a (re)fill.

Shape legend: ``L`` layers, ``N`` blocks, ``bs`` block size, ``B`` batch rows, ``P`` longest
cached length in the batch, ``T`` new tokens per row, ``Hkv`` key/value heads, ``D`` head dim.
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
        self.pool_kv = pool_kv  # (N·bs, 2·Hkv, D)
        self.batch = batch

    def update(self, kv_new: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """kv_new (B, 2·Hkv, T, D), written after the P cached columns (``start`` = P);
        returns keys and values (B, Hkv, P + T, D) each."""
        batch, h = self.batch, self.batch.n_kv_heads
        b, _, t, d = kv_new.shape
        if start != batch.past:
            raise ValueError(f"a paged cache writes its new tokens after its {batch.past} "
                             f"cached columns; got offset {start}")
        # The new keys/values into their requests' blocks (token-major, as the pool is).
        self.pool_kv.index_copy_(0, batch.write_slots,
                                 kv_new.permute(0, 2, 1, 3).reshape(b * t, 2 * h, d))
        if batch.past == 0:
            full = kv_new  # (B, 2·Hkv, T, D): nothing cached yet
        else:
            # One gather of every column, the new ones included (just written): no second
            # copy to append them. Token-major, so the heads are a strided view.
            full = self.pool_kv.index_select(0, batch.read_slots)  # (B·(P+T), 2·Hkv, D)
            full = full.view(b, batch.past + t, 2 * h, d).permute(0, 2, 1, 3)  # (B,2·Hkv,P+T,D)
        return full[:, :h], full[:, h:]  # (B, Hkv, P + T, D) each


class PagedBatchCache:
    """A ``DecoderCache`` look-alike over the pool for one forward call of ``B`` requests.

    ``tables[i]`` is request i's block table, ``cached[i]`` how many of its context tokens
    the pool holds already, and every row feeds ``new_tokens`` new ones; each table must
    already hold ``cached[i] + new_tokens`` slots (the scheduler allocated them). Used once:
    the engine builds a new one for every call.
    """

    def __init__(self, pool: KVPool, tables: Sequence[Sequence[int]], cached: Sequence[int],
                 new_tokens: int) -> None:
        device = pool.kv.device
        b, t, bs = len(tables), new_tokens, pool.block_size
        self.batch_size = b
        self.n_kv_heads = pool.n_kv_heads
        self.past = max(cached)  # P
        self.capacity = self.past + t
        self.length = self.past  # the filled columns, as DecoderCache counts them
        widest = max(len(table) for table in tables)
        padded = torch.tensor([list(table) + [0] * (widest - len(table)) for table in tables],
                              dtype=torch.long)  # (B, blocks)
        # The pool slot of each request's context position p: block table[p // bs], offset
        # p % bs — laid out for every position its table covers.
        slot_of = (padded[:, :, None] * bs + torch.arange(bs)).view(b, widest * bs)  # (B, ·)
        n = torch.tensor(list(cached), dtype=torch.long)  # (B,)
        # Column j of the laid-out cache holds context position j - (P - n_i): negative for
        # the left padding.
        position = torch.arange(self.past + t)[None, :] - (self.past - n)[:, None]  # (B, P+T)
        real = position >= 0  # (B, P + T)
        position = position.clamp(min=0)
        # Padding columns read slot 0 of the pool: any finite value, masked out by key_mask.
        read = torch.where(real, slot_of.gather(1, position), 0)  # (B, P + T)
        write = read[:, self.past :]  # (B, T): the new tokens' own slots
        self.read_slots = read.flatten().to(device)  # (B·(P+T),)
        self.write_slots = write.flatten().to(device)  # (B·T,)
        self.key_mask = real.to(device)  # (B, P + T) True = a real token
        self.key_positions = position.to(device)  # (B, P + T)
        self.next_position = n.to(device)  # (B,)
        self.has_padding = any(c != self.past for c in cached)
        self.layers = [_PagedLayer(pool.kv[i], self) for i in range(pool.kv.shape[0])]

    def append_tokens(self, new_mask: Tensor | None, t: int | None = None
                      ) -> tuple[Tensor, int]:
        """The new tokens' positions (B, T) and the write offset P; every new token is real
        (``new_mask`` must be None: rows feed the same number of tokens)."""
        if new_mask is not None or t != self.capacity - self.past:
            raise ValueError("a paged cache takes exactly the new tokens it was built for, "
                             "with no padding mask")
        return self.key_positions[:, self.past:], self.past  # (B, T)

    def commit(self, t: int) -> None:
        self.length += t
