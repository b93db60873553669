"""What the gateway believes about prefixes: per-replica shadow indexes and branch statistics.

``ShadowIndex``: the block chains one replica is believed to hold. An LRU set of block hashes
bounded by the replica's KV capacity (``num_gpu_blocks``), so its memory is at most
``capacity`` entries, plus as many recently evicted ones (about 100 bytes each in CPython: 28,000 blocks, the default H100 replica,
is under 6 MB). Blocks are added when a request is routed (vLLM makes them hittable as soon as
they are scheduled) and touched when they hit; the generated tokens' blocks take their share of
capacity when the request ends; LRU approximates vLLM's "least recently freed first" eviction.
The engine's reported ``cached_tokens`` then tells a right prediction from an eviction.

``BranchStats``: for each block, up to ``threshold`` distinct next blocks seen after it. A
block followed by many different continuations ends a prefix shared by many conversations
(a common system prompt or tool list); the routing key must reach past it, to the first block
specific to the conversation, or every conversation sharing that prefix lands on one replica
(the failure the field notes report for peer routers). Bounded by an LRU of ``max_blocks``.

``PrefixDemand``: for each block, the share of recent requests whose prompt passed through it.
A prefix whose share is more than its holders can serve at their fair share is hot and must be
replicated; any other prefix is cold and is best left where it is (``policy``).
"""

from __future__ import annotations

import heapq
import operator
from collections import OrderedDict
from collections.abc import Sequence

from prefix_router.cache.blocks import BlockHash

__all__ = ["ShadowIndex", "BranchStats", "PrefixDemand"]


class ShadowIndex:
    """LRU set of the block hashes one replica is believed to hold, at most ``capacity``."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
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
        event loop (``bench/results/hostile-bodies.md``, the text rows).
        """
        blocks = self._blocks
        added = []
        for h in reversed(hashes[: self.capacity]):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                added.append(h)
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
        for h in hashes:
            self._blocks.pop(h, None)

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
        blocks, ghosts = self._blocks, self._ghosts
        while len(blocks) > self.capacity:
            h, _ = blocks.popitem(last=False)
            if h >= 0:  # generated-token blocks are never looked up
                ghosts[h] = None
        while len(ghosts) > self.capacity:
            ghosts.popitem(last=False)

    def resize(self, capacity: int) -> None:
        """Adopt a capacity learned from the replica's metrics."""
        self.capacity = max(capacity, 1)
        self.insert(())

    def clear(self) -> None:
        """The replica restarted or its cache was reset."""
        self._blocks.clear()
        self._ghosts.clear()


class BranchStats:
    """Distinct next blocks seen after each block, up to ``threshold``; LRU-bounded.

    Memory: a block seen with one successor stores that successor (an int); with a few, a set;
    once ``threshold`` are seen it is marked shared and the set is dropped. About 170 bytes an
    entry in CPython (measured), so the default 500,000 entries stay under 100 MB.
    """

    _SHARED = True  # marker: at least ``threshold`` successors seen

    def __init__(self, threshold: int = 4, max_blocks: int = 500_000) -> None:
        if threshold < 2:
            raise ValueError(f"threshold must be at least 2, got {threshold}")
        self.threshold = threshold
        self.max_blocks = max_blocks
        self._next: OrderedDict[BlockHash, BlockHash | set[BlockHash] | bool] = OrderedDict()

    def __len__(self) -> int:
        return len(self._next)

    def record(self, hashes: Sequence[BlockHash], depth: int) -> None:
        """Note the successors of the first ``depth`` blocks of one request."""
        table = self._next
        shared = self._SHARED
        for i in range(min(depth, len(hashes) - 1)):
            block, successor = hashes[i], hashes[i + 1]
            seen = table.get(block)
            if seen is None:
                table[block] = successor
                continue
            table.move_to_end(block)
            if seen is shared or seen == successor:
                continue
            if not isinstance(seen, set):
                seen = {seen}
            seen.add(successor)
            table[block] = shared if len(seen) >= self.threshold else seen
        while len(table) > self.max_blocks:
            table.popitem(last=False)

    def is_shared(self, block: BlockHash) -> bool:
        """Whether ``block`` was seen followed by at least ``threshold`` different blocks."""
        return self._next.get(block) is self._SHARED

    def key_depth(self, hashes: Sequence[BlockHash], max_depth: int) -> int:
        """Blocks the routing key should cover: through the first block after the deepest
        shared (branching) block within ``max_depth``; 1 when no branching block is known.
        May exceed ``len(hashes)`` when the prompt ends inside the shared prefix.
        """
        table = self._next
        shared = self._SHARED
        depth = 1
        for i in range(min(max_depth, len(hashes))):
            if table.get(hashes[i]) is shared:
                depth = i + 2
        return depth


class PrefixDemand:
    """The share of recent requests whose prompt passed through each block, decayed.

    ``record`` adds one request, weighted ``2 ** (t / half_life_s)`` so that older requests
    count half as much every ``half_life_s`` without touching every entry (weights are rescaled
    when they grow past ``2 ** 50``); ``share`` divides by the total weight, which the same
    decay applies to. Chained hashes make a deeper block's share at most its parent's: the
    share of the deepest block a replica holds is the share of traffic that wants that prefix.

    Memory: one float per block seen within the first ``depth`` blocks of a prompt, at most
    ``max_blocks``; past it the half with the least weight is dropped, so hot prefixes stay.
    """

    def __init__(self, half_life_s: float = 60.0, max_blocks: int = 500_000) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        if max_blocks < 2:
            raise ValueError(f"max_blocks must be at least 2, got {max_blocks}")
        self.half_life_s = half_life_s
        self.max_blocks = max_blocks
        self._weight: dict[BlockHash, float] = {}
        self._total = 0.0
        self._origin: float | None = None  # monotonic seconds at which a request weighs 1

    def __len__(self) -> int:
        return len(self._weight)

    def record(self, hashes: Sequence[BlockHash], depth: int, now: float) -> None:
        """Count one request through the first ``depth`` of ``hashes`` (``now``: monotonic s)."""
        if self._origin is None:
            self._origin = now
        exponent = (now - self._origin) / self.half_life_s
        if exponent > 50:  # rebase before the weights overflow: every ratio is unchanged
            scale = 0.5 ** exponent
            self._weight = {b: w * scale for b, w in self._weight.items() if w * scale > 1e-9}
            self._total *= scale
            self._origin, exponent = now, 0.0
        w = 2.0 ** exponent
        weight = self._weight
        self._total += w
        for h in hashes[:depth]:
            weight[h] = weight.get(h, 0.0) + w
        if len(weight) > self.max_blocks:
            keep = heapq.nlargest(self.max_blocks // 2, weight.items(), key=operator.itemgetter(1))
            self._weight = dict(keep)

    def share(self, block: BlockHash) -> float:
        """Of the recent requests, the fraction whose prompt passed through ``block`` (0 to 1)."""
        return self._weight.get(block, 0.0) / self._total if self._total else 0.0
