"""What the gateway believes one replica holds: the shadow index.

``ShadowIndex``: the block chains one replica is believed to hold, bounded by the replica's KV
capacity (``num_gpu_blocks``), least recently used first out. Blocks are added when a request
is routed (vLLM makes them hittable as soon as they are scheduled) and touched when they hit;
the generated tokens' blocks take their share of capacity when the request ends; LRU
approximates vLLM's "least recently freed first" eviction. The engine's reported
``cached_tokens`` then tells a right prediction from an eviction. Where a replica's KV events
are followed, its engine's own picture (``cache/events.py``, ``EngineView``) replaces this
guess for routing.

The blocks live in a ``BlockTree`` (``cache/tree.py``) that the fleet's indexes share: a run of
blocks several replicas hold is stored once, and a prompt is matched against all of them in one
walk. Hashes given to an index are always a prompt's chain from its first block.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefix_router.cache.blocks import BlockHash
from prefix_router.cache.tree import BlockTree

__all__ = ["ShadowIndex"]


class ShadowIndex:
    """The chains one replica is believed to hold, at most ``capacity`` blocks, in ``holders``
    (a ``BlockTree`` the fleet shares; one of its own when None) under a slot ``bit``.

    Blocks evicted lately are remembered (``match_ever``) as a second slot that sees the same
    touches with twice the capacity: what an LRU of ``capacity`` holds plus the ``capacity``
    blocks it evicted last (ARC's ghost list) is what an LRU of twice the size holds. Generated
    blocks take no room there, so it remembers somewhat more than that where outputs are long."""

    def __init__(self, capacity: int, holders: BlockTree | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.holders = holders if holders is not None else BlockTree()
        self.bit = self.holders.join(capacity)
        self._ever = self.holders.join(2 * capacity)

    def __len__(self) -> int:
        return self.holders.held(self.bit)

    @property
    def capacity(self) -> int:
        return self.holders.capacity(self.bit)

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of ``hashes`` believed cached (chained hashes: stop at the first miss)."""
        return self.holders.match(self.bit, hashes)

    def insert(self, hashes: Sequence[BlockHash]) -> tuple[int, int]:
        """Record the chain ``hashes`` as cached and most recently used; evict the least
        recently used beyond capacity. Returns the leading blocks held before, and held or
        evicted lately before: what ``forget`` keeps if the request fails.

        The chain is touched tail first, so its first block ends most recent: vLLM frees a
        request's blocks tail first (``BlockPool.free_blocks`` on the reversed block list) and
        evicts the least recently freed, so under pressure a prefix loses its tail, never its
        head. A chain longer than the capacity is cut to it first: its head is what the
        capacity would keep anyway.
        """
        ever = self.holders.insert(self._ever, hashes)
        return self.holders.insert(self.bit, hashes), ever

    def add_output(self, num_blocks: int, prompt: Sequence[BlockHash]) -> None:
        """Account for a finished request's generated blocks, then its prompt's.

        vLLM caches generated tokens' blocks too; they are never hit by a new prompt but take
        KV capacity. They enter as blocks that only fill the LRU, and the prompt's blocks are
        touched after them: a request's blocks are freed tail first, so its output blocks are
        evicted before its prompt (``BlockPool.free_blocks``).
        """
        if num_blocks <= 0:
            return
        self.holders.add_opaque(self.bit, min(num_blocks, self.capacity), evict=False)
        self.holders.touch(self.bit, prompt)
        self.holders.touch(self._ever, prompt)

    def forget(self, hashes: Sequence[BlockHash], before: tuple[int, int]) -> None:
        """Take back what ``insert(hashes)`` added for a request that failed (``before``: its
        answer): the engine never held those blocks. Blocks they prefix go too: without them
        they can never be hit."""
        self.holders.cut(self.bit, hashes, before[0])
        self.holders.cut(self._ever, hashes, before[1])

    def match_ever(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks believed cached now or evicted lately: a prompt the replica held until
        LRU pressure took it. Lets the gateway call such a miss ``miss_evicted`` rather than cold."""
        return max((depth for _, depth in self.holders.drops(hashes, self.bit | self._ever)), default=0)

    def resize(self, capacity: int) -> None:
        """Adopt a capacity learned from the replica's metrics (at least 1 block)."""
        self.holders.set_capacity(self.bit, capacity)
        self.holders.set_capacity(self._ever, 2 * max(capacity, 1))

    def clear(self) -> None:
        """The replica restarted or its cache was reset."""
        self.holders.clear(self.bit)
        self.holders.clear(self._ever)

    def close(self) -> None:
        """The replica left: its blocks leave the tree and its slots are free again. A request
        still in flight may end after: the index goes on, alone in a tree of its own."""
        self.holders.leave(self.bit)
        self.holders.leave(self._ever)
        self.holders = BlockTree()
        self.bit = self.holders.join(1)
        self._ever = self.holders.join(2)
