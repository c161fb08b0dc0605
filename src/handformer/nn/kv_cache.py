"""The key/value cache: what autoregressive decoding remembers between steps.

Without a cache every new token recomputes the keys and values of the whole context. With
one, each layer keeps its keys and values in preallocated buffers and a step computes them
for the new token only.

* ``KVCache`` — one layer's keys and values in one buffer, written at an explicit offset.
* ``DecoderCache`` — all layers of a model plus what the layers share: how many columns are
  filled, which of them are real tokens (left-padded batches) and each column's position.

Shape legend: ``B`` batch, ``Hkv`` key/value heads, ``L`` capacity, ``T`` new tokens,
``S`` filled length, ``D`` head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from handformer.nn import huge_pages

__all__ = ["DecoderCache", "KVCache", "storage_shape", "stores_by_column"]


def stores_by_column(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a cache of ``dtype`` on ``device`` stores its keys and values column by column
    (see ``KVCache``): where the hand-written decoding attention reads it (float32 on the
    CPU), which reads every head of a column together. Elsewhere torch's attention reads the
    cache one head at a time, and its single-query kernels read a column-by-column cache at a
    stride, several times slower than one head's keys side by side: those caches stay head by
    head."""
    return dtype == torch.float32 and torch.device(device).type == "cpu"


def storage_shape(batch_size: int, n_kv_heads: int, capacity: int, head_dim: int,
                  by_column: bool) -> tuple[int, ...]:
    """The shape of a ``KVCache``'s ``buffer``: (B, 2, L, Hkv, D) column by column, else
    (B, 2, Hkv, L, D)."""
    if by_column:
        return (batch_size, 2, capacity, n_kv_heads, head_dim)
    return (batch_size, 2, n_kv_heads, capacity, head_dim)


