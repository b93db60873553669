"""What the gateway believes one replica holds: the shadow index.

``ShadowIndex``: the block chains one replica is believed to hold. An LRU set of block hashes
bounded by the replica's KV capacity (``num_gpu_blocks``), so its memory is at most
``capacity`` entries, plus as many recently evicted ones (about 100 bytes each in CPython: the
28,000 blocks of the default H100 replica stay under 6 MB). Blocks are added when a request is
routed (vLLM makes them hittable as soon as they are scheduled) and touched when they hit; the
generated tokens' blocks take their share of capacity when the request ends; LRU approximates
vLLM's "least recently freed first" eviction. The engine's reported ``cached_tokens`` then tells
a right prediction from an eviction. Where a replica's KV events are followed, its engine's own
picture (``cache/events.py``, ``EngineView``) replaces this guess for routing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from prefix_router.cache.blocks import BlockHash
from prefix_router.cache.holders import Holders

__all__ = ["ShadowIndex"]


class ShadowIndex:
    """LRU set of the block hashes one replica is believed to hold, at most ``capacity``.

    With ``holders``, every block it starts or stops holding is reported there under a slot of
    its own (``bit``), so the fleet is matched in one walk (``cache/holders.py``); ``close``
    gives the slot back."""

    def __init__(self, capacity: int, holders: Holders | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.holders = holders
        self.bit = holders.slot() if holders is not None else 0
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()
        self._opaque = 0  # counter naming generated-token blocks
        self._ghosts: OrderedDict[BlockHash, None] = OrderedDict()  # evicted lately, newest last

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of ``hashes`` believed cached (chained hashes: stop at the first miss)."""
        blocks = self._blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Record ``hashes`` as cached and most recently used; evict the oldest beyond capacity.

        The chain is touched tail first, so its first block ends most recent: vLLM frees a
        request's blocks tail first (``BlockPool.free_blocks`` on the reversed block list) and
        evicts the least recently freed, so under pressure a prefix loses its tail, never its
        head. Returns the hashes that were not there before (to ``forget`` if the request failed).
        A chain longer than the capacity is cut to it first: its head is what the capacity
        would keep anyway, and inserting and evicting a huge prompt's blocks one by one held the
        event loop (``bench/results/hostile-bodies/README.md``, the text rows).
        """
        blocks = self._blocks
        added = []
        for h in reversed(hashes[: self.capacity]):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                added.append(h)
        if self.holders is not None:
            for h in added:
                self.holders.add(h, self.bit)
        self._evict_over_capacity()
        return added

    def add_output(self, num_blocks: int, prompt: Sequence[BlockHash]) -> None:
        """Account for a finished request's generated blocks, then its prompt's.

        vLLM caches generated tokens' blocks too; they are never hit by a new prompt but take
        KV capacity. They enter as unique entries that only fill the LRU, and the prompt's
        blocks are touched after them: a request's blocks are freed tail first, so its output
        blocks are evicted before its prompt (``BlockPool.free_blocks``).
        """
        if num_blocks <= 0:
            return
        blocks = self._blocks
        for _ in range(min(num_blocks, self.capacity)):
            self._opaque = (self._opaque + 1) % (1 << 62)
            blocks[BlockHash(-1 - self._opaque)] = None  # negative: never a real xxh3 digest
        for h in reversed(prompt):  # tail first: the head ends most recent, as in insert
            if h in blocks:
                blocks.move_to_end(h)
        self._evict_over_capacity()

    def forget(self, hashes: Sequence[BlockHash]) -> None:
        """Drop blocks the engine showed it no longer holds."""
        holders = self.holders
        for h in hashes:
            if self._blocks.pop(h, 0) is None and holders is not None:  # it was there
                holders.discard(h, self.bit)

    def match_ever(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks believed cached now or evicted lately (a ghost list of ``capacity``
        entries, as in ARC): a prompt the replica held until LRU pressure took it. Lets the
        gateway call such a miss ``miss_evicted`` rather than cold."""
        blocks, ghosts = self._blocks, self._ghosts
        n = 0
        for h in hashes:
            if h not in blocks and h not in ghosts:
                break
            n += 1
        return n

    def _evict_over_capacity(self) -> None:
        blocks, ghosts, holders = self._blocks, self._ghosts, self.holders
        while len(blocks) > self.capacity:
            h, _ = blocks.popitem(last=False)
            if h >= 0:  # generated-token blocks are never looked up
                ghosts[h] = None
                if holders is not None:
                    holders.discard(h, self.bit)
        while len(ghosts) > self.capacity:
            ghosts.popitem(last=False)

    def resize(self, capacity: int) -> None:
        """Adopt a capacity learned from the replica's metrics."""
        self.capacity = max(capacity, 1)
        self.insert(())

    def clear(self) -> None:
        """The replica restarted or its cache was reset."""
        if self.holders is not None:
            for h in self._blocks:
                self.holders.discard(h, self.bit)
        self._blocks.clear()
        self._ghosts.clear()

    def close(self) -> None:
        """The replica left: its blocks leave ``holders`` and its slot is free again."""
        if self.holders is not None:
            self.holders.release(self.bit, self._blocks)
            self.holders = None
        self._blocks.clear()
        self._ghosts.clear()
