"""The paged KV cache: one preallocated pool of blocks, read through each request's block table.

``KVPool`` is the memory: for every layer, ``num_blocks · block_size`` token slots of keys and
values, (L, N·bs, 2·Hkv, D), keys in heads [0, Hkv) and values after them — the layout
``MultiHeadAttention``'s fused projection produces, as in ``nn.kv_cache.KVCache``.

``PagedBatchCache`` is what one forward call of the model sees: it speaks the interface of
``nn.kv_cache.DecoderCache`` (``append_tokens``, ``key_mask``, ``key_positions``,
``has_padding``, ``layers[i].update``, ``commit``), so the model runs its own ``forward``
unchanged — no second copy of attention. For a batch of requests, row ``i`` with ``n_i``
cached tokens and ``t_i`` new ones (``T`` = max t_i: every decoding row feeds one, prefill
chunks differ), it lays the rows out as a padded contiguous cache:

    columns   [0, P - n_i)      padding (P = max n_i)
              [P - n_i, P)      row i's cached keys/values, gathered from its blocks
              [P, P + t_i)      its t_i new tokens, computed by this call
              [P + t_i, P + T)  padding for a row with fewer new tokens than the longest

Each layer's ``update`` scatters the new keys and values into their requests' blocks, then
gathers every column — cached and new — from the pool in one copy, and hands the
(B, Hkv, P + T, D) keys and values (views of that copy) to the model's existing attention
kernels. When the rows' lengths differ, ``row_spans`` tells attention where each row's own
columns lie, and each row runs the kernel over them alone: the padding is never read, costs
no work and needs no mask, and every row meets the shapes it has when it is the only
request, so its attention does not depend on the rest of the batch
(``nn.attention._attend_each_row``).

Why a gather and not a fused paged kernel: the gather is a readable copy into the kernels the
tests already hold equal to torch's. A fused paged-attention kernel (vLLM's) reads the keys
straight out of the blocks inside the attention loop, which would save (a) the copy itself —
each step reads every cached key twice (gather, then attention) and writes it once in
between; (b) the transient (B, 2·Hkv, P + T, D) buffer per layer, padding included; and
(c) the per-row kernel calls, one launch for the whole batch instead.

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
        # pool_kv (N·bs, 2·Hkv, D) seen as one row per token: torch copies whole rows of a
        # 2-D tensor faster than (2·Hkv, D) slices of a 3-D one, in both directions.
        self.pool_rows = pool_kv.view(pool_kv.shape[0], -1)  # (N·bs, 2·Hkv·D)
        self.batch = batch
        self.row_spans = batch.row_spans  # (first key column, keys, queries) per row, or None

    def update(self, kv_new: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """kv_new (B, 2·Hkv, T, D), written after the P cached columns (``start`` = P);
        returns keys and values (B, Hkv, P + T, D) each."""
        batch, h = self.batch, self.batch.n_kv_heads
        b, _, t, d = kv_new.shape
        if start != batch.past:
            raise ValueError(f"a paged cache writes its new tokens after its {batch.past} "
                             f"cached columns; got offset {start}")
        # The new keys/values into their requests' blocks (token-major, as the pool is);
        # a ragged batch's padding is left out.
        rows = kv_new.permute(0, 2, 1, 3).reshape(b * t, 2 * h * d)  # (B·T, 2·Hkv·D)
        if batch.write_rows is not None:
            rows = rows.index_select(0, batch.write_rows)  # (real new tokens, 2·Hkv·D)
        self.pool_rows.index_copy_(0, batch.write_slots, rows)
        if batch.past == 0:
            full = kv_new  # (B, 2·Hkv, T, D): nothing cached yet
        else:
            # One gather of every column, the new ones included (just written): no second
            # copy to append them. Token-major, so the heads are a strided view.
            full = self.pool_rows.index_select(0, batch.read_slots)  # (B·(P+T), 2·Hkv·D)
            full = full.view(b, batch.past + t, 2 * h, d).permute(0, 2, 1, 3)  # (B,2·Hkv,P+T,D)
        return full[:, :h], full[:, h:]  # (B, Hkv, P + T, D) each


class PagedBatchCache:
    """A ``DecoderCache`` look-alike over the pool for one forward call of ``B`` requests.

    ``tables[i]`` is request i's block table, ``cached[i]`` how many of its context tokens
    the pool holds already, and row i feeds ``new_tokens`` new ones — one count for every
    row, or one per row (prefill chunks of different lengths in one call: a row with fewer
    than the longest, T, is right-padded, its padding never attended to nor written
    to the pool; the caller reads row i's logits at its last real token, ``new[i] - 1``).
    Each table must already hold ``cached[i] + new[i]`` slots (the scheduler allocated
    them). Used once: the engine builds a new one for every call.
    """

    def __init__(self, pool: KVPool, tables: Sequence[Sequence[int]], cached: Sequence[int],
                 new_tokens: int | Sequence[int]) -> None:
        device = pool.kv.device
        b, bs = len(tables), pool.block_size
        new = [new_tokens] * b if isinstance(new_tokens, int) else list(new_tokens)
        t = max(new)
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
        counts = torch.tensor(new, dtype=torch.long)  # (B,)
        # Column j of the laid-out cache holds context position j - (P - n_i): negative for
        # the left padding, past the row's last new token for its right padding.
        position = torch.arange(self.past + t)[None, :] - (self.past - n)[:, None]  # (B, P+T)
        last = (n + counts - 1)[:, None]  # (B, 1) each row's last real position
        real = (position >= 0) & (position <= last)  # (B, P + T)
        # Padding takes a real row's position (learned tables end at the window).
        position = torch.minimum(position.clamp(min=0), last)
        # Padding columns read slot 0 of the pool: no row's attention reads them (row_spans).
        read = torch.where(real, slot_of.gather(1, position), 0)  # (B, P + T)
        real_new = real[:, self.past :]  # (B, T)
        ragged = any(c != t for c in new)
        self.read_slots = read.flatten().to(device)  # (B·(P+T),)
        # The new tokens' own slots, and (ragged rows only) which of the B·T new rows are real.
        self.write_slots = read[:, self.past :][real_new].to(device)  # (real new tokens,)
        self.write_rows = real_new.flatten().nonzero().flatten().to(device) if ragged else None
        self.key_mask = real.to(device)  # (B, P + T) True = a real token
        self.key_positions = position.to(device)  # (B, P + T)
        self.next_position = n.to(device)  # (B,)
        # Rows of different lengths: each row's attention runs over its own columns only,
        # [P - n_i, P + t_i) (``nn.attention._attend_each_row``), so no padding column is
        # ever read into it and the model needs no key mask. Rows of one length share one
        # kernel call.
        padded = ragged or any(c != self.past for c in cached)
        self.row_spans = [(self.past - c, c + k, k) for c, k in zip(cached, new, strict=True)
                          ] if padded else None
        self.has_padding = False
        self.layers = [_PagedLayer(pool.kv[i], self) for i in range(pool.kv.shape[0])]

    def append_tokens(self, new_mask: Tensor | None, t: int | None = None
                      ) -> tuple[Tensor, int]:
        """The new tokens' positions (B, T) and the write offset P (``new_mask`` must be
        None: which new tokens are real was fixed when the cache was built)."""
        if new_mask is not None or t != self.capacity - self.past:
            raise ValueError("a paged cache takes exactly the new tokens it was built for, "
                             "with no padding mask")
        return self.key_positions[:, self.past:], self.past  # (B, T)

    def commit(self, t: int) -> None:
        self.length += t