class KVCache:
    """Preallocated key/value buffers of one attention layer.

    Keys and values share one buffer, ``buffer``: the keys, then the values. ``k`` and ``v``
    are views of the two halves in attention's order (B, Hkv, L, D). A float32 cache on the
    CPU stores each half column by column, (B, 2, L, Hkv, D): a column's heads side by side
    (``stores_by_column``; the attribute ``by_column`` says which). Why: a decoding step reads
    the first S columns of every head; stored head by head, that is 2·Hkv separate runs of
    memory with the unfilled columns between them, and memory's prefetchers start over at each
    run (and fetch past its end). By column, the filled keys are one run and the filled values
    another, however many are filled; the decoding attention (``decode_attention.c``) reads
    every head of a column together. Other caches, read by torch's attention one head at a
    time, store (B, 2, Hkv, L, D).
    """

    # A contiguous cache's rows share one length (padding, if any, is masked): attention
    # runs once over the batch. A paged batch packs its requests one after another along
    # the sequence and sets (query start, queries, key start, keys) per request instead:
    # see ``serve.paged``.
    row_spans: list[tuple[int, int, int, int]] | None = None

    def __init__(self, batch_size: int, n_kv_heads: int, capacity: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 buffer: Tensor | None = None) -> None:
        """``buffer``: a zero tensor of the cache's ``storage_shape`` and dtype to hold the
        keys and values (``DecoderCache`` lays its layers' buffers on huge pages); default a
        new one."""
        self.n_kv_heads = n_kv_heads
        self.by_column = stores_by_column(dtype, device)
        shape = storage_shape(batch_size, n_kv_heads, capacity, head_dim, self.by_column)
        if buffer is not None and (tuple(buffer.shape) != shape or buffer.dtype != dtype):
            raise ValueError(f"a KV buffer of shape {shape} and dtype {dtype} was expected; "
                             f"got {tuple(buffer.shape)} {buffer.dtype}")
        self.buffer = (buffer if buffer is not None
                       else torch.zeros(shape, dtype=dtype, device=device))
        # (B, 2, Hkv, L, D) whichever way it is stored: every read and write goes through it
        self._heads = self.buffer.transpose(2, 3) if self.by_column else self.buffer

    @property
    def k(self) -> Tensor:
        """The key buffer (B, Hkv, L, D), a view of ``buffer``."""
        return self._heads[:, 0]

    @property
    def v(self) -> Tensor:
        """The value buffer (B, Hkv, L, D), a view of ``buffer``."""
        return self._heads[:, 1]

    @property
    def capacity(self) -> int:
        """How many columns (tokens) the buffers hold."""
        return self._heads.shape[3]

    def update(self, kv_new: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Write new keys and values, kv_new (B, 2·Hkv, T, D) with the keys first (the order
        of ``MultiHeadAttention``'s fused projection), at columns [start, start+T); return the
        keys and values of columns [0, start+T), (B, Hkv, S, D) each (views of the buffer)."""
        heads, h = self._heads, self.n_kv_heads  # (B, 2, Hkv, L, D)
        b, _, _, capacity, d = heads.shape
        if kv_new.dim() != 4 or tuple(kv_new.shape[:2]) != (b, 2 * h) or kv_new.shape[3] != d:
            raise ValueError(f"new keys and values {tuple(kv_new.shape)} do not fit the cache "
                             f"(B, 2·Hkv, T, D) = ({b}, {2 * h}, T, {d})")
        end = start + kv_new.shape[2]
        if end > capacity:
            raise ValueError(f"KV cache overflow: writing columns {start}..{end - 1} into a "
                             f"cache of capacity {capacity}; reset it or make it larger")
        heads[:, :, :, start:end] = kv_new.unflatten(1, (2, h))  # (B, 2, Hkv, T, D)
        return heads[:, 0, :, :end], heads[:, 1, :, :end]  # (B, Hkv, S, D) each

    def nbytes(self) -> int:
        """Bytes held by the key and value buffers."""
        return self.buffer.numel() * self.buffer.element_size()


class DecoderCache:
    """Per-layer KV caches plus the bookkeeping every layer shares.

    ``length`` columns are filled. ``key_mask[:, j]`` says whether column j holds a real
    token (False for left padding); ``key_positions[:, j]`` is its position id, counting
    real tokens only; ``next_position`` is the position the next real token of each row gets.
    """

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, capacity: int,
                 head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        shape = storage_shape(batch_size, n_kv_heads, capacity, head_dim,
                              stores_by_column(dtype, device))
        # On the CPU the layers' buffers lie back to back on 2 MiB pages (nn.huge_pages): a
        # decoding step streams them all, as it streams the int8 weights. Pages are taken at
        # first touch, 2 MiB at a time, as the columns fill (a short window's cache at once).
        buffers = (huge_pages.zeros([shape] * n_layers, dtype)
                   if torch.device(device).type == "cpu" else None)
        self.layers = [KVCache(batch_size, n_kv_heads, capacity, head_dim, dtype=dtype,
                               device=device, buffer=None if buffers is None else buffers[i])
                       for i in range(n_layers)]
        self.batch_size = batch_size
        self.capacity = capacity
        self._key_mask = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)
        self._key_positions = torch.zeros(batch_size, capacity, dtype=torch.long, device=device)
        self._next_position = torch.zeros(batch_size, dtype=torch.long, device=device)
        # The last _run filled columns were counted by ``add_decoded_token`` and their
        # bookkeeping is not written yet (``_settle`` writes it before the length moves).
        self._run = 0
        self.length = 0
        self.has_padding = False  # any filled column that is not a real token?

    @property
    def key_mask(self) -> Tensor:
        """(B, L) bool: whether column j holds a real token (False for left padding)."""
        self._settle()
        return self._key_mask

    @property
    def key_positions(self) -> Tensor:
        """(B, L) long: column j's position id, counting real tokens only."""
        self._settle()
        return self._key_positions

    @property
    def next_position(self) -> Tensor:
        """(B,) long: the position the next real token of each row gets."""
        self._settle()
        return self._next_position

    def _settle(self) -> None:
        """Write the bookkeeping of the tokens ``add_decoded_token`` counted: every one real,
        at the positions that follow ``next_position``."""
        n = self._run
        if n == 0:
            return
        start = self.length - n
        self._run = 0
        # A read may come outside the inference mode the tokens were decoded in, and an
        # inference tensor (a cache made in that mode) takes in-place writes only within it.
        with torch.inference_mode():
            steps = torch.arange(n, device=self._next_position.device)  # (n,)
            self._key_mask[:, start : start + n] = True
            self._key_positions[:, start : start + n] = self._next_position[:, None] + steps
            self._next_position += n

    def reset(self) -> None:
        """Forget everything (buffers stay allocated and are overwritten on the next fill)."""
        self._run = 0
        self.length = 0
        self._next_position.zero_()
        self.has_padding = False

    def add_decoded_token(self) -> None:
        """Count one real token per row whose keys and values every layer has already
        written at column ``length`` (the one-call decoding token, ``decode_block.
        token_step``): ``append_tokens(None, 1)`` and ``commit(1)`` in one, without a tensor
        op. Decoding calls this once a token, and each of those ops would run with caches the
        weights just streamed through; their mask, positions and next position are written
        for the whole run at once, when something next reads them."""
        self._check_room(1)
        self._run += 1
        self.length += 1

    def _check_room(self, t: int) -> None:
        """``ValueError`` unless T more columns fit after the filled ones."""
        if self.length + t > self.capacity:
            raise ValueError(f"KV cache overflow: {self.length} cached + {t} new "
                             f"token{'' if t == 1 else 's'} > capacity {self.capacity}; reset "
                             "the cache or set it up with a larger max_len")

    def append_tokens(self, new_mask: Tensor | None, t: int | None = None
                      ) -> tuple[Tensor, int]:
        """Register T new columns; returns their positions (B, T) and the write offset.

        ``new_mask`` (B, T) bool marks real tokens among them; ``None`` means all T are real
        (then pass ``t``), which needs no look at the data — and for ``t == 1``, the common
        decoding step, no arithmetic beyond one increment either.
        """
        if new_mask is None:
            if t is None:
                raise ValueError("append_tokens needs new_mask or t")
            b = self.batch_size
        else:
            b, t = new_mask.shape
        if b != self.batch_size:
            raise ValueError(f"cache was set up for batch size {self.batch_size}; got {b}")
        self._settle()
        self._check_room(t)
        start = self.length
        if new_mask is None and t == 1:  # one real token per row: a decoding step
            positions = self._next_position[:, None].clone()  # (B, 1)
            self._key_mask[:, start] = True
            self._key_positions[:, start] = self._next_position
            self._next_position += 1
            return positions, start
        if new_mask is None:
            counts = torch.arange(1, t + 1, device=self._key_mask.device).expand(b, t)  # (B, T)
            self._key_mask[:, start : start + t] = True
        else:
            counts = new_mask.long().cumsum(dim=-1)  # (B, T)
            self._key_mask[:, start : start + t] = new_mask
            self.has_padding = self.has_padding or not bool(new_mask.all())
        positions = (self._next_position[:, None] + counts - 1).clamp(min=0)  # (B, T)
        self._key_positions[:, start : start + t] = positions
        self._next_position += counts[:, -1]
        return positions, start

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` filled columns, as if the later ones had never been
        appended: speculative decoding rolls back the tokens its target rejected this way.

        Exact: the bookkeeping of the kept columns is untouched and ``next_position`` and
        ``has_padding`` are recomputed from them (a column's position counts the real
        tokens before it since the last ``reset``); the buffers past ``length`` are simply
        overwritten by the next write, and attention never reads beyond the filled length.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} filled columns to "
                             f"{length}; expected 0 <= length <= {self.length}")
        if length == self.length:
            return
        self._settle()
        kept = self._key_mask[:, :length]  # (B, length)
        self._next_position.copy_(kept.sum(dim=1))
        self.has_padding = bool(length) and not bool(kept.all())
        self.length = length

    def commit(self, t: int) -> None:
        """Mark T appended columns as filled, once every layer has written them."""
        self._settle()  # a counted run's columns are the last filled ones
        self.length += t

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
