"""The block manager: which fixed-size KV blocks of the one pool each request holds.

The pool is ``num_blocks`` blocks of ``block_size`` token slots each, allocated once when the
server starts (``paged.KVPool`` holds the tensors; this module only counts). A request owns a
*block table* — the list of its block ids in order — and token ``p`` of its context lives in
slot ``p % block_size`` of block ``table[p // block_size]``. Blocks are taken one at a time as
the request's context grows and all go back to the free list at once when it finishes, is
cancelled, its client goes away, or it is preempted. So memory follows the tokens actually in
flight, never batch × window, and a freed block is reused by the next request at once: the
pool never fragments, because every block is the same size.

Nothing here touches a tensor; the scheduler asks, the engine reads the tables.
"""

from __future__ import annotations

__all__ = ["BlockManager", "blocks_for"]


def blocks_for(tokens: int, block_size: int) -> int:
    """How many blocks hold ``tokens`` token slots (ceil division)."""
    return -(-tokens // block_size)


class BlockManager:
    """Hands out block ids from a free list and takes them back.

    ``allocate(table, tokens)`` grows ``table`` (a request's block table, a list it owns) to
    hold ``tokens`` slots, or returns False and changes nothing when the free list is short;
    ``release(table)`` returns every block of ``table`` and empties it.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"a KV pool needs num_blocks > 0 and block_size > 0; got "
                             f"{num_blocks} blocks of {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Low ids first: a quiet server reuses the same few blocks (warm in the cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.peak = 0  # the most blocks held at once so far

    @property
    def free(self) -> int:
        """Blocks not held by any request."""
        return len(self._free)

    @property
    def used(self) -> int:
        """Blocks held by some request."""
        return self.num_blocks - len(self._free)

    def needed(self, table: list[int], tokens: int) -> int:
        """Blocks ``table`` must gain to hold ``tokens`` slots (0 when it holds them)."""
        return max(0, blocks_for(tokens, self.block_size) - len(table))

    def can_allocate(self, table: list[int], tokens: int) -> bool:
        return self.needed(table, tokens) <= len(self._free)

    def allocate(self, table: list[int], tokens: int) -> bool:
        """Grow ``table`` to hold ``tokens`` slots; False (nothing taken) if the pool is short."""
        n = self.needed(table, tokens)
        if n > len(self._free):
            return False
        for _ in range(n):
            table.append(self._free.pop())
        self.peak = max(self.peak, self.used)
        return True

    def release(self, table: list[int]) -> None:
        """Give back every block of ``table`` and empty it."""
        self._free.extend(reversed(table))
        table.clear()
