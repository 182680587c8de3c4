"""Paged KV-cache block manager: a free list, reference counts and a quarantine.

Block 0 is reserved (padded rows of CUDA-graph batches write there). Blocks
released while a ring consumer may still hold a snapshot naming them are
quarantined until the next sync has told it so; otherwise a standby could
adopt a request whose blocks another request had already overwritten.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from .config import NULL_BLOCK


class BlockError(ValueError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise BlockError(f"need at least 2 blocks (block {NULL_BLOCK} is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(b for b in range(num_blocks) if b != NULL_BLOCK)
        self._free_set = set(self._free)
        self._ref = [0] * num_blocks
        self._quarantine: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_quarantined(self) -> int:
        return len(self._quarantine)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise BlockError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise BlockError(f"out of KV blocks: need {n}, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._free_set.discard(b)
            self._ref[b] = 1
        return out

    def pin(self, block_ids: Sequence[int]) -> None:
        """Take specific blocks (adoption): all must be valid and free, or nothing is taken."""
        seen = set()
        for b in block_ids:
            if not isinstance(b, int) or isinstance(b, bool):
                raise BlockError(f"block id {b!r} is not an integer")
            if b == NULL_BLOCK or not (0 <= b < self.num_blocks):
                raise BlockError(f"block id {b} out of range (valid: 1..{self.num_blocks - 1})")
            if b in seen:
                raise BlockError(f"block id {b} given twice")
            seen.add(b)
            if b not in self._free_set:
                raise BlockError(f"block id {b} is already in use")
        for b in block_ids:
            self._free_set.discard(b)
            self._ref[b] = 1
        if block_ids:
            self._free = deque(b for b in self._free if b not in seen)

    def release(self, block_ids: Iterable[int], quarantine: bool) -> None:
        for b in block_ids:
            if self._ref[b] <= 0:
                raise BlockError(f"block {b} released twice")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if quarantine:
                    self._quarantine.append(b)
                else:
                    self._free.append(b)
                    self._free_set.add(b)

    def release_quarantine(self) -> int:
        n = len(self._quarantine)
        for b in self._quarantine:
            self._free.append(b)
            self._free_set.add(b)
        self._quarantine.clear()
        return n

    def refcount(self, b: int) -> int:
        return self._ref[b]

    def check(self) -> None:
        """Invariant check for tests: every block is free, used or quarantined, exactly once."""
        used = {b for b in range(self.num_blocks) if self._ref[b] > 0}
        q = set(self._quarantine)
        assert len(q) == len(self._quarantine)
        assert set(self._free) == self._free_set and len(self._free) == len(self._free_set)
        assert not (used & self._free_set) and not (used & q) and not (q & self._free_set)
        assert used | q | self._free_set | {NULL_BLOCK} == set(range(self.num_blocks))
