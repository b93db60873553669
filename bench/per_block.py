"""The gateway's guess of a replica's cache as it was before ``cache/tree.py``: an LRU set of
block hashes per replica (a dictionary entry a block), optionally reporting into the fleet's
``Holders`` map. Kept as the baseline that ``python -m bench choice`` measures the tree against,
in the same run; the gateway does not use it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from prefix_router.cache.blocks import BlockHash
from prefix_router.cache.holders import Holders

__all__ = ["PerBlockIndex"]


class PerBlockIndex:
    """LRU set of one replica's block hashes, at most ``capacity`` (``ShadowIndex`` before the tree)."""

    def __init__(self, capacity: int, holders: Holders | None = None) -> None:
        self.capacity = capacity
        self.holders = holders
        self.bit = holders.slot() if holders is not None else 0
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[BlockHash]) -> None:
        """The chain, touched tail first; the least recently used beyond capacity go."""
        blocks = self._blocks
        for h in reversed(hashes[: self.capacity]):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                if self.holders is not None:
                    self.holders.add(h, self.bit)
        while len(blocks) > self.capacity:
            h, _ = blocks.popitem(last=False)
            if self.holders is not None:
                self.holders.discard(h, self.bit)
